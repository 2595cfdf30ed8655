"""AMD Quark's range -> (scale, zero point) arithmetic: `QuarkRule`, and the
power-of-two candidate of its ONNX-derived observers, `QuarkPow2Rule`.

Each function does its arithmetic in the dtype of its inputs with Quark's
order of operations, so results equal Quark 0.13's bit for bit, dtype
included (a bfloat16 range gives bfloat16-rounded scales where Quark's do).
Exponents of powers of two are exact (`quantobs.core.qparams.pow2`), where
Quark takes `floor` / `ceil` of a float `log2`.

Symmetric int: `scale = max(amax / ((qmax - qmin) / 2), eps)`, zero point 0
(also for unsigned dtypes: no 128 as torch.ao gives). Asymmetric int: `scale
= max((max+ - min-) / (qmax - qmin), eps)`, `zero_point = clamp(qmin -
round(min- / scale))` with the range first extended to contain 0; the
`float32` zero-point type uses the raw range and `zero_point = -min / scale`.
FP8: `amax / qmax`, zeros -> eps. FP4 / FP6 elements take a scale format:
`float32` (`amax / qmax`), `e4m3` (two-level FP8 scales) or `e8m0` (OCP MX
shared scales, `2**(exponent(amax) - emax)`; the exponent's rounding is one
of `pow2`'s: Quark's `scale_calculation_mode="even"` is `round` at the
element's mantissa width, `floor` and `ceil` are themselves)::

    e8m0, amax == 0: round -> exponent -126 (scale 2**max(-126 - emax, -127));
                     floor / ceil -> the scale is `eps`.
    e8m0 round, an amax rounding up to 2**128 (beyond float32): 2**127.

BFP16 (`bfp_scale`): blocks share `2**(floor(log2 amax) - 6)` (int8
mantissas), zeros -> eps.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from quantobs.core.exact import divide
from quantobs.core.formats import get_format
from quantobs.core.qparams.pow2 import (
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    Pow2Rounding,
    pow2_exponent,
    pow2_nearest,
)

__all__ = [
    "QuarkPow2Rule",
    "QuarkRule",
    "bfp_scale",
    "check_finite",
    "e4m3_two_level_scale",
    "e8m0_scale",
    "finish_scale",
    "float_scale",
    "int_qparams",
    "most_frequent",
    "nonfinite_error",
    "pow2_nearest",
]

_F32_MIN_NORMAL_EXP = -126  # Quark's round (even) mode replaces amax 0 by 2**-126
_F32_MAX_EXP = 127
_FP8_E4M3 = get_format("float8_e4m3fn")
_FLOAT32_EPS = torch.finfo(torch.float32).eps
_BFP_MANTISSA_EXP = 6  # int8 mantissas: |q| <= 127 -> scale 2**(e - 6)

QParams = tuple[torch.Tensor, torch.Tensor]


def nonfinite_error(owner: str, count: int) -> ValueError:
    """The error for NaN / inf in `count` qparams (Quark would return NaN or
    inf scales)."""
    return ValueError(
        f"{owner}: the input holds NaN or inf ({count} qparam(s) affected); "
        "Quark would return NaN or inf scales. Clean the input first, "
        "e.g. torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)"
    )


def check_finite(owner: str, *values: torch.Tensor) -> None:
    """Raise `nonfinite_error` if a range or amax holds NaN or inf."""
    for value in values:
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise nonfinite_error(owner, bad)


def int_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    qmin: float,
    qmax: float,
    symmetric: bool,
    eps: torch.Tensor,
    float_zero_point: bool = False,
) -> QParams:
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
        scale = torch.maximum(divide(amax, levels / 2), eps)
        zero_point = torch.zeros(min_neg.shape, dtype=torch.int32, device=eps.device)
        return scale, zero_point
    if float_zero_point:
        scale = divide(max_val - min_val, levels)
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        return scale, -1 * min_val / scale
    scale = torch.maximum(divide(max_pos - min_neg, levels), eps)
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
    """
    if scale_dtype is not None:
        amax = amax.to(scale_dtype)
    scale = divide(amax, quant_max)
    return scale.masked_fill(scale == 0.0, eps)


def e8m0_scale(
    amax: torch.Tensor,
    rounding: Pow2Rounding,
    mantissa_bits: int,
    emax: int,
    eps: float,
) -> torch.Tensor:
    """OCP MX shared scale `2**(exponent(amax) - emax)`, an e8m0 value.

    Args:
        amax: `(*Q,)` block absolute maxima (finite, `>= 0`).
        rounding: `round` (Quark's "even"), `floor` or `ceil`.
        mantissa_bits: element mantissa bits (the width `round` rounds to).
        emax: element largest exponent.
        eps: scale of all-zero blocks in `floor` / `ceil` modes.

    Returns:
        `(*Q,)` scales: float32 for `round`, `amax.dtype` otherwise (as
        Quark returns them).
    """
    rounded = pow2_exponent(amax, rounding, mantissa_bits)
    exponent = (rounded - emax).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    zero = amax == 0
    if rounding == "round":
        at_zero = max(_F32_MIN_NORMAL_EXP - emax, E8M0_MIN_EXP)
        exponent = exponent.masked_fill(zero, at_zero)
        # An amax that rounds up past float32 (2**128) is inf to Quark: 2**127.
        exponent = exponent.masked_fill(rounded > _F32_MAX_EXP, E8M0_MAX_EXP)
        return torch.exp2(exponent)
    scale = torch.exp2(exponent).to(amax.dtype)
    return scale.masked_fill(zero | (scale == 0), eps)


def e4m3_two_level_scale(
    amax: torch.Tensor, elem_max: float, eps: float
) -> torch.Tensor:
    """FP8 e4m3 local scales under a global scale (Quark's `e4m3` format).

    `global = 448 * elem_max / amax.max()`; each local scale is
    `fp8(amax / elem_max * global) / global`, float32, so the largest block
    gets exactly `amax / elem_max`. All-zero blocks (and an all-zero tensor)
    get `eps` where Quark returns 0 (or NaN).
    """
    local = amax.float()
    global_amax = local.max()
    if not bool(global_amax > 0):
        return torch.full_like(local, eps)
    two_level = _FP8_E4M3.max * (elem_max / global_amax)
    scale = _FP8_E4M3.round(local / elem_max * two_level) / two_level
    return scale.masked_fill(scale == 0, eps)


def bfp_scale(amax: torch.Tensor, eps: float) -> torch.Tensor:
    """BFP16 block scales `2**(floor(log2 amax) - 6)` in `amax.dtype`, `eps`
    where zero (exact exponents: Quark floors a `log2` in the input dtype)."""
    exponent = pow2_exponent(amax, "floor") - _BFP_MANTISSA_EXP
    scale = torch.exp2(exponent).to(amax.dtype)
    return scale.masked_fill((amax == 0) | (scale == 0), eps)


@dataclass(frozen=True)
class QuarkRule:
    """Quark's rule (`UniformScalingObserver.calculate_qparams` and
    `get_scale`, Quark 0.13), for one spec.

    Attributes:
        kind: `int`, `fp8`, or `small_float` (fp4 / fp6, MX elements).
        quant_min: smallest quantized value (e.g. -128, -448.0).
        quant_max: largest quantized value.
        symmetric: int symmetric ranges (zero point 0).
        eps: smallest scale (the observer's buffer or a float).
        float_zero_point: `-min / scale` zero points (`ZeroPointType.float32`).
        pof2: round scales to the nearest power of two (`ScaleType.pof2`).
        scale_dtype: dtype scales are cast to (`ScaleType.float32`, ...).
        scale_format: `float32`, `e4m3` or `e8m0` for small floats.
        rounding: e8m0 exponent rounding (`round` for Quark's "even").
        mantissa_bits: element mantissa bits (the `round` width).
        emax: element largest exponent.
        owner: the observer's name, for messages.
    """

    name: ClassVar[str] = "quark"
    kind: Literal["int", "fp8", "small_float"]
    quant_min: float
    quant_max: float
    symmetric: bool = True
    eps: torch.Tensor | float = _FLOAT32_EPS
    float_zero_point: bool = False
    pof2: bool = False
    scale_dtype: torch.dtype | None = None
    scale_format: str | None = None
    rounding: Pow2Rounding = "round"
    mantissa_bits: int = 1
    emax: int = 0
    owner: str = "observer"

    def __call__(
        self,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        global_scale: torch.Tensor | None = None,
    ) -> QParams:
        """Scale and zero point of a range, in its dtype.

        Args:
            min_vals: `()` or `(*Q,)` minima; the arithmetic runs in its dtype.
            max_vals: maxima, same shape.
            global_scale: unused (Quark's two-level scales compute their own).

        Returns:
            `(scale, zero_point)`, each of the range's shape. Integer kinds:
            before any observation Quark's defaults `(tensor([1.]),
            tensor([0]))` with a warning. Float kinds: zero point zeros of
            the scale's dtype.

        Raises:
            ValueError: NaN / inf in the range, or `min_vals > max_vals`.
        """
        if self.kind != "int":
            # Unobserved entries (inf, -inf) give amax 0 and the eps scale.
            seen = ~((min_vals == math.inf) & (max_vals == -math.inf))
            check_finite(self.owner, min_vals[seen], max_vals[seen])
            min_neg = torch.minimum(min_vals, torch.zeros_like(min_vals))
            max_pos = torch.maximum(max_vals, torch.zeros_like(max_vals))
            scale = self.scales_of(torch.maximum(min_neg.abs(), max_pos.abs()))
            if self.kind == "small_float":
                scale = scale.masked_fill(scale == 0.0, _FLOAT32_EPS)
            scale = self._finish(scale)
            return scale, torch.zeros_like(scale)
        if _unobserved(min_vals, max_vals):
            warnings.warn(
                f"{self.owner}: calculate_qparams() was called before any "
                "observation; returning Quark's defaults (scale 1.0, zero point "
                "0). Run calibration batches through the observer first.",
                UserWarning,
                stacklevel=3,
            )
            device = min_vals.device.type
            return torch.tensor([1.0], device=device), torch.tensor([0], device=device)
        check_finite(self.owner, min_vals, max_vals)
        if bool((min_vals > max_vals).any()):
            raise ValueError(
                f"{self.owner}: min_val > max_val somewhere; pass the range as "
                "(min, max)"
            )
        eps = self.eps if isinstance(self.eps, torch.Tensor) else torch.tensor(self.eps)
        scale, zero_point = int_qparams(
            min_vals,
            max_vals,
            self.quant_min,
            self.quant_max,
            self.symmetric,
            eps,
            float_zero_point=self.float_zero_point,
        )
        if self.pof2 and not self.symmetric:
            scale = pow2_nearest(scale)
            if self.float_zero_point:
                zero_point = -1 * min_vals / scale
            else:
                min_neg = torch.clamp(min_vals, max=0)
                zero_point = int(self.quant_min) - torch.round(min_neg / scale).int()
                zero_point = zero_point.clamp(int(self.quant_min), int(self.quant_max))
        return self._finish(scale), zero_point

    def scales_of(self, amax: torch.Tensor) -> torch.Tensor:
        """Float scales of absolute maxima (Quark's `get_scale`), before the
        scale type's rounding and cast (see `block_qparams`)."""
        eps = float(self.eps)
        if self.kind == "fp8":
            return float_scale(amax, self.quant_max, eps, self.scale_dtype)
        if self.scale_format == "e8m0":
            return e8m0_scale(amax, self.rounding, self.mantissa_bits, self.emax, eps)
        if self.scale_format == "e4m3":
            scale = e4m3_two_level_scale(amax, self.quant_max, eps)
            return scale.to(self.scale_dtype) if self.scale_dtype else scale
        if self.scale_format == "float32":
            return float_scale(amax, self.quant_max, eps, self.scale_dtype)
        raise ValueError(
            f"scale_format={self.scale_format!r} is not one of 'e8m0', 'e4m3', "
            "'float32'; set it in the QTensorConfig"
        )

    def block_qparams(self, amax: torch.Tensor) -> QParams:
        """MX block scales of `(*Q,)` absolute maxima, zero points all 0."""
        scale = self._finish(self.scales_of(amax))
        return scale, torch.zeros_like(scale)

    def _finish(self, scale: torch.Tensor) -> torch.Tensor:
        return finish_scale(scale, self.pof2, self.scale_dtype)


def finish_scale(
    scale: torch.Tensor, pof2: bool, scale_dtype: torch.dtype | None
) -> torch.Tensor:
    """Quark's `scale_type` rules: `pof2` rounds to a power of two, float
    types cast."""
    if pof2:
        scale = pow2_nearest(scale)
    return scale.to(scale_dtype) if scale_dtype else scale


def _unobserved(min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    if min_val.numel() == 0 or max_val.numel() == 0:
        return True
    return bool(
        min_val.dim() == 0 and bool(min_val == math.inf) and bool(max_val == -math.inf)
    )


@dataclass(frozen=True)
class QuarkPow2Rule:
    """Quark's power-of-two observers' rule (ported from its ONNX tools).

    One candidate per range::

        range       zero-extended; symmetric: [-amax, amax]
        scale       (max - min) / (qmax - qmin)  (1 for an empty range)
        zero point  trunc(qmin - min / scale)
        pof2        scale rounded to the nearest power of two in log2
        zero point  max(zero point, qmin); 128 if symmetric uint8 gave 127

    computed in float32 whatever the input dtype (Quark computes in it: a
    bfloat16 input gives symmetric int8 the zero point -1).

    Attributes:
        quant_min: smallest quantized value.
        quant_max: largest quantized value.
        symmetric: symmetric ranges.
        middle_zero_point: symmetric uint8: the zero point 127 becomes 128.
    """

    name: ClassVar[str] = "quark_pow2"
    quant_min: float
    quant_max: float
    symmetric: bool = True
    middle_zero_point: bool = False

    def __call__(
        self,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        global_scale: torch.Tensor | None = None,
    ) -> QParams:
        """The candidate `(scale, zero_point)` (float32, int32) of a range."""
        min_vals, max_vals = min_vals.float(), max_vals.float()
        qmin, qmax = float(self.quant_min), float(self.quant_max)
        min_neg = torch.clamp(min_vals, max=0)
        max_pos = torch.clamp(max_vals, min=0)
        if self.symmetric:
            amax = torch.maximum(-min_neg, max_pos)
            min_neg, max_pos = -amax, amax
        spread = max_pos - min_neg
        scale = torch.where(spread != 0, divide(spread, qmax - qmin), 1.0)
        zero_point = (qmin - min_neg / scale).trunc()
        pof2 = pow2_nearest(scale)
        new_min = torch.clamp((qmin - zero_point) * pof2, max=0)
        zero_point = torch.round(qmin - new_min / pof2).to(torch.int32)
        if self.middle_zero_point and bool((zero_point == 127).all()):
            zero_point = torch.full_like(zero_point, 128)
        return pof2, zero_point


def most_frequent(votes: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The most frequent vote (the earliest on ties)."""
    return Counter(votes).most_common(1)[0][0]
