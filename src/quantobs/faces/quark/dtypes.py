"""Quark's enums (`Dtype`, `QSchemeType`, `ScaleType`, `RoundType`,
`ZeroPointType`: members, names and values of Quark 0.13) and what each
dtype quantizes to: its number format from the core table, its range, and
the MX element parameters.
"""

from __future__ import annotations

from enum import Enum

import torch

from quantobs.core.formats import NumberFormat, get_format

__all__ = [
    "BFP16_BLOCK",
    "CAST_DTYPES",
    "FP8_DTYPES",
    "INT_DTYPES",
    "MX_ELEMENT_DTYPES",
    "SCALE_FORMATS",
    "SCALE_MODES",
    "SMALL_FLOAT_DTYPES",
    "SUPPORTED_DTYPES",
    "Dtype",
    "QSchemeType",
    "RoundType",
    "ScaleType",
    "ZeroPointType",
    "element_format",
    "mx_element_params",
    "quant_range",
]


class Dtype(Enum):
    """Quantized data types (Quark's members; `SUPPORTED_DTYPES` are observed)."""

    int8 = "int8"
    uint8 = "uint8"
    uint16 = "uint16"
    int16 = "int16"
    int32 = "int32"
    int4 = "int4"
    uint4 = "uint4"
    int3 = "int3"
    int2 = "int2"
    uint2 = "uint2"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp8_e5m2 = "fp8_e5m2"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m3 = "fp8_e5m3"
    fp6_e3m2 = "fp6_e3m2"
    fp6_e2m3 = "fp6_e2m3"
    fp4 = "fp4"
    mx = "mx"
    mx6 = "mx6"
    mx9 = "mx9"
    bfp16 = "bfp16"


class QSchemeType(Enum):
    """Granularity of the scales."""

    per_tensor = "per_tensor"
    per_channel = "per_channel"
    per_group = "per_group"
    per_block = "per_block"


class ScaleType(Enum):
    """Kind of scale: `float` keeps the model's dtype, `float32` / `float16` /
    `bfloat16` cast to it, `pof2` rounds to a power of two."""

    float = "float"
    pof2 = "pof2"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float8_e5m3 = "float8_e5m3"
    float8_e8m0fnu = "float8_e8m0fnu"

    def to_torch_dtype(self) -> torch.dtype | None:
        """The dtype scales are cast to (`None`: keep the computed dtype)."""
        return _SCALE_TORCH_DTYPES.get(self)


_SCALE_TORCH_DTYPES = {
    ScaleType.float32: torch.float32,
    ScaleType.float16: torch.float16,
    ScaleType.bfloat16: torch.bfloat16,
}


class RoundType(Enum):
    """Rounding of the quantizer (observers record it; none of them rounds)."""

    round = 2
    floor = 3
    half_even = 8


class ZeroPointType(Enum):
    """`int32`: integer zero points; `float32`: `-min / scale` unrounded."""

    int32 = "int32"
    float32 = "float32"


INT_DTYPES = (
    Dtype.int8, Dtype.uint8, Dtype.int16, Dtype.uint16, Dtype.int32,
    Dtype.int4, Dtype.uint4, Dtype.int3, Dtype.int2, Dtype.uint2,
)  # fmt: skip
FP8_DTYPES = (Dtype.fp8_e4m3, Dtype.fp8_e5m2)
SMALL_FLOAT_DTYPES = (Dtype.fp4, Dtype.fp6_e2m3, Dtype.fp6_e3m2)
CAST_DTYPES = (Dtype.float16, Dtype.bfloat16)
SUPPORTED_DTYPES = (
    *INT_DTYPES, *FP8_DTYPES, *SMALL_FLOAT_DTYPES, *CAST_DTYPES,
    Dtype.mx, Dtype.bfp16,
)  # fmt: skip
MX_ELEMENT_DTYPES = (*SMALL_FLOAT_DTYPES, *FP8_DTYPES, Dtype.int8)
SCALE_FORMATS = ("float32", "e8m0", "e4m3")
SCALE_MODES = ("even", "floor", "ceil")
BFP16_BLOCK = 8


_FORMAT_NAMES = {
    Dtype.int8: "int8", Dtype.uint8: "uint8", Dtype.int4: "int4",
    Dtype.uint4: "uint4", Dtype.int3: "int3", Dtype.int2: "int2",
    Dtype.uint2: "uint2", Dtype.fp8_e4m3: "float8_e4m3fn",
    Dtype.fp8_e5m2: "float8_e5m2", Dtype.fp6_e2m3: "float6_e2m3fn",
    Dtype.fp6_e3m2: "float6_e3m2fn", Dtype.fp4: "float4_e2m1fn",
    Dtype.int16: "int16", Dtype.uint16: "uint16", Dtype.int32: "int32",
}  # fmt: skip
_FORMATS = {dtype: get_format(name) for dtype, name in _FORMAT_NAMES.items()}


def element_format(dtype: Dtype) -> NumberFormat:
    """The number format the values of `dtype` are rounded to.

    Raises:
        ValueError: `dtype` has no element format (`mx`, `bfp16`, float16...).
    """
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype.value!r} has no element format; use an integer, "
            "fp8, fp6 or fp4 dtype"
        ) from None


def quant_range(dtype: Dtype) -> tuple[float, float]:
    """`(qmin, qmax)` of `dtype` as Quark's `calculate_qmin_qmax` gives them:
    Python ints for integer dtypes (`(-128, 127)` for int8), floats for float
    formats (`(-448.0, 448.0)` for fp8_e4m3)."""
    fmt = element_format(dtype)
    if fmt.is_float:
        return fmt.min, fmt.max
    return int(fmt.min), int(fmt.max)


def mx_element_params(dtype: Dtype) -> tuple[int, int]:
    """`(mantissa_bits, emax)` of an MX element format.

    Float elements: the format's own (fp4 `(1, 2)`, fp6_e2m3 `(3, 2)`,
    fp6_e3m2 `(2, 4)`, fp8_e4m3 `(3, 8)`, fp8_e5m2 `(2, 15)`). int8 elements
    are OCP MXINT8's fixed-point `q * 2**-6` (|values| < 2), so `emax` is 0
    and all 8 bits count as mantissa: the shared scale is `2**exponent(amax)`
    and the integer step is `scale / 64`.
    """
    if dtype == Dtype.int8:
        return 8, 0
    if dtype not in MX_ELEMENT_DTYPES:
        valid = ", ".join(d.value for d in MX_ELEMENT_DTYPES)
        raise ValueError(
            f"{dtype.value!r} is not an MX element dtype; use one of {valid}"
        )
    fmt = element_format(dtype)
    return fmt.mantissa_bits, fmt.emax


# ---------------------------------------------------------------- coercion
