"""Min-max observers: per tensor, per channel, per group; and the placeholder.

Ranges are one reduction over a view of the input (`quantobs.faces.quark.blocks`):
per tensor one `aminmax` pass; per channel and per group `amin` + `amax` over
a `(pre, C, post)` or block view, no permute copy. Static observers
(`is_dynamic` false) keep the running range; dynamic ones keep the last
batch's. As in Quark, `PerGroupMinMaxObserver` always keeps the last batch's
(Quark calibrates per-group weights, observed once).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantobs.faces.quark.base import (
    FLOAT32_EPS,
    ObserverBase,
    UniformScalingObserver,
    check_finite,
    stat_dtype,
)
from quantobs.faces.quark.blocks import block_minmax, channel_minmax
from quantobs.faces.quark.spec import Dtype, QSchemeType, QTensorConfig

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

    def __init__(self, qspec: Any, device: torch.device | None = None) -> None:
        super().__init__(qspec, device)

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

    def __init__(self, qspec: Any, device: torch.device | None = None) -> None:
        super().__init__(qspec, device)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record the range of `x_orig` (any shape); return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        min_val, max_val = torch.aminmax(x)  # one pass, in x's dtype
        check_finite(type(self).__name__, min_val, max_val)
        dtype = stat_dtype(x.dtype)
        min_val, max_val = min_val.to(dtype), max_val.to(dtype)
        if not self.is_dynamic:
            min_val = torch.minimum(min_val, self.min_val.to(dtype))
            max_val = torch.maximum(max_val, self.max_val.to(dtype))
        self._store_range(min_val, max_val, x)
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

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        eps: float = FLOAT32_EPS,
    ) -> None:
        super().__init__(qspec, device, eps)
        self.ch_axis = self.qspec.ch_axis

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record per-channel ranges of `x_orig`; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        if self.ch_axis is None:
            raise ValueError("PerChannelMinMaxObserver needs qspec.ch_axis (e.g. 0)")
        x = x_orig.detach()
        min_val, max_val = channel_minmax(x, self.ch_axis)  # (C,)
        check_finite(type(self).__name__, min_val, max_val)
        dtype = stat_dtype(x.dtype)
        min_val, max_val = min_val.to(dtype), max_val.to(dtype)
        if not self.is_dynamic and self._has_range():
            if self.min_val.shape != min_val.shape:
                raise ValueError(
                    f"{type(self).__name__}: {min_val.numel()} channels along "
                    f"ch_axis={self.ch_axis}, but earlier batches had "
                    f"{self.min_val.numel()}; use one observer per tensor, or "
                    "reset_min_max_vals() first"
                )
            min_val = torch.minimum(min_val, self.min_val.to(dtype))
            max_val = torch.maximum(max_val, self.max_val.to(dtype))
        self._store_range(min_val, max_val, x)
        return x_orig

    def _has_range(self) -> bool:
        return not (self.min_val.dim() == 0 and bool(self.min_val == math.inf))


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

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        eps: float = FLOAT32_EPS,
    ) -> None:
        super().__init__(qspec, device, eps)
        self.ch_axis = int(self.qspec.ch_axis or 0)
        self.group_size = int(self.qspec.group_size or -1)
        self.group_count = 1

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record per-group ranges of `x_orig`; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        min_val, max_val = block_minmax(x, self.ch_axis, self.group_size, pad=False)
        check_finite(type(self).__name__, min_val, max_val)
        self.group_count = int(min_val.shape[1])
        self._store_range(min_val.reshape(-1), max_val.reshape(-1), x)
        return x_orig

    def calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point per group, each `(rows, group_count)`."""
        scale, zero_point = super().calculate_qparams(min_val, max_val)
        return (
            scale.reshape(-1, self.group_count),
            zero_point.reshape(-1, self.group_count),
        )

    def get_extra_state(self) -> dict[str, Any]:
        """Base state plus `group_count`."""
        return {**super().get_extra_state(), "group_count": self.group_count}

    def set_extra_state(self, state: Any) -> None:
        """Inverse of `get_extra_state`."""
        super().set_extra_state(state)
        if isinstance(state, dict):
            self.group_count = int(state.get("group_count", 1))
