"""torch.ao's `HistogramObserver`: its histogram update rule and its greedy L2
search bit for bit, with an option for a global (non-greedy) search.

The histogram state is torch's (`histogram`: float32 counts over `bins` equal
bins spanning `[min_val, max_val]`) and so is its update, step for step:

* first batch: `torch.histc` over the batch's own range;
* later batches: `torch.histc` over the union range; if the range grew, the
  old counts are spread uniformly over 16 sub-bins each and re-binned into
  the new range by sub-bin midpoint (`rebin_histogram`);
* `+-inf` values are dropped with a warning.

`torch.histc` runs as its native twin (`quantobs.native.histc`: the same
float32 bin selection, counted exactly, so the same float32 counts; about 3x
faster) wherever that is exact, and as `torch.histc` itself elsewhere.

So the numbers equal torch's, including its quirks, reproduced on purpose:
counts are float32, `torch.histc` counts bf16 / fp16 inputs in their own
dtype (a bin stops growing at 256 per thread in bf16), and a constant batch
is counted over `[c - 1, c + 1]` while the range stays `[c, c]`.

Search (`search=`)::

    "torch"   torch's greedy walk (trims 1e-5 of the mass per step, stops at
              the first step whose L2 error grows), bit for bit, vectorized:
              `quantobs.solvers.histogram_l2.torch_l2_search`
    "global"  the range of least L2 error over all candidate ranges, not a
              greedy walk (`quantobs.solvers.histogram_l2.l2_search`), with
              the level count of the real quantized range (torch always
              assumes 2**bits levels) and, for symmetric qschemes, scored with
              the symmetric quantizer the qparams will have
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import torch

from quantobs import native
from quantobs.faces.torch_ao.base import (
    FLOAT32_EPS,
    UniformQuantizationObserverBase,
    check_finite_range,
    reject_dynamic,
    require_qscheme,
)
from quantobs.core.qparams.torch_ao import (
    PER_TENSOR_QSCHEMES,
    SYMMETRIC_QSCHEMES,
    default_qparams,
    symmetric_zero_point,
)
from quantobs.solvers.global_l2 import l2_search
from quantobs.solvers.torch_l2 import torch_l2_search

__all__ = [
    "HistogramObserver",
    "HistogramSearch",
    "merge_histograms",
    "rebin_histogram",
]

HistogramSearch = Literal["torch", "global"]
_SEARCHES = ("torch", "global")
_UPSAMPLE_RATE = 16  # torch's sub-bins per bin when re-binning


def rebin_histogram(
    histogram: torch.Tensor,
    old_min: torch.Tensor,
    old_max: torch.Tensor,
    new_min: torch.Tensor,
    new_max: torch.Tensor,
    upsample_rate: int = _UPSAMPLE_RATE,
) -> torch.Tensor:
    """Counts over `[old_min, old_max]` moved to `bins` bins over the wider
    `[new_min, new_max]`, as torch.ao re-bins them.

    Each bin is split into `upsample_rate` sub-bins of equal count; a sub-bin
    goes whole to the new bin that holds its midpoint.

    Args:
        histogram: `(bins,)` counts.
        old_min: 0-dim left edge of the counts.
        old_max: 0-dim right edge.
        new_min: 0-dim left edge of the result (`<= old_min`).
        new_max: 0-dim right edge (`>= old_max`).
        upsample_rate: sub-bins per bin.

    Returns:
        `(bins,)` counts over the new range (same total).
    """
    bins = histogram.numel()
    fine = bins * upsample_rate
    sub_counts = histogram.repeat_interleave(upsample_rate) / upsample_rate
    sub_width = (old_max - old_min) / fine
    # torch builds the midpoints from linspace edges: same ops, same floats.
    edges = torch.linspace(old_min, old_max, fine + 1, device=old_min.device)
    midpoints = edges[:-1].to(histogram.device) + 0.5 * sub_width
    new_edges = torch.linspace(new_min, new_max, bins + 1, device=new_min.device)
    target = torch.bucketize(midpoints, new_edges.to(histogram.device), right=True) - 1
    target = target.clamp_(0, bins - 1)  # float rounding at the two ends
    return torch.bincount(target, weights=sub_counts, minlength=bins)


def merge_histograms(
    old_hist: torch.Tensor,
    old_min: torch.Tensor,
    old_max: torch.Tensor,
    new_hist: torch.Tensor,
    new_min: torch.Tensor,
    new_max: torch.Tensor,
    upsample_rate: int = _UPSAMPLE_RATE,
) -> torch.Tensor:
    """torch.ao's merge of old counts into a batch histogram over the union
    range `[new_min, new_max]` (which contains `[old_min, old_max]`)."""
    if bool(new_min == old_min) and bool(new_max == old_max):
        return old_hist + new_hist
    bins = old_hist.numel()
    if bool(old_min == old_max):
        # All old values were one number: histc puts it in its bin.
        at_value = torch.histc(old_min, bins=bins, min=new_min, max=new_max)  # type: ignore[arg-type]
        return at_value * torch.sum(old_hist) + new_hist
    moved = rebin_histogram(old_hist, old_min, old_max, new_min, new_max, upsample_rate)
    return new_hist + moved


def _histc(
    x: torch.Tensor, bins: int, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """`torch.histc(x, bins, min=lo, max=hi)`: the native kernel's exact
    counts where it applies (float32; same bins, same numbers), else torch."""
    low, high = float(lo), float(hi)
    counts = native.histc(x, bins, low, high)
    return torch.histc(x, bins, min=low, max=high) if counts is None else counts


class HistogramObserver(UniformQuantizationObserverBase):
    """Histogram of every value seen, and the range of least L2 error.

    Args:
        bins: number of histogram bins.
        dtype: quantized dtype (an integer one: the search uses its bits).
        qscheme: `torch.per_tensor_affine` or `torch.per_tensor_symmetric`.
        reduce_range: drop one bit of the range.
        quant_min: custom lower end of the quantized range.
        quant_max: custom upper end.
        factory_kwargs: `device` / `dtype` of the buffers.
        eps: smallest scale.
        is_dynamic: must be False.
        search: `"torch"` (default: torch's greedy search, torch's qparams)
            or `"global"` (least L2 error over all ranges; beyond torch).
        **kwargs: `nan_policy` (`"raise"`: NaN inputs raise `ValueError`;
            `+-inf` are dropped with a warning as torch does).

    Raises:
        UnsupportedObserverConfig: a per-channel qscheme, or dynamic.
        TypeError: a non-integer dtype (float8).
        ValueError: an unknown `search`, or `bins` below 1.
    """

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        bins: int = 2048,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = FLOAT32_EPS,
        is_dynamic: bool = False,
        *,
        search: HistogramSearch = "torch",
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        require_qscheme(owner, qscheme, PER_TENSOR_QSCHEMES)
        reject_dynamic(owner, is_dynamic, "use MinMaxObserver")
        if search not in _SEARCHES:
            raise ValueError(f"search={search!r} is not one of {list(_SEARCHES)}")
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins={bins!r} must be a positive int (e.g. 2048)")
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        factory_kwargs = torch.nn.factory_kwargs(factory_kwargs)
        self.bins = bins
        self.search: HistogramSearch = search
        self.register_buffer("histogram", torch.zeros(bins, **factory_kwargs))
        self.register_buffer("min_val", torch.tensor(float("inf"), **factory_kwargs))
        self.register_buffer("max_val", torch.tensor(float("-inf"), **factory_kwargs))
        try:
            self.dst_nbins = 2 ** torch.iinfo(dtype).bits
        except TypeError:
            raise TypeError(
                f"{owner} needs an integer dtype (its search counts 2**bits "
                f"levels), got {dtype}; use MinMaxObserver for float8"
            ) from None
        self.upsample_rate = _UPSAMPLE_RATE

    def _store(
        self, histogram: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
    ) -> None:
        self.histogram.detach_().resize_(histogram.shape).copy_(histogram)
        self.min_val.detach_().resize_(lo.shape).copy_(lo)
        self.max_val.detach_().resize_(hi.shape).copy_(hi)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Add `x_orig`'s values to the histogram; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        x_min, x_max = torch.aminmax(x)
        check_finite_range(
            type(self).__name__, self.nan_policy, x_min, x_max, x, allow_inf=True
        )
        if bool(x_min == -math.inf) or bool(x_max == math.inf):
            warnings.warn(
                f"{type(self).__name__}: +-inf values in the input are ignored "
                "(they would make the range infinite)",
                UserWarning,
                stacklevel=2,
            )
            x = x[x.abs() != math.inf]
            if x.numel() == 0:
                return x_orig
            x_min, x_max = torch.aminmax(x)

        if bool(self.min_val == math.inf) or bool(self.max_val == -math.inf):
            batch = _histc(x, self.bins, x_min, x_max)
            self._store(batch, x_min, x_max)
            return x_orig
        old_min, old_max = self.min_val, self.max_val
        new_min = torch.min(old_min, x_min).detach()
        new_max = torch.max(old_max, x_max).detach()
        batch = _histc(x, self.bins, new_min, new_max)
        merged = merge_histograms(
            self.histogram,
            old_min,
            old_max,
            batch.to(self.histogram.device),
            new_min,
            new_max,
            self.upsample_rate,
        )
        self._store(merged, new_min, new_max)
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """`(scale, zero_point)` of the searched range, each of shape `(1,)`."""
        if bool(self.min_val == math.inf) and bool(self.max_val == -math.inf):
            warnings.warn(
                "calculate_qparams() was called before the observer saw any "
                "data; returning the default scale 1.0 and zero point 0. Run "
                "calibration batches through the observer first.",
                UserWarning,
                stacklevel=2,
            )
            return default_qparams(self.min_val.device)
        if self.histogram.numel() != self.bins:
            raise ValueError(
                f"the histogram has {self.histogram.numel()} bins but the "
                f"observer was built with bins={self.bins}; build it with "
                "the bins of the loaded state"
            )
        if self.search == "global":
            lo, hi = self._global_search()
        else:  # the search works on float32 state, as torch's default buffers
            lo, hi = torch_l2_search(
                self.histogram.float(),
                self.min_val.float(),
                self.max_val.float(),
                self.dst_nbins,
            )
        return self._calculate_qparams(lo, hi)

    def _global_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        width = (self.max_val - self.min_val) / self.bins
        if self.qscheme not in SYMMETRIC_QSCHEMES:
            levels = self.quant_max - self.quant_min + 1
            return l2_search(self.histogram, self.min_val, width, levels)
        # The symmetric grid is (q - zero_point) * scale for q in qmin..qmax.
        zero_point = symmetric_zero_point(
            self.dtype, self.quant_min, self.quant_max, self.has_customized_qrange
        )
        signed = (self.quant_min - zero_point, self.quant_max - zero_point)
        return l2_search(
            self.histogram,
            self.min_val,
            width,
            signed[1] - signed[0] + 1,
            symmetric=signed,
        )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        version = local_metadata.get("version")
        for name, empty in (("min_val", math.inf), ("max_val", -math.inf)):
            key = prefix + name
            saved = state_dict.get(key)
            if not isinstance(saved, torch.Tensor):
                continue
            if (version is None or version < 3) and saved.shape == (0,):
                # Before version 3 an unobserved range was an empty tensor.
                saved = state_dict[key] = torch.tensor(empty)
            getattr(self, name).resize_(saved.shape)
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def reset_min_max_vals(self) -> None:
        """Forget everything observed (beyond torch, which cannot reset)."""
        self.histogram.zero_()
        self.min_val.fill_(math.inf)
        self.max_val.fill_(-math.inf)
