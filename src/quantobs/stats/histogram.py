"""Batched exact-count histograms over the canonical layout, one per qparam.

A `Histogram` holds, for every quantization parameter of `qparam_shape`,
`bins` int64 counts over uniform bins whose width is a power of two and whose
edges are multiples of that width (the grid is anchored at 0)::

    bin i of qparam q covers  [(offset[q] + i) * 2**exponent[q],
                               (offset[q] + i + 1) * 2**exponent[q])

Range-growth rule. The grid of a qparam is a function of its data range
`[lo, hi]` only (for an |x| histogram, `[0, max |x|]`)::

    exponent = the smallest e >= e_floor with
               floor(hi / 2**e) - floor(lo / 2**e) + 1 <= bins
    offset   = floor(lo / 2**exponent)
    e_floor  = max(-126, floor(log2(max(|lo|, |hi|))) - 61)

`e_floor` keeps `x / 2**e` below 2**62 (exact int64 cell numbers) and `2**-e`
a float32. The smallest fitting exponent only grows when the range grows, so
when a batch widens the range, old bins are re-binned by an integer shift,
`new_bin = ((offset + i) >> (e_new - e_old)) - offset_new`: each old bin lies
inside one new bin, so re-binning moves whole counts and is exact. Binning is
exact too: `x * 2**-e` is exact in float32 (a power-of-two scaling) and
`floor` of it is the cell number.

Merge error bound: **zero**. Because the grid depends only on the union range
and every count is exact, the histogram of a set of values does not depend on
how the values were split into batches or processes: `merge(a, b)` equals the
histogram of the concatenation whatever the two ranges were, and merging is
associative and commutative (an all-reduce gives the single-process result).
The price is resolution: data spans between about `bins / 2` and `bins`
bins (a power-of-two width is at most twice the width `range / bins`).
Across processes: all-reduce `min_vals` (MIN) and `max_vals` (MAX), take
`histogram_grid` of the result, `rebin` the local histogram to it and
all-reduce the counts (SUM): the single-process histogram, exactly.

One exception to exact binning, documented rather than paid for: a negative
value so small that `x * 2**-e` underflows to `-0.0` (`|x| < 2**(e - 149)`,
possible only for bins wider than 2) is counted in the cell `[0, w)` instead
of `[-w, 0)`, or in the last bin if the window ends at 0.

One-pass updates: `quantobs.stats.speculate` counts a per-tensor batch on
the grid it is expected to need in the same pass that finds its range.

Counts are int64 (exact past 2**24 per bin, where `torch.histc` saturates).
Memory is `bins * num_qparams` int64 counts; `check_budget` refuses more than
`max_counts` (default 2**26, 512 MiB) with an error that suggests a coarser
granularity, fewer bins or a raw-data observer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from quantobs.core.exact import divide
from quantobs.stats.base import Batch, Field, Reduce, Statistic
from quantobs.stats.binning import bin_counts
from quantobs.stats.rebinning import rebin_counts
from quantobs.stats.reduce import minmax, minmax_omit_nonfinite

if TYPE_CHECKING:
    from quantobs.stats.speculate import Speculation

__all__ = [
    "DEFAULT_BINS",
    "DEFAULT_MAX_COUNTS",
    "MIN_BINS",
    "Histogram",
    "check_budget",
    "empty_histogram",
    "grid_range",
    "histogram_grid",
    "histogram_of",
    "merge_histograms",
    "rebin",
    "update_histogram",
    "widen",
]

DEFAULT_BINS = 2048
DEFAULT_MAX_COUNTS = 1 << 26
MIN_BINS = 8
_MIN_EXPONENT = -126  # 2**-e stays a normal float32 multiplier
_CELL_BITS = 61  # |x| / 2**e < 2**62: exact int64 cell numbers


@dataclass(frozen=True)
class Histogram(Statistic):
    """Exact-count histograms of `qparam_shape` qparams, one grid each.

    Attributes:
        counts: `(*qparam_shape, bins)` int64 counts.
        exponent: `(*qparam_shape,)` int64; the bin width is `2**exponent`.
        offset: `(*qparam_shape,)` int64 cell number of the left edge of bin 0.
        min_vals: `(*qparam_shape,)` float32 smallest finite value observed
            (`+inf` where none).
        max_vals: `(*qparam_shape,)` float32 largest finite value (`-inf`).
        absolute: whether the counts are of `|x|` (the grid then spans
            `[0, max |x|]`); `min_vals`/`max_vals` are of `x` either way.
    """

    counts: torch.Tensor
    exponent: torch.Tensor
    offset: torch.Tensor
    min_vals: torch.Tensor
    max_vals: torch.Tensor
    absolute: bool = False

    fields: ClassVar[tuple[Field, ...]] = (
        Field("counts", Reduce.SUM),
        Field("exponent", Reduce.GRID),
        Field("offset", Reduce.GRID),
        Field("min_vals", Reduce.MIN),
        Field("max_vals", Reduce.MAX),
    )
    needs_values: ClassVar[bool] = True

    # ------------------------------------------------------ statistic protocol

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        bins: int = DEFAULT_BINS,
        absolute: bool = False,
        max_counts: int = DEFAULT_MAX_COUNTS,
        owner: str = "histogram",
    ) -> Histogram:
        """No data (see `empty_histogram`), after `check_budget`."""
        check_budget(math.prod(qparam_shape), bins, max_counts, owner)
        return empty_histogram(qparam_shape, bins, absolute, device)

    def scan(self, x_flat: torch.Tensor, *, exact_dtype: bool = False) -> Batch:
        """The batch's range; per tensor also its counts on a speculated grid
        in the same pass (`quantobs.stats.speculate`)."""
        from quantobs.stats.speculate import speculate  # builds on this module

        found = speculate(self, x_flat) if math.prod(self.qparam_shape) == 1 else None
        if found is None:
            return super().scan(x_flat, exact_dtype=exact_dtype)
        low, high = found.batch_range
        return Batch(None, low, high, int(x_flat.shape[0]), scan=found)

    def omit_nonfinite(self, x_flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Non-finite values become NaN, which binning skips (0 would count)."""
        return torch.where(torch.isfinite(x_flat), x_flat, math.nan), True

    def update(self, batch: Batch) -> Histogram:
        """Count the batch (in place: the old value is given up)."""
        if batch.x_flat is None:
            raise ValueError("a histogram counts values; the batch has none")
        return update_histogram(
            self,
            batch.x_flat,
            (batch.min_vals, batch.max_vals),
            has_nonfinite=batch.has_skipped,
            inplace=True,
            speculation=batch.scan,
        )

    def merge(self, other: Histogram) -> Histogram:
        """Exact: see `merge_histograms`."""
        return merge_histograms(self, other)

    def align(self, reduced: Mapping[str, torch.Tensor]) -> Histogram:
        """Re-binned to the grid of the reduced range (exact)."""
        return widen(self, reduced["min_vals"], reduced["max_vals"])

    @property
    def bins(self) -> int:
        """Bins per qparam."""
        return int(self.counts.shape[-1])

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        """The shape of the qparams."""
        return tuple(self.min_vals.shape)

    def total(self) -> torch.Tensor:
        """`(*qparam_shape,)` int64 number of values counted per qparam."""
        return self.counts.sum(dim=-1)

    def edges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(left edge of bin 0, bin width)`, each `(*qparam_shape,)` float64."""
        width = torch.ldexp(
            torch.ones_like(self.exponent, dtype=torch.float64), self.exponent
        )
        return self.offset.to(torch.float64) * width, width

    def value_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(lo, hi)` float32 range the grid covers data of: `[0, amax]` if absolute."""
        return grid_range(self.min_vals, self.max_vals, self.absolute)


def check_budget(
    num_qparams: int,
    bins: int,
    max_counts: int = DEFAULT_MAX_COUNTS,
    what: str = "histogram",
) -> None:
    """Refuse histograms of more than `max_counts` counts.

    Raises:
        ValueError: `num_qparams * bins > max_counts`; the message gives the
            memory and the ways out.
    """
    needed = num_qparams * bins
    if needed > max_counts:
        raise ValueError(
            f"{what} would keep {num_qparams} qparams x {bins} bins = {needed} "
            f"int64 counts ({needed * 8 / 2**20:.0f} MiB), above max_counts="
            f"{max_counts}; use a coarser granularity (strategy 'tensor' or "
            "'channel', a larger group_size), fewer bins, a larger max_counts, "
            "or an observer that reads raw data ('memoryless_mse', 'static_mse')"
        )


def grid_range(
    min_vals: torch.Tensor, max_vals: torch.Tensor, absolute: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The data range a grid covers: `[min, max]`, or `[0, max |x|]` if absolute
    (`(+inf, -inf)` where there is no data)."""
    if not absolute:
        return min_vals, max_vals
    amax = torch.maximum(-min_vals, max_vals)  # -inf where empty
    empty = min_vals > max_vals
    lo = torch.where(empty, torch.full_like(amax, math.inf), torch.zeros_like(amax))
    return lo, amax


def _cells(values: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """`floor(values / 2**exponent)` as int64, exact (float64 power-of-two scaling)."""
    return torch.floor(torch.ldexp(values.to(torch.float64), -exponent)).to(torch.int64)


def histogram_grid(
    min_vals: torch.Tensor, max_vals: torch.Tensor, bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical `(exponent, offset)` grid of each range (module docstring).

    Args:
        min_vals: `(*Q,)` float32 lower ends (`+inf` where there is no data).
        max_vals: `(*Q,)` float32 upper ends (`-inf` where there is no data).
        bins: bins per qparam.

    Returns:
        `(exponent, offset)`, each `(*Q,)` int64. Empty ranges get
        `(-126, 0)`.
    """
    empty = min_vals > max_vals
    lo = torch.where(empty, torch.zeros_like(min_vals), min_vals).to(torch.float64)
    hi = torch.where(empty, torch.zeros_like(max_vals), max_vals).to(torch.float64)
    amax = torch.maximum(lo.abs(), hi.abs())
    _, amax_exp = torch.frexp(amax)  # amax = m * 2**amax_exp, 0.5 <= m < 1
    floor_exp = torch.clamp(
        amax_exp.to(torch.int64) - 1 - _CELL_BITS, min=_MIN_EXPONENT
    )
    # (hi - lo) / 2**e <= bins - 1 guarantees a fit; the smallest fitting
    # exponent is that bound or one below (checked exactly, with a margin).
    ratio = divide(hi - lo, bins - 1)
    mant, ratio_exp = torch.frexp(ratio)
    upper = ratio_exp.to(torch.int64) - (mant == 0.5).to(torch.int64)
    upper = torch.where(ratio > 0, upper, torch.full_like(upper, _MIN_EXPONENT))
    exponent = torch.maximum(upper + 1, floor_exp)
    for step in (0, -1, -2):
        trial = torch.maximum(upper + step, floor_exp)
        fits = _cells(hi, trial) - _cells(lo, trial) + 1 <= bins
        exponent = torch.where(fits, trial, exponent)
    exponent = torch.where(empty, torch.full_like(exponent, _MIN_EXPONENT), exponent)
    offset = torch.where(empty, torch.zeros_like(exponent), _cells(lo, exponent))
    return exponent, offset


def empty_histogram(
    qparam_shape: tuple[int, ...],
    bins: int = DEFAULT_BINS,
    absolute: bool = False,
    device: torch.device | str | None = None,
) -> Histogram:
    """A histogram with no data (the identity of `merge_histograms`)."""
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < MIN_BINS:
        raise ValueError(f"bins must be an int >= {MIN_BINS}, got {bins!r}")
    shape = tuple(qparam_shape)
    return Histogram(
        counts=torch.zeros(*shape, bins, dtype=torch.int64, device=device),
        exponent=torch.full(shape, _MIN_EXPONENT, dtype=torch.int64, device=device),
        offset=torch.zeros(shape, dtype=torch.int64, device=device),
        min_vals=torch.full(shape, math.inf, dtype=torch.float32, device=device),
        max_vals=torch.full(shape, -math.inf, dtype=torch.float32, device=device),
        absolute=absolute,
    )


def rebin(hist: Histogram, exponent: torch.Tensor, offset: torch.Tensor) -> Histogram:
    """Move the counts to a coarser (or equal), aligned grid, exactly.

    Args:
        hist: the histogram.
        exponent: `(*Q,)` new exponents, each `>= hist.exponent` where the
            qparam has data.
        offset: `(*Q,)` new offsets; the new window must contain every
            non-empty old bin (true for the grid of any range containing the
            old data range).

    Returns:
        The histogram on the new grid (same ranges). Qparams whose grid did not
        change keep their counts; the rest move with one `scatter_add_`
        (`quantobs.stats.rebinning`: on a device, every row, with no host read).
    """
    if hist.bins == 0:  # a placeholder without bins: nothing to move
        return replace(hist, exponent=exponent, offset=offset)
    changed = (exponent != hist.exponent) | (offset != hist.offset)
    changed &= hist.min_vals <= hist.max_vals  # qparams with no data: all zeros
    rows = hist.counts.reshape(-1, hist.bins)
    counts = rebin_counts(
        rows,
        changed.reshape(-1),
        hist.offset.reshape(-1),
        (exponent - hist.exponent).reshape(-1),
        offset.reshape(-1),
    )
    if counts is rows:  # nothing moved (the CPU path tells)
        return replace(hist, exponent=exponent, offset=offset)
    return replace(
        hist, counts=counts.view(hist.counts.shape), exponent=exponent, offset=offset
    )


def widen(hist: Histogram, lo: torch.Tensor, hi: torch.Tensor) -> Histogram:
    """`hist` re-binned to the grid of its data range joined with `[lo, hi]`."""
    min_vals = torch.minimum(hist.min_vals, lo)
    max_vals = torch.maximum(hist.max_vals, hi)
    exponent, offset = histogram_grid(
        *grid_range(min_vals, max_vals, hist.absolute), hist.bins
    )
    moved = rebin(hist, exponent, offset)
    return replace(moved, min_vals=min_vals, max_vals=max_vals)


def update_histogram(
    hist: Histogram,
    x_flat: torch.Tensor,
    batch_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    has_nonfinite: bool = False,
    inplace: bool = False,
    speculation: Speculation | None = None,
) -> Histogram:
    """Fold a batch into a histogram (the grid grows if the range does).

    Args:
        hist: the histogram so far (`empty_histogram` for none).
        x_flat: `(N, *Q, G)` values; NaN entries are skipped when
            `has_nonfinite` (other non-finite values must not be present).
        batch_range: the finite `(min, max)` of the batch per qparam
            (`(+inf, -inf)` where a qparam has no finite value), if known.
        has_nonfinite: whether `x_flat` holds NaN entries to skip.
        inplace: add the counts into `hist.counts` (which the caller gives up)
            instead of a copy.
        speculation: `speculate(hist, x_flat)`, if the caller made it: the
            batch is then not read again (unless it must be).

    Returns:
        The new histogram; its counts equal `histogram_of` the concatenation
        of every batch.

    Raises:
        ValueError: `x_flat` does not match the histogram's qparam shape.
    """
    qshape = tuple(x_flat.shape[1:-1])
    if qshape != hist.qparam_shape:
        raise ValueError(
            f"x_flat of qparam shape {qshape} does not match the histogram's "
            f"{hist.qparam_shape}"
        )
    if batch_range is None:
        batch_range = minmax_omit_nonfinite(x_flat) if has_nonfinite else minmax(x_flat)
    lo, hi = batch_range[0].float(), batch_range[1].float()
    if (
        speculation is not None
        and not has_nonfinite
        and speculation.matches(hist, x_flat)
    ):
        done = speculation.complete(hist, lo, hi)
        if done is not None:
            return done
    joined = widen(hist, lo, hi)
    counts = joined.counts
    if counts is hist.counts and not inplace:  # not re-binned: still shared
        counts = counts.clone()
    bin_counts(
        x_flat,
        joined.exponent.reshape(-1),
        joined.offset.reshape(-1),
        counts.view(-1, hist.bins),
        hist.absolute,
        has_nonfinite,
    )
    return replace(joined, counts=counts)


def histogram_of(
    x_flat: torch.Tensor,
    bins: int = DEFAULT_BINS,
    absolute: bool = False,
    *,
    max_counts: int = DEFAULT_MAX_COUNTS,
) -> Histogram:
    """The histogram of one tensor in the canonical layout.

    Args:
        x_flat: `(N, *Q, G)` values; non-finite values are skipped.
        bins: bins per qparam (at least 8).
        absolute: count `|x|` (grid over `[0, max |x|]`).
        max_counts: memory budget, see `check_budget`.

    Returns:
        The `Histogram` of qparam shape `Q`.
    """
    qshape = tuple(x_flat.shape[1:-1])
    check_budget(math.prod(qshape), bins, max_counts)
    batch_range = minmax(x_flat)
    finite = bool(
        torch.isfinite(batch_range[0]).all() & torch.isfinite(batch_range[1]).all()
    )
    if not finite:
        batch_range = minmax_omit_nonfinite(x_flat)
        x_flat = torch.where(torch.isfinite(x_flat), x_flat, math.nan)
    return update_histogram(
        empty_histogram(qshape, bins, absolute, x_flat.device),
        x_flat,
        batch_range,
        has_nonfinite=not finite,
        inplace=True,
    )


def merge_histograms(a: Histogram, b: Histogram) -> Histogram:
    """The histogram of both histograms' data: exact and order-free.

    Both are re-binned to the grid of the union range (a coarsening of both
    grids, exact) and added; the result equals the histogram of the
    concatenated data, so merging is associative and commutative.

    Raises:
        ValueError: different qparam shapes, bins or `absolute`.
    """
    if a.counts.shape != b.counts.shape or a.absolute != b.absolute:
        raise ValueError(
            f"cannot merge histograms of counts {tuple(a.counts.shape)} "
            f"(absolute={a.absolute}) and {tuple(b.counts.shape)} "
            f"(absolute={b.absolute}); use the same qparam shape, bins and "
            "absolute setting"
        )
    joined_a = widen(a, b.min_vals, b.max_vals)
    joined_b = rebin(b, joined_a.exponent, joined_a.offset)
    return replace(joined_a, counts=joined_a.counts + joined_b.counts)
