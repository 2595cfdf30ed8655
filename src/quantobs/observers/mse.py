"""MSE observers: the range minimizing `sum |fake_quant(x) - x| ** norm`.

=================  ==============================================  ===========
name               statistic                                       merge
=================  ==============================================  ===========
``memoryless_mse`` MSE range of the latest batch                   latest wins
``mse``            moving average of per-batch MSE ranges (0.01)   approximate
``static_mse``     error of every candidate summed over batches    exact
=================  ==============================================  ===========

`static_mse` goes beyond llm-compressor: it keeps, per qparam and per
candidate range, the error summed over every batch, so its range minimizes the
error over all the calibration data. Candidates are shrink factors of a
*reference* range: the first batch's min/max (times `expand`), or one set with
`set_reference` (e.g. a min-max pass all-reduced across processes). Observers
with the same reference merge exactly (sums of errors); data beyond the
reference range is scored as clipped.
"""

from __future__ import annotations

import torch
from pydantic import Field

from quantobs.core.qparams import generate_gparam
from quantobs.observers.base import Observer, ObserverOptions
from quantobs.solvers.mse import (
    DEFAULT_CHUNK_ELEMS,
    candidate_errors,
    mse_search,
    search_args,
    shrink_factors,
)
from quantobs.stats.reduce import Range, lerp_ranges, range_or_zero

__all__ = [
    "MSEOptions",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "MovingAverageMSEOptions",
    "StaticMSEObserver",
    "StaticMSEOptions",
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
    """

    patience: int | None = Field(5, ge=0)
    triton_error_buffer: float | None = Field(None, ge=0.0)


class MovingAverageMSEOptions(MSEOptions):
    """`MSEOptions` plus the moving-average weight of the newest batch."""

    averaging_constant: float = Field(0.01, gt=0.0, le=1.0)


class StaticMSEOptions(_SearchOptions):
    """Search options of `static_mse` (every candidate is scored: no patience)."""


def _values(x_flat: torch.Tensor | None) -> torch.Tensor:
    if x_flat is None:  # pragma: no cover - needs_values guarantees values
        raise RuntimeError("MSE observers score values; none were given")
    return x_flat


def _search(
    observer: Observer,
    options: MSEOptions,
    x_flat: torch.Tensor | None,
    batch_range: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    return mse_search(
        _values(x_flat),
        observer.args,
        maxshrink=options.maxshrink,
        grid=options.grid,
        norm=options.norm,
        patience=options.patience,
        expand=options.expand,
        chunk_elems=options.chunk_elems,
        batch_range=range_or_zero(*batch_range),
        round_scales=options.round_scales,
    )


@Observer.register("memoryless_mse")
class MemorylessMSEObserver(Observer):
    """MSE range of the latest batch only."""

    Options = MSEOptions
    options: MSEOptions

    def _update_stats(self, x_flat: torch.Tensor | None, batch_range: Range) -> None:
        min_vals, max_vals = _search(self, self.options, x_flat, batch_range)
        self._stats = {"min_vals": min_vals, "max_vals": max_vals}
        if self.options.round_scales:
            # The search assumed the global scale of the observed range.
            expand = self.options.expand
            self._stats["observed_min"] = batch_range[0] * expand
            self._stats["observed_max"] = batch_range[1] * expand

    def _global_range(self) -> Range:
        if "observed_min" in self._stats:
            return self._stats["observed_min"], self._stats["observed_max"]
        return self._range()

    def _merge_stats(self, other: Observer) -> None:
        self._stats = {k: v.clone() for k, v in other._stats.items()}


@Observer.register("mse")
class MovingAverageMSEObserver(Observer):
    """Moving average of per-batch MSE ranges (llm-compressor's `mse`)."""

    Options = MovingAverageMSEOptions
    options: MovingAverageMSEOptions

    def _update_stats(self, x_flat: torch.Tensor | None, batch_range: Range) -> None:
        searched = _search(self, self.options, x_flat, batch_range)
        if self._stats:
            searched = lerp_ranges(
                self._range(), searched, self.options.averaging_constant
            )
        self._stats = {"min_vals": searched[0], "max_vals": searched[1]}

    def _merge_stats(self, other: Observer) -> None:
        self._merge_moving_average(other)


@Observer.register("static_mse")
class StaticMSEObserver(Observer):
    """Range minimizing the error summed over every batch (exact merge)."""

    Options = StaticMSEOptions
    options: StaticMSEOptions

    def factors(self) -> torch.Tensor:
        """`(C,)` shrink factors of the candidate ranges."""
        return shrink_factors(self.options.maxshrink, self.options.grid)

    @torch.no_grad()
    def set_reference(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        """Fix the reference range the candidates shrink (before observing).

        Raises:
            RuntimeError: errors were already accumulated.
        """
        if self._stats:
            raise RuntimeError(
                "set_reference() must come before the first observation; call "
                "reset() first"
            )
        min_vals, max_vals = min_vals.float(), max_vals.float()
        if not (torch.isfinite(min_vals).all() and torch.isfinite(max_vals).all()):
            raise ValueError("set_reference() needs finite min_vals and max_vals")
        if min_vals.shape != max_vals.shape or (min_vals > max_vals).any():
            raise ValueError(
                "set_reference() needs min_vals <= max_vals of the same shape"
            )
        num_c = self.factors().numel()
        errors = torch.zeros(
            num_c, *min_vals.shape, dtype=torch.float64, device=min_vals.device
        )
        self._stats = {
            "ref_min": min_vals * self.options.expand,
            "ref_max": max_vals * self.options.expand,
            "errors": errors,
        }
        if self.options.round_scales and self.args.strategy == "tensor_group":
            self._stats["global_scale"] = generate_gparam(
                self._stats["ref_min"].min(), self._stats["ref_max"].max()
            )

    def _update_stats(self, x_flat: torch.Tensor | None, batch_range: Range) -> None:
        if not self._stats:
            self.set_reference(*range_or_zero(*batch_range))
        stats = self._stats
        values = _values(x_flat)
        stats["errors"] += candidate_errors(
            values,
            search_args(self.args, self.options.round_scales),
            stats["ref_min"],
            stats["ref_max"],
            self.factors().to(values.device),
            self.options.norm,
            self.options.chunk_elems,
            stats.get("global_scale"),
        )

    def _merge_stats(self, other: Observer) -> None:
        mine, theirs = self._stats, other._stats
        if not (
            torch.equal(mine["ref_min"], theirs["ref_min"])
            and torch.equal(mine["ref_max"], theirs["ref_max"])
        ):
            raise ValueError(
                "static_mse observers with different reference ranges cannot "
                "merge; give both the same set_reference(min_vals, max_vals) "
                "before observing"
            )
        mine["errors"] = mine["errors"] + theirs["errors"]

    def _global_range(self) -> Range:
        if self.options.round_scales:  # the search used the reference's scale
            return self._stats["ref_min"], self._stats["ref_max"]
        return self._range()

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        stats = self._stats
        best = self.factors().to(stats["errors"].device)[stats["errors"].argmin(dim=0)]
        return stats["ref_min"] * best, stats["ref_max"] * best
