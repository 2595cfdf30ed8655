"""torch.ao's qparams of finite ranges where its float32 arithmetic
overflows, repaired; and the message of a histogram too wide to search.

Shared by the faces that use torch.ao's rule (`quantobs.faces.torch_ao`,
and Quark's `PerTensorHistogramObserverPro`, which wraps torch.ao's
histogram observer): each repair touches only the qparams that overflowed,
everywhere else the numbers are torch's bit for bit. The face's table of
every repair is in `quantobs.faces.torch_ao.overflow`.
"""

from __future__ import annotations

import torch

from quantobs.core.exact import divide
from quantobs.core.qparams.torch_rule import SYMMETRIC_QSCHEMES, TorchAORule

__all__ = ["repair_qparams", "unsearchable_histogram"]

_INT32_MIN = -(2**31)


def _too_wide(
    owner: str, rule: TorchAORule, low: torch.Tensor, high: torch.Tensor
) -> ValueError:
    return ValueError(
        f"{owner}: the observed range [{float(low):g}, {float(high):g}] is too "
        f"wide for {rule.dtype} with quant_min={rule.quant_min}, quant_max="
        f"{rule.quant_max}: its scale exceeds the float32 maximum. Use a wider "
        "quantized range (quant_min / quant_max), or clip or rescale the input."
    )


def unsearchable_histogram(owner: str, low: float, high: float) -> str:
    """The warning of a histogram observer whose range `[low, high]` is wider
    than float32's max: torch's float32 histogram then has no usable counts
    (torch: NaN scale), so the qparams cover the whole observed range. One
    policy for every face wrapping torch's histogram (`HistogramObserver`,
    Quark's `PerTensorHistogramObserverPro`)."""
    return (
        f"{owner}: the observed range [{low:g}, {high:g}] is wider than the "
        "float32 maximum, so its histogram has no usable counts (torch.ao "
        "returns a NaN scale); the qparams cover the whole observed range, as "
        "MinMaxObserver's would. Rescale the input to search it."
    )


def repair_qparams(
    rule: TorchAORule,
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    owner: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's `(scale, zero_point)` of a range, repaired where its float32
    arithmetic overflowed on a finite range (module table).

    Qparams of finite ranges that did not overflow are returned untouched;
    an overflowed scale is recomputed in float64 (from half the range, which
    cannot overflow) and an affine zero point from it, rounded and clamped
    into `[quant_min, quant_max]` (so the represented range still holds the
    observed one). Non-finite ranges (`nan_policy="propagate"`) and
    unobserved ones keep torch's results.

    Args:
        rule: the observer's rule (dtype, qscheme, range, eps).
        min_val: the range's minimum, `()` or `(C,)`.
        max_val: its maximum.
        scale: `rule(min_val, max_val)[0]`.
        zero_point: `rule(min_val, max_val)[1]`.
        owner: the observer's name, for the error.

    Raises:
        ValueError: a scale that does not fit in float32 even computed
            exactly (a range too wide for the quantized range).
    """
    if min_val.numel() != scale.numel():  # unobserved: torch's defaults
        return scale, zero_point
    low, high = min_val.reshape(scale.shape), max_val.reshape(scale.shape)
    observed = torch.isfinite(low) & torch.isfinite(high)
    wide = observed & ~torch.isfinite(scale)
    symmetric = rule.qscheme in SYMMETRIC_QSCHEMES
    float_zero_point = rule.qscheme == torch.per_channel_affine_float_qparams
    affine = not (symmetric or float_zero_point)
    min_neg = torch.clamp(low, max=0)
    wraps = torch.zeros_like(wide)
    if affine:  # torch casts round(min_neg / scale) to int32
        wraps = observed & (torch.round(min_neg / scale) < _INT32_MIN)
    if not bool((wide | wraps).any()):
        return scale, zero_point

    lo64, hi64 = low.double(), high.double()
    half_levels = (rule.quant_max - rule.quant_min) / 2
    if symmetric:
        exact = divide(torch.maximum(-lo64, hi64).clamp(min=0), half_levels)
    elif float_zero_point:  # the raw range
        exact = divide(hi64 / 2 - lo64 / 2, half_levels)
    else:  # the range extended to include 0
        exact = divide(hi64.clamp(min=0) / 2 - min_neg.double() / 2, half_levels)
    if not float_zero_point:  # torch's floor
        exact = torch.maximum(exact, torch.as_tensor(rule.eps).to(exact))
    fitted = exact.to(scale.dtype)
    if not bool(torch.isfinite(fitted[wide]).all()):
        index = int((wide & ~torch.isfinite(fitted)).reshape(-1).nonzero()[0])
        raise _too_wide(owner, rule, low.flatten()[index], high.flatten()[index])
    scale = torch.where(wide, fitted, scale)

    if float_zero_point:
        zero_point = torch.where(wide, -1 * low / scale, zero_point)
    elif affine:
        exact_zp = rule.quant_min - torch.round(min_neg.double() / scale.double())
        exact_zp = torch.clamp(exact_zp, rule.quant_min, rule.quant_max)
        zero_point = torch.where(
            wide | wraps, exact_zp.to(zero_point.dtype), zero_point
        )
    return scale, zero_point
