"""Histogram observers: exact per-qparam histograms + a range solver.

Every observer here keeps one `quantobs.stats.histogram.Histogram` per qparam (any
strategy the layout supports: tensor, channel, group, block, token,
tensor_group, attention head), accumulating over batches; statistics merge
exactly (whatever the ranges) and travel in `state_dict`. The solver runs
when qparams are asked for.

==================  =============================  ===========================
name                histogram                      range
==================  =============================  ===========================
``histogram``       x                              least L2 error: global
                                                   search (``mode="global"``)
                                                   or torch.ao's greedy one
                                                   (``mode="torch"``)
``percentile``      |x| if symmetric, else x       percentile bounds
``entropy``         |x|                            least KL divergence
                                                   (TensorRT / ModelOpt)
``histogram_mse``   x (|x| with symmetric_abs)     least expected
                                                   `|fq(x) - x|**norm`
==================  =============================  ===========================

Levels. `histogram` (global) cuts a candidate range into as many destination
bins as the format has values (`qmax - qmin + 1`: 16 for int4, 256 for int8,
128 for 0..127) and returns the first and last bin centers, which is where
`calculate_qparams` then puts the first and last levels; symmetric args
search `[-amax, amax]` with the symmetric quantizer's real levels. For float
formats (FP8, FP4, MX) uniform levels do not model the quantizer, so
`histogram` uses the `histogram_mse` solver with `norm=2`, the format's real
rounding. `mode="torch"` reproduces torch.ao's search on this histogram:
`2 ** num_bits` destination bins and torch's bin-edge range, whatever the
format. `entropy` quantizes |x| to `num_quantized_bins` levels, by default
those of one sign: `(qmax - qmin + 1) // 2` for symmetric int args (128 for
int8), all of them for asymmetric args on non-negative data, `2 **
(num_bits - 1)` for float formats.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from quantobs.observers.base import Observer, ObserverOptions
from quantobs.solvers.entropy import entropy_search
from quantobs.solvers.global_l2 import l2_search
from quantobs.solvers.histogram_mse import histogram_mse_search
from quantobs.solvers.percentile import percentile_range
from quantobs.solvers.torch_l2 import torch_l2_search, torch_l2_search_batched
from quantobs.stats.base import Statistic
from quantobs.stats.histogram import (
    DEFAULT_BINS,
    DEFAULT_MAX_COUNTS,
    MIN_BINS,
    Histogram,
)
from quantobs.stats.reduce import Range

__all__ = [
    "EntropyObserver",
    "EntropyOptions",
    "HistogramL2Observer",
    "HistogramL2Options",
    "HistogramMSEObserver",
    "HistogramMSEOptions",
    "HistogramOptions",
    "HistogramStatObserver",
    "PercentileObserver",
    "PercentileOptions",
]


class HistogramOptions(ObserverOptions):
    """Options of every histogram observer.

    Attributes:
        bins: bins per qparam (at least 8; 2048 as torch.ao and ModelOpt).
        max_counts: largest `bins * num_qparams` kept (memory budget, 8 bytes
            a count); beyond it the first observation raises `ValueError`.
    """

    bins: int = Field(DEFAULT_BINS, ge=MIN_BINS)
    max_counts: int = Field(DEFAULT_MAX_COUNTS, ge=1)


class HistogramL2Options(HistogramOptions):
    """Options of `histogram`.

    Attributes:
        mode: `"global"` (default): the least L2 error over all candidate
            ranges; `"torch"`: torch.ao's greedy search, same steps.
    """

    mode: Literal["global", "torch"] = "global"


class PercentileOptions(HistogramOptions):
    """Options of `percentile`.

    Attributes:
        percentile: in (0, 100]; each kept tail holds this percent of values.
        symmetric_abs: histogram |x| (one-sided); default: `args.symmetric`.
    """

    percentile: float = Field(99.99, gt=0.0, le=100.0)
    symmetric_abs: bool | None = None


class EntropyOptions(HistogramOptions):
    """Options of `entropy` (TensorRT / ModelOpt defaults).

    Attributes:
        start_bin: the smallest clipping candidate, in bins.
        stride: candidate spacing, in bins.
        num_quantized_bins: levels of the quantized |x| (default: see the
            module docstring; 128 for int8).
    """

    start_bin: int = Field(128, ge=1)
    stride: int = Field(1, ge=1)
    num_quantized_bins: int | None = Field(None, ge=1)


class HistogramMSEOptions(HistogramOptions):
    """Options of `histogram_mse`.

    Attributes:
        norm: exponent of the absolute error (2: mean squared error).
        maxshrink: largest fraction the observed range shrinks by, (0, 1].
        grid: candidates per unit of shrink (`int(maxshrink * grid)` in all).
        symmetric_abs: histogram |x| (scores positive values only).
    """

    norm: float = Field(2.0, gt=0.0)
    maxshrink: float = Field(0.8, gt=0.0, le=1.0)
    grid: float = Field(100.0, gt=0.0)
    symmetric_abs: bool = False


class HistogramStatObserver(Observer):
    """Base of the histogram observers: an exact `Histogram` per qparam.

    Subclasses choose whether the histogram is of |x| (`_absolute`) and turn
    it into a range (`_solve`).
    """

    statistic_cls = Histogram
    Options: ClassVar[type[ObserverOptions]] = HistogramOptions
    options: HistogramOptions

    def _absolute(self) -> bool:
        return False

    def statistic_config(self) -> dict[str, Any]:
        return {
            "bins": self.options.bins,
            "absolute": self._absolute(),
            "max_counts": self.options.max_counts,
            "owner": f"observer {self.name!r} for {self.base_name!r}",
        }

    @property
    def histogram(self) -> Histogram:
        """The accumulated `Histogram` (raises before any observation)."""
        stat = self._require()
        assert isinstance(stat, Histogram)
        return stat

    @abstractmethod
    def _solve(self, hist: Histogram) -> Range:
        """The `(*qparam_shape,)` range this observer's solver selects."""

    def _range(self, stat: Statistic) -> Range:
        assert isinstance(stat, Histogram)
        min_vals, max_vals = self._solve(stat)
        # Qparams that saw no finite value: the empty range (base -> (0, 0)).
        empty = stat.min_vals > stat.max_vals
        min_vals = torch.where(empty, stat.min_vals, min_vals.float())
        max_vals = torch.where(empty, stat.max_vals, max_vals.float())
        return min_vals, max_vals


def _within(hist: Histogram, amax: torch.Tensor) -> Range:
    """`[-amax, amax]` cut to the observed range."""
    amax = amax.float()
    return torch.maximum(-amax, hist.min_vals), torch.minimum(amax, hist.max_vals)


@Observer.register("histogram")
class HistogramL2Observer(HistogramStatObserver):
    """Least L2 error over the histogram (torch.ao's objective, global search)."""

    Options = HistogramL2Options
    options: HistogramL2Options

    def _solve(self, hist: Histogram) -> Range:
        lo, width = hist.edges()
        fmt = self.args.format
        if self.options.mode == "torch":
            bins = hist.bins
            counts = hist.counts.reshape(-1, bins).to(torch.float32)
            low = lo.reshape(-1).to(torch.float32)
            high = (lo + bins * width).reshape(-1).to(torch.float32)
            dst_nbins = 2**self.args.num_bits
            if counts.shape[0] == 1:  # one histogram: the block-scored walk
                new_min, new_max = torch_l2_search(
                    counts[0], low[0], high[0], dst_nbins
                )
            else:
                new_min, new_max = torch_l2_search_batched(counts, low, high, dst_nbins)
            return new_min.reshape(lo.shape), new_max.reshape(lo.shape)
        if fmt.is_float:
            return histogram_mse_search(
                hist.counts, lo, width, self.args, hist.min_vals, hist.max_vals
            )
        levels = int(fmt.max - fmt.min) + 1
        if self.args.symmetric:
            return l2_search(
                hist.counts, lo, width, levels, symmetric=(fmt.min, fmt.max)
            )
        low, high = l2_search(hist.counts, lo, width, levels)
        step = (high - low) / levels  # destination bin width: centers are levels
        return low + step / 2, high - step / 2


@Observer.register("percentile")
class PercentileObserver(HistogramStatObserver):
    """Percentile range: two-sided on x, or one-sided on |x| (symmetric)."""

    Options = PercentileOptions
    options: PercentileOptions

    def _absolute(self) -> bool:
        chosen = self.options.symmetric_abs
        return bool(self.args.symmetric) if chosen is None else chosen

    def _solve(self, hist: Histogram) -> Range:
        lo, width = hist.edges()
        min_vals, max_vals = percentile_range(
            hist.counts,
            lo,
            width,
            self.options.percentile,
            hist.min_vals,
            hist.max_vals,
            absolute=hist.absolute,
        )
        if hist.absolute:
            return _within(hist, max_vals)
        return min_vals, max_vals


@Observer.register("entropy")
class EntropyObserver(HistogramStatObserver):
    """KL-divergence calibration (TensorRT / ModelOpt) on a histogram of |x|."""

    Options = EntropyOptions
    options: EntropyOptions

    def _absolute(self) -> bool:
        return True

    def _levels(self, hist: Histogram) -> int | torch.Tensor:
        if self.options.num_quantized_bins is not None:
            return self.options.num_quantized_bins
        fmt = self.args.format
        if fmt.is_float:
            return 2 ** (self.args.num_bits - 1)
        every = int(fmt.max - fmt.min) + 1
        if self.args.symmetric:
            return every // 2
        one_signed = (hist.min_vals >= 0).reshape(-1)
        return torch.where(one_signed, every, every // 2)

    def _solve(self, hist: Histogram) -> Range:
        _, width = hist.edges()
        amax = torch.maximum(-hist.min_vals, hist.max_vals)
        threshold = entropy_search(
            hist.counts,
            width,
            self._levels(hist),
            start_bin=self.options.start_bin,
            stride=self.options.stride,
            amax=amax,
        )
        return _within(hist, threshold)


@Observer.register("histogram_mse")
class HistogramMSEObserver(HistogramStatObserver):
    """Least expected `|fake_quant(x) - x|**norm` under the histogram."""

    Options = HistogramMSEOptions
    options: HistogramMSEOptions

    def _absolute(self) -> bool:
        return self.options.symmetric_abs

    def _solve(self, hist: Histogram) -> Range:
        lo, width = hist.edges()
        min_vals, max_vals = histogram_mse_search(
            hist.counts,
            lo,
            width,
            self.args,
            hist.min_vals,
            hist.max_vals,
            norm=self.options.norm,
            maxshrink=self.options.maxshrink,
            grid=self.options.grid,
            absolute=hist.absolute,
        )
        if hist.absolute:
            return _within(hist, max_vals)
        return min_vals, max_vals
