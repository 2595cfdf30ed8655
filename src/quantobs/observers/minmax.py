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

from typing import Any

import torch
from pydantic import Field

from quantobs.observers.base import Observer, ObserverOptions
from quantobs.stats.base import Statistic
from quantobs.stats.minmax import LatestRange, MinMax, MovingAverage

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

    statistic_cls = LatestRange

    def statistic_config(self) -> dict[str, Any]:
        return {"track_absmax": self._tracks_global()}

    def _starting_statistic(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> Statistic:
        # no (+inf, -inf) tensors per qparam written for the first batch
        return LatestRange.starting(qparam_shape, device, **self.statistic_config())


@Observer.register("static_minmax")
class StaticMinMaxObserver(Observer):
    """Min/max over every batch; merges exactly across batches and processes."""

    statistic_cls = MinMax

    def statistic_config(self) -> dict[str, Any]:
        return {"track_absmax": self._tracks_global()}

    def _starting_statistic(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> Statistic:
        # no (+inf, -inf) tensors per qparam written for the first batch
        return MinMax.starting(qparam_shape, device, **self.statistic_config())


@Observer.register("minmax")
class MinMaxObserver(Observer):
    """Moving average of per-batch min/max: `avg += c * (batch - avg)`."""

    statistic_cls = MovingAverage
    Options = MovingAverageOptions
    options: MovingAverageOptions

    def statistic_config(self) -> dict[str, Any]:
        return {
            "constant": self.options.averaging_constant,
            "form": "blend",
            "rounding": self.rounding_dtype(),
        }
