"""`MinMaxObserver` ("minmax"): a running min/max range per `tensor_id`.

=====================  =====================  =========================
averaging_constant     statistic              range after each batch
=====================  =====================  =========================
1.0                    `LatestRange`          the batch's
None                   `MinMax`               min / max over every batch
c in (0, 1)            `MovingAverage` step   `running + c * (batch - running)`
=====================  =====================  =========================
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated

from pydantic import Field

from quantobs.faces.llmcompressor_legacy.base import Observer, ObserverOptions
from quantobs.faces.llmcompressor_legacy.ranges import RangeObserver, TensorRange
from quantobs.stats.minmax import LatestRange, MinMax, MovingAverage

__all__ = ["AveragingConstant", "MinMaxObserver", "MinMaxOptions"]

AveragingConstant = Annotated[float, Field(gt=0.0, le=1.0)]


class MinMaxOptions(ObserverOptions):
    """Options of `MinMaxObserver`.

    Attributes:
        averaging_constant: weight of the newest batch in `(0, 1]`: the range
            is `running + c * (batch - running)`. 1.0 keeps the latest batch
            only; None keeps the running min and max over every batch (the
            static behaviour of llm-compressor 0.6's `averaging_constant=None`).
    """

    averaging_constant: AveragingConstant | None = 0.01


@Observer.register("minmax")
class MinMaxObserver(RangeObserver):
    """Moving average (default 0.01) of each batch's min and max."""

    Options = MinMaxOptions
    options: MinMaxOptions

    def _new_range(self, tensor_id: Hashable) -> TensorRange:
        constant = self.options.averaging_constant
        if constant == 1.0:  # the latest batch: no running range to keep
            return TensorRange(LatestRange, {}, self.name, tensor_id)
        if constant is None:
            return TensorRange(MinMax, {}, self.name, tensor_id)
        config = {"constant": constant, "form": "step"}
        return TensorRange(MovingAverage, config, self.name, tensor_id)
