"""Number formats that quantized values are rounded to.

One table, :data:`FORMATS`, keyed by the names torch and ml_dtypes use. Each
entry is a :class:`NumberFormat` that knows its bounds, its bit patterns and
its rounding, so callers never branch on ``num_bits``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "NumberFormat", "get_format", "int_format"]

# float8_e8m0fnu has no sign, no zero and no mantissa: its values are 2**e for
# e in -127..127 (code e + 127), and code 0xFF is NaN. With no mantissa bit there
# is no "even" to tie to: from the linear midpoint 1.5 * 2**e upwards we round to
# 2**(e+1), so ties go UP, whatever the parity of the code. ml_dtypes and torch
# agree (torch calls the implicit leading 1, always odd, the LSB):
#
#     x            1.0  1.4  1.5  1.6  2.9  3.0  3.1  6.0  12.0  0.75
#     round(x)     1    1    2    2    2    4    4    8    16    1
#     code         127  127  128  128  128  129  129  130  131   127
#
# Beyond the range we saturate where ml_dtypes and torch give NaN (or worse):
#     x <= 2**-127 (including 0, negatives, -inf)  ->  2**-127
#     x >= 2**127  (including +inf)                ->  2**127
#     NaN                                          ->  NaN

# Fast path for float32 input and float formats with a mantissa: exact
# float32 arithmetic (faster than torch's float8 casts, and it covers the
# formats torch has no dtype for). Not float8_e8m0fnu (no mantissa bit; its
# ties go up), which takes the generic path.
_F32_MANTISSA_BITS = 23
_MAX_LISTED_BITS = 16  # `values()` of wider formats (int32) would not fit memory


@dataclass(frozen=True, kw_only=True, slots=True)
class NumberFormat:
    """A number format: its range, its bit patterns and its rounding.

    Attributes:
        name: Name as torch / ml_dtypes spell it, e.g. ``"int4"``.
        bits: Width of one code in bits.
        is_float: Whether the format is a floating-point format.
        signed: Whether the format has negative values.
        min: Most negative finite value; for unsigned formats the smallest
            value (0.0 for unsigned ints, ``2**-127`` for float8_e8m0fnu).
        max: Largest finite value.
        exponent_bits: Exponent field width (0 for ints).
        mantissa_bits: Mantissa field width (0 for ints).
        exponent_bias: Exponent bias (0 for ints).
        min_normal: Smallest positive normal value (1.0 for ints).
        min_subnormal: Smallest positive value (1.0 for ints).
        torch_dtype: Native torch dtype with exactly these semantics, if any.
        has_inf: Whether the all-ones exponent with zero mantissa encodes
            infinity (IEEE style). Codes whose magnitude would exceed ``max``
            and are not infinities are NaN.
    """

    name: str
    bits: int
    is_float: bool
    signed: bool
    min: float
    max: float
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    min_normal: float
    min_subnormal: float
    torch_dtype: torch.dtype | None
    has_inf: bool = False

    @property
    def emax(self) -> int:
        """``floor(log2(max))``: exponent of the largest binade (also for ints)."""
        return math.frexp(self.max)[1] - 1

    @property
    def _emin(self) -> int:
        """``log2(min_normal)``: exponent of the smallest normal binade."""
        return math.frexp(self.min_normal)[1] - 1

    def values(self) -> torch.Tensor:
        """Every distinct finite value, ascending, float64 (zero appears once).

        Raises:
            ValueError: the format has more than 2**16 values (int32).
        """
        if not self.is_float:
            if self.bits > _MAX_LISTED_BITS:
                raise ValueError(
                    f"{self.name} has 2**{self.bits} values; too many to list"
                )
            return torch.arange(self.min, self.max + 1, dtype=torch.float64)
        table = _code_table(self)
        finite: torch.Tensor = torch.unique(table[torch.isfinite(table)])
        return finite + 0.0  # -0.0 -> +0.0

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Interpret bit patterns as values of this format.

        Args:
            codes: Integer tensor of codes in ``0 .. 2**bits - 1``; for ints the
                code is the two's-complement pattern.

        Returns:
            Float64 tensor of values on ``codes.device``: NaN for NaN codes and
            ``±inf`` for infinity codes.

        Raises:
            TypeError: If ``codes`` is not an integer tensor.
            ValueError: If a code is outside ``0 .. 2**bits - 1``.
        """
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
        idx = codes.long()
        if idx.numel() and (idx.min() < 0 or idx.max() >= 1 << self.bits):
            raise ValueError(f"{self.name} codes must lie in 0..{(1 << self.bits) - 1}")
        if not self.is_float:  # two's complement: the top half of codes is negative
            wrap = (idx >= 1 << (self.bits - 1)) & self.signed
            return (idx - wrap.long() * (1 << self.bits)).double()
        return _code_table(self).to(codes.device)[idx]

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the nearest value of this format, saturating.

        Ties go to even (ints: half to even like :func:`torch.round`; floats:
        even mantissa; float8_e8m0fnu: up, see the table in this module).
        Values beyond ``[min, max]``, including ``±inf``, become ``min`` /
        ``max``; float8_e8m0fnu has no zero, so values ``<= 2**-127`` become
        ``2**-127``. NaN stays NaN. Computes in float32 (float64 if ``x`` is
        float64); float32 input to a format with mantissa bits takes an exact
        float32 fast path (see ``_round_float32``).

        Args:
            x: Floating-point tensor.

        Returns:
            Tensor of ``x.dtype`` holding representable values. When the format
            reaches beyond ``x.dtype`` (float8_e8m0fnu into float16), the final
            cast back may itself overflow or underflow.

        Raises:
            TypeError: If ``x`` is not a real floating-point tensor.
        """
        if not x.is_floating_point():
            raise TypeError(f"round needs a floating-point tensor, got {x.dtype}")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(work)
        if work == torch.float32 and self.is_float and self.mantissa_bits > 0:
            out = self._round_float32(y)
        else:
            out = self._round_generic(y)
        return out.to(x.dtype)

    def _round_float32(self, y: torch.Tensor) -> torch.Tensor:
        """Exact round-to-nearest-even of float32 to a signed float format.

        Normal results by Veltkamp splitting: with `c = a * (2**s + 1)`,
        `c - (c - a)` is `a` rounded to nearest-even at `24 - s` significant
        bits; `s = 23 - mantissa_bits` keeps the format's bits. Subnormal
        results share one quantum q: `(a + q * 2**23) - q * 2**23` rounds
        `a < q * 2**23` to a multiple of q (ties to even). Exhaustively
        checked against the generic path in the tests.
        """
        a = y.abs().clamp_(max=self.max)  # saturate first: no carry past max
        split = float((1 << (_F32_MANTISSA_BITS - self.mantissa_bits)) + 1)
        c = a * split
        normal = c.sub_(c - a)  # c - (c - a), into c's buffer
        magic = self.min_subnormal * float(1 << _F32_MANTISSA_BITS)
        tiny = a < self.min_normal
        subnormal = a.add_(magic).sub_(magic)  # into a's buffer, a is done
        out = torch.where(tiny, subnormal, normal, out=normal)
        return out.copysign_(y)

    def _round_generic(self, y: torch.Tensor) -> torch.Tensor:
        """Exact round-to-nearest of a float32/float64 tensor, without casts."""
        if not self.is_float:
            return torch.round(y).clamp(*_int_bounds(self, y.dtype))
        # Saturate first: no overflow below, and no carry past max.
        a = y.abs().clamp(0.0, self.max) if self.signed else y.clamp(self.min, self.max)
        _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): binade e - 1
        # Subnormals share the smallest normal binade's quantum.
        binade = (e - 1).clamp(self._emin, self.emax) - self._emin
        quantum = _quanta(self, y.dtype, y.device)[binade.long()]
        # a / quantum is exact (power of two), torch.round is half-to-even.
        out = torch.round(a / quantum) * quantum
        return torch.copysign(out, y) if self.signed else out


@functools.cache
def _code_table(fmt: NumberFormat) -> torch.Tensor:
    """Float64 value of every code ``0 .. 2**bits - 1`` of a float format (CPU)."""
    n = 1 << fmt.bits
    m_bits, e_bits = fmt.mantissa_bits, fmt.exponent_bits
    out = []
    for code in range(n):
        mant = code & ((1 << m_bits) - 1)
        exp = (code >> m_bits) & ((1 << e_bits) - 1)
        sign = -1.0 if fmt.signed and code >> (m_bits + e_bits) else 1.0
        if exp - fmt.exponent_bias < fmt._emin:  # subnormal
            mag = mant * fmt.min_subnormal
        else:
            mag = math.ldexp(1.0 + mant / (1 << m_bits), exp - fmt.exponent_bias)
        if mag > fmt.max:
            mag = math.inf if fmt.has_inf and mant == 0 else math.nan
        out.append(sign * mag)
    return torch.tensor(out, dtype=torch.float64)


@functools.cache
def _int_bounds(fmt: NumberFormat, dtype: torch.dtype) -> tuple[float, float]:
    """`(min, max)` of an integer format as values of `dtype`: int32's max
    2**31 - 1 is not a float32, whose largest value below it, 2**31 - 128,
    saturates instead (never a value outside the format)."""
    bounds = torch.tensor([fmt.min, fmt.max], dtype=dtype)
    inward = torch.tensor([math.inf, -math.inf], dtype=dtype)
    outside = torch.tensor([fmt.min, fmt.max], dtype=torch.float64)
    outside = (bounds.double() < outside[0:1]) | (bounds.double() > outside[1:2])
    bounds = torch.where(outside, torch.nextafter(bounds, inward), bounds)
    return float(bounds[0]), float(bounds[1])


@functools.cache
def _quanta(
    fmt: NumberFormat, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``2**(E - mantissa_bits)`` for every binade E in ``emin .. emax``."""
    exps = range(fmt._emin - fmt.mantissa_bits, fmt.emax - fmt.mantissa_bits + 1)
    return torch.tensor([math.ldexp(1.0, e) for e in exps], dtype=dtype, device=device)


def _int(bits: int, signed: bool) -> NumberFormat:
    """Two's-complement (or unsigned) integer format of ``bits`` bits."""
    name = f"{'' if signed else 'u'}int{bits}"
    lo = -(1 << (bits - 1)) if signed else 0
    return NumberFormat(
        name=name,
        bits=bits,
        is_float=False,
        signed=signed,
        min=float(lo),
        max=float(lo + (1 << bits) - 1),
        exponent_bits=0,
        mantissa_bits=0,
        exponent_bias=0,
        min_normal=1.0,
        min_subnormal=1.0,
        torch_dtype=_INT_DTYPES.get(name),
    )


_INT_DTYPES = {
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
}


_FLOAT_DTYPES = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}


def _float(
    name: str,
    bits: int,
    emax_hex: str,
    e: int,
    m: int,
    bias: int,
    normal: str,
    subnormal: str,
    signed: bool = True,
    has_inf: bool = False,
) -> NumberFormat:
    """A float format; bounds as exact hex literals."""
    largest = float.fromhex(emax_hex)
    return NumberFormat(
        name=name, bits=bits, is_float=True, signed=signed,
        min=-largest if signed else float.fromhex(subnormal), max=largest,
        exponent_bits=e, mantissa_bits=m, exponent_bias=bias,
        min_normal=float.fromhex(normal), min_subnormal=float.fromhex(subnormal),
        torch_dtype=_FLOAT_DTYPES.get(name), has_inf=has_inf,
    )  # fmt: skip


FORMATS: dict[str, NumberFormat] = {
    **{f.name: f for f in (_int(b, s) for s in (True, False) for b in range(2, 9))},
    "int16": _int(16, True),
    "uint16": _int(16, False),
    "int32": _int(32, True),
    # name, bits, max, exponent bits, mantissa bits, bias, min normal, subnormal
    "float8_e4m3fn": _float("float8_e4m3fn", 8, "0x1.cp8", 4, 3, 7, "0x1p-6", "0x1p-9"),
    "float8_e5m2": _float(
        "float8_e5m2", 8, "0x1.cp15", 5, 2, 15, "0x1p-14", "0x1p-16", has_inf=True
    ),
    "float6_e2m3fn": _float("float6_e2m3fn", 6, "0x1.ep2", 2, 3, 1, "0x1p0", "0x1p-3"),
    "float6_e3m2fn": _float("float6_e3m2fn", 6, "0x1.cp4", 3, 2, 3, "0x1p-2", "0x1p-4"),
    "float4_e2m1fn": _float("float4_e2m1fn", 4, "0x1.8p2", 2, 1, 1, "0x1p0", "0x1p-1"),
    "float8_e8m0fnu": _float(
        "float8_e8m0fnu", 8, "0x1p127", 8, 0, 127, "0x1p-127", "0x1p-127", signed=False
    ),
}  # fmt: skip


def get_format(name: str) -> NumberFormat:
    """Look a format up by name.

    Args:
        name: A key of :data:`FORMATS`, e.g. ``"int4"`` or ``"float8_e4m3fn"``.

    Returns:
        The format.

    Raises:
        TypeError: If ``name`` is not a string.
        KeyError: If ``name`` is unknown; the message lists every valid name.
    """
    if not isinstance(name, str):
        raise TypeError(f"format name must be a str, got {type(name).__name__}")
    try:
        return FORMATS[name]
    except KeyError:
        valid = ", ".join(FORMATS)
        raise KeyError(f"unknown format {name!r}; valid names: {valid}") from None


def int_format(num_bits: int, signed: bool = True) -> NumberFormat:
    """The integer format ``int{num_bits}`` or ``uint{num_bits}``.

    Args:
        num_bits: Width in bits, 2 to 8.
        signed: Two's-complement signed (default) or unsigned.

    Returns:
        The format from :data:`FORMATS`.

    Raises:
        TypeError: If ``num_bits`` is not an int.
        ValueError: If ``num_bits`` is outside 2..8.
    """
    if isinstance(num_bits, bool) or not isinstance(num_bits, int):
        raise TypeError(f"num_bits must be an int, got {type(num_bits).__name__}")
    if not 2 <= num_bits <= 8:
        raise ValueError(f"num_bits must be in 2..8 (int2..int8), got {num_bits}")
    return FORMATS[f"{'' if signed else 'u'}int{num_bits}"]
