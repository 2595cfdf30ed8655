"""Quark's range -> (scale, zero point) arithmetic, as pure functions.

Each function does its arithmetic in the dtype of its inputs with Quark's
order of operations, so results equal Quark 0.13's bit for bit, dtype
included (a bfloat16 range gives bfloat16-rounded scales where Quark's do).
Exponents of powers of two are exact (`torch.frexp`), where Quark takes
`floor` / `ceil` of a float `log2` (see `mx_exponent`).

Symmetric int: `scale = max(amax / ((qmax - qmin) / 2), eps)`, zero point 0
(also for unsigned dtypes: no 128 as torch.ao gives). Asymmetric int: `scale
= max((max+ - min-) / (qmax - qmin), eps)`, `zero_point = clamp(qmin -
round(min- / scale))` with the range first extended to contain 0; the
`float32` zero-point type uses the raw range and `zero_point = -min / scale`.

MX (e8m0) shared-scale exponent of a block amax `a = m * 2**e` (`1 <= m <
2`), for an element format with `M` mantissa bits and largest exponent
`emax`; the scale is `2**(exponent - emax)`, clamped to `2**-127 .. 2**127`::

    mode    exponent                         fp4 (M=1):  a = 1.5   1.75  1.9   2
    even    e + 1 if m >= 2 - 2**-(M+1)                  0     1     1     1
            else e (the amax rounded to M
            mantissa bits, ties up)
    floor   e                                            0     0     0     1
    ceil    e if m == 1 else e + 1                       1     1     1     1

    even threshold by element: fp4 1.75, fp6_e3m2 / fp8_e5m2 1.875,
    fp6_e2m3 / fp8_e4m3 1.9375, int8 2 - 2**-9.
    a == 0: even -> exponent -126 (scale 2**max(-126 - emax, -127));
            floor / ceil -> the scale is `eps`.
    even, a rounding up to 2**128 (beyond float32): the scale is 2**127.

`quantobs.core.qparams.pow2_exponent`'s `even` mode (compressed-tensors') always
uses the 1.75 threshold: it equals Quark's for fp4 elements only, so this
module has its own.
"""

from __future__ import annotations

import torch

from quantobs.core.formats import get_format

__all__ = [
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "e4m3_two_level_scale",
    "e8m0_scale",
    "float_scale",
    "int_qparams",
    "mx_exponent",
    "pow2_round",
]

E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
_F32_MIN_NORMAL_EXP = -126  # Quark's even mode replaces amax == 0 by 2**-126
_F32_MAX_EXP = 127
_FP8_E4M3 = get_format("float8_e4m3fn")


def int_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    qmin: float,
    qmax: float,
    symmetric: bool,
    eps: torch.Tensor,
    float_zero_point: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer scale and zero point of a range (see the module docstring).

    Args:
        min_val: `(*Q,)` minima, any real dtype (the arithmetic dtype).
        max_val: `(*Q,)` maxima.
        qmin: smallest quantized value (e.g. -128).
        qmax: largest quantized value (e.g. 127).
        symmetric: symmetric range, zero point 0.
        eps: 0-d float32 smallest scale (a tensor: its dtype takes part in
            type promotion, as in Quark, so 0-d bfloat16 ranges give float32
            scales and n-d ones bfloat16 scales).
        float_zero_point: asymmetric `-min / scale` float zero point on the
            raw (not zero-extended) range; scales `<= eps` become 1.

    Returns:
        `(scale, zero_point)`, each `(*Q,)`; zero points int32 unless
        `float_zero_point`.
    """
    eps = eps.to(min_val.device)
    min_neg = torch.clamp(min_val, max=0)
    max_pos = torch.clamp(max_val, min=0)
    levels = float(qmax - qmin)
    if symmetric:
        amax = torch.maximum(-min_neg, max_pos)
        scale = torch.maximum(amax / (levels / 2), eps)
        zero_point = torch.zeros(min_neg.shape, dtype=torch.int32, device=eps.device)
        return scale, zero_point
    if float_zero_point:
        scale = (max_val - min_val) / levels
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        return scale, -1 * min_val / scale
    scale = torch.maximum((max_pos - min_neg) / levels, eps)
    zero_point = int(qmin) - torch.round(min_neg / scale).to(torch.int32)
    return scale, torch.clamp(zero_point, int(qmin), int(qmax))


def float_scale(
    amax: torch.Tensor,
    quant_max: float,
    eps: float,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`amax / quant_max` (FP8, or float scales of FP4 / FP6), zero -> `eps`.

    Args:
        amax: `(*Q,)` absolute maxima.
        quant_max: largest element value (448 for fp8_e4m3, 6 for fp4).
        eps: replacement of zero scales.
        scale_dtype: dtype to divide in (default: `amax.dtype`).

    Returns:
        `(*Q,)` scales in `scale_dtype` or `amax.dtype`.
    """
    if scale_dtype is not None:
        amax = amax.to(scale_dtype)
    scale = torch.div(amax, quant_max)
    return scale.masked_fill(scale == 0.0, eps)


def mx_exponent(amax: torch.Tensor, mode: str, mantissa_bits: int) -> torch.Tensor:
    """Power-of-two exponent of each positive `amax` (module truth table).

    Args:
        amax: `(*Q,)` positive finite values (zeros give garbage; callers
            mask them).
        mode: `even`, `floor` or `ceil`.
        mantissa_bits: element mantissa bits (the `even` threshold).

    Returns:
        `(*Q,)` int32 exponents, exact (no float `log2`).
    """
    mantissa, exponent = torch.frexp(amax.float())  # amax = m * 2**x, m in [.5, 1)
    exponent = exponent - 1  # amax = (2 m) * 2**(x - 1), 2 m in [1, 2)
    if mode == "even":
        # 2 m >= 2 - 2**-(M + 1)  <=>  m >= 1 - 2**-(M + 2)
        return exponent + (mantissa >= 1.0 - 2.0 ** -(mantissa_bits + 2)).int()
    if mode == "ceil":
        return exponent + (mantissa > 0.5).int()
    if mode == "floor":
        return exponent
    raise ValueError(f"scale_calculation_mode={mode!r}; use 'even', 'floor' or 'ceil'")


def e8m0_scale(
    amax: torch.Tensor,
    mode: str,
    mantissa_bits: int,
    emax: int,
    eps: float,
) -> torch.Tensor:
    """OCP MX shared scale `2**(exponent(amax) - emax)`, an e8m0 value.

    Args:
        amax: `(*Q,)` block absolute maxima (finite, `>= 0`).
        mode: `even`, `floor` or `ceil` (module truth table).
        mantissa_bits: element mantissa bits.
        emax: element largest exponent.
        eps: scale of all-zero blocks in `floor` / `ceil` modes.

    Returns:
        `(*Q,)` scales: float32 in `even` mode, `amax.dtype` otherwise (as
        Quark returns them).
    """
    rounded = mx_exponent(amax, mode, mantissa_bits)
    exponent = (rounded - emax).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    zero = amax == 0
    if mode == "even":
        at_zero = max(_F32_MIN_NORMAL_EXP - emax, E8M0_MIN_EXP)
        exponent = exponent.masked_fill(zero, at_zero)
        # An amax that rounds up past float32 (2**128) is inf to Quark: 2**127.
        exponent = exponent.masked_fill(rounded > _F32_MAX_EXP, E8M0_MAX_EXP)
        return torch.exp2(exponent.float())
    scale = torch.exp2(exponent.float()).to(amax.dtype)
    return scale.masked_fill(zero | (scale == 0), eps)


def e4m3_two_level_scale(
    amax: torch.Tensor, elem_max: float, eps: float
) -> torch.Tensor:
    """FP8 e4m3 local scales under a global scale (Quark's `e4m3` format).

    `global = 448 * elem_max / amax.max()`; each local scale is
    `fp8(amax / elem_max * global) / global`, float32, so the largest block
    gets exactly `amax / elem_max`. All-zero blocks (and an all-zero tensor)
    get `eps` where Quark returns 0 (or NaN).

    Args:
        amax: `(*Q,)` block absolute maxima.
        elem_max: largest element value (6 for fp4).
        eps: scale of all-zero blocks.

    Returns:
        `(*Q,)` float32 scales.
    """
    local = amax.float()
    global_amax = local.max()
    if not bool(global_amax > 0):
        return torch.full_like(local, eps)
    two_level = _FP8_E4M3.max * (elem_max / global_amax)
    scale = _FP8_E4M3.round(local / elem_max * two_level) / two_level
    return scale.masked_fill(scale == 0, eps)


def pow2_round(scale: torch.Tensor) -> torch.Tensor:
    """Each positive scale rounded to the nearest power of two (in log2).

    `s = m * 2**e` (`1 <= m < 2`) becomes `2**e` if `m < sqrt(2)` else
    `2**(e + 1)`, decided exactly (`m**2 < 2` in float64); non-positive values
    are kept.

    Args:
        scale: `(*Q,)` floating scales.

    Returns:
        `(*Q,)` in `scale.dtype`.
    """
    mantissa, exponent = torch.frexp(scale.double())  # m in [0.5, 1)
    up = (mantissa * mantissa >= 0.5).int()  # (2 m)**2 >= 2
    rounded = torch.ldexp(torch.ones_like(mantissa), exponent - 1 + up)
    return torch.where(scale > 0, rounded.to(scale.dtype), scale)
