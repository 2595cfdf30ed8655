"""torch.ao's histogram as a statistic: `bins` float32 counts over the
observed range `[min_vals, max_vals]`, updated as torch's `HistogramObserver`
updates them, step for step.

Update (one batch `x`)::

    state before        counts of x                  old counts
    no data             histc over x's own range     (none)
    same range          histc over the range         added as they are
    range grew          histc over the union range   moved to the union
                                                     (`move_histogram`), added

Moving counts to a wider range (`move_histogram`, torch's
`_combine_histograms` / `_upscale_histogram`): each old bin is split into
`upsample_rate` (16) sub-bins of equal count, and a sub-bin goes whole to the
new bin that holds its midpoint; a histogram of one value (`min == max`) is
put whole in the bin `torch.histc` gives that value. `+-inf` values are
dropped with a warning (they would make the range infinite); a batch of
nothing else leaves the statistic as it was.

Quirks of torch reproduced on purpose, so the numbers equal torch's: counts
are float32 and counted by `torch.histc`'s float32 bin selection (`histc`, a
kernel: `torch.histc`, or its exact native twin on CPU float32), bf16 /
fp16 batches are counted in their own dtype (a bin stops growing at 256 per
thread in bf16), and a constant batch is counted over `[c - 1, c + 1]` while
the range stays `[c, c]`.

Merge and reduction (`fields`): `min_vals` MIN, `max_vals` MAX, then each
statistic is `align`ed to the reduced range by `move_histogram` and the
counts SUM. Not exact (`exact = False`): moving counts spreads them over
sub-bins, so a merge approximates the histogram of the concatenated data,
and folding three or more statistics pairwise can differ from reducing them
at once (each fold re-bins again). Two statistics give the same result
either way, in either order.

Per tensor only (`qparam_shape == ()`), as torch's observer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantobs import native
from quantobs.native.dispatch import kernel
from quantobs.stats.base import Batch, Field, Reduce, Statistic

__all__ = [
    "UPSAMPLE_RATE",
    "TorchHistogram",
    "combine_histograms",
    "histc",
    "move_histogram",
    "rebin_histogram",
]

UPSAMPLE_RATE = 16  # torch's sub-bins per bin when re-binning


@kernel
def histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """`torch.histc(x, bins, min=lo, max=hi)`.

    A kernel: on CPU float32 the native twin counts exactly with the same
    float32 bin selection (the same float32 counts, about 3x faster) and
    declines where that is not exact; `torch.histc` runs elsewhere (any
    dtype: bf16 / fp16 inputs are counted in their own dtype, as torch does).

    Args:
        x: the values (any shape; NaN and values outside `[lo, hi]` skipped).
        bins: number of bins.
        lo: left edge of bin 0.
        hi: right edge of the last bin (closed).

    Returns:
        `(bins,)` counts in x's dtype.

    Raises:
        RuntimeError: a non-finite range (torch's error).
    """
    if x.dtype == torch.bfloat16 and x.device.type != "cpu":
        # CUDA's histc has no bfloat16 (torch.ao raises there): count the
        # values in float32 (the CPU rounds bfloat16 bin positions and counts)
        return torch.histc(x.float(), bins, min=lo, max=hi).to(x.dtype)
    return torch.histc(x, bins, min=lo, max=hi)


histc.register("cpu", native.histc)


def rebin_histogram(
    histogram: torch.Tensor,
    old_min: torch.Tensor,
    old_max: torch.Tensor,
    new_min: torch.Tensor,
    new_max: torch.Tensor,
    upsample_rate: int = UPSAMPLE_RATE,
) -> torch.Tensor:
    """Counts over `[old_min, old_max]` moved to `bins` bins over the wider
    `[new_min, new_max]`, as torch.ao re-bins them (`_upscale_histogram`).

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


def move_histogram(
    histogram: torch.Tensor,
    old_min: torch.Tensor,
    old_max: torch.Tensor,
    new_min: torch.Tensor,
    new_max: torch.Tensor,
    upsample_rate: int = UPSAMPLE_RATE,
) -> torch.Tensor:
    """Counts over `[old_min, old_max]` moved to the range `[new_min,
    new_max]` that contains it, by torch's rule (the module's table): all in
    one bin for a one-value histogram, else `rebin_histogram`.

    Raises:
        ValueError: the new range does not contain the old one.
    """
    if bool(new_min > old_min) or bool(new_max < old_max):
        raise ValueError(
            f"cannot move a histogram over [{float(old_min)}, {float(old_max)}] "
            f"to the narrower [{float(new_min)}, {float(new_max)}]"
        )
    bins = histogram.numel()
    if bool(old_min == old_max):
        # All old values were one number: histc puts it in its bin.
        at_value = histc(old_min, bins, float(new_min), float(new_max))
        return at_value * torch.sum(histogram)
    return rebin_histogram(histogram, old_min, old_max, new_min, new_max, upsample_rate)


def combine_histograms(
    old_hist: torch.Tensor,
    old_min: torch.Tensor,
    old_max: torch.Tensor,
    new_hist: torch.Tensor,
    new_min: torch.Tensor,
    new_max: torch.Tensor,
    upsample_rate: int = UPSAMPLE_RATE,
) -> torch.Tensor:
    """torch.ao's merge of old counts into a batch histogram over the union
    range `[new_min, new_max]` (which contains `[old_min, old_max]`)."""
    if bool(new_min == old_min) and bool(new_max == old_max):
        return old_hist + new_hist
    moved = move_histogram(old_hist, old_min, old_max, new_min, new_max, upsample_rate)
    return new_hist + moved


def _warn_inf(owner: str) -> None:
    warnings.warn(
        f"{owner}: +-inf values in the input are ignored (they would make the "
        "range infinite)",
        UserWarning,
        stacklevel=2,
    )


def _histc_kept(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """`histc(x, bins, lo, hi)` of a batch whose omitted values
    (`nan_policy="omit"`) are marked NaN.

    Over a one-value range (`lo == hi`) `torch.histc` takes the range of the
    data itself, which the NaN would make NaN: there only the kept values
    are counted (histc skips NaN: the same counts). It then counts over
    `[c - 1, c + 1]`, which float16 / bfloat16 cannot hold for some `c`
    (torch raises "max must be larger than min" for bfloat16 from about
    1e20, "cannot be converted to type c10::Half" at float16's +-max):
    those are counted in float32 (one bin holds every value, as any range
    around `c` gives).
    """
    if lo != hi:
        return histc(x, bins, lo, hi)
    x = x[~torch.isnan(x)]
    try:
        return histc(x, bins, lo, hi)
    except RuntimeError:
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise
        return histc(x.float(), bins, lo, hi).to(x.dtype)


@dataclass(frozen=True)
class TorchHistogram(Statistic):
    """torch.ao's per-tensor histogram (see the module docstring).

    Attributes:
        histogram: `(bins,)` counts (float32 as torch keeps them).
        min_vals: `()` left edge of bin 0 (`+inf` before any data).
        max_vals: `()` right edge of the last bin (`-inf` before any data).
        upsample_rate: sub-bins per bin when counts move (config).
        owner: the observer named in warnings (config).
    """

    histogram: torch.Tensor
    min_vals: torch.Tensor
    max_vals: torch.Tensor
    upsample_rate: int = UPSAMPLE_RATE
    owner: str = "TorchHistogram"

    fields: ClassVar[tuple[Field, ...]] = (
        Field("histogram", Reduce.SUM),
        Field("min_vals", Reduce.MIN),
        Field("max_vals", Reduce.MAX),
    )
    exact: ClassVar[bool] = False
    needs_values: ClassVar[bool] = True

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        bins: int = 2048,
        dtype: torch.dtype = torch.float32,
        upsample_rate: int = UPSAMPLE_RATE,
        owner: str = "TorchHistogram",
    ) -> TorchHistogram:
        """No data: zero counts, the range `(+inf, -inf)`.

        Raises:
            ValueError: a qparam shape other than `()` (per tensor only).
        """
        if tuple(qparam_shape) != ():
            raise ValueError(
                f"{owner} keeps one histogram per tensor, not per qparam shape "
                f"{tuple(qparam_shape)}; use quantobs.stats.histogram.Histogram"
            )
        counts = torch.zeros(bins, dtype=dtype, device=device)
        low = torch.tensor(math.inf, dtype=dtype, device=device)
        return cls(counts, low, torch.full_like(low, -math.inf), upsample_rate, owner)

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.min_vals.shape)

    @property
    def bins(self) -> int:
        """The number of bins."""
        return self.histogram.numel()

    @property
    def is_empty(self) -> bool:
        """Whether nothing was counted yet (torch's "uninitialized": either
        end still at its initial infinity)."""
        return bool(self.min_vals == math.inf) or bool(self.max_vals == -math.inf)

    def scan(self, x_flat: torch.Tensor, *, exact_dtype: bool = False) -> Batch:
        """The batch's range in its own dtype (torch's `aminmax`), without
        `+-inf` values, which are dropped with a warning.

        Returns:
            The `Batch`; where values were dropped it carries the kept ones
            `(1, K)` (an empty batch also its absmax, 0: nothing is left to
            check for non-finite values).
        """
        x_min, x_max = torch.aminmax(x_flat)
        count = int(x_flat.shape[0])
        if not (bool(x_min == -math.inf) or bool(x_max == math.inf)):
            return Batch(None, x_min, x_max, count)
        _warn_inf(self.owner)
        kept = x_flat[x_flat.abs() != math.inf].reshape(1, -1)
        if kept.numel() == 0:
            low = torch.full_like(x_min, math.inf)
            high = torch.full_like(x_max, -math.inf)
            return Batch(kept, low, high, count, absmax=0.0)
        x_min, x_max = torch.aminmax(kept)
        return Batch(kept, x_min, x_max, count)

    def omit_nonfinite(self, x_flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Non-finite values marked NaN (`histc` skips NaN)."""
        nan = torch.tensor(math.nan, dtype=x_flat.dtype, device=x_flat.device)
        return torch.where(torch.isfinite(x_flat), x_flat, nan), True

    def update(self, batch: Batch) -> TorchHistogram:
        """torch's `HistogramObserver.forward` on one batch (module table).

        Raises:
            ValueError: a batch without values.
            RuntimeError: a NaN range (torch's `histc` error).
        """
        x = batch.x_flat
        if x is None:
            raise ValueError(f"{self.owner}: a histogram update needs the values")
        x_min, x_max = batch.min_vals, batch.max_vals
        if bool(x_min > x_max):  # nothing finite in the batch
            return self
        dtype = self.histogram.dtype
        if self.is_empty:
            counts = _histc_kept(x, self.bins, float(x_min), float(x_max))
            return self.replace(
                histogram=counts.to(self.histogram.device, dtype),
                min_vals=x_min.to(self.min_vals),
                max_vals=x_max.to(self.max_vals),
            )
        new_min = torch.min(self.min_vals, x_min).detach()
        new_max = torch.max(self.max_vals, x_max).detach()
        counts = _histc_kept(x, self.bins, float(new_min), float(new_max))
        merged = combine_histograms(
            self.histogram,
            self.min_vals,
            self.max_vals,
            counts.to(self.histogram.device),
            new_min,
            new_max,
            self.upsample_rate,
        )
        return self.replace(
            histogram=merged.to(dtype),
            min_vals=new_min.to(self.min_vals),
            max_vals=new_max.to(self.max_vals),
        )

    def _moved_to(self, new_min: torch.Tensor, new_max: torch.Tensor) -> TorchHistogram:
        """This statistic's counts over the range `[new_min, new_max]`."""
        new_min, new_max = new_min.to(self.min_vals), new_max.to(self.max_vals)
        if self.is_empty:
            counts = torch.zeros_like(self.histogram)
        elif bool(new_min == self.min_vals) and bool(new_max == self.max_vals):
            return self
        else:
            counts = move_histogram(
                self.histogram,
                self.min_vals,
                self.max_vals,
                new_min,
                new_max,
                self.upsample_rate,
            ).to(self.histogram.dtype)
        return self.replace(histogram=counts, min_vals=new_min, max_vals=new_max)

    def align(self, reduced: Mapping[str, torch.Tensor]) -> TorchHistogram:
        """The counts moved to the reduced range (`min_vals`, `max_vals`)."""
        return self._moved_to(reduced["min_vals"], reduced["max_vals"])

    def merge(self, other: TorchHistogram) -> TorchHistogram:
        """Both histograms moved to the union range by torch's rule, added.

        Raises:
            ValueError: different bin counts.
        """
        if other.bins != self.bins:
            raise ValueError(
                f"cannot merge histograms of {self.bins} and {other.bins} bins"
            )
        new_min = torch.minimum(self.min_vals, other.min_vals.to(self.min_vals))
        new_max = torch.maximum(self.max_vals, other.max_vals.to(self.max_vals))
        mine, theirs = (
            self._moved_to(new_min, new_max),
            other._moved_to(new_min, new_max),
        )
        return mine.replace(
            histogram=mine.histogram + theirs.histogram.to(mine.histogram)
        )
