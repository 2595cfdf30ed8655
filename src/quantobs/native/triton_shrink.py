# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton kernels: llm-compressor's shrink search with its candidates made on chip.

The GPU twin of `quantobs.solvers.mse.best_shrink`'s work, in few launches
and no `(C, Q)` candidate tensors:

* `shrink_errors`: for every shrink factor `f` (in the search's order) and
  qparam, the candidate range `(f * min, f * max)`, its scale and zero point
  (`Rule`: compressed-tensors' `calculate_qparams` in float32, the
  operations `quantobs.core.scoring.candidate_qparams` runs, in its order:
  the bits of its result) and the error `sum w * |fake_quant(x) - x| **
  norm` (`triton_mse._error`, one pass over the data); with it, per qparam,
  whether a comparison the search makes (a candidate's error against the
  least before it) is within a relative tolerance ("near": decided again
  with torch by the caller), a candidate whose qparams repeat its
  predecessor's never counting as near;
* `candidate_qparams`: the same candidates' `(C, K)` scales and zero points
  of `K` chosen qparams (those the caller re-scores with torch);
* `choose`: llm-compressor's early stop and first minimum from the `(C, Q)`
  errors, in two launches (which candidates improve some qparam; then the
  number scored and each qparam's first least error): the chosen factor
  (`first_best`) or index (`imatrix.best_index`).

Importing this module imports Triton: callers import it lazily.

(Over 500 lines: the on-chip candidate rule must follow `candidate_qparams`
step by step for every format, beside the kernels that use it.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantobs.core.args import QuantizationArgs
from quantobs.core.formats import NumberFormat, get_format
from quantobs.native import gpu, triton_mse
from quantobs.native.triton_mse import _error, _load_values, _row_sums

__all__ = ["Rule", "candidate_qparams", "choose", "shrink_errors"]

_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_MX_OWN_MANTISSA = frozenset({"float6_e2m3fn"})  # compressed_tensors' set
_SYM, _ASYM, _MX = 0, 1, 2
_TILE = 4096
_MAX_TILE_E = 1024
_SEGMENT = 8192
_CHOOSE_BLOCK = 1024  # qparams per program of the choice
# the choice's rules: first_best (mse_ties) and imatrix.best_index
FIRST_BEST, BEST_INDEX = 0, 1


@dataclass(frozen=True)
class Rule:
    """The constants of compressed-tensors' rule for one args (host side):
    what `_candidate` computes on chip. `Rule.of(args, global_scale)` or
    None where the kernel does not make these candidates."""

    kind: int  # _SYM, _ASYM, _MX
    fmt: NumberFormat  # the quantized values' format
    divisor: float  # SYM: (qmax - qmin) / 2; ASYM: qmax - qmin
    eps: float  # a zero scale's replacement
    floor_tiny: bool  # SYM: scales below float32's tiny raised to it
    round_scale: NumberFormat | None  # scale_dtype's format (FP8 e4m3) or None
    zp_low: float  # ASYM: the zero point dtype's bounds
    zp_high: float
    mx_threshold: float  # MX: significands from it round up
    mx_emax: int

    @staticmethod
    def of(args: QuantizationArgs, global_scale: torch.Tensor | None) -> Rule | None:
        fmt = args.format
        scale_dtype = None if args.is_mx else args.scale_dtype
        if scale_dtype not in (None, torch.float32, torch.float8_e4m3fn):
            return None
        round_scale = None
        if scale_dtype == torch.float8_e4m3fn:
            round_scale = get_format("float8_e4m3fn")
        if scale_dtype == torch.float8_e4m3fn:
            eps = 0.125
        else:
            eps = float(torch.finfo(torch.float32).eps)
        zp_low = zp_high = 0.0
        mx_threshold, mx_emax = 2.0, 0
        if args.is_mx:
            if not args.symmetric or global_scale is not None:
                return None
            kind, divisor = _MX, 1.0
            bits = fmt.mantissa_bits if fmt.name in _MX_OWN_MANTISSA else 1
            mx_threshold, mx_emax = 2.0 - 2.0 ** -(bits + 1), fmt.emax
        elif args.symmetric:
            kind, divisor = _SYM, (fmt.max - fmt.min) / 2
        else:
            zp_dtype = args.zp_dtype or torch.int8
            if global_scale is not None or zp_dtype.is_floating_point:
                return None
            if zp_dtype == torch.bool or zp_dtype.is_complex:
                return None
            info = torch.iinfo(zp_dtype)
            kind, divisor = _ASYM, fmt.max - fmt.min
            zp_low, zp_high = float(info.min), float(info.max)
        floor_tiny = round_scale is None  # FP8's subnormals are above tiny
        return Rule(kind, fmt, float(divisor), eps, floor_tiny, round_scale,
                    zp_low, zp_high, mx_threshold, mx_emax)  # fmt: skip

    def arguments(self) -> tuple[float, ...]:
        """The kernels' float arguments of the rule (`_candidate`'s order)."""
        r = self.round_scale or get_format("float8_e4m3fn")
        return (self.divisor, self.eps, self.fmt.min, self.fmt.max,
                self.zp_low, self.zp_high, self.mx_threshold, float(self.mx_emax),
                r.max, *_float_rounding(r))  # fmt: skip


def _float_rounding(fmt: NumberFormat) -> tuple[float, float, float]:
    """`(split, magic, min_normal)` of `NumberFormat._round_float32`."""
    if not fmt.is_float:
        return 1.0, 0.0, 1.0
    split = float((1 << (23 - fmt.mantissa_bits)) + 1)
    return split, fmt.min_subnormal * float(1 << 23), fmt.min_normal


@triton.jit
def _round_float(a, top, split, magic, min_normal):
    """`a >= 0` rounded to nearest even in a float format, saturating at
    `top` (`NumberFormat._round_float32`'s operations)."""
    a = tl.minimum(a, top)
    c = a * split
    normal = c - (c - a)
    tiny = (a + magic) - magic
    return tl.where(a < min_normal, tiny, normal)


@triton.jit
def _mx_exponent(amax, mx_threshold, mx_emax):
    """The e8m0 exponent of MX scales of float32 `amax >= 0`: its exponent
    rounded to k bits (`mx_threshold`: the significand from which it rounds
    up) less `mx_emax`, clamped to [-127, 127]; zero and float32 subnormals
    get -127."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    sig = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    e = (biased - 127).to(tl.float32) + (sig >= mx_threshold).to(tl.float32)
    n = tl.minimum(tl.maximum(e - mx_emax, -127.0), 127.0)
    return tl.where(biased == 0, -127.0, n)


@triton.jit
def _pow2(n):
    """`2.0 ** n` for integer-valued float32 `n` in `-127 .. 127`, exactly."""
    k = n.to(tl.int32)
    bits = tl.where(k >= -126, (k + 127) << 23, 1 << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _candidate(lo, hi, f, gs, divisor, eps, qmin, qmax, zp_low, zp_high,
               mx_threshold, mx_emax, s_top, s_split, s_magic, s_min_normal,
               KIND: tl.constexpr, HAS_GS: tl.constexpr,
               ROUND_SCALE: tl.constexpr, FLOOR_TINY: tl.constexpr):  # fmt: skip
    """The effective scale and zero point (0.0 when symmetric) of the
    candidate range `(f * lo, f * hi)`: `scoring.candidate_qparams`' float32
    operations, in its order (`calculate_qparams` without its checks)."""
    top = 3.4028234663852886e38
    low = tl.minimum(tl.maximum(lo * f, -top), top)
    high = tl.minimum(tl.maximum(hi * f, -top), top)
    zp = tl.zeros_like(low)
    if KIND == 0:  # symmetric: amax / ((qmax - qmin) / 2)
        amax = tl.maximum(tl.maximum(-low, high), 0.0)
        s = tl.math.div_rn(amax, divisor)
        if HAS_GS:
            s = gs * s
        if ROUND_SCALE:
            s = _round_float(s, s_top, s_split, s_magic, s_min_normal)
        s = tl.where(s <= 0, eps, s)
        if FLOOR_TINY:
            s = tl.maximum(s, 1.1754943508222875e-38)
        if HAS_GS:
            s = tl.math.div_rn(s, gs)
    elif KIND == 1:  # asymmetric: (max - min) / (qmax - qmin), its zero point
        low = tl.minimum(low, 0.0)
        high = tl.maximum(high, 0.0)
        s = tl.math.div_rn(high - low, divisor)
        wide = s == float("inf")  # max - min overflowed
        s = tl.where(wide, tl.math.div_rn(high, divisor)
                     - tl.math.div_rn(low, divisor), s)  # fmt: skip
        s = tl.where((s > 0) & (s < 1.1754943508222875e-38),
                     1.1754943508222875e-38, s)  # fmt: skip
        safe = tl.where(s == 0, 1.0, s)
        z = qmin - tl.math.div_rn(low, safe)
        z = tl.minimum(tl.maximum(z, qmin), qmax)
        if ROUND_SCALE:
            s = _round_float(s, s_top, s_split, s_magic, s_min_normal)
        s = tl.where(s <= 0, eps, s)
        z = tl.minimum(tl.maximum(z, zp_low), zp_high)
        zp = (z + 12582912.0) - 12582912.0  # half to even (|z| < 2**22)
    else:  # MX: 2 ** (exponent of amax rounded to k bits - emax)
        amax = tl.maximum(tl.maximum(-low, high), 0.0)
        s = _pow2(_mx_exponent(amax, mx_threshold, mx_emax))
    return s, zp


@triton.jit
def _near_step(val, best, c, repeat, near, tol):
    """One candidate's comparison with the least error before it: `near`
    updated, and the new least."""
    bound = tl.maximum(val, best) * tol
    close = (tl.abs(val - best) <= bound) & (c > 0) & (repeat == 0)
    return near | close.to(tl.int8), tl.minimum(best, val)


@triton.jit
def _shrink_kernel(
    x_ptr, w_ptr, lo_ptr, hi_ptr, f_ptr, gs_ptr, out_ptr, near_ptr,
    Q, G, E, C, seg_len,
    sxn, sxq, sxg, swn, swq, swg,
    qmin, qmax, split, magic, min_normal, norm, tol,
    divisor, eps, cqmin, cqmax, zp_low, zp_high, mx_threshold, mx_emax,
    s_top, s_split, s_magic, s_min_normal,
    KIND: tl.constexpr, HAS_GS: tl.constexpr, ROUND_SCALE: tl.constexpr,
    FLOOR_TINY: tl.constexpr, HAS_ZP: tl.constexpr, HAS_W: tl.constexpr,
    IS_FLOAT: tl.constexpr, NORM_KIND: tl.constexpr, ROWS: tl.constexpr,
    ONE_TILE: tl.constexpr, NEAR: tl.constexpr, EXACT: tl.constexpr,
    FAST_POW: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Program `(i, s)`: qparams `i * BLOCK_Q ..`, values `s * seg_len ..`;
    every candidate made and scored on chip: `out[s, c, q]` its error sum,
    `near[q]` (one segment) whether a comparison is near."""
    pid_q = tl.program_id(0)
    pid_s = tl.program_id(1)
    q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BQ,)
    q_ok = q < Q
    q64 = q.to(tl.int64)[:, None]  # (BQ, 1)
    e_start = pid_s.to(tl.int64) * seg_len
    lanes = tl.arange(0, BLOCK_E)[None, :]  # (1, BE)
    out_row = out_ptr + pid_s.to(tl.int64) * C * Q + q
    lo = tl.load(lo_ptr + q, mask=q_ok, other=0.0)
    hi = tl.load(hi_ptr + q, mask=q_ok, other=0.0)
    gs = 1.0
    if HAS_GS:
        gs = tl.load(gs_ptr)
    best = tl.full([BLOCK_Q], float("inf"), tl.float64)
    near = tl.zeros([BLOCK_Q], dtype=tl.int8)
    prev_s = tl.full([BLOCK_Q], -1.0, tl.float32)  # no scale is negative
    prev_z = tl.zeros([BLOCK_Q], dtype=tl.float32)
    if ONE_TILE:
        e = e_start + lanes
        ok = q_ok[:, None] & (e < E)
        x, w = _load_values(x_ptr, w_ptr, e, q64, ok, G, sxn, sxq, sxg, swn,
                            swq, swg, ROWS, HAS_W)  # fmt: skip
    for c in range(C):
        f = tl.load(f_ptr + c)
        s1, z1 = _candidate(lo, hi, f, gs, divisor, eps, cqmin, cqmax, zp_low,
                            zp_high, mx_threshold, mx_emax, s_top, s_split,
                            s_magic, s_min_normal, KIND, HAS_GS, ROUND_SCALE,
                            FLOOR_TINY)  # fmt: skip
        repeat = ((s1 == prev_s) & (z1 == prev_z)).to(tl.int8)
        prev_s = s1
        prev_z = z1
        s = tl.where(q_ok, s1, 1.0)[:, None]
        zp = z1[:, None]
        inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        if ONE_TILE:
            err = _error(x, s, inv, zp, w, qmin, qmax, split, magic, min_normal,
                         norm, HAS_ZP, HAS_W, IS_FLOAT, NORM_KIND, EXACT,
                         FAST_POW)  # fmt: skip
            total = _row_sums(tl.where(ok, err, 0.0), EXACT)
        else:
            total = tl.zeros([BLOCK_Q], dtype=tl.float64)
            for e0 in range(0, seg_len, BLOCK_E):
                e = e_start + e0 + lanes
                ok = q_ok[:, None] & (e < E) & (e0 + lanes < seg_len)
                x, w = _load_values(x_ptr, w_ptr, e, q64, ok, G, sxn, sxq, sxg, swn,
                                    swq, swg, ROWS, HAS_W)  # fmt: skip
                err = _error(x, s, inv, zp, w, qmin, qmax, split, magic,
                             min_normal, norm, HAS_ZP, HAS_W, IS_FLOAT,
                             NORM_KIND, EXACT, FAST_POW)  # fmt: skip
                total += _row_sums(tl.where(ok, err, 0.0), EXACT)
        stored = total.to(out_ptr.dtype.element_ty)
        tl.store(out_row + c * Q, stored, mask=q_ok)
        if NEAR:  # the comparison as the caller makes it: stored values
            near, best = _near_step(stored.to(tl.float64), best, c, repeat,
                                    near, tol)  # fmt: skip
    if NEAR:
        tl.store(near_ptr + q, near, mask=q_ok)


@triton.jit
def _near_kernel(
    err_ptr, lo_ptr, hi_ptr, f_ptr, gs_ptr, near_ptr, Q, C, tol,
    divisor, eps, cqmin, cqmax, zp_low, zp_high, mx_threshold, mx_emax,
    s_top, s_split, s_magic, s_min_normal,
    KIND: tl.constexpr, HAS_GS: tl.constexpr, ROUND_SCALE: tl.constexpr,
    FLOOR_TINY: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """`near[q]` of summed `(C, Q)` errors (qparams scored in segments)."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < Q
    lo = tl.load(lo_ptr + q, mask=q_ok, other=0.0)
    hi = tl.load(hi_ptr + q, mask=q_ok, other=0.0)
    gs = 1.0
    if HAS_GS:
        gs = tl.load(gs_ptr)
    best = tl.full([BLOCK_Q], float("inf"), tl.float64)
    near = tl.zeros([BLOCK_Q], dtype=tl.int8)
    prev_s = tl.full([BLOCK_Q], -1.0, tl.float32)
    prev_z = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for c in range(C):
        f = tl.load(f_ptr + c)
        s1, z1 = _candidate(lo, hi, f, gs, divisor, eps, cqmin, cqmax, zp_low,
                            zp_high, mx_threshold, mx_emax, s_top, s_split,
                            s_magic, s_min_normal, KIND, HAS_GS, ROUND_SCALE,
                            FLOOR_TINY)  # fmt: skip
        repeat = ((s1 == prev_s) & (z1 == prev_z)).to(tl.int8)
        prev_s = s1
        prev_z = z1
        val = tl.load(err_ptr + c * Q + q, mask=q_ok, other=0.0).to(tl.float64)
        near, best = _near_step(val, best, c, repeat, near, tol)
    tl.store(near_ptr + q, near, mask=q_ok)


@triton.jit
def _qparams_kernel(
    lo_ptr, hi_ptr, f_ptr, gs_ptr, idx_ptr, s_ptr, z_ptr, K, C,
    divisor, eps, cqmin, cqmax, zp_low, zp_high, mx_threshold, mx_emax,
    s_top, s_split, s_magic, s_min_normal,
    KIND: tl.constexpr, HAS_GS: tl.constexpr, ROUND_SCALE: tl.constexpr,
    FLOOR_TINY: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """`(C, K)` scales and zero points of the qparams `idx`."""
    j = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    j_ok = j < K
    q = tl.load(idx_ptr + j, mask=j_ok, other=0)
    lo = tl.load(lo_ptr + q, mask=j_ok, other=0.0)
    hi = tl.load(hi_ptr + q, mask=j_ok, other=0.0)
    gs = 1.0
    if HAS_GS:
        gs = tl.load(gs_ptr)
    for c in range(C):
        f = tl.load(f_ptr + c)
        s, z = _candidate(lo, hi, f, gs, divisor, eps, cqmin, cqmax, zp_low,
                          zp_high, mx_threshold, mx_emax, s_top, s_split,
                          s_magic, s_min_normal, KIND, HAS_GS, ROUND_SCALE,
                          FLOOR_TINY)  # fmt: skip
        tl.store(s_ptr + c * K + j, s, mask=j_ok)
        tl.store(z_ptr + c * K + j, z, mask=j_ok)


def _rule_launch_args(rule: Rule, global_scale: torch.Tensor | None):
    """The rule's float arguments and constexprs of the kernels."""
    consts = {
        "KIND": rule.kind,
        "HAS_GS": global_scale is not None,
        "ROUND_SCALE": rule.round_scale is not None,
        "FLOOR_TINY": rule.floor_tiny,
    }
    return rule.arguments(), consts


def _prepared(min_vals, max_vals, factors, global_scale, device):
    lo = min_vals.to(device=device, dtype=torch.float32).contiguous()
    hi = max_vals.to(device=device, dtype=torch.float32).contiguous()
    f = factors.to(device=device, dtype=torch.float32).contiguous()
    gs = lo if global_scale is None else global_scale.to(device, torch.float32)
    return lo, hi, f, gs


def shrink_errors(
    x3: torch.Tensor,
    rule: Rule,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    norm: float,
    tolerance: float,
    *,
    global_scale: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every shrink candidate made and scored on chip, and the near ties.

    Args:
        x3: `(N, Q, G)` finite values (bf16, fp16, fp32; any strides).
        rule: the candidates' rule (`Rule.of(args, global_scale)`).
        min_vals: `(Q,)` float32 minima the factors shrink.
        max_vals: `(Q,)` maxima.
        factors: `(C,)` float32 factors, in the search's order.
        norm: exponent of the absolute error.
        tolerance: relative distance of a near comparison.
        global_scale: optional `(1,)` NVFP4 global scale of the candidates
            (read on the device).
        weights: optional `(N | 1, Q, G)` weight of each value.
        dtype: of the errors (float32 or float64).
        exact: `triton_mse.candidate_errors`' exact mode.

    Returns:
        `(C, Q)` errors (`triton_mse.candidate_errors` of the candidates
        `scoring.candidate_qparams` makes) and `(Q,)` int8 near flags; None
        where the kernel does not apply.
    """
    fmt = rule.fmt
    if x3.ndim != 3 or not triton_mse.supported(fmt):
        return None
    if x3.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    n, num_q, g = x3.shape
    num_c = factors.numel()
    device = x3.device
    if num_c == 0 or num_q == 0:
        return None
    lo, hi, f, gs = _prepared(min_vals, max_vals, factors, global_scale, device)
    values = n * g
    if weights is not None:
        weights = weights.to(device=device, dtype=torch.float32)
        weights = weights.expand(n if weights.shape[0] != 1 else 1, num_q, g)
    w_strides = (0, 0, 0) if weights is None else weights.stride()
    if weights is not None and weights.shape[0] == 1:
        w_strides = (0, *weights.stride()[1:])
    block_e = triton.next_power_of_2(min(values, _MAX_TILE_E))
    one_tile = values <= block_e
    block_q = max(1, min(_TILE // block_e, triton.next_power_of_2(num_q)))
    seg_len = block_e if one_tile else max(block_e, _SEGMENT)
    segments = 1 if one_tile else -(-values // seg_len)
    partial = dtype if segments == 1 else torch.float64
    out = torch.empty(segments, num_c, num_q, dtype=partial, device=device)
    near = torch.empty(num_q, dtype=torch.int8, device=device)
    split, magic, min_normal = _float_rounding(fmt)
    rule_args, consts = _rule_launch_args(rule, global_scale)
    grid = (triton.cdiv(num_q, block_q), segments)
    launch = functools.partial(
        _shrink_kernel[grid],
        x3, x3 if weights is None else weights, lo, hi, f, gs, out, near,
        num_q, g, values, num_c, seg_len, *x3.stride(), *w_strides,
        float(fmt.min), float(fmt.max), split, magic, min_normal, float(norm),
        float(tolerance), *rule_args, **consts,
        HAS_ZP=rule.kind == _ASYM, HAS_W=weights is not None,
        IS_FLOAT=fmt.is_float, NORM_KIND=triton_mse._norm_kind(norm),
        ROWS=n > 1, ONE_TILE=one_tile, NEAR=segments == 1, EXACT=exact,
        BLOCK_Q=block_q, BLOCK_E=block_e, enable_fp_fusion=False,
    )  # fmt: skip
    fast = not exact and x3.is_cuda and triton_mse._HAS_FAST_POW
    with gpu.interpreter_quiet():
        try:
            launch(FAST_POW=fast)
        except Exception:  # a Triton without libdevice's fast_powf
            if not fast:
                raise
            triton_mse._HAS_FAST_POW = False
            launch(FAST_POW=False)
    if segments == 1:
        return out[0], near
    errors = out.sum(dim=0).to(dtype)  # segments in a fixed order
    block = min(_CHOOSE_BLOCK, triton.next_power_of_2(num_q))
    with gpu.interpreter_quiet():
        _near_kernel[(triton.cdiv(num_q, block),)](
            errors, lo, hi, f, gs, near, num_q, num_c, float(tolerance),
            *rule_args, **consts, BLOCK_Q=block, enable_fp_fusion=False,
        )  # fmt: skip
    return errors, near


def candidate_qparams(
    rule: Rule,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    index: torch.Tensor,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(C, K)` effective scales and zero points (None when symmetric) of
    the candidates of qparams `index` (`(K,)` int64): those of
    `scoring.candidate_qparams`, in float32."""
    device = min_vals.device
    lo, hi, f, gs = _prepared(min_vals, max_vals, factors, global_scale, device)
    num_c, k = f.numel(), index.numel()
    scale = torch.empty(num_c, k, dtype=torch.float32, device=device)
    zp = torch.empty(num_c, k, dtype=torch.float32, device=device)
    rule_args, consts = _rule_launch_args(rule, global_scale)
    block = min(_CHOOSE_BLOCK, triton.next_power_of_2(max(k, 1)))
    if k:
        with gpu.interpreter_quiet():
            _qparams_kernel[(triton.cdiv(k, block),)](
                lo, hi, f, gs, index, scale, zp, k, num_c, *rule_args,
                **consts, BLOCK_K=block, enable_fp_fusion=False,
            )  # fmt: skip
    return scale, (zp if rule.kind == _ASYM else None)


@triton.jit
def _improved_kernel(err_ptr, imp_ptr, Q, C, MODE: tl.constexpr,
                     BLOCK_Q: tl.constexpr):  # fmt: skip
    """`imp[c] = 1` where candidate `c` improves some qparam of this block:
    its error strictly below the least before it (FIRST_BEST: candidate 0
    always; BEST_INDEX: NaN as inf, the least from float32's max)."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < Q
    if MODE == 0:
        best = tl.full([BLOCK_Q], float("inf"), tl.float64)
    else:
        best = tl.full([BLOCK_Q], 3.4028234663852886e38, tl.float64)
    for c in range(C):
        v = tl.load(err_ptr + c * Q + q, mask=q_ok, other=float("inf"))
        v = v.to(tl.float64)
        if MODE == 1:
            v = tl.where(v != v, float("inf"), v)
        better = (v < best) & q_ok
        if MODE == 0:
            better = better | (c == 0)
        hit = tl.max(better.to(tl.int32), axis=0)
        if hit > 0:
            tl.atomic_max(imp_ptr + c, hit)
        # the least so far, NaN once a NaN is seen (torch's cummin)
        best = tl.where((v != v) | (best != best), v + best, tl.minimum(best, v))


@triton.jit
def _choose_kernel(err_ptr, imp_ptr, f_ptr, out_ptr, Q, C, patience,
                   STOPS: tl.constexpr, MODE: tl.constexpr,
                   BLOCK_Q: tl.constexpr):  # fmt: skip
    """How many candidates are scored before the early stop (from `imp`),
    then each qparam's first least error among them: the factor
    (FIRST_BEST) or the index (BEST_INDEX, 0 where none is below float32's
    max)."""
    # the stop: after `patience` candidates past the last improving one
    last = tl.zeros([1], dtype=tl.int32) - MODE  # BEST_INDEX: from -1
    scored = tl.zeros([1], dtype=tl.int32) + C
    if STOPS:
        for i in range(C):
            imp = tl.load(imp_ptr + i + tl.zeros([1], dtype=tl.int32))
            last = tl.where(imp > 0, i, last)
            stop = (i - last >= patience) & (imp == 0)
            scored = tl.where(stop & (scored == C), i + 1, scored)
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < Q
    best = tl.full([BLOCK_Q], float("inf"), tl.float64)
    index = tl.zeros([BLOCK_Q], dtype=tl.int32)
    for c in range(C):
        v = tl.load(err_ptr + c * Q + q, mask=q_ok, other=float("inf"))
        v = v.to(tl.float64)
        if MODE == 1:
            v = tl.where(v != v, float("inf"), v)
        better = (v < best) & (c < scored)
        if MODE == 0:  # torch's argmin: the first NaN is the least
            better = better | ((v != v) & (best == best) & (c < scored))
        best = tl.where(better, v, best)
        index = tl.where(better, c, index)
    if MODE == 0:
        tl.store(out_ptr + q, tl.load(f_ptr + index, mask=q_ok, other=0.0),
                 mask=q_ok)  # fmt: skip
    else:
        found = tl.where(best < 3.4028234663852886e38, index, 0)
        tl.store(out_ptr + q, found.to(tl.int64), mask=q_ok)


def choose(
    errors: torch.Tensor,
    patience: int | None,
    mode: int,
    factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """llm-compressor's choice from `(C, Q)` errors, on the device.

    Args:
        errors: `(C, Q)` float32 / float64 errors, contiguous.
        patience: the early stop (FIRST_BEST: None never, 0 at the first
            candidate improving nothing; BEST_INDEX: 0 never).
        mode: `FIRST_BEST` (`mse_ties.first_best`: the chosen `factors`,
            `(Q,)` float32) or `BEST_INDEX` (`imatrix.best_index`: `(Q,)`
            int64 indices).
        factors: `(C,)` float32 factors (FIRST_BEST).
    """
    errors = errors.contiguous()
    num_c, num_q = errors.shape
    device = errors.device
    improved = torch.zeros(num_c, dtype=torch.int32, device=device)
    stops = patience is not None if mode == FIRST_BEST else bool(patience)
    if mode == FIRST_BEST:
        if factors is None:
            raise ValueError("choose(FIRST_BEST) needs the factors")
        out = torch.empty(num_q, dtype=torch.float32, device=device)
        f = factors.to(device=device, dtype=torch.float32).contiguous()
    else:
        out = torch.empty(num_q, dtype=torch.int64, device=device)
        f = improved
    block = min(_CHOOSE_BLOCK, triton.next_power_of_2(max(num_q, 1)))
    grid = (triton.cdiv(num_q, block),)
    with gpu.interpreter_quiet():
        if stops:
            _improved_kernel[grid](errors, improved, num_q, num_c, MODE=mode,
                                   BLOCK_Q=block)  # fmt: skip
        _choose_kernel[grid](errors, improved, f, out, num_q, num_c,
                             int(patience or 0), STOPS=stops, MODE=mode,
                             BLOCK_Q=block)  # fmt: skip
    return out
