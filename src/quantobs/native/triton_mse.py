# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton kernel: the error of every MSE candidate, per qparam, in one pass.

`candidate_errors(x3, scale, zero_point, fmt, norm, weights)` is the GPU twin
of `quantobs.core.scoring.score` for candidates given as `(C, Q)` effective
scales and zero points: each program loads a tile of its qparams' values
once (or, for qparams of more values than a tile, one segment of them) and
evaluates every candidate on it, summing `w * |fake_quant(x) - x| ** norm`
per qparam on chip; only the `(C, Q)` sums (or `(S, C, Q)` partial sums of
`S` segments, added in a fixed order) reach memory. Importing this module
imports Triton: callers import it lazily (`quantobs.native.gpu.available`).

Which operations are exact (`exact=True`: torch's bits per value):

* the value's conversion to float32 (bf16, fp16: exact), `x / scale` by
  `div_rn` (IEEE division, correctly rounded; Triton's `/` is approximate),
  `+ zero_point`, the clamp, `- zero_point`, `* scale` and `- x`: correctly
  rounded float32 operations, launched with `enable_fp_fusion=False` so that
  no multiply and add are contracted into one FMA (torch rounds each);
* the rounding: ints by `(v + 1.5 * 2**23) - 1.5 * 2**23` (half to even for
  `|v| < 2**22`: ints of at most 16 bits), float formats by the Veltkamp
  split of `NumberFormat._round_float32` (same operations, same order);
* the sums: each value's error in float64, tiles and segments in order.

What is not torch's: `|e| ** norm` (`exp2(norm * log2 |e|)`, times `e * e`
for norm 2.4; `e * e` and `e * e * e` exactly for 2 and 3) is within a few
float32 ulps of torch's `pow`, and the sums are not torch's float32 sums in
its order. The searches run `exact=False`, 2-3 times faster: `x * (1 /
scale)` (within 1.5 ulp of `x / scale`: a value's level changes only within
an ulp of a rounding midpoint, where both levels' errors are equal to an
ulp) and float32 tree sums of each tile's at most 1024 values (relative
error at most 10 * 2**-24). Either way the errors are torch's to about 1e-6
relative, deterministic, the same on every run; `quantobs.solvers.mse_gpu`
re-scores the qparams whose candidates are that close with torch, so the
choice is torch's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from quantobs.core.formats import NumberFormat
from quantobs.native import gpu

try:  # CUDA's fast `pow` (libdevice); the interpreter has no libdevice
    from triton.language.extra import libdevice

    _HAS_FAST_POW = hasattr(libdevice, "fast_powf")
except ImportError:  # pragma: no cover - older Triton
    libdevice = None
    _HAS_FAST_POW = False

__all__ = ["candidate_errors", "supported"]

_F32_MANTISSA_BITS = 23
_INT_MAX_BITS = 16  # the magic-number rounding is exact below 2**22
_TILE = 4096  # values per program tile (qparams x their values)
_MAX_TILE_E = 1024  # values of one qparam per tile row
_SEGMENT = 8192  # values of one qparam per program, for long qparams

# error power: generic `exp2(norm * log2 a)`, `a * a * a ** 0.4`, squares, cubes
_POW_GENERIC, _POW_24, _POW_2, _POW_3 = 0, 1, 2, 3


@triton.jit
def _load_values(x_ptr, w_ptr, e, q64, ok, G, sxn, sxq, sxg, swn, swq, swg,
                 ROWS: tl.constexpr, HAS_W: tl.constexpr):  # fmt: skip
    """`(BQ, BE)` float32 values (and weights, or 1.0) of qparams `q64`
    `(BQ, 1)` at value indices `e` `(1, BE)` of the `N * G` per qparam (row
    `e // G`, column `e % G` where `ROWS`), 0 where not `ok`."""
    if ROWS:
        n = e // G
        g = e - n * G
        x_off = n * sxn + q64 * sxq + g * sxg
        w_off = n * swn + q64 * swq + g * swg
    else:
        x_off = q64 * sxq + e * sxg
        w_off = q64 * swq + e * swg
    x = tl.load(x_ptr + x_off, mask=ok, other=0.0).to(tl.float32)
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + w_off, mask=ok, other=0.0).to(tl.float32)
    return x, w


@triton.jit
def _error_power(a, norm, NORM_KIND: tl.constexpr, FAST_POW: tl.constexpr):
    """`a ** norm` for float32 `a >= 0` (module docstring)."""
    if NORM_KIND == 2:
        return a * a
    elif NORM_KIND == 3:
        return a * a * a
    else:
        # log2 of 0 would be -inf (and warn under the interpreter): skip it
        safe = tl.where(a > 0, a, 1.0)
        if NORM_KIND == 1:  # a ** 2.4 = a * a * a ** 0.4
            if FAST_POW:  # CUDA: exp2(y * log2(x)), the hardware's approximations
                power = a * a * libdevice.fast_powf(safe, 0.4)
            else:
                power = a * a * tl.exp2(0.4 * tl.log2(safe))
        else:
            if FAST_POW:
                power = libdevice.fast_powf(safe, norm)
            else:
                power = tl.exp2(norm * tl.log2(safe))
        return tl.where(a > 0, power, 0.0)


@triton.jit
def _error(x, s, inv, zp, w, qmin, qmax, split, magic, min_normal, norm,
           HAS_ZP: tl.constexpr, HAS_W: tl.constexpr, IS_FLOAT: tl.constexpr,
           NORM_KIND: tl.constexpr, EXACT: tl.constexpr,
           FAST_POW: tl.constexpr):  # fmt: skip
    """`w * |fake_quant(x) - x| ** norm` in float32, element by element
    (`x / s` exactly, or `x * inv` with `inv = 1 / s`)."""
    if EXACT:  # noqa: SIM108 (Triton: a constexpr branch)
        v = tl.math.div_rn(x, s)
    else:
        v = x * inv
    if HAS_ZP:
        v = v + zp
    v = tl.minimum(tl.maximum(v, qmin), qmax)
    if IS_FLOAT:
        # NumberFormat._round_float32: saturate, Veltkamp split, subnormals
        a = tl.minimum(tl.abs(v), qmax)
        c = a * split
        normal = c - (c - a)
        tiny = (a + magic) - magic
        r = tl.where(a < min_normal, tiny, normal)
        v = tl.where(v < 0, -r, r)
    else:
        v = (v + 12582912.0) - 12582912.0  # half to even (|v| < 2**22)
    if HAS_ZP:
        v = v - zp
    err = _error_power(tl.abs(v * s - x), norm, NORM_KIND, FAST_POW)
    if HAS_W:
        err = err * w
    return err


@triton.jit
def _row_sums(err, EXACT: tl.constexpr):
    """`(BQ, BE)` float32 errors -> `(BQ,)` float64 sums: of float64 values,
    or (fast) a float32 tree, rounded to float64."""
    if EXACT:
        return tl.sum(err.to(tl.float64), axis=1)
    else:
        return tl.sum(err, axis=1).to(tl.float64)


@triton.jit
def _errors_kernel(
    x_ptr, w_ptr, scale_ptr, zp_ptr, out_ptr,
    Q, G, E, C, seg_len,
    sxn, sxq, sxg, swn, swq, swg,
    qmin, qmax, split, magic, min_normal, norm,
    HAS_ZP: tl.constexpr, HAS_W: tl.constexpr, IS_FLOAT: tl.constexpr,
    NORM_KIND: tl.constexpr, ROWS: tl.constexpr, ONE_TILE: tl.constexpr,
    EXACT: tl.constexpr, FAST_POW: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Program `(i, s)`: qparams `i * BLOCK_Q ..`, values `s * seg_len ..` of
    each; writes `out[s, c, q]`, the float64 error sum of candidate `c`."""
    pid_q = tl.program_id(0)
    pid_s = tl.program_id(1)
    q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BQ,)
    q_ok = q < Q
    q64 = q.to(tl.int64)[:, None]  # (BQ, 1)
    e_start = pid_s.to(tl.int64) * seg_len
    lanes = tl.arange(0, BLOCK_E)[None, :]  # (1, BE)
    out_row = out_ptr + pid_s.to(tl.int64) * C * Q + q
    if ONE_TILE:
        # every value of these qparams in one tile, loaded once
        e = e_start + lanes
        ok = q_ok[:, None] & (e < E)
        x, w = _load_values(x_ptr, w_ptr, e, q64, ok, G, sxn, sxq, sxg, swn,
                            swq, swg, ROWS, HAS_W)  # fmt: skip
        for c in range(C):
            s = tl.load(scale_ptr + c * Q + q, mask=q_ok, other=1.0)[:, None]
            inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
            zp = 0.0
            if HAS_ZP:
                zp = tl.load(zp_ptr + c * Q + q, mask=q_ok, other=0.0)[:, None]
            err = _error(x, s, inv, zp, w, qmin, qmax, split, magic, min_normal,
                         norm, HAS_ZP, HAS_W, IS_FLOAT, NORM_KIND, EXACT,
                         FAST_POW)  # fmt: skip
            total = _row_sums(tl.where(ok, err, 0.0), EXACT)
            tl.store(out_row + c * Q, total.to(out_ptr.dtype.element_ty), mask=q_ok)
    else:
        for c in range(C):
            s = tl.load(scale_ptr + c * Q + q, mask=q_ok, other=1.0)[:, None]
            inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
            zp = 0.0
            if HAS_ZP:
                zp = tl.load(zp_ptr + c * Q + q, mask=q_ok, other=0.0)[:, None]
            acc = tl.zeros([BLOCK_Q], dtype=tl.float64)
            for e0 in range(0, seg_len, BLOCK_E):
                e = e_start + e0 + lanes
                ok = q_ok[:, None] & (e < E) & (e0 + lanes < seg_len)
                x, w = _load_values(x_ptr, w_ptr, e, q64, ok, G, sxn, sxq, sxg, swn,
                                    swq, swg, ROWS, HAS_W)  # fmt: skip
                err = _error(x, s, inv, zp, w, qmin, qmax, split, magic,
                             min_normal, norm, HAS_ZP, HAS_W, IS_FLOAT, NORM_KIND,
                             EXACT, FAST_POW)  # fmt: skip
                acc += _row_sums(tl.where(ok, err, 0.0), EXACT)
            tl.store(out_row + c * Q, acc.to(out_ptr.dtype.element_ty), mask=q_ok)


def supported(fmt: NumberFormat) -> bool:
    """Whether the kernel rounds to `fmt`: signed float formats with a
    mantissa (FP8, FP6, FP4), ints of at most 16 bits."""
    if fmt.is_float:
        return fmt.signed and fmt.mantissa_bits > 0
    return fmt.bits <= _INT_MAX_BITS


def _norm_kind(norm: float) -> int:
    return {2.4: _POW_24, 2.0: _POW_2, 3.0: _POW_3}.get(float(norm), _POW_GENERIC)


def candidate_errors(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
    weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    exact: bool = True,
) -> torch.Tensor | None:
    """Errors `sum w * |fake_quant(x) - x| ** norm` of every candidate.

    Args:
        x3: `(N, Q, G)` finite float values (any strides; bf16, fp16, fp32).
        scale: `(C, Q)` effective candidate scales (divided by any global
            scale), finite and positive.
        zero_point: `(C, Q)` candidate zero points, or None (symmetric).
        fmt: the quantized format (`supported`).
        norm: exponent of the absolute error.
        weights: optional weight of each value, `(N | 1, Q, G)` (any
            strides, e.g. expanded); products `w * err` are float32.
        dtype: of the result: float64 (the sums), or float32 (each sum
            rounded once; half the memory for the searches, which compare
            float32 sums).
        exact: torch's per-value errors (`x / scale` correctly rounded) in
            float64 sums; False: `x * (1 / scale)` and float32 sums of each
            tile's values (at most 1024), 2-3 times faster (module docstring).

    Returns:
        `(C, Q)` errors, or None where the kernel does not apply.
    """
    if x3.ndim != 3 or not supported(fmt) or not x3.is_floating_point():
        return None
    if x3.dtype == torch.float64 or scale.ndim != 2:
        return None
    n, num_q, g = x3.shape
    num_c = scale.shape[0]
    device = x3.device
    if num_c == 0 or num_q == 0:
        return torch.zeros(num_c, num_q, dtype=dtype, device=device)
    values = n * g  # per qparam
    scale = scale.to(device=device, dtype=torch.float32).contiguous()
    zp = None
    if zero_point is not None:
        zp = zero_point.to(device=device, dtype=torch.float32).contiguous()
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
    if fmt.is_float:
        split = float((1 << (_F32_MANTISSA_BITS - fmt.mantissa_bits)) + 1)
        magic = fmt.min_subnormal * float(1 << _F32_MANTISSA_BITS)
        min_normal = fmt.min_normal
    else:
        split, magic, min_normal = 1.0, 0.0, 1.0
    grid = (triton.cdiv(num_q, block_q), segments)
    launch = functools.partial(
        _errors_kernel[grid],
        x3, x3 if weights is None else weights, scale,
        scale if zp is None else zp, out,
        num_q, g, values, num_c, seg_len,
        *x3.stride(), *w_strides,
        float(fmt.min), float(fmt.max), split, magic, min_normal, float(norm),
        HAS_ZP=zp is not None, HAS_W=weights is not None, IS_FLOAT=fmt.is_float,
        NORM_KIND=_norm_kind(norm), ROWS=n > 1, ONE_TILE=one_tile, EXACT=exact,
        BLOCK_Q=block_q, BLOCK_E=block_e, enable_fp_fusion=False,
    )  # fmt: skip
    global _HAS_FAST_POW
    fast = not exact and x3.is_cuda and _HAS_FAST_POW
    with gpu.interpreter_quiet():
        try:
            launch(FAST_POW=fast)
        except Exception:  # a Triton without libdevice's fast_powf: portable pow
            if not fast:
                raise
            _HAS_FAST_POW = False
            launch(FAST_POW=False)
    if segments == 1:
        return out[0]
    return out.sum(dim=0).to(dtype)  # segments in a fixed order: deterministic
