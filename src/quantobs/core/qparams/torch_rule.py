"""torch.ao's range -> (scale, zero point) rules as pure functions.

These rules differ from compressed-tensors' (`quantobs.calculate_qparams`) and
are reproduced here bit for bit: same float32 operations in the same order.

The quantized range `(qmin, qmax)`::

    dtype              default              reduce_range     custom (a, b)
    qint8 / int8       -128 .. 127          -64 .. 63        a .. b
    quint8 / uint8     0 .. 255             0 .. 127         a .. b
    qint32 / int32     -2**31 .. 2**31-1    (unchanged)      a .. b
    int16              -2**15 .. 2**15-1    (unchanged)      a .. b
    uint16             0 .. 2**16-1         (unchanged)      a .. b
    anything else      0 .. 15              (unchanged)      a .. b
    (quint4x2, float8)

    A custom range is used only when both ends are given; `reduce_range`
    floor-halves it: (a // 2, b // 2).

Scale and zero point, for a range first extended to include 0::

    qscheme                 scale                             zero point
    *_symmetric             max(-min, max) / ((qmax-qmin)/2)  0; quint8/uint8: 128
                            floored at eps                    ((qmin+qmax)//2 if
                                                              custom); uint16: 2**15
                                                              (int64)
    *_affine                (max - min) / (qmax - qmin)       qmin - round(min/scale)
                            floored at eps                    clamped (int32)
    per_channel_affine_     (max - min) / (qmax - qmin) on    -min / scale (float)
    float_qparams           the raw range; 1.0 if <= eps

Beyond torch, on finite ranges where its float32 arithmetic overflows (only
there; elsewhere torch's bits): a `max - min` past float32's max gives the
scale `(max / 2 - min / 2) / ((qmax - qmin) / 2)` computed in float64 (torch:
inf), and a `round(min / scale)` past int32's range is subtracted and clamped
in float64 before the int32 cast (torch's cast wraps, e.g. qint32 zero points
of 0 for wide ranges).

    Before any observation: a warning and (1.0, 0) of shape (1,).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantobs.core.exact import divide

__all__ = [
    "ALLOWED_DTYPES",
    "ALLOWED_QSCHEMES",
    "PER_CHANNEL_QSCHEMES",
    "PER_TENSOR_QSCHEMES",
    "SYMMETRIC_QSCHEMES",
    "TorchAORule",
    "default_qparams",
    "range_is_observed",
    "symmetric_zero_point",
    "torch_qparams",
    "torch_quant_range",
]

PER_TENSOR_QSCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric)
PER_CHANNEL_QSCHEMES = (
    torch.per_channel_affine,
    torch.per_channel_symmetric,
    torch.per_channel_affine_float_qparams,
)
ALLOWED_QSCHEMES = PER_TENSOR_QSCHEMES + PER_CHANNEL_QSCHEMES
SYMMETRIC_QSCHEMES = (torch.per_tensor_symmetric, torch.per_channel_symmetric)
ALLOWED_DTYPES = (
    torch.qint8,
    torch.quint8,
    torch.quint4x2,
    torch.qint32,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
    torch.uint16,
)

_INT8 = (torch.qint8, torch.int8)
_UINT8 = (torch.quint8, torch.uint8)
_INT32 = (torch.qint32, torch.int32)
# Default ranges; int8/uint8 have a second, reduced one.
_DEFAULT_RANGES: dict[torch.dtype, tuple[int, int]] = {
    **dict.fromkeys(_INT8, (-128, 127)),
    **dict.fromkeys(_UINT8, (0, 255)),
    **dict.fromkeys(_INT32, (-(2**31), 2**31 - 1)),
    torch.int16: (-(2**15), 2**15 - 1),
    torch.uint16: (0, 2**16 - 1),
}
_REDUCED_RANGES: dict[torch.dtype, tuple[int, int]] = {
    **dict.fromkeys(_INT8, (-64, 63)),
    **dict.fromkeys(_UINT8, (0, 127)),
}
_FALLBACK_RANGE = (0, 15)  # every other dtype (quint4x2, float8): torch's rule


def torch_quant_range(
    dtype: torch.dtype,
    quant_min: int | None = None,
    quant_max: int | None = None,
    reduce_range: bool = False,
) -> tuple[int, int]:
    """The `(qmin, qmax)` torch.ao's observers use (table in the module doc).

    Args:
        dtype: the observer's quantized dtype.
        quant_min: custom lower end (used only together with `quant_max`).
        quant_max: custom upper end.
        reduce_range: drop one bit (x86 `vpmaddubsw` overflow workaround).

    Returns:
        `(qmin, qmax)` as Python ints.

    Raises:
        ValueError: a custom range that excludes 0, is empty, or
            is wider than 8 bits for (q)int8 / 32 bits for (q)int32.
    """
    if quant_min is None or quant_max is None:
        if reduce_range and dtype in _REDUCED_RANGES:
            return _REDUCED_RANGES[dtype]
        return _DEFAULT_RANGES.get(dtype, _FALLBACK_RANGE)
    if not quant_min <= 0 <= quant_max:
        raise ValueError(
            f"quant_min={quant_min}, quant_max={quant_max}: a custom quantization "
            "range must include 0; pick quant_min <= 0 <= quant_max"
        )
    if quant_min >= quant_max:
        raise ValueError(
            f"quant_min={quant_min} must be strictly below quant_max={quant_max}"
        )
    levels = quant_max - quant_min + 1
    for kinds, bits in ((_INT8, 8), (_INT32, 32)):
        if dtype in kinds and levels > 2**bits:
            raise ValueError(
                f"quant_min={quant_min}, quant_max={quant_max} span {levels} "
                f"levels, more than the {2**bits} of {dtype}; narrow the range"
            )
    if reduce_range:
        return quant_min // 2, quant_max // 2
    return quant_min, quant_max


def symmetric_zero_point(
    dtype: torch.dtype, quant_min: int, quant_max: int, custom_range: bool
) -> int:
    """The zero point torch gives symmetric qschemes: the middle of an
    unsigned range (128, or `(qmin + qmax) // 2` for a custom range; 2**15
    for uint16), 0 for signed dtypes."""
    if dtype in _UINT8:
        return (quant_min + quant_max) // 2 if custom_range else 128
    if dtype == torch.uint16:
        return 2**15
    return 0


def default_qparams(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's qparams before any observation: `([1.0], [0])`, int64 zero point."""
    return (
        torch.tensor([1.0], device=device.type),
        torch.tensor([0], device=device.type),
    )


def range_is_observed(min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    """Whether a range holds data; warns (as torch does) when it does not.

    An empty per-channel range (no elements) and the per-tensor initial range
    `(+inf, -inf)` mean "nothing observed yet".

    Raises:
        ValueError: some `min_val > max_val` (an inconsistent
            observer state, e.g. from a hand-edited state dict).
    """
    unobserved = min_val.numel() == 0 or max_val.numel() == 0
    if not unobserved and (min_val.dim() == 0 or max_val.dim() == 0):
        unobserved = bool(min_val == float("inf")) and bool(max_val == float("-inf"))
    if unobserved:
        warnings.warn(
            "calculate_qparams() was called before the observer saw any data; "
            "returning the default scale 1.0 and zero point 0. Run calibration "
            "batches through the observer first.",
            UserWarning,
            stacklevel=3,
        )
        return False
    if bool((min_val > max_val).any()):
        raise ValueError(
            f"observer state has min_val > max_val (min_val={min_val}, "
            f"max_val={max_val}); reset the observer or load a consistent "
            "state dict"
        )
    return True


def torch_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    *,
    dtype: torch.dtype,
    qscheme: torch.qscheme,
    quant_min: int,
    quant_max: int,
    eps: torch.Tensor | float,
    custom_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ao's `_calculate_qparams`: a range to scale and zero point.

    Vectorized: per-tensor ranges are 0-dim, per-channel ranges `(C,)`.

    Args:
        min_val: observed minimum, `()` or `(C,)`.
        max_val: observed maximum, same shape.
        dtype: the quantized dtype (decides the symmetric zero point).
        qscheme: one of `ALLOWED_QSCHEMES`.
        quant_min: `qmin` as `torch_quant_range` returns it.
        quant_max: `qmax`.
        eps: the scale floor (torch keeps it as a `(1,)` buffer).
        custom_range: the user gave `quant_min`/`quant_max` (the symmetric
            uint8 zero point is then the range's middle, not 128).

    Returns:
        `(scale, zero_point)`: float32 scale of shape `(1,)` per tensor or
        `(C,)` per channel; int32 zero point (affine), int64 (symmetric) or
        float (`per_channel_affine_float_qparams`).
    """
    if not range_is_observed(min_val, max_val):
        return default_qparams(min_val.device)
    if not isinstance(eps, torch.Tensor):
        eps = torch.tensor([eps], dtype=min_val.dtype, device=min_val.device)
    device = min_val.device
    zeros = torch.zeros_like(min_val)
    min_neg = torch.min(min_val, zeros)
    max_pos = torch.max(max_val, zeros)
    zero_point = torch.zeros(min_neg.size(), dtype=torch.int64, device=device)

    if qscheme in SYMMETRIC_QSCHEMES:
        amax = torch.max(-min_neg, max_pos)
        scale = torch.max(divide(amax, float(quant_max - quant_min) / 2), eps)
        middle = symmetric_zero_point(dtype, quant_min, quant_max, custom_range)
        zero_point = zero_point.new_full(zero_point.size(), middle)
    elif qscheme == torch.per_channel_affine_float_qparams:
        scale = divide(max_val - min_val, float(quant_max - quant_min))
        scale = _wide_scale(scale, min_val, max_val, quant_min, quant_max)
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        # q = round(x / scale + zp) with zp = -min / scale: q = round((x - min) / scale)
        zero_point = -1 * min_val / scale
    else:
        scale = divide(max_pos - min_neg, float(quant_max - quant_min))
        scale = _wide_scale(scale, min_neg, max_pos, quant_min, quant_max)
        scale = torch.max(scale, eps)
        zero_point = _affine_zero_point(min_neg, scale, quant_min, quant_max)

    # Per-tensor results become shape (1,), as torch's FakeQuantize expects.
    if scale.dim() == 0:
        scale = torch.tensor([float(scale)], dtype=scale.dtype, device=device)
    if zero_point.dim() == 0:
        if zero_point.is_floating_point():  # torch truncates through int() first
            value: float = float(int(zero_point))
        else:
            value = int(zero_point)
        zero_point = torch.tensor([value], dtype=zero_point.dtype, device=device)
    return scale, zero_point


def _wide_scale(
    scale: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    quant_min: int,
    quant_max: int,
) -> torch.Tensor:
    """`(high - low) / (qmax - qmin)` where torch's float32 `high - low`
    overflowed on a finite range (torch: an infinite scale): `(high / 2 -
    low / 2) / ((qmax - qmin) / 2)` in float64, cast back (still infinite
    only where the scale itself passes float32's max, e.g. a custom range of
    2 levels; the torch.ao face then raises). Other scales keep torch's bits."""
    if bool(torch.isfinite(scale).all()):
        return scale
    wide = ~torch.isfinite(scale) & torch.isfinite(low) & torch.isfinite(high)
    if not bool(wide.any()):
        return scale
    half = (high.double() / 2 - low.double() / 2) / ((quant_max - quant_min) / 2)
    return torch.where(wide, half.to(scale.dtype), scale)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _affine_zero_point(
    min_neg: torch.Tensor, scale: torch.Tensor, quant_min: int, quant_max: int
) -> torch.Tensor:
    """torch's affine zero point, `clamp(qmin - round(min_neg / scale))`, as
    int32: torch's float32 quotient and rounding, then the subtraction and
    clamp in float64 before the int32 cast where `round(min_neg / scale)`
    passes int32's range (torch casts first, and the cast wraps: qint32
    zero points of wide ranges). Elsewhere torch's bits."""
    rounded = torch.round(min_neg / scale)
    zero_point = torch.clamp(quant_min - rounded.to(torch.int), quant_min, quant_max)
    wraps = torch.isfinite(rounded) & ((rounded < _INT32_MIN) | (rounded > _INT32_MAX))
    if not bool(wraps.any()):
        return zero_point
    exact = torch.clamp(quant_min - rounded.double(), quant_min, quant_max)
    return torch.where(wraps, exact.to(zero_point.dtype), zero_point)


@dataclass(frozen=True)
class TorchAORule:
    """torch.ao's rule (`_calculate_qparams`, torch 2.13): `torch_qparams`.

    Attributes: as `torch_qparams`' keyword arguments (`eps` a float or the
    observer's `(1,)` buffer).
    """

    name: ClassVar[str] = "torch_ao"
    dtype: torch.dtype
    qscheme: torch.qscheme
    quant_min: int
    quant_max: int
    eps: torch.Tensor | float
    custom_range: bool = False

    def __call__(
        self,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        global_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(scale, zero_point)` of the ranges (torch.ao has no global scale)."""
        if global_scale is not None:
            raise ValueError("torch.ao's rule has no global scale")
        return torch_qparams(
            min_vals,
            max_vals,
            dtype=self.dtype,
            qscheme=self.qscheme,
            quant_min=self.quant_min,
            quant_max=self.quant_max,
            eps=self.eps,
            custom_range=self.custom_range,
        )
