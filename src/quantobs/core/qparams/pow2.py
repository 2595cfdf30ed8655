"""Power-of-two exponents: MX (e8m0) shared scales and power-of-two scales.

The exponent of a positive value `a = m * 2**e` (`1 <= m < 2`) under each
rounding, by what it does (no mode is called "even": compressed-tensors'
and Quark's "even" are two different `round` widths)::

    rounding  exponent                              a = 1.5  1.75  1.9  1.99
    floor     e                                         0      0     0    0
    ceil      e if m == 1 else e + 1                    1      1     1    1
    round     the exponent of `a` rounded to k          0      1     1    1  (k=1)
              mantissa bits, ties up: e + 1 if          0      0     0    1  (k=3)
              m >= 2 - 2**-(k + 1) else e

    who                                  rounding
    compressed-tensors MX ("even")       round, k = 1 (the OCP reference)
    Quark MX "even"                      round, k = the element's mantissa
                                         bits (fp4 1, fp6_e3m2 / fp8_e5m2 2,
                                         fp6_e2m3 / fp8_e4m3 3, MXINT8 8)
    Quark MX "floor" / "ceil"            floor / ceil

compressed-tensors rounds the bits of the amax in its own dtype, so a
subnormal of that dtype rounds to its smallest normal or to 0
(`pow2_exponent(..., bits_of=dtype)`: float16 values below 2**-14).

The MX shared scale is `2**(exponent - emax)` of the element format, an
e8m0 value clamped to `2**-127 .. 2**127`. `pow2_nearest` rounds a scale to
the nearest power of two in log2 (Quark's `pof2` scales: `m < sqrt(2)` goes
down), decided exactly.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = [
    "E8M0_BIAS",
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "Pow2Rounding",
    "e8m0_scale",
    "pow2_exponent",
    "pow2_nearest",
]

Pow2Rounding = Literal["floor", "ceil", "round"]
_ROUNDINGS = ("floor", "ceil", "round")

E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127  # biased 254; 255 is NaN in float8_e8m0fnu


def pow2_exponent(
    amax: torch.Tensor,
    rounding: Pow2Rounding = "round",
    mantissa_bits: int = 1,
    *,
    bits_of: torch.dtype | None = None,
) -> torch.Tensor:
    """The power-of-two exponent of positive values (module truth table).

    Args:
        amax: values `> 0` (zeros and negatives give `-inf`), any float dtype.
        rounding: `floor`, `ceil` or `round`.
        mantissa_bits: `k` of `round`: the mantissa width the value is rounded
            to before its exponent is taken.
        bits_of: with `round`, the float dtype whose bits are rounded, as
            compressed-tensors rounds the amax's own bits (`amax` holds
            values of it): a subnormal of it, `a = f * tiny` (`f < 1`,
            `tiny` its smallest normal), rounds to `tiny` where
            `f >= 1 - 2**-(k + 1)`, else to 0 (exponent `-inf`); float16's
            subnormals lie below 2**-14. None: subnormals have their exact
            exponent (float32's only differ below 2**-126).

    Returns:
        float32 tensor of integer-valued exponents, same shape (exact:
        `frexp`, no float `log2`).

    Raises:
        ValueError: an unknown rounding.
    """
    if rounding not in _ROUNDINGS:
        raise ValueError(
            f"rounding={rounding!r}; use 'floor', 'ceil' or 'round' (the "
            "value rounded to mantissa_bits bits)"
        )
    mantissa, exponent = torch.frexp(amax.float())  # amax = m * 2**x, m in [.5, 1)
    e = (exponent - 1).to(torch.float32)  # amax = (2 m) * 2**(x - 1)
    if rounding == "round":
        # 2 m >= 2 - 2**-(k + 1)  <=>  m >= 1 - 2**-(k + 2)
        e = e + (mantissa >= 1.0 - 2.0 ** -(mantissa_bits + 2)).to(torch.float32)
    elif rounding == "ceil":
        e = e + (mantissa > 0.5).to(torch.float32)
    positive = amax > 0
    if rounding == "round" and bits_of is not None:
        tiny = torch.finfo(bits_of).tiny
        # a subnormal's fraction rounded to k bits: up to `tiny`, or 0
        up = amax >= (1.0 - 2.0 ** -(mantissa_bits + 1)) * tiny
        e = torch.where(amax < tiny, math.log2(tiny), e)
        positive = positive & ((amax >= tiny) | up)
    return torch.where(positive, e, torch.full_like(e, float("-inf")))


def e8m0_scale(exponent: torch.Tensor, emax: int) -> torch.Tensor:
    """MX shared scales `2**(exponent - emax)`, clamped to the e8m0 range.

    Args:
        exponent: float32 exponents of the block maxima (`pow2_exponent`).
        emax: largest exponent of the element format (fp4: 2, fp8 e4m3: 8).

    Returns:
        float32 powers of two in `2**-127 .. 2**127`.
    """
    return torch.exp2((exponent - emax).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP))


def pow2_nearest(scale: torch.Tensor) -> torch.Tensor:
    """Each positive value rounded to the nearest power of two in log2.

    `s = m * 2**e` (`1 <= m < 2`) becomes `2**e` if `m < sqrt(2)` else
    `2**(e + 1)`, decided exactly (`m**2 < 2` in float64); non-positive values
    are kept. Same dtype.
    """
    mantissa, exponent = torch.frexp(scale.double())  # m in [0.5, 1)
    up = (mantissa * mantissa >= 0.5).int()  # (2 m)**2 >= 2
    rounded = torch.ldexp(torch.ones_like(mantissa), exponent - 1 + up)
    return torch.where(scale > 0, rounded.to(scale.dtype), scale)
