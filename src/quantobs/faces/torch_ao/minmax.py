"""torch.ao's min-max observers: running and moving-average, per tensor and
per channel, with torch's buffers and numbers.

Each keeps an engine statistic in torch's buffers `min_val` / `max_val`::

    observer                                statistic            buffers
    MinMaxObserver                          MinMax               ()
    MovingAverageMinMaxObserver             TorchMovingAverage   ()
    PerChannelMinMaxObserver                MinMax               (C,)
    MovingAveragePerChannelMinMaxObserver   TorchMovingAverage   (C,)

(`TorchMovingAverage`: `MovingAverage(form="step")` whose steps do not
overflow, `quantobs.faces.torch_ao.overflow`.)

A batch is viewed in the canonical layout, `(1, numel)` per tensor
(`tensor_view`) or `(N, C, G)` along `ch_axis` (`quantobs.core.layout.
channel_view`: no permute + copy as torch does), and reduced by the engine
(`quantobs.stats.reduce`: one `aminmax` pass per tensor; per channel the
native kernel or cache-blocked torch reductions), in the input's dtype
(torch first copies it to the buffers' dtype; min and max commute with that
monotone cast, and the range is cast after). Min and max are exact, so the
numbers equal torch's. The moving average is torch's step form,
`min_val + c * (batch_min - min_val)`, its first batch taken as it is.
"""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar

import torch

from quantobs.core.layout import channel_view
from quantobs.core.qparams.torch_rule import PER_CHANNEL_QSCHEMES, PER_TENSOR_QSCHEMES
from quantobs.faces.torch_ao.base import (
    FLOAT32_EPS,
    UniformQuantizationObserverBase,
    reject_dynamic,
    require_qscheme,
    tensor_view,
)
from quantobs.faces.torch_ao.errors import ObserverShapeError
from quantobs.faces.torch_ao.overflow import TorchMovingAverage, cast_range
from quantobs.stats.base import Batch, Statistic
from quantobs.stats.minmax import MinMax, MovingAverage

__all__ = [
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PerChannelMinMaxObserver",
]


class _RangeObserver(UniformQuantizationObserverBase):
    """What the four min-max observers share: the range buffers, the batch
    as the engine observes it, the statistic's settings and the qparams."""

    statistic_cls: ClassVar[type[Statistic] | None] = MinMax

    min_val: torch.Tensor
    max_val: torch.Tensor
    averaging_constant: float

    def _register_range(
        self, factory_kwargs: dict[str, Any] | None, *, per_channel: bool
    ) -> None:
        """torch's range buffers before any data: `(+inf, -inf)` 0-dim per
        tensor, empty `(0,)` per channel, in the factory device / dtype."""
        factory_kwargs = torch.nn.factory_kwargs(factory_kwargs)
        low = torch.tensor([] if per_channel else math.inf, **factory_kwargs)
        high = torch.tensor([] if per_channel else -math.inf, **factory_kwargs)
        self.register_buffer("min_val", low)
        self.register_buffer("max_val", high)

    def statistic_config(self) -> dict[str, Any]:
        stype = self.statistic_type()
        if stype is not None and issubclass(stype, MovingAverage):
            return {
                "constant": self.averaging_constant,
                "form": "step",
                "counted": False,
                "dtype": self.min_val.dtype,
            }
        return {"dtype": self.min_val.dtype}

    @abc.abstractmethod
    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        """The batch in the canonical layout."""

    def _prepare_batch(self, batch: Batch) -> Batch:
        # torch reduces in the buffers' dtype: the range, cast to it (a
        # float64 range beyond float32 buffers raises: torch's is infinite).
        dtype = self.min_val.dtype
        if batch.min_vals.dtype == dtype:
            return batch
        owner = type(self).__name__
        low, high = cast_range(owner, batch.min_vals, batch.max_vals, dtype)
        return Batch(
            batch.x_flat,
            low,
            high,
            batch.num_observations,
            batch.absmax,
            batch.has_skipped,
            batch.scan,
        )

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record the range of `x_orig`; return it unchanged.

        Raises:
            ValueError: NaN or inf values under `nan_policy="raise"`, or
                values beyond the buffers' dtype (a float64 batch beyond
                float32's range: torch's range would be infinite).
            ObserverShapeError: (per channel) a bad `ch_axis` or a changed
                channel count.
        """
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        if not x.is_floating_point():  # ints, bool: cast first, as torch does
            x = x.to(self.min_val.dtype)
        self._observe(self._layout(x))
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """`(scale, zero_point)`: shape `(1,)` per tensor, `(C,)` per channel.

        Raises:
            ValueError: a range too wide for the quantized range (a custom
                range of very few levels: the scale exceeds float32).
        """
        return self._calculate_qparams(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"


class MinMaxObserver(_RangeObserver):
    """Running min and max of every value seen, per tensor.

    `min_val` / `max_val` (0-dim buffers, `+inf` / `-inf` before any data)
    hold the smallest and largest value so far; `calculate_qparams()` turns
    them into scale and zero point with torch.ao's rules (see
    `quantobs.core.qparams.torch_rule`).

    Args:
        dtype: quantized dtype.
        qscheme: `torch.per_tensor_affine` or `torch.per_tensor_symmetric`.
        reduce_range: drop one bit of the range.
        quant_min: custom lower end of the quantized range.
        quant_max: custom upper end.
        factory_kwargs: `device` / `dtype` of the buffers.
        eps: smallest scale.
        is_dynamic: dynamic quantization marker.
        **kwargs: `nan_policy` (see `UniformQuantizationObserverBase`).

    Raises:
        UnsupportedObserverConfig: a per-channel qscheme, or `reduce_range`
            with symmetric quint8.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        require_qscheme(type(self).__name__, qscheme, PER_TENSOR_QSCHEMES)
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self._register_range(factory_kwargs, per_channel=False)
        self._reject_symmetric_reduced_quint8()

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_view(x)  # (1, numel)


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Moving average of each batch's min and max, per tensor.

    The first batch sets the range; each later one moves it:
    `min_val += averaging_constant * (batch_min - min_val)` (same for max).

    Args:
        averaging_constant: weight of the newest batch, in (0, 1].
        dtype: quantized dtype.
        qscheme: `torch.per_tensor_affine` or `torch.per_tensor_symmetric`.
        reduce_range: drop one bit of the range.
        quant_min: custom lower end of the quantized range.
        quant_max: custom upper end.
        eps: smallest scale.
        is_dynamic: dynamic quantization marker (needs
            `averaging_constant=1`).
        **kwargs: `factory_kwargs`, `nan_policy`.

    Raises:
        UnsupportedObserverConfig: a per-channel qscheme, or dynamic with an
            averaging constant other than 1.
    """

    statistic_cls = TorchMovingAverage

    def __init__(
        self,
        averaging_constant: float = 0.01,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        require_qscheme(type(self).__name__, qscheme, PER_TENSOR_QSCHEMES)
        if averaging_constant != 1:
            reject_dynamic(
                type(self).__name__,
                is_dynamic,
                f"averaging_constant={averaging_constant} would average over "
                "batches; dynamic needs averaging_constant=1",
            )
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self.averaging_constant = averaging_constant


class PerChannelMinMaxObserver(_RangeObserver):
    """Running min and max per channel along `ch_axis`.

    `min_val` / `max_val` are `(C,)` buffers, empty until the first batch;
    they take the saved channel count when a state dict is loaded.

    Args:
        ch_axis: the channel axis (negative counts from the end).
        dtype: quantized dtype.
        qscheme: `torch.per_channel_affine`, `per_channel_symmetric` or
            `per_channel_affine_float_qparams`.
        reduce_range: drop one bit of the range.
        quant_min: custom lower end of the quantized range.
        quant_max: custom upper end.
        factory_kwargs: `device` / `dtype` of the buffers.
        eps: smallest scale.
        is_dynamic: must be False.
        **kwargs: `nan_policy`.

    Raises:
        UnsupportedObserverConfig: a per-tensor qscheme, dynamic, or
            `reduce_range` with symmetric quint8.
        ObserverShapeError: (in `forward`) a batch whose channel count differs
            from the earlier ones, or a `ch_axis` out of range.
    """

    _unobserved_shape = (0,)

    def __init__(
        self,
        ch_axis: int = 0,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_channel_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        require_qscheme(owner, qscheme, PER_CHANNEL_QSCHEMES)
        reject_dynamic(owner, is_dynamic, "use a per-tensor observer")
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self.ch_axis = ch_axis
        self._register_range(factory_kwargs, per_channel=True)
        self._reject_symmetric_reduced_quint8()

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return channel_view(x, self.ch_axis)  # (N, C, G)
        except ValueError as error:
            raise ObserverShapeError(f"{type(self).__name__}: {error}") from None

    def _shape_error(
        self, before: tuple[int, ...], after: tuple[int, ...]
    ) -> Exception:
        return ObserverShapeError(
            f"{type(self).__name__} saw {after[0]} channels along "
            f"ch_axis={self.ch_axis} after {before[0]} in earlier batches; the "
            "channel count must not change (call reset_min_max_vals() to start "
            "over)"
        )

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        version = local_metadata.get("version")
        if version is not None and version < 3:  # buffers were min_vals/max_vals
            for name in ("min_val", "max_val"):
                if prefix + name + "s" in state_dict:
                    state_dict[prefix + name] = state_dict.pop(prefix + name + "s")
        # The buffers take the saved channel count (the engine's load).
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )


class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Moving average of each batch's per-channel min and max.

    The first batch sets the ranges; each later one moves them:
    `min_val += averaging_constant * (batch_min - min_val)` (same for max).

    Args:
        averaging_constant: weight of the newest batch, in (0, 1].
        ch_axis: the channel axis.
        dtype: quantized dtype.
        qscheme: a per-channel qscheme.
        reduce_range: drop one bit of the range.
        quant_min: custom lower end of the quantized range.
        quant_max: custom upper end.
        eps: smallest scale.
        is_dynamic: must be False.
        **kwargs: `factory_kwargs`, `nan_policy`.
    """

    statistic_cls = TorchMovingAverage

    def __init__(
        self,
        averaging_constant: float = 0.01,
        ch_axis: int = 0,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_channel_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = FLOAT32_EPS,
        is_dynamic: bool = False,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        require_qscheme(owner, qscheme, PER_CHANNEL_QSCHEMES)
        reject_dynamic(owner, is_dynamic, "use a per-tensor observer")
        super().__init__(
            ch_axis=ch_axis,
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        self.averaging_constant = averaging_constant
