"""MSE observers: the range minimizing `sum |fake_quant(x) - x| ** norm`.

=================  ==============================================  ===========
name               statistic                                       merge
=================  ==============================================  ===========
``memoryless_mse`` MSE range of the latest batch                   latest wins
``mse``            moving average of per-batch MSE ranges (0.01)   approximate
``static_mse``     error of every candidate summed over batches    exact
=================  ==============================================  ===========

`memoryless_mse` and `mse` search llm-compressor's 20-point shrink grid by
default (its ranges bit for bit on float32 inputs) and, as opt-in options,
further: `search="fine"` (a 10x denser grid) or `"refine"` (the grid, then
local refinement around each qparam's best factor; `solvers.mse_refine`),
`independent_bounds=True` (asymmetric args: the min and max factors searched
apart), and `scale_search="discrete"` (NVFP4 and MX: every e4m3 group scale
or e8m0 exponent the checkpoint can store near the grid's, scored as stored;
`solvers.mse_discrete`). Each scores at least as well as the default grid in
the error it minimizes, on the same batch.

`static_mse` goes beyond llm-compressor: it keeps, per qparam and per
candidate range, the error summed over every batch, so its range minimizes the
error over all the calibration data. Candidates are shrink factors of a
*reference* range: the first batch's min/max (times `expand`), or one set with
`set_reference` (e.g. a min-max pass all-reduced across processes). Observers
with the same reference merge exactly (sums of errors); data beyond the
reference range is scored as clipped.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from pydantic import Field, model_validator

from quantobs.core.args import QuantizationArgs
from quantobs.core.scoring import DEFAULT_CHUNK_ELEMS
from quantobs.observers.base import Arithmetic, Observer, ObserverOptions
from quantobs.observers.needs import Need
from quantobs.observers.observed_search import OBSERVED_DTYPES, observed_grid_search
from quantobs.solvers.mse import mse_search
from quantobs.solvers.mse_discrete import (
    ScaleSearch,
    check_discrete_args,
    discrete_scale_search,
)
from quantobs.solvers.mse_refine import (
    Search,
    check_independent_bounds,
    refined_mse_search,
)
from quantobs.stats.base import Batch, Statistic
from quantobs.stats.candidate_errors import CandidateErrors
from quantobs.stats.minmax import LatestRange, MovingAverage
from quantobs.stats.reduce import Range, absmax_or_zero, range_or_zero

__all__ = [
    "MSEOptions",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "MovingAverageMSEOptions",
    "StaticMSEObserver",
    "StaticMSEOptions",
    "check_search_options",
]


class _SearchOptions(ObserverOptions):
    maxshrink: float = Field(0.2, gt=0.0, le=1.0)
    grid: float = Field(100.0, gt=0.0)
    norm: float = Field(2.4, gt=0.0)
    expand: float = Field(1.0, ge=1.0)
    chunk_elems: int = Field(DEFAULT_CHUNK_ELEMS, ge=1024)
    round_scales: bool = False


class MSEOptions(_SearchOptions):
    """Options of the MSE search (llm-compressor's names and defaults).

    Attributes:
        maxshrink: largest fraction the range shrinks by, in (0, 1].
        grid: candidates per unit of shrink (`int(maxshrink * grid)` in all).
        norm: exponent of the absolute error (2.4).
        patience: stop after this many candidates that improve no qparam
            (`None`: score every candidate).
        expand: start the search at `expand` times the observed range (>= 1).
        triton_error_buffer: accepted for llm-compressor configs; it tunes
            their CUDA kernel and has no effect here.
        chunk_elems: elements per temporary tensor (bounds memory).
        round_scales: NVFP4 only: score candidates with the FP8-rounded group
            scales and the global scale they will be stored with
            (llm-compressor scores unrounded scales and no global scale).
        search: the candidates of the shared shrink factor: `"grid"`
            (llm-compressor's, the default), `"fine"` (every factor of the
            grid's interval at a tenth of its step, about 10x the cost) or
            `"refine"` (the grid, then 3 rounds of local refinement around
            each qparam's best factor down to steps of 1/6400; 1-3x).
            Both start from the grid's range and keep it unless a candidate
            scores strictly better.
        independent_bounds: asymmetric args only: after `search`, search
            the min and max factors apart (2 rounds of min-then-max, each
            over `search`'s factors); a side with no data beyond 0 keeps
            its factor.
        scale_search: `"continuous"` (shrink factors, the default) or
            `"discrete"` (NVFP4 / MX only: the stored scales themselves,
            e4m3 group scales under the observed range's global scale, or
            e8m0 powers of two, from one below the grid's smallest to one
            above its largest, scored as the checkpoint applies them; the
            resulting qparams are exactly the chosen stored scales, unless a
            module's own global scale overrides the observer's). Excludes
            `search` and `independent_bounds`.
        search_arithmetic: how bfloat16 / float16 values are searched:
            `"float32"` (default) scores the candidates on their float32
            copy (the design's rule: statistics in float32; the native and
            Triton kernels; the same choice on every device); `"observed"`,
            with `arithmetic="observed"`, searches as llm-compressor 0.14's
            eager search does, in the observed dtype (candidates,
            fake-quantized values and error sums rounded in it:
            `observed_search`, torch ops only), for its choice bit for bit
            on the CPU (docs/dtypes.md: the measured effect).
    """

    patience: int | None = Field(5, ge=0)
    triton_error_buffer: float | None = Field(None, ge=0.0)
    search_arithmetic: Arithmetic = "float32"
    search: Search = "grid"
    independent_bounds: bool = False
    scale_search: ScaleSearch = "continuous"

    @model_validator(mode="after")
    def _one_kind_of_search(self) -> MSEOptions:
        if self.scale_search == "discrete" and (
            self.search != "grid" or self.independent_bounds
        ):
            raise ValueError(
                "scale_search='discrete' scores every stored scale near the "
                "grid's; it takes no search= or independent_bounds= (drop them, "
                "or use scale_search='continuous')"
            )
        return self


class MovingAverageMSEOptions(MSEOptions):
    """`MSEOptions` plus the moving-average weight of the newest batch."""

    averaging_constant: float = Field(0.01, gt=0.0, le=1.0)


class StaticMSEOptions(_SearchOptions):
    """Search options of `static_mse` (every candidate is scored: no patience)."""


def check_search_options(options: MSEOptions, args: QuantizationArgs) -> None:
    """Raise `ValueError` where a search option does not apply to the args."""
    if options.independent_bounds:
        check_independent_bounds(args)
    if options.scale_search == "discrete":
        check_discrete_args(args)


class _SearchingObserver(Observer):
    """A per-batch MSE search feeds the statistic its range."""

    options: MSEOptions
    needs_values = True

    def __init__(
        self,
        base_name: str,
        args: QuantizationArgs,
        module: torch.nn.Module | None = None,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__(base_name, args, module, **observer_kwargs)
        check_search_options(self.options, self.args)

    def _peer_search(self, x_flat: torch.Tensor) -> bool:
        """Whether the batch is searched in its own bfloat16 / float16
        arithmetic, as llm-compressor searches it (`arithmetic="observed"`,
        `search_arithmetic="observed"` and llm-compressor's own search: the
        grid, unrounded scales)."""
        opts = self.options
        return (
            opts.arithmetic == "observed"
            and opts.search_arithmetic == "observed"
            and x_flat.dtype in OBSERVED_DTYPES
            and opts.scale_search == "continuous"
            and opts.search == "grid"
            and not opts.independent_bounds
            and not opts.round_scales
        )

    def _search(self, x_flat: torch.Tensor, observed: Range) -> Range:
        """The batch's range under the options' search."""
        opts = self.options
        if self._peer_search(x_flat):
            return observed_grid_search(
                x_flat, self.args, maxshrink=opts.maxshrink, grid=opts.grid,
                norm=opts.norm, patience=opts.patience, expand=opts.expand,
            )  # fmt: skip
        common: dict[str, Any] = {
            "maxshrink": opts.maxshrink,
            "norm": opts.norm,
            "expand": opts.expand,
            "chunk_elems": opts.chunk_elems,
            "batch_range": observed,
        }
        if opts.scale_search == "discrete":
            return discrete_scale_search(x_flat, self.args, **common)
        common.update(
            grid=opts.grid, patience=opts.patience, round_scales=opts.round_scales
        )
        if opts.search != "grid" or opts.independent_bounds:
            return refined_mse_search(
                x_flat,
                self.args,
                search=opts.search,
                independent_bounds=opts.independent_bounds,
                **common,
            )
        return mse_search(x_flat, self.args, **common)

    def _prepare_batch(self, batch: Batch) -> Batch:
        if batch.x_flat is None:  # pragma: no cover - needs_values
            raise RuntimeError("MSE observers score values; none were given")
        opts = self.options
        observed = range_or_zero(batch.min_vals, batch.max_vals)
        low, high = self._search(batch.x_flat, observed)
        absmax: torch.Tensor | None = None
        fixed_global = opts.round_scales or opts.scale_search == "discrete"
        if fixed_global and self._tracks_global():
            # The search used the global scale of the observed range.
            found = absmax_or_zero(observed[0] * opts.expand, observed[1] * opts.expand)
            absmax = found.clamp(max=torch.finfo(torch.float32).max)  # saturate
        return replace(batch, min_vals=low, max_vals=high, absmax=absmax)


@Observer.register("memoryless_mse")
class MemorylessMSEObserver(_SearchingObserver):
    """MSE range of the latest batch only."""

    statistic_cls = LatestRange
    Options = MSEOptions

    def statistic_config(self) -> dict[str, Any]:
        return {"track_absmax": self._tracks_global()}


@Observer.register("mse")
class MovingAverageMSEObserver(_SearchingObserver):
    """Moving average of per-batch MSE ranges (llm-compressor's `mse`)."""

    statistic_cls = MovingAverage
    Options = MovingAverageMSEOptions
    options: MovingAverageMSEOptions

    def statistic_config(self) -> dict[str, Any]:
        return {
            "constant": self.options.averaging_constant,
            "form": "blend",
            "rounding": self.rounding_dtype(),
        }


@Observer.register("static_mse")
class StaticMSEObserver(Observer):
    """Range minimizing the error summed over every batch (exact merge)."""

    statistic_cls = CandidateErrors
    Options = StaticMSEOptions
    options: StaticMSEOptions
    needs = frozenset({Need.SHARED_REFERENCE})

    def has_reference(self) -> bool:
        """Whether the reference range the candidates shrink is fixed."""
        stat = self.statistic()
        return isinstance(stat, CandidateErrors) and stat.has_reference

    def statistic_config(self) -> dict[str, Any]:
        opts = self.options
        return {
            "args": self.args,
            "maxshrink": opts.maxshrink,
            "grid": opts.grid,
            "norm": opts.norm,
            "expand": opts.expand,
            "chunk_elems": opts.chunk_elems,
            "round_scales": opts.round_scales,
        }

    def factors(self) -> torch.Tensor:
        """`(C,)` shrink factors of the candidate ranges."""
        return self._empty().factors()

    def _empty(self) -> CandidateErrors:
        return CandidateErrors.empty((), torch.device("cpu"), **self.statistic_config())

    @torch.no_grad()
    def set_reference(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        """Fix the reference range the candidates shrink (before observing).

        Raises:
            RuntimeError: errors were already accumulated.
            ValueError: non-finite values, or `min_vals > max_vals`.
        """
        if self.has_statistics:
            raise RuntimeError(
                "set_reference() must come before the first observation; call "
                "reset() first"
            )
        self._store(self._empty().with_reference(min_vals, max_vals))

    def _range(self, stat: Statistic) -> Range:
        assert isinstance(stat, CandidateErrors)
        return stat.best_range()

    def _global_amax(self, stat: Statistic) -> torch.Tensor:
        assert isinstance(stat, CandidateErrors)
        if self.options.round_scales:  # the search used the reference's scale
            return absmax_or_zero(stat.ref_min, stat.ref_max)
        return absmax_or_zero(*stat.best_range())
