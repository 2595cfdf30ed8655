"""Quark's growing per-tensor histogram with a bounded number of bins.

`BoundedQuarkHistogram` is `quantobs.stats.quark_histogram.QuarkHistogram`
(Quark 0.13's grid, float for float, exact int64 counts) with three limits
that keep every batch finite and its cost independent of how far the range
grows:

* **Bounded bins.** While the grown grid holds at most `max_bins` bins
  (4 times the first batch's, default) it grows as Quark's, by whole bins of
  the first batch's width. A batch that would need more merges the grid
  instead: groups of `k` adjacent bins become one bin of width `k * w`
  (anchored on the old grid, so every old bin lies inside one new bin and
  its count moves whole), `k` the smallest factor that covers the new range
  within `max_bins` bins. The grid then holds between about `max_bins / 2`
  and `max_bins` bins, whatever the growth (Quark: a batch 1e17 times wider
  than the first asks for ~1e19 bins and never returns).
* **Resolvable widths.** A first batch whose bins would be narrower than
  half a float32 step (`max - min < bins * eps * max(|min|, |max|) / 2`, or
  below float32's smallest subnormal) is widened to bins of one step (Quark:
  repeated edges, a width of 0, then a division by zero on growth), as Quark
  already widens a constant batch; a widened range that would pass float32's
  max is widened downward.
* **float32's range.** Edges are computed in float64 where float32's
  `linspace` overflows (a range wider than float32's max); a batch is binned
  in float64 where float32's `(x - lo) * bins` would overflow (Quark:
  infinite edges, `torch.histc` errors or every value in bin 0). A merged
  grid that would pass float32's max is re-binned onto as many equal bins
  over the joint range instead, each old bin moving whole to the bin holding
  its centre (as `QuarkHistogram.align`; only for data within a bin width of
  float32's max), as is one where Quark's growth would hold fewer bins than
  the old grid (float32 edges near its max are uneven).

On inputs whose grid stays within `max_bins` bins and float32's range (every
ordinary calibration), counts and edges are `QuarkHistogram`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quantobs.stats.base import Batch
from quantobs.stats.quark_histogram import QuarkHistogram, batch_range, histc_counts

__all__ = ["BoundedQuarkHistogram", "linear_edges", "safe_centers"]

_F32 = torch.finfo(torch.float32)
_F32_MAX = float(_F32.max)
_EPS = float(_F32.eps)
_SMALLEST = 2.0**-149  # float32's smallest subnormal
_CHUNK = 1 << 18  # elements per float64 binning pass
_MAX_BINS_FACTOR = 4


def linear_edges(lo: float, hi: float, bins: int, device: torch.device) -> torch.Tensor:
    """`(bins + 1,)` float32 edges of `bins` equal bins over `[lo, hi]`:
    float32's `linspace` (Quark's), in float64 where that overflows."""
    edges = torch.linspace(lo, hi, bins + 1, device=device)
    if bool(torch.isfinite(edges).all()):
        return edges
    wide = torch.linspace(lo, hi, bins + 1, dtype=torch.float64, device=device)
    return wide.to(torch.float32)


def safe_centers(edges: torch.Tensor) -> torch.Tensor:
    """`(bins,)` float32 bin centres of `(bins + 1,)` edges, summed in float64
    (float32's `e[i] + e[i + 1]` overflows near its max; elsewhere the same
    numbers)."""
    wide = edges.to(torch.float64)
    return ((wide[1:] + wide[:-1]) / 2).to(torch.float32)


def _widened(lo: float, hi: float, span: float) -> tuple[float, float]:
    """`[lo, lo + span]`, or `[hi - span, hi]` where that passes float32's max."""
    return (hi - span, hi) if lo + span > _F32_MAX else (lo, lo + span)


def _widen_constant(lo: float, hi: float, bins: int) -> tuple[float, float]:
    """Quark's widening of a constant batch (`bins` bins of `eps * max(|x|,
    1)`; downward near float32's max, where Quark's edges are infinite)."""
    if lo != hi:
        return lo, hi
    return _widened(lo, hi, max(max(abs(lo), 1.0) * bins * _EPS, _F32.tiny))


def _first_range(lo: float, hi: float, bins: int) -> tuple[float, float]:
    """The range of the first grid: Quark's widening of a constant batch, and
    of a batch whose bins would be narrower than half a float32 step (Quark's
    edges then repeat and its width can be 0): to bins of one step."""
    if lo == hi:
        return _widen_constant(lo, hi, bins)
    step = max(_EPS * max(abs(lo), abs(hi)), _SMALLEST)
    return _widened(lo, hi, bins * step) if hi - lo < bins * step / 2 else (lo, hi)


def _count(
    x: torch.Tensor, edges: torch.Tensor, absolute: bool, skip_zeros: bool
) -> torch.Tensor:
    """`(bins,)` int64 counts of `x` (or `|x|`) on the grid of `edges`, as
    `torch.histc` bins over `[edges[0], edges[-1]]`: in float32 (Quark's)
    where `(x - lo) * bins` stays finite, else in float64."""
    bins = edges.numel() - 1
    lo, hi = float(edges[0]), float(edges[-1])
    if (hi - lo) * bins < _F32_MAX / 2:
        return histc_counts(x, bins, lo, hi, absolute=absolute, skip_zeros=skip_zeros)
    counts = torch.zeros(bins, dtype=torch.int64, device=x.device)
    for chunk in x.reshape(-1).split(_CHUNK):
        values = chunk.to(torch.float64)
        values = values.abs() if absolute else values
        values = values[values != 0] if skip_zeros else values
        counts += torch.histc(values, bins, lo, hi).to(torch.int64)
    return counts


def _quark_growth(
    counts: torch.Tensor, edges: torch.Tensor, lo: float, hi: float, width: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Quark's growth: whole bins of `width` on each side to cover `[lo, hi]`
    (the left side keeps the old edges and shifts the old counts; the right
    side rebuilds the edges with Quark's `arange`). None where that `arange`
    gives fewer bins than the old grid holds: float32 edges near its max are
    uneven, and bins of the first one's width may span more than they do
    (Quark: a negative size error)."""
    device = counts.device
    if lo < float(edges[0]):
        added = math.ceil((float(edges[0]) - lo) / width)
        added += float(edges[0]) - added * width > lo  # float rounding
        steps = torch.arange(added, 0, -1, dtype=torch.float64, device=device)
        prefix = (float(edges[0]) - steps * width).to(edges.dtype)
        edges = torch.cat([prefix, edges])
        counts = torch.cat([counts.new_zeros(added), counts])
    if hi > float(edges[-1]):
        edges = torch.arange(float(edges[0]), hi + width, width, device=device)
        if float(edges[-1]) < hi:  # pragma: no cover - float rounding guard
            edges = torch.cat([edges, edges[-1:] + width])
        added = edges.numel() - 1 - counts.numel()
        if added < 0:
            return None
        counts = torch.cat([counts, counts.new_zeros(added)])
    return counts, edges


def _merged_growth(
    counts: torch.Tensor,
    edges: torch.Tensor,
    lo: float,
    hi: float,
    width: float,
    max_bins: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Merge groups of `k` bins into bins of width `k * width` anchored on the
    old grid, covering `[lo, hi]` in at most `max_bins` bins; None if those
    edges would pass float32's max."""
    n = counts.numel()
    start, stop = float(edges[0]), float(edges[-1])
    spread = (max(stop, hi) - min(start, lo)) / width  # in old bins, float64
    k = max(2, math.ceil(spread / (max_bins - 6)))
    wide = k * width
    left = math.ceil(max(0.0, start - lo) / wide)
    left += start - left * wide > lo  # float rounding
    first = start - left * wide
    bins = math.ceil((max(stop, hi) - first) / wide)
    bins += first + bins * wide < max(stop, hi)
    # the last old bin's group: past the bins above where float32 edges
    # (uneven near its max) span less than `n * width`
    bins = max(bins, left + (n - 1) // min(k, n) + 1)
    if first < -_F32_MAX or first + bins * wide > _F32_MAX:
        return None
    steps = torch.arange(bins + 1, dtype=torch.float64, device=counts.device)
    new_edges = (first + steps * wide).to(torch.float32)
    # old bin i lies in new bin left + i // k (k >= n: all in bin `left`)
    group = torch.arange(n, device=counts.device) // min(k, n) + left
    new_counts = counts.new_zeros(bins).index_add_(0, group, counts)
    return new_counts, new_edges


def _rebinned(
    counts: torch.Tensor, edges: torch.Tensor, lo: float, hi: float, bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`bins` equal bins over `[lo, hi]`, each old count moved to the bin of
    its bin's centre (approximate, `QuarkHistogram.align`'s re-binning)."""
    new_edges = linear_edges(lo, hi, bins, counts.device)
    target = torch.bucketize(safe_centers(edges), new_edges, right=True) - 1
    target = target.clamp_(0, bins - 1)
    return counts.new_zeros(bins).index_add_(0, target, counts), new_edges


def grow(
    counts: torch.Tensor,
    edges: torch.Tensor,
    lo: float,
    hi: float,
    max_bins: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid `(counts (bins,), edges (bins + 1,))` grown to cover `[lo,
    hi]` in at most `max_bins` bins (module docstring), old counts kept."""
    start, stop = float(edges[0]), float(edges[-1])
    if lo >= start and hi <= stop:
        return counts, edges
    width = float(edges[1] - edges[0])  # Quark's width, > 0 by construction
    left = max(0.0, start - lo) / width
    right = max(0.0, hi - stop) / width
    fits = counts.numel() + left + right + 4 <= max_bins
    if fits and start - (left + 2) * width >= -_F32_MAX and hi + 2 * width <= _F32_MAX:
        grown = _quark_growth(counts, edges, lo, hi, width)
        if grown is not None:
            return grown
    merged = _merged_growth(counts, edges, lo, hi, width, max_bins)
    if merged is not None:
        return merged
    return _rebinned(counts, edges, min(start, lo), max(stop, hi), counts.numel())


@dataclass(frozen=True)
class BoundedQuarkHistogram(QuarkHistogram):
    """`QuarkHistogram` whose growth stays within `max_bins` bins and
    float32's range (module docstring).

    Attributes:
        max_bins: most bins the grid may hold (config; 0: 4 times `bins`).
    """

    max_bins: int = 0

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        bins: int = 2048,
        absolute: bool = False,
        skip_zeros: bool = False,
        max_bins: int = 0,
    ) -> BoundedQuarkHistogram:
        """No data: no bins yet, the empty range `(+inf, -inf)`."""
        stat = super().empty(
            qparam_shape, device, bins=bins, absolute=absolute, skip_zeros=skip_zeros
        )
        return cls(**{**stat.state(), **stat.config(), "max_bins": max_bins})

    @property
    def bin_limit(self) -> int:
        """The most bins the grid may hold."""
        return self.max_bins or _MAX_BINS_FACTOR * self.bins

    def update(self, batch: Batch) -> BoundedQuarkHistogram:
        if batch.x_flat is None:
            raise ValueError("a histogram counts values; the batch has none")
        low, high = batch.min_vals.reshape(()), batch.max_vals.reshape(())
        x = batch.x_flat
        lo, hi = batch_range(x, self.absolute, self.skip_zeros, minmax=(low, high))
        if max(-lo, hi) > _F32_MAX:  # float64 inputs
            raise ValueError(
                f"Quark's per-tensor histogram keeps float32 bin edges, and the "
                f"batch holds values up to {max(-lo, hi):.4g} (float32's max is "
                f"{_F32_MAX:.4g}); scale the input down or use a min-max observer"
            )
        if self.counts.numel() == 0:
            lo, hi = _first_range(lo, hi, self.bins)
            edges = linear_edges(lo, hi, self.bins, x.device)
            counts = torch.zeros(self.bins, dtype=torch.int64, device=x.device)
        else:
            lo, hi = _widen_constant(lo, hi, self.counts.numel())
            counts, edges = grow(self.counts, self.edges, lo, hi, self.bin_limit)
        counts = counts + _count(x, edges, self.absolute, self.skip_zeros)
        return self.replace(
            counts=counts,
            edges=edges,
            min_vals=torch.minimum(self.min_vals, low.to(self.min_vals.dtype)),
            max_vals=torch.maximum(self.max_vals, high.to(self.max_vals.dtype)),
        )

    def align(self, reduced: Mapping[str, torch.Tensor]) -> BoundedQuarkHistogram:
        """Re-binned onto `bins` equal bins over the reduced data range."""
        low, high = reduced["min_vals"], reduced["max_vals"]
        if self.counts.numel() == 0 or not bool(low <= high):
            return self.replace(min_vals=low, max_vals=high)
        both = torch.stack([low.reshape(()), high.reshape(())])
        lo, hi = _first_range(*batch_range(both, self.absolute, False), self.bins)
        counts, edges = _rebinned(self.counts, self.edges, lo, hi, self.bins)
        return self.replace(counts=counts, edges=edges, min_vals=low, max_vals=high)
