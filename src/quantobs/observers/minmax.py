"""Min-max observers: the range is the observed minimum and maximum.

Registered with llm-compressor's names and defaults:

=====================  ===========================================  ===========
name                   statistic                                    merge
=====================  ===========================================  ===========
``memoryless_minmax``  min/max of the latest batch                  latest wins
``static_minmax``      min/max over every batch                     exact
``minmax``             moving average of per-batch min/max (0.01)   approximate
=====================  ===========================================  ===========
"""

from __future__ import annotations

import torch
from pydantic import Field

from quantobs.observers.base import Observer, ObserverOptions
from quantobs.stats.reduce import Range, lerp_ranges, merge_minmax

__all__ = [
    "MemorylessMinMaxObserver",
    "MinMaxObserver",
    "MovingAverageOptions",
    "StaticMinMaxObserver",
]


class MovingAverageOptions(ObserverOptions):
    """Options of moving-average observers.

    Attributes:
        averaging_constant: weight of the newest batch, in (0, 1]; 1 keeps
            only the latest batch. llm-compressor's default 0.01 makes the
            first batch dominate.
    """

    averaging_constant: float = Field(0.01, gt=0.0, le=1.0)


@Observer.register("memoryless_minmax")
class MemorylessMinMaxObserver(Observer):
    """Min/max of the latest batch only (weights, dynamic activations)."""

    needs_values = False

    def _update_stats(self, x_flat: torch.Tensor | None, batch_range: Range) -> None:
        self._stats = {"min_vals": batch_range[0], "max_vals": batch_range[1]}

    def _merge_stats(self, other: Observer) -> None:
        # Nothing accumulates: the merged observer holds the later statistics.
        self._stats = {k: v.clone() for k, v in other._stats.items()}


@Observer.register("static_minmax")
class StaticMinMaxObserver(Observer):
    """Min/max over every batch; merges exactly across batches and processes."""

    needs_values = False

    def _update_stats(self, x_flat: torch.Tensor | None, batch_range: Range) -> None:
        if self._stats:
            batch_range = merge_minmax(self._range(), batch_range)
        self._stats = {"min_vals": batch_range[0], "max_vals": batch_range[1]}

    def _merge_stats(self, other: Observer) -> None:
        min_vals, max_vals = merge_minmax(self._range(), other._range())
        self._stats = {"min_vals": min_vals, "max_vals": max_vals}


@Observer.register("minmax")
class MinMaxObserver(Observer):
    """Moving average of per-batch min/max: `avg += c * (batch - avg)`."""

    needs_values = False

    Options = MovingAverageOptions
    options: MovingAverageOptions

    def _update_stats(self, x_flat: torch.Tensor | None, batch_range: Range) -> None:
        if self._stats:
            c = self.options.averaging_constant
            batch_range = lerp_ranges(self._range(), batch_range, c)
        self._stats = {"min_vals": batch_range[0], "max_vals": batch_range[1]}

    def _merge_stats(self, other: Observer) -> None:
        # Approximate: count-weighted mean of the two moving averages.
        self._merge_moving_average(other)
