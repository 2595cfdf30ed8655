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

`entropy` and `percentile` warn (`quantobs.ObjectiveFitWarning`) on float
formats, where their clipping objectives do not fit, and `entropy` on
weights (`quantobs.observers.fit`).

Per tensor and per channel / per group. Options are in
`quantobs.observers.histogram_options`; their `"auto"` defaults keep
per-tensor observers as they always were (2048 bins, the certified global
L2 search, TensorRT's exhaustive entropy search, ModelOpt's bin-centre MSE)
and make per-channel / per-group ones fast: histograms of `auto_bins(G)`
bins (64 to 256 for `G` values per qparam per observation), the batched L2
search, the coarse-to-fine entropy search, and the uniform-bin closed form
for `histogram_mse` on integer formats. A histogram of several qparams
whose values per qparam are not known yet (an observer that has seen
nothing, in a distributed sync) is a placeholder without bins: it holds no
statistic until the first batch sizes it.

The solver's result is cached while the statistic is unchanged: a repeated
`get_qparams()` / `get_range()` costs no search. The cache is keyed on the
statistic's buffers (their identity and in-place version counter), so
`update`, `merge`, `load_state_dict`, `reset` and `.to()` all invalidate it.

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

import functools
import math
from abc import abstractmethod
from dataclasses import replace
from typing import Any, ClassVar

import torch

from quantobs import native
from quantobs.core.syncs import on_host
from quantobs.observers.base import Observer, ObserverOptions
from quantobs.observers.fit import warn_if_unfit
from quantobs.observers.histogram_host import HostCopy
from quantobs.observers.histogram_options import (
    EntropyOptions,
    HistogramL2Options,
    HistogramMSEOptions,
    HistogramOptions,
    PercentileOptions,
    resolve_bins,
)
from quantobs.observers.solve_cache import SolveCache
from quantobs.solvers.entropy import entropy_search
from quantobs.solvers.global_l2 import l2_search
from quantobs.solvers.histogram_mse import (
    histogram_mse_search,
    histogram_mse_uniform,
    uniform_applies,
)
from quantobs.solvers.l2_batched import l2_search_batched
from quantobs.solvers.percentile import percentile_range
from quantobs.solvers.torch_l2 import torch_l2_search, torch_l2_search_batched
from quantobs.stats.base import Statistic
from quantobs.stats.histogram import MIN_BINS, Histogram
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


# Most counts copied to the host for a host-deciding search (8192 channels
# of 256 bins): the copy is read as Python floats with the deferred checks.
_HOST_COPY_MAX = 1 << 21


class HistogramStatObserver(Observer):
    """Base of the histogram observers: an exact `Histogram` per qparam.

    Subclasses choose whether the histogram is of |x| (`_absolute`) and turn
    it into a range (`_solve`).
    """

    statistic_cls = Histogram
    Options: ClassVar[type[ObserverOptions]] = HistogramOptions
    options: HistogramOptions
    # The NaN policy is deferred to qparams time (issue 24): a batch with
    # non-finite values is counted (NaN skipped, infinities clamped to the
    # end bins) and its error raised before any range is solved.
    defer_checks = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        warn_if_unfit(self.name, self.args, self.base_name, stacklevel=3)
        self._values_per_qparam: int | None = None  # G of the last batch
        self._known_bins: int | None = None  # bins of the last statistic held
        self._solved = SolveCache()
        self._host = HostCopy()

    def _absolute(self) -> bool:
        return False

    def statistic_config(self) -> dict[str, Any]:
        bins = self.options.bins
        return {
            "bins": bins if isinstance(bins, int) else MIN_BINS,  # see _new_statistic
            "absolute": self._absolute(),
            "max_counts": self.options.max_counts,
            "owner": f"observer {self.name!r} for {self.base_name!r}",
        }

    # ------------------------------------------------- bins chosen from data

    def _values_from_args(self) -> int | None:
        """Values per qparam per observation that the args fix, if any."""
        if self.args.strategy in ("group", "tensor_group"):
            return self.args.group_size
        if self.args.strategy == "block" and self.args.block_structure:
            return math.prod(self.args.block_structure)
        return None

    def _bins_for(self, qparam_shape: tuple[int, ...]) -> int | None:
        """Bins of a new histogram (None: not known yet, see the module)."""
        found = resolve_bins(
            self.options.bins,
            math.prod(qparam_shape),
            self._values_per_qparam or self._values_from_args(),
        )
        return self._known_bins if found is None else found

    def _new_statistic(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> Statistic:
        config = self.statistic_config()
        bins = self._bins_for(qparam_shape)
        if bins is not None:
            return Histogram.empty(qparam_shape, device, **{**config, "bins": bins})
        # A placeholder without bins: `statistic()` reads it as none (module).
        empty = Histogram.empty(qparam_shape, device, **config)
        return replace(empty, counts=empty.counts[..., :0])

    def statistic(self) -> Statistic | None:
        """The histogram in the buffers (None before data; a placeholder
        without bins counts as none)."""
        stat = super().statistic()
        if isinstance(stat, Histogram) and stat.bins == 0:
            return None
        return stat

    def _observe(self, x_flat: torch.Tensor) -> Statistic | None:
        self._values_per_qparam = int(x_flat.shape[-1])
        return super()._observe(x_flat)

    def reset(self) -> None:
        """Forget every statistic and count (the bins of the last histogram
        are remembered for an empty one made before the next batch, e.g. by
        `clear_data`)."""
        counts = self._buffers.get(self._buffer_name("counts"))
        if isinstance(counts, torch.Tensor) and counts.ndim and counts.shape[-1]:
            self._known_bins = int(counts.shape[-1])
        super().reset()

    def _store(self, stat: Statistic | None) -> None:
        if isinstance(stat, Histogram) and stat.bins > 0:
            self._known_bins = stat.bins
        super()._store(stat)

    # ----------------------------------------------------------------- solve

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
        tensors = list(stat.state().values())
        return self._solved.get(
            tensors, (self.args, self.options), lambda: self._solved_range(stat)
        )

    # ------------------------------------------- searches run on the host

    def _host_search(self, hist: Histogram) -> bool:
        """Whether this observer's search decides step by step on the host
        (`quantobs.observers.histogram_host`); default: no, it runs on the
        histogram's device with no host read."""
        return False

    def _on_host(self, hist: Histogram) -> bool:
        """Whether `hist` is solved on a host copy: a host-deciding search of
        a device histogram (or of a CPU one on the torch path, which stands
        for it) of at most `_HOST_COPY_MAX` counts (larger ones, only with
        a host-deciding search chosen for many qparams, are searched on
        their device, with its host reads)."""
        if hist.counts.device.type == "cpu" and native.available():
            return False
        return hist.counts.numel() <= _HOST_COPY_MAX and self._host_search(hist)

    def _extra_pending(self) -> torch.Tensor | None:
        stat = self.statistic()
        if not isinstance(stat, Histogram) or not self._on_host(stat):
            return None
        return self._host.ask(stat)  # read with the deferred checks

    def _settle_extra(self, values: list[float]) -> None:
        self._host.take(values)

    def _solved_range(self, stat: Histogram) -> Range:
        copy = self._host.get(stat) if self._on_host(stat) else None
        if copy is None:
            return self._range_of(stat)
        with on_host():  # read already: the search's reads are free
            found = torch.stack(self._range_of(copy))
        device = stat.min_vals.device
        if device.type == "cuda":  # a pinned copy waits for no kernel
            found = found.pin_memory()
        found = found.to(device, non_blocking=True)
        return found[0], found[1]

    def _range_of(self, stat: Histogram) -> Range:
        min_vals, max_vals = self._solve(stat)
        # Qparams that saw no finite value: the empty range (base -> (0, 0)).
        empty = stat.min_vals > stat.max_vals
        min_vals = torch.where(empty, stat.min_vals, min_vals.float())
        max_vals = torch.where(empty, stat.max_vals, max_vals.float())
        return min_vals, max_vals

    def _several(self, hist: Histogram) -> bool:
        """Whether the histogram has more than one qparam (the `"auto"`
        settings' per-channel / per-group side)."""
        return math.prod(hist.qparam_shape) > 1


def _within(hist: Histogram, amax: torch.Tensor) -> Range:
    """`[-amax, amax]` cut to the observed range."""
    amax = amax.float()
    return torch.maximum(-amax, hist.min_vals), torch.minimum(amax, hist.max_vals)


@Observer.register("histogram")
class HistogramL2Observer(HistogramStatObserver):
    """Least L2 error over the histogram (torch.ao's objective, global search)."""

    Options = HistogramL2Options
    options: HistogramL2Options

    def _host_search(self, hist: Histogram) -> bool:
        # torch.ao's walk and the certified search decide on the host; the
        # batched search and the float formats' MSE search do not
        if self.options.mode == "torch":
            return True
        if self.args.format.is_float:
            return False
        search = self.options.search
        return not self._several(hist) if search == "auto" else search == "certified"

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
        search = self.options.search
        if search == "auto":
            search = "batched" if self._several(hist) else "certified"
        solver = l2_search_batched if search == "batched" else l2_search
        if self.args.symmetric:
            return solver(hist.counts, lo, width, levels, symmetric=(fmt.min, fmt.max))
        low, high = solver(hist.counts, lo, width, levels)
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

    def _host_search(self, hist: Histogram) -> bool:
        # the exhaustive search groups qparams by their data on the host
        search = self.options.search
        return not self._several(hist) if search == "auto" else search == "exhaustive"

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

    def _level_choices(self) -> tuple[int, int]:
        """The two values `_levels` chooses between per qparam (asymmetric)."""
        fmt = self.args.format
        every = int(fmt.max - fmt.min) + 1
        return every, every // 2

    def _solve(self, hist: Histogram) -> Range:
        _, width = hist.edges()
        levels = self._levels(hist)
        amax = torch.maximum(-hist.min_vals, hist.max_vals)
        several = self._several(hist)
        start_bin = self.options.start_bin
        if start_bin is None:
            start_bin = max(1, hist.bins // 16) if several else 128
        search = self.options.search
        if search == "auto":
            search = "coarse_to_fine" if several else "exhaustive"
        threshold = entropy_search(
            hist.counts,
            width,
            levels,
            start_bin=start_bin,
            stride=self.options.stride,
            amax=amax,
            search=search,
            level_choices=self._level_choices() if torch.is_tensor(levels) else None,
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
        objective = self.options.objective
        if objective == "auto":
            several = self._several(hist)
            objective = (
                "uniform_bins"
                if several and uniform_applies(self.args, self.options.norm)
                else "bin_centers"
            )
        search = (
            functools.partial(histogram_mse_uniform, widths_positive=True)
            if objective == "uniform_bins"
            else histogram_mse_search
        )
        min_vals, max_vals = search(
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
