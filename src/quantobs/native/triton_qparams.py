# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton kernel: an observer's qparams from its `(Q,)` ranges in one launch.

The GPU twin of `quantobs.core.qparams.observer_qparams`' torch path
(compressed-tensors' `calculate_qparams` with `empty_as_zero`, the NVFP4
global scale from its amax, `finite_range` of a searched range, the scale
in the dtype llm-compressor returns): every float32 operation of the torch
rule, in its order, one qparam per lane, so the bits are the torch path's
on every device:

* IEEE division (`div_rn`), products and sums rounded one by one (launched
  with `enable_fp_fusion=False`: no FMA contraction);
* bfloat16 / float16 arithmetic (`arithmetic="observed"`) as torch computes
  it: each operation in float32, then rounded to nearest even in the
  dtype (bfloat16 from the float's bits; float16 by the cast);
* FP8 e4m3 scale rounding by the Veltkamp split and MX exponents from the
  float's bits (`triton_shrink._round_float`, `_pow2`); in float16
  arithmetic a subnormal amax rounds to 2**-14 or 0 and a scale below
  2**-24 becomes 1.0, as the torch rule (`compressed_tensors._mx_scales`);
* the rule's checks counted on the device in one `(8,)` int32 vector
  (`FLAG_*`), read by the caller in one host read.

Importing this module imports Triton: callers import it lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantobs.core.args import QuantizationArgs
from quantobs.core.exact import rounded_to
from quantobs.native import gpu
from quantobs.native.triton_shrink import (
    _ASYM,
    _MX,
    Rule,
    _float_rounding,
    _mx_exponent,
    _pow2,
)
from quantobs.native.triton_shrink import _round_float as _round_fp

__all__ = ["FLAGS", "Launch", "range_qparams"]

_BLOCK = 1024  # qparams per program
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_ROUNDED = {None: 0, torch.bfloat16: 1, torch.float16: 2}
_GS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ZP_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
# the flags vector: what the torch rule's checks read, by index
FLAG_AMAX, FLAG_GS, FLAG_GS_BITS, FLAG_RANGE, FLAG_OVERFLOW = 0, 1, 2, 3, 4
FLAG_FP16_GS, FLAG_AMAX_BITS = 5, 6
FLAGS = 8


@triton.jit
def _rounded(x, ROUNDED: tl.constexpr):
    """float32 `x` rounded to nearest even in bfloat16 (1) or float16 (2),
    as float32 (0: unchanged); overflow gives inf, as torch's casts."""
    out = x
    if ROUNDED == 1:  # bfloat16: the float's upper half, ties to even
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        out = bits.to(tl.float32, bitcast=True)
    elif ROUNDED == 2:
        out = x.to(tl.float16).to(tl.float32)
    return out


@triton.jit
def _nonfinite(x):
    """1 where `x` is NaN or +-inf (`x - x` is 0 exactly for finite `x`)."""
    return ((x - x) != 0).to(tl.int32)


@triton.jit
def _global_scale(gs_ptr, flags_ptr, pid, product, gs_tiny, gs_max,
                  GS: tl.constexpr, ROUNDED: tl.constexpr):  # fmt: skip
    """The global scale every lane multiplies (1.0 without one): the
    module's (GS 1, checked finite and positive), or `amax_to_global_scale`
    of the amax at `gs_ptr` (GS 2: `reciprocal(amax) * 448 * 6`, each
    rounded in the arithmetic's dtype; inf -> 1.0). Program 0 writes the
    flags of its checks."""
    gs = 1.0
    if GS == 1:
        gs = tl.load(gs_ptr).to(tl.float32)
        good = (gs > 0) & (gs <= 3.4028234663852886e38)  # NaN fails
        if pid == 0:
            tl.store(flags_ptr + 1, 1 - good.to(tl.int32))
            tl.store(flags_ptr + 2, gs.to(tl.int32, bitcast=True))
    elif GS == 2:
        raw = tl.load(gs_ptr).to(tl.float32)
        amax = tl.abs(raw)
        clamped = tl.minimum(tl.maximum(amax, gs_tiny), gs_max)
        clamped = tl.where(amax != amax, amax, clamped)  # NaN stays
        inv = _rounded(tl.math.div_rn(1.0, _rounded(clamped, ROUNDED)), ROUNDED)
        found = _rounded(inv * product, ROUNDED)
        finite = _nonfinite(found) == 0
        gs = tl.where(finite, found, 1.0)
        if pid == 0:
            tl.store(flags_ptr + 0, _nonfinite(raw))
            tl.store(flags_ptr + 6, amax.to(tl.int32, bitcast=True))
            if ROUNDED == 2:  # float16 overflowed it (a warning)
                tl.store(flags_ptr + 5, 1 - finite.to(tl.int32))
    return gs


@triton.jit
def _range_qparams_kernel(
    lo_ptr, hi_ptr, dlo_ptr, dhi_ptr, gs_ptr, s_ptr, z_ptr, flags_ptr, Q,
    divisor, eps, qmin, qmax, zp_low, zp_high, mx_threshold, mx_emax,
    s_top, s_split, s_magic, s_min_normal, rd_max, product, gs_tiny, gs_max,
    KIND: tl.constexpr, ROUNDED: tl.constexpr, GS: tl.constexpr,
    ROUND_SCALE: tl.constexpr, FLOOR_TINY: tl.constexpr,
    FINITE_RANGE: tl.constexpr, ZP_OUT: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program `i`: the scales (and zero points) of qparams `i * BLOCK ..`."""
    pid = tl.program_id(0)
    q = pid * BLOCK + tl.arange(0, BLOCK)
    ok = q < Q
    top = 3.4028234663852886e38
    tiny = 1.1754943508222875e-38
    lo = tl.load(lo_ptr + q, mask=ok, other=0.0)
    hi = tl.load(hi_ptr + q, mask=ok, other=0.0)
    if FINITE_RANGE:  # `finite_range(selected, observed)`
        dlo = tl.load(dlo_ptr + q, mask=ok, other=0.0)
        dhi = tl.load(dhi_ptr + q, mask=ok, other=0.0)
        seen = (dlo >= -top) & (dlo <= dhi) & (dhi <= top)
        seen = seen & ((lo != float("inf")) | (hi != float("-inf")))
        fixed_lo = tl.where(lo != lo, dlo, tl.minimum(tl.maximum(lo, -top), top))
        fixed_hi = tl.where(hi != hi, dhi, tl.minimum(tl.maximum(hi, -top), top))
        lo = tl.where(seen, fixed_lo, lo)
        hi = tl.where(seen, fixed_hi, hi)
    # range_or_zero, then the count of non-finite ends (`_check_range`)
    empty = lo > hi
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    bad = tl.sum(tl.where(ok, _nonfinite(lo) + _nonfinite(hi), 0), axis=0)
    if bad > 0:
        tl.atomic_add(flags_ptr + 3, bad)
    gs = _global_scale(gs_ptr, flags_ptr, pid, product, gs_tiny, gs_max, GS,
                       ROUNDED)  # fmt: skip
    z = tl.zeros_like(lo)
    if KIND == 0:  # symmetric: amax / ((qmax - qmin) / 2)
        amax = tl.maximum(tl.maximum(-lo, hi), 0.0)
        if ROUNDED != 0:  # amax and the quotient in the observed dtype
            amax = _rounded(tl.minimum(amax, rd_max), ROUNDED)
            s = _rounded(tl.math.div_rn(amax, divisor), ROUNDED)
        else:
            s = tl.math.div_rn(amax, divisor)
        if GS != 0:
            s = gs * s
            over = tl.max(tl.where(ok, _nonfinite(s), 0), axis=0)
            if over > 0:
                tl.atomic_max(flags_ptr + 4, over)
    elif KIND == 1:  # asymmetric: (max - min) / (qmax - qmin), its zero point
        if ROUNDED != 0:
            low = _rounded(tl.minimum(tl.maximum(lo, -rd_max), 0.0), ROUNDED)
            high = _rounded(tl.minimum(tl.maximum(hi, 0.0), rd_max), ROUNDED)
            s = _rounded(tl.math.div_rn(_rounded(high - low, ROUNDED), divisor),
                         ROUNDED)  # fmt: skip
            split = _rounded(tl.math.div_rn(high, divisor), ROUNDED) - _rounded(
                tl.math.div_rn(low, divisor), ROUNDED)  # fmt: skip
            s = tl.where(_nonfinite(s) != 0, _rounded(split, ROUNDED), s)
        else:
            low = tl.minimum(lo, 0.0)
            high = tl.maximum(hi, 0.0)
            s = tl.math.div_rn(high - low, divisor)
            split = tl.math.div_rn(high, divisor) - tl.math.div_rn(low, divisor)
            s = tl.where(_nonfinite(s) != 0, split, s)  # max - min overflowed
        s = tl.where((s > 0) & (s < tiny), tiny, s)
        safe = tl.where(s == 0, 1.0, s)
        t = _rounded(tl.math.div_rn(low, safe), ROUNDED)
        z = _rounded(qmin - t, ROUNDED)
        z = tl.minimum(tl.maximum(z, qmin), qmax)
        z = tl.minimum(tl.maximum(z, zp_low), zp_high)
        z = (z + 12582912.0) - 12582912.0  # half to even (|z| < 2**22)
    else:  # MX: 2 ** (exponent of amax rounded to k bits - emax)
        amax = tl.maximum(tl.maximum(-lo, hi), 0.0)
        if ROUNDED != 0:  # a value of the observed dtype (saturating)
            amax = _rounded(tl.minimum(amax, rd_max), ROUNDED)
        n = _mx_exponent(amax, mx_threshold, mx_emax)
        if ROUNDED == 2:  # float16's bits: its subnormals -> 2**-14 or 0
            up = amax >= (mx_threshold - 1.0) * 6.103515625e-05
            n_sub = tl.where(up, tl.maximum(-14.0 - mx_emax, -127.0), -127.0)
            n = tl.where(amax < 6.103515625e-05, n_sub, n)
        s = _pow2(n)
        if ROUNDED == 2:  # below float16's least subnormal 2**-24: 0 -> 1.0
            s = tl.where(s < 5.960464477539063e-08, 1.0, s)
    if ROUND_SCALE:
        s = _round_fp(s, s_top, s_split, s_magic, s_min_normal)
    s = tl.where(s <= 0, eps, s)
    if FLOOR_TINY:
        s = tl.maximum(s, tiny)
    if OUT_BF16:  # the bfloat16 value's bits (exact: s is one)
        out = (s.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        out = out.to(tl.bfloat16, bitcast=True)
    else:
        out = s.to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + q, out, mask=ok)
    if ZP_OUT:
        tl.store(z_ptr + q, z.to(z_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class Launch:
    """What `range_qparams` computes (host side), or None from `of` where
    the kernel does not apply (the torch path then runs).

    Attributes:
        rule: the rule's constants (`triton_shrink.Rule`).
        rounded: bfloat16 / float16 arithmetic, or None (float32).
        eps: a zero scale's replacement.
        divisor: the half range / level span, in the arithmetic's dtype.
        floor_tiny: symmetric scales below float32's tiny raised to it.
    """

    rule: Rule
    rounded: torch.dtype | None
    eps: float
    divisor: float
    floor_tiny: bool

    @staticmethod
    def of(
        args: QuantizationArgs,
        rounded: torch.dtype | None,
        global_scale: torch.Tensor | None,
        eps: float,
    ) -> Launch | None:
        if rounded not in _ROUNDED:
            return None
        rule = Rule.of(args, global_scale)
        if rule is None or (global_scale is not None and rule.kind != 0):
            return None
        divisor = rule.divisor
        if rounded is not None and rule.kind != _MX:
            divisor = rounded_to(divisor, rounded)
        floor_tiny = rule.kind == 0 and rule.floor_tiny
        return Launch(rule, rounded, eps, divisor, floor_tiny)


def range_qparams(
    launch: Launch,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    scale_dtype: torch.dtype,
    zp_dtype: torch.dtype,
    *,
    global_scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    observed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`(scale, zero_point, flags)` of `(*Q,)` float32 ranges in one launch.

    Args:
        launch: the rule (`Launch.of`).
        min_vals: `(*Q,)` contiguous float32 minima (`+inf` where empty).
        max_vals: `(*Q,)` maxima.
        scale_dtype: the returned scales' dtype (float32, bfloat16,
            float16: their values are of it).
        zp_dtype: the zero points' dtype.
        global_scale: the module's `(1,)` global scale (checked on chip).
        amax: or the `(1,)` float32 amax to compute it from (NVFP4).
        observed: the data's range, when `min_vals` / `max_vals` are a
            solver's (`finite_range` on chip).

    Returns:
        `(*Q,)` scales, `(*Q,)` zero points and the `(FLAGS,)` int32 flags
        (`FLAG_*`); None where an input is not what the kernel reads.
    """
    device = min_vals.device
    tensors = [min_vals, max_vals, *(observed or ())]
    if any(
        t.dtype != torch.float32 or not t.is_contiguous() or t.shape != min_vals.shape
        for t in tensors
    ):
        return None
    gs_source = global_scale if global_scale is not None else amax
    if gs_source is not None:
        if gs_source.numel() != 1 or gs_source.dtype not in _GS_DTYPES:
            return None
        if gs_source.device != device:
            return None
    rule = launch.rule
    shape = tuple(min_vals.shape) or (1,)
    num_q = min_vals.numel()
    out_bf16 = scale_dtype == torch.bfloat16
    scale = torch.empty(shape, dtype=scale_dtype, device=device)
    zp_out = rule.kind == _ASYM or zp_dtype in _ZP_INTS
    if zp_out:
        zero_point = torch.empty(shape, dtype=zp_dtype, device=device)
    else:
        zero_point = torch.zeros(shape, dtype=zp_dtype, device=device)
    flags = torch.zeros(FLAGS, dtype=torch.int32, device=device)
    gs_mode = 0 if gs_source is None else (1 if global_scale is not None else 2)
    rd = launch.rounded or torch.float32
    info = torch.finfo(rd)
    r = rule.round_scale
    s_top, s_split, s_magic, s_min_normal = (
        (1.0, 1.0, 0.0, 1.0) if r is None else (r.max, *_float_rounding(r))
    )
    lows, highs = observed if observed is not None else (min_vals, max_vals)
    grid = (triton.cdiv(max(num_q, 1), _BLOCK),)
    with gpu.interpreter_quiet():
        _range_qparams_kernel[grid](
            min_vals, max_vals, lows, highs,
            min_vals if gs_source is None else gs_source,
            scale, zero_point, flags, num_q,
            launch.divisor, launch.eps, float(rule.fmt.min), float(rule.fmt.max),
            rule.zp_low, rule.zp_high, rule.mx_threshold, float(rule.mx_emax),
            s_top, s_split, s_magic, s_min_normal, float(info.max),
            448.0 * 6.0, float(info.tiny), float(info.max),
            KIND=rule.kind, ROUNDED=_ROUNDED[launch.rounded], GS=gs_mode,
            ROUND_SCALE=r is not None, FLOOR_TINY=launch.floor_tiny,
            FINITE_RANGE=observed is not None, ZP_OUT=zp_out, OUT_BF16=out_bf16,
            BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )  # fmt: skip
    return scale, zero_point, flags
