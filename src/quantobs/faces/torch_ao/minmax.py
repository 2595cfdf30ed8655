"""torch.ao's min-max observers: running and moving-average, per tensor and
per channel, with torch's buffers and numbers.

The reductions are ours: per tensor one `torch.aminmax` pass in the input's
dtype (torch first copies the input to float32); per channel `amin` / `amax`
over the non-channel dims without torch's permute + flatten copy, reducing
cache-sized row blocks on CPU where the reduced dims are outer ones (see
`channel_minmax`). Min and max are exact, so the numbers equal torch's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantobs.faces.torch_ao.base import (
    FLOAT32_EPS,
    UniformQuantizationObserverBase,
    check_finite_range,
    reject_dynamic,
    require_qscheme,
)
from quantobs.faces.torch_ao.errors import ObserverShapeError
from quantobs.core.qparams.torch_ao import PER_CHANNEL_QSCHEMES, PER_TENSOR_QSCHEMES

__all__ = [
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PerChannelMinMaxObserver",
    "channel_minmax",
]

# Rows of an outer reduction reduced together on CPU. torch's amin/amax over
# dim 0 of a large (P, M) tensor run at 2-3x the aminmax floor each; over
# blocks of rows that fit in L2 (the amax pass then re-reads the block from
# cache) both together take 1.1-1.5x the floor (measured on 1 thread for
# 4096x4096, 16384x1024 and 65536x256 float32; 256 KiB to 1 MiB all do).
_BLOCK_BYTES = 512 << 10
# Below this many contiguous elements per channel, reduce as an outer
# reduction over (P, C * Q) instead of short inner rows.
_MIN_INNER = 16


def _as_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Floating inputs are reduced in their own dtype: min / max commute with
    # the monotone cast to float32 that torch applies first. Others (ints,
    # bool) are cast first, as torch does.
    return x if x.is_floating_point() else x.to(dtype)


def _outer_minmax(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(P, M) -> (M,), (M,)`: min and max over dim 0."""
    rows = _BLOCK_BYTES // max(1, x2.shape[1] * x2.element_size())
    if x2.device.type != "cpu" or rows < 2 or rows >= x2.shape[0]:
        return x2.amin(0), x2.amax(0)
    blocks = x2.split(rows)  # each (rows, M) fits in L2: amax re-reads from cache
    min_vals, max_vals = blocks[0].amin(0), blocks[0].amax(0)
    for block in blocks[1:]:
        torch.minimum(min_vals, block.amin(0), out=min_vals)
        torch.maximum(max_vals, block.amax(0), out=max_vals)
    return min_vals, max_vals


def channel_minmax(x: torch.Tensor, ch_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min and max of `x` along `ch_axis`: `(C,), (C,)`, x's dtype.

    NaN propagates (a channel with a NaN gets NaN), as with torch's aminmax.

    Raises:
        ObserverShapeError: `x` is 0-dim or `ch_axis` is out of range.
    """
    if x.dim() == 0 or not -x.dim() <= ch_axis < x.dim():
        raise ObserverShapeError(
            f"ch_axis={ch_axis} is out of range for an input of shape "
            f"{tuple(x.shape)}; pick an axis in [-{x.dim()}, {x.dim() - 1}]"
            if x.dim()
            else "a per-channel observer needs an input with at least one dim, "
            "got a 0-dim tensor"
        )
    axis = ch_axis % x.dim()
    if not x.is_contiguous():
        # A permuted contiguous tensor (e.g. a transposed weight): reduce it in
        # memory order, where the fast paths below apply.
        strides = x.stride()
        order = sorted(range(x.dim()), key=lambda d: -strides[d])
        in_memory_order = x.permute(order)
        if in_memory_order.is_contiguous():
            return channel_minmax(in_memory_order, order.index(axis))
        others = [d for d in range(x.dim()) if d != axis]
        if not others:
            return x, x
        return x.amin(others), x.amax(others)
    channels = x.shape[axis]
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1 :])
    x3 = x.view(outer, channels, inner)  # (P, C, Q)
    if inner >= _MIN_INNER:
        # Contiguous rows of Q: an inner reduction (vectorized, one pass each),
        # then a small (P, C) reduction.
        min_pc, max_pc = x3.amin(2), x3.amax(2)  # (P, C)
        if outer == 1:
            return min_pc[0], max_pc[0]
        return min_pc.amin(0), max_pc.amax(0)
    min_cq, max_cq = _outer_minmax(x3.view(outer, channels * inner))  # (C * Q,)
    if inner == 1:
        return min_cq, max_cq
    return min_cq.view(channels, inner).amin(1), max_cq.view(channels, inner).amax(1)


class MinMaxObserver(UniformQuantizationObserverBase):
    """Running min and max of every value seen, per tensor.

    `min_val` / `max_val` (0-dim buffers, `+inf` / `-inf` before any data)
    hold the smallest and largest value so far; `calculate_qparams()` turns
    them into scale and zero point with torch.ao's rules (see
    `quantobs.core.qparams.torch_ao`).

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

    min_val: torch.Tensor
    max_val: torch.Tensor

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
        factory_kwargs = torch.nn.factory_kwargs(factory_kwargs)
        self.register_buffer("min_val", torch.tensor(float("inf"), **factory_kwargs))
        self.register_buffer("max_val", torch.tensor(float("-inf"), **factory_kwargs))
        self._reject_symmetric_reduced_quint8()

    def _batch_range(self, x_orig: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = _as_float(x_orig.detach(), self.min_val.dtype)
        min_cur, max_cur = torch.aminmax(x)
        check_finite_range(type(self).__name__, self.nan_policy, min_cur, max_cur, x)
        dtype = self.min_val.dtype
        return min_cur.to(dtype), max_cur.to(dtype)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record the min and max of `x_orig`; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        min_cur, max_cur = self._batch_range(x_orig)
        self.min_val.copy_(torch.min(min_cur, self.min_val))
        self.max_val.copy_(torch.max(max_cur, self.max_val))
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """`(scale, zero_point)`, each of shape `(1,)`."""
        return self._calculate_qparams(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def reset_min_max_vals(self) -> None:
        """Forget the observed range."""
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))


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
        self.averaging_constant = averaging_constant
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

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Move the averaged range towards `x_orig`'s; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        min_cur, max_cur = self._batch_range(x_orig)
        min_val, max_val = self.min_val, self.max_val
        if bool(min_val == float("inf")) and bool(max_val == float("-inf")):
            min_val, max_val = min_cur, max_cur
        else:
            c = self.averaging_constant
            min_val = min_val + c * (min_cur - min_val)
            max_val = max_val + c * (max_cur - max_val)
        self.min_val.copy_(min_val)
        self.max_val.copy_(max_val)
        return x_orig


class PerChannelMinMaxObserver(UniformQuantizationObserverBase):
    """Running min and max per channel along `ch_axis`.

    `min_val` / `max_val` are `(C,)` buffers, empty until the first batch;
    they resize when a state dict with another channel count is loaded.

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

    min_val: torch.Tensor
    max_val: torch.Tensor

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
        factory_kwargs = torch.nn.factory_kwargs(factory_kwargs)
        self.ch_axis = ch_axis
        self.register_buffer("min_val", torch.tensor([], **factory_kwargs))
        self.register_buffer("max_val", torch.tensor([], **factory_kwargs))
        self._reject_symmetric_reduced_quint8()

    def _batch_range(self, x_orig: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = _as_float(x_orig.detach(), self.min_val.dtype)
        min_cur, max_cur = channel_minmax(x, self.ch_axis)
        check_finite_range(type(self).__name__, self.nan_policy, min_cur, max_cur, x)
        seen = self.min_val.numel()
        if seen and min_cur.numel() != seen:
            raise ObserverShapeError(
                f"{type(self).__name__} saw {min_cur.numel()} channels along "
                f"ch_axis={self.ch_axis} (input shape {tuple(x.shape)}) after "
                f"{seen} in earlier batches; the channel count must not change "
                "(call reset_min_max_vals() to start over)"
            )
        dtype = self.min_val.dtype
        return min_cur.to(dtype), max_cur.to(dtype)

    def _store(self, min_val: torch.Tensor, max_val: torch.Tensor) -> None:
        self.min_val.resize_(min_val.shape).copy_(min_val)
        self.max_val.resize_(max_val.shape).copy_(max_val)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record the per-channel min and max of `x_orig`; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        min_cur, max_cur = self._batch_range(x_orig)
        if self.min_val.numel():
            min_cur = torch.min(min_cur, self.min_val)
            max_cur = torch.max(max_cur, self.max_val)
        self._store(min_cur, max_cur)
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """`(scale, zero_point)`, each of shape `(C,)`."""
        return self._calculate_qparams(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
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
        # The buffers take the saved channel count, then load as usual.
        for name in ("min_val", "max_val"):
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor):
                getattr(self, name).resize_(saved.shape)
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )

    def reset_min_max_vals(self) -> None:
        """Forget the observed ranges (the buffers become empty)."""
        self.min_val.resize_(0)
        self.max_val.resize_(0)


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

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Move the averaged ranges towards `x_orig`'s; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        min_cur, max_cur = self._batch_range(x_orig)
        if self.min_val.numel():
            c = self.averaging_constant
            min_cur = self.min_val + c * (min_cur - self.min_val)
            max_cur = self.max_val + c * (max_cur - self.max_val)
        self._store(min_cur, max_cur)
        return x_orig
