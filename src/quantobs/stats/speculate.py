"""One-pass per-tensor histogram updates: count while finding the range.

Because the exact histograms' grids nest (`quantobs.stats.histogram`), a
per-tensor batch can be counted on the grid it is expected to need before
its range is known: the histogram's grid, or for the first batch the grid of
a small sample's range. `speculate` counts the values inside that grid's
window in the same pass that finds the batch's min/max (one native kernel)
and sets the few others aside; once the range is known,
`Speculation.complete` re-bins the counts exactly and bins the values set
aside. The result is the two-pass histogram, bit for bit.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from quantobs import native
from quantobs.native.dispatch import kernel
from quantobs.stats.binning import bin_counts
from quantobs.stats.histogram import Histogram, grid_range, histogram_grid, widen

__all__ = ["Speculation", "speculate"]

# Values set aside as tiny are below 2**-100: a grid up to this exponent
# cannot underflow the others (see qo_histogram_pass).
_SPECULATION_MAX_EXPONENT = 49
_SPECULATION_MIN_ELEMS = 1 << 16  # smaller batches: two passes cost little
_SAMPLE = 4096  # values sampled to guess a first grid


@dataclass(frozen=True)
class Speculation:
    """A per-tensor batch counted on a grid in the same pass that found its
    min/max (`speculate`); `update_histogram` completes it.

    Attributes:
        batch: the batch (by weak reference: `matches` tells whether a later
            update is of the same tensor object).
        source: the grid `(exponent, offset)` of the histogram speculated on.
        exponent, offset: the grid counted on (the histogram's, or for an
            empty histogram one guessed from a sample of the batch).
        batch_range: `(min, max)` of the batch, each `(*Q,)` float32 (NaN
            when the batch holds NaN).
        counts: `(bins,)` int64 counts of the values inside that grid's window.
        side: the other values, 1-D.
    """

    batch: weakref.ref[torch.Tensor]
    source: tuple[torch.Tensor, torch.Tensor]
    exponent: torch.Tensor
    offset: torch.Tensor
    batch_range: tuple[torch.Tensor, torch.Tensor]
    counts: torch.Tensor
    side: torch.Tensor

    def matches(self, hist: Histogram, x_flat: torch.Tensor) -> bool:
        """Whether this speculation counted `x_flat` for `hist`."""
        return (
            self.batch() is x_flat
            and torch.equal(self.source[0], hist.exponent)
            and torch.equal(self.source[1], hist.offset)
        )

    def complete(
        self, hist: Histogram, lo: torch.Tensor, hi: torch.Tensor
    ) -> Histogram | None:
        """`hist` plus the speculated batch of range `[lo, hi]`, or None (the
        grid grew past what speculation handles: count again)."""
        counted = Histogram(
            counts=hist.counts + self.counts.view(hist.counts.shape),
            exponent=self.exponent,
            offset=self.offset,
            min_vals=torch.minimum(hist.min_vals, lo),  # holds data: rebin moves it
            max_vals=torch.maximum(hist.max_vals, hi),
            absolute=hist.absolute,
        )
        joined = widen(counted, lo, hi)
        if int(joined.exponent.max()) > _SPECULATION_MAX_EXPONENT:
            return None
        if self.side.numel():
            bin_counts(
                self.side.reshape(1, -1, self.side.numel()),
                joined.exponent.reshape(-1),
                joined.offset.reshape(-1),
                joined.counts.view(-1, hist.bins),
                hist.absolute,
                False,
            )
        return joined


def _guess_grid(
    hist: Histogram, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The histogram's grid, or for an empty one the grid of a sample's range."""
    if bool((hist.min_vals <= hist.max_vals).all()):
        return hist.exponent, hist.offset
    sample = values[:: max(1, values.numel() // _SAMPLE)]
    low, high = torch.aminmax(sample)
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        return None
    shape = hist.min_vals.shape
    return histogram_grid(
        *grid_range(low.reshape(shape), high.reshape(shape), hist.absolute),
        hist.bins,
    )


@kernel
def _histogram_pass(
    x: torch.Tensor, inv: float, offset: float, bins: int, absolute: bool, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Min/max and counts on a known grid in one pass (`native.histogram_pass`).

    Only a native kernel does it in one pass; torch's answer is None: the
    caller counts in two passes (the same counts).
    """
    return None


_histogram_pass.register("cpu", native.histogram_pass)


def speculate(hist: Histogram, x_flat: torch.Tensor) -> Speculation | None:
    """Count a per-tensor batch on a known grid while finding its min/max.

    Calibration batches mostly fall inside the range seen so far, so one
    pass over the batch can do what otherwise takes two: values inside the
    window of the histogram's grid (for an empty histogram, of a grid
    guessed from a sample) are counted there, the few others set aside, and
    `update_histogram` re-bins the counts once the batch's range is known
    (exact: power-of-two grids nest) and bins the rest. None where it does
    not apply: more than one qparam, small or non-float32 batches, no native
    kernels (a device tensor: two passes, with no host read), or more values
    outside the window than the budget.
    """
    if math.prod(hist.qparam_shape) != 1 or x_flat.dtype != torch.float32:
        return None
    if x_flat.device.type != "cpu" or not native.available():
        return None  # only the C kernel counts in one pass (guessing syncs)
    if x_flat.numel() < _SPECULATION_MIN_ELEMS:
        return None
    values = x_flat.reshape(-1)
    grid = _guess_grid(hist, values)
    if grid is None or int(grid[0].reshape(-1)[0]) > _SPECULATION_MAX_EXPONENT:
        return None
    exponent, offset = grid
    threads = max(1, torch.get_num_threads())
    cap = max(1 << 12, values.numel() // threads >> 7)
    found = _histogram_pass(
        values,
        2.0 ** -int(exponent.reshape(-1)[0]),
        float(offset.reshape(-1)[0]),
        hist.bins,
        hist.absolute,
        cap,
    )
    if found is None:
        return None
    ends, counts, side = found
    if side is None:  # too many values outside the window
        return None
    if bool(side.isnan().any()):  # the kernel's min/max skip NaN
        ends = torch.full_like(ends, math.nan)
    shape = hist.min_vals.shape
    return Speculation(
        batch=weakref.ref(x_flat),
        source=(hist.exponent, hist.offset),
        exponent=exponent,
        offset=offset,
        batch_range=(ends[0].reshape(shape), ends[1].reshape(shape)),
        counts=counts,
        side=side,
    )
