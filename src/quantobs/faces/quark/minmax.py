"""Min-max observers: per tensor, per channel, per group; and the placeholder.

Each is a `MinMax` statistic of the engine over a view of the input (per
tensor the whole tensor, one `aminmax` pass; per channel `channel_view`; per
group `group_view`: no permute copy along the last axis). Static observers
(`is_dynamic` false) keep the running range; dynamic ones the last batch's.
As in Quark, `PerGroupMinMaxObserver` always keeps the last batch's (Quark
calibrates per-group weights, observed once).
"""

from __future__ import annotations

from typing import Any

import torch

from quantobs.core.layout import group_view
from quantobs.faces.quark.base import (
    ObserverBase,
    UniformScalingObserver,
    per_channel_view,
)
from quantobs.faces.quark.spec import Dtype, QSchemeType, QTensorConfig
from quantobs.stats.reduce import NanPolicy

__all__ = [
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerTensorMinMaxObserver",
    "PlaceholderObserver",
]


class PlaceholderObserver(ObserverBase):
    """No statistics: float16 / bfloat16 "quantization" is a cast.

    Raises:
        ValueError: a dtype other than float16 / bfloat16.
    """

    qschemes = tuple(QSchemeType)

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """Only float16 and bfloat16 specs."""
        if spec.dtype not in (Dtype.float16, Dtype.bfloat16):
            raise ValueError(
                f"PlaceholderObserver is for float16 / bfloat16 casts, got dtype="
                f"{spec.dtype.value!r}; use a min-max observer, PerBlockMXObserver "
                "(mx) or PerBlockBFPObserver (bfp16)"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x` unchanged."""
        return x

    def _calculate_qparams(self) -> None:
        return None

    def reset_state(self) -> None:
        """Nothing to forget."""

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}"


class PerTensorMinMaxObserver(UniformScalingObserver):
    """Running (static) or last-batch (dynamic) min and max of the whole tensor.

    Args:
        qspec: the spec (`qscheme="per_tensor"`).
        device: device of the buffers.
    """

    qschemes = (QSchemeType.per_tensor,)

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        *,
        nan_policy: NanPolicy = "raise",
    ) -> None:
        super().__init__(qspec, device, nan_policy=nan_policy)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record the range of `x_orig` (any shape); return it unchanged."""
        if x_orig.numel():
            x = x_orig.detach()
            self._observe_view(x.reshape(1, -1), x)  # 0-d ranges: one aminmax pass
        return x_orig


class PerChannelMinMaxObserver(UniformScalingObserver):
    """Min and max per channel along `qspec.ch_axis`: ranges of shape `(C,)`.

    Args:
        qspec: the spec (`qscheme="per_channel"`, `ch_axis`).
        device: device of the buffers.
        eps: smallest scale.

    Raises:
        ValueError: (forward) a static observer sees a different channel
            count (Quark silently restarts from the new batch).
    """

    qschemes = (QSchemeType.per_channel,)

    def _init_attributes(self) -> None:
        super()._init_attributes()
        self.ch_axis = self.qspec.ch_axis

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record per-channel ranges of `x_orig`; return it unchanged."""
        if x_orig.numel():
            x = x_orig.detach()
            self._observe_view(per_channel_view(x, self._channel_axis(x)), x)
        return x_orig

    def _shape_error(
        self, before: tuple[int, ...], after: tuple[int, ...]
    ) -> Exception:
        return ValueError(
            f"{type(self).__name__}: {after[0]} channels along "
            f"ch_axis={self.ch_axis}, but earlier batches had {before[0]}; use "
            "one observer per tensor, or reset_min_max_vals() first"
        )


class PerGroupMinMaxObserver(UniformScalingObserver):
    """Min and max per group of `group_size` elements along `ch_axis`.

    Scales have shape `(rows, A // group_size)` (`A` the axis length; rows:
    every other index, with `ch_axis` swapped with the last dim). Each batch
    replaces the ranges (Quark's rule). `group_size=-1`: one group per row.

    Args:
        qspec: the spec (`qscheme="per_group"`, `ch_axis`, `group_size`).
        device: device of the buffers.
        eps: smallest scale.

    Raises:
        ValueError: (forward) `group_size` does not divide the axis.
    """

    qschemes = (QSchemeType.per_group,)

    def _init_attributes(self) -> None:
        super()._init_attributes()
        self.ch_axis = int(self.qspec.ch_axis or 0)
        self.group_size = int(self.qspec.group_size or -1)

    @property
    def group_count(self) -> int:
        """Groups per row of the recorded ranges (1 before any data)."""
        return int(self.min_val.shape[-1]) if self.min_val.dim() == 2 else 1

    def _keeps_latest(self) -> bool:
        return True

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record per-group ranges of `x_orig`; return it unchanged."""
        if x_orig.numel():
            x = x_orig.detach()
            self._observe_view(group_view(x, self.ch_axis, self.group_size), x)
        return x_orig

    def calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point per group, each `(rows, group_count)`."""
        scale, zero_point = super().calculate_qparams(min_val, max_val)
        groups = self.group_count
        return scale.reshape(-1, groups), zero_point.reshape(-1, groups)
