"""`ObserverBase` and `UniformScalingObserver`: Quark's bases on the engine.

`ObserverBase(qspec, device=None)` holds the (validated) spec and Quark's
attributes (`dtype`, `qspec`, `scale_torch_dtype`, `scale_format`,
`scale_calculation_mode`); `UniformScalingObserver` adds `min_val` /
`max_val` / `eps` buffers, `calculate_qparams(min_val, max_val)` (Quark's
rule, `quantobs.core.qparams.quark_rule.QuarkRule`) and `reset_min_max_vals()`.

State. Each observer keeps one statistic of the engine
(`quantobs.observers.engine`) in its buffers, float32 (float64 for float64
inputs); they travel in `state_dict` (Quark registers them non-persistent,
so a saved calibration loses them) and take the saved shapes on load. Small
Python state (the input dtype, vote records) travels as the module's extra
state. The input dtype is remembered because Quark computes qparams in it
(`ScaleType.float`: "the model's dtype"): ranges are cast back to it,
exactly, before the arithmetic. A dynamic spec (`is_dynamic`) keeps only the
latest batch: the statistic restarts with each batch.

NaN / inf inputs raise `ValueError` (Quark returns NaN or inf scales), except
in `PerBlockBFPObserver`, which maps them to 0 as Quark does. Every observer
takes the keyword `nan_policy` (`"raise"`, `"omit"`, `"propagate"`, as
`quantobs.Observer`; default `"raise"`, `"omit"` for `PerBlockBFPObserver`:
the defaults keep the behaviour above). Finite inputs
give finite positive scales: an asymmetric int range wider than its dtype
holds (`max - min` past its max, e.g. `[-3e38, 3e38]` in float32 or `[-4e4,
4e4]` in float16) is computed in float64 and its scale cast back (Quark:
infinite scales).
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from quantobs.core.layout import channel_view, normalize_axis
from quantobs.core.qparams.quark_rule import QuarkRule, nonfinite_error
from quantobs.faces.quark.spec import (
    Dtype,
    QSchemeType,
    QTensorConfig,
    ScaleType,
    ZeroPointType,
    as_spec,
    mx_element_params,
    quant_range,
    register_observer,
)
from quantobs.observers.engine import ObserverEngine
from quantobs.stats.base import Statistic
from quantobs.stats.minmax import MinMax
from quantobs.stats.reduce import NanPolicy

__all__ = [
    "FLOAT32_EPS",
    "ObserverBase",
    "UniformScalingObserver",
    "per_channel_view",
]

FLOAT32_EPS = torch.finfo(torch.float32).eps
_FP8 = (Dtype.fp8_e4m3, Dtype.fp8_e5m2)
_SMALL_FLOATS = (Dtype.fp4, Dtype.fp6_e2m3, Dtype.fp6_e3m2)
# Quark's scale_calculation_mode -> the exponent rounding that does it
_ROUNDINGS = {"even": "round", "floor": "floor", "ceil": "ceil"}


def per_channel_view(x: torch.Tensor, ch_axis: int) -> torch.Tensor:
    """`x` as `(N, C, G)` for channels along `ch_axis` (a 0-d input: one)."""
    return channel_view(x.reshape(1) if x.ndim == 0 else x, ch_axis)


class ObserverBase(ObserverEngine, abc.ABC):
    """Base of every observer of the Quark face.

    Args:
        qspec: a `QTensorConfig` (ours or Quark's; Quark's is converted).
        device: device of the statistics.
        nan_policy: what NaN / inf inputs do (keyword only; Quark has no such
            argument): `"raise"` (default) raises `ValueError`; `"omit"`
            ignores them (a batch with no finite value is skipped);
            `"propagate"` lets them reach the statistics, whose qparams then
            raise `ValueError` (Quark returns NaN or inf scales). The table
            is `quantobs.stats.reduce`'s.

    Raises:
        ValueError: the spec is invalid, or names a qscheme this observer
            does not implement, or an unknown `nan_policy`.
    """

    qschemes: ClassVar[tuple[QSchemeType, ...]] = ()
    exact_dtype = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_observer(cls)

    @classmethod
    def is_abstract(cls) -> bool:
        """Whether the class only defines an interface (not an observer)."""
        return inspect.isabstract(cls)

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """Raise `ValueError` if this observer cannot observe `spec`."""
        if spec.qscheme is not None and spec.qscheme not in cls.qschemes:
            valid = ", ".join(q.value for q in cls.qschemes) or "none"
            raise ValueError(
                f"{cls.__name__} does not support qscheme={spec.qscheme.value!r}; "
                f"it supports {valid}"
            )

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        *,
        nan_policy: NanPolicy = "raise",
    ) -> None:
        super().__init__(nan_policy=nan_policy)
        spec = as_spec(qspec)
        type(self).check_spec(spec)
        if device is not None:
            self._device_marker = self._device_marker.to(device)
        self.qspec = spec
        self.dtype = spec.dtype
        self.scale_torch_dtype: torch.dtype | None = (
            spec.scale_type.to_torch_dtype() if spec.scale_type is not None else None
        )
        self.scale_format = spec.scale_format
        self.scale_calculation_mode = spec.scale_calculation_mode
        self.is_dynamic = spec.is_dynamic
        self._num_observed_tokens = 0
        self.quant_max_first_level: float | None = None
        self._input_dtype: torch.dtype | None = None
        self._init_attributes()

    def _init_attributes(self) -> None:
        """Hook at the end of `ObserverBase.__init__`: a subclass's attributes.

        A subclass that only adds attributes overrides this (calling
        `super()._init_attributes()` first) instead of `__init__`, and so
        keeps its parent's constructor: signature, defaults and `nan_policy`
        handling. It runs before the `__init__` bodies of intermediate bases
        (`UniformScalingObserver`'s buffers do not exist yet): it may use the
        spec and the attributes set above, nothing more.
        """

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> Any:
        """Record statistics of `x`; return `x` unchanged."""

    @abc.abstractmethod
    def _calculate_qparams(self) -> Any:
        """`(scale, zero_point)` from the statistics recorded so far."""

    @abc.abstractmethod
    def reset_state(self) -> None:
        """Forget every statistic."""

    # -- observing ------------------------------------------------------------

    def _observe_view(self, x_flat: torch.Tensor, x: torch.Tensor) -> None:
        """Fold `x` (as `x_flat`, canonical) in; a dynamic spec keeps only it."""
        if self._keeps_latest():
            self.reset()
        self._input_dtype = x.dtype
        self._observe(x_flat)

    def _keeps_latest(self) -> bool:
        """Whether each batch replaces the statistic (a dynamic spec)."""
        return bool(self.is_dynamic)

    def _describe(self) -> str:
        return type(self).__name__

    def _nonfinite_error(self, x_flat: torch.Tensor) -> Exception:
        bad = (~torch.isfinite(x_flat)).any(dim=0).any(dim=-1)  # per qparam
        return nonfinite_error(self._describe(), int(bad.sum()))

    # -- helpers shared by the observers --------------------------------------

    def record_observed_tokens(self, batch_tensor: torch.Tensor) -> None:
        """Count rows of a `(tokens, features)` batch with a nonzero value.

        An MoE expert's all-zero rows are tokens routed elsewhere. Inputs of
        fewer than 2 dims are ignored (as in Quark).
        """
        if not isinstance(batch_tensor, torch.Tensor):
            raise ValueError(
                f"record_observed_tokens needs a tensor, got "
                f"{type(batch_tensor).__name__}"
            )
        if batch_tensor.ndim < 2:
            return
        rows = batch_tensor.reshape(-1, batch_tensor.shape[-1])
        self._num_observed_tokens += int((rows != 0).any(dim=1).sum())

    def _element_dtype(self) -> Dtype:
        spec = self.qspec
        return (
            spec.mx_element_dtype if spec.mx_element_dtype is not None else spec.dtype
        )

    def _rule(self, eps: torch.Tensor | float, blocks: bool = False) -> QuarkRule:
        """Quark's rule for this spec (the config translation); `blocks`: of
        MX block scales (always in a scale format, e8m0 by default)."""
        spec = self.qspec
        element = self._element_dtype()
        if blocks or (element in _SMALL_FLOATS):
            kind = "small_float"
        elif element in _FP8:
            kind = "fp8"
        else:
            kind = "int"
        qmin, qmax = quant_range(element)
        bits, emax = mx_element_params(element) if kind == "small_float" else (1, 0)
        mode = self.scale_calculation_mode or "even"
        return QuarkRule(
            kind=kind,  # type: ignore[arg-type]
            quant_min=qmin,
            quant_max=qmax,
            symmetric=bool(spec.symmetric) if kind == "int" else True,
            eps=eps,
            float_zero_point=spec.zero_point_type == ZeroPointType.float32,
            pof2=self._pof2(),
            scale_dtype=self.scale_torch_dtype,
            scale_format=self.scale_format or ("e8m0" if blocks else None),
            rounding=_ROUNDINGS[mode],  # type: ignore[arg-type]
            mantissa_bits=bits,
            emax=emax,
            owner=type(self).__name__,
        )

    def _pof2(self) -> bool:
        return self.qspec.scale_type == ScaleType.pof2

    def _model_dtype(self, default: torch.dtype) -> torch.dtype:
        return self._input_dtype if self._input_dtype is not None else default

    # -- state ---------------------------------------------------------------

    def get_extra_state(self) -> dict[str, Any]:
        """Python state saved with the buffers (see the module docstring)."""
        return {
            "input_dtype": None
            if self._input_dtype is None
            else str(self._input_dtype),
            "num_observed_tokens": self._num_observed_tokens,
        }

    def set_extra_state(self, state: Any) -> None:
        """Inverse of `get_extra_state`."""
        if not isinstance(state, dict):
            return
        name = state.get("input_dtype")
        dtype = getattr(torch, name.removeprefix("torch."), None) if name else None
        self._input_dtype = dtype if isinstance(dtype, torch.dtype) else None
        self._num_observed_tokens = int(state.get("num_observed_tokens", 0))

    def _may_drop(self, name: str) -> bool:
        return False  # the buffers exist from construction, as Quark's


class UniformScalingObserver(ObserverBase):
    """Min / max ranges -> uniform scales (int, FP8, FP4 / FP6 with a format).

    Args:
        qspec: the spec.
        device: device of the buffers.
        eps: smallest scale (float32's machine epsilon by default).

    Attributes:
        min_val: running minimum (`inf` before any observation).
        max_val: running maximum (`-inf` before any observation).
        eps: 0-d float32 buffer.
        quant_min: smallest quantized value (e.g. -128).
        quant_max: largest quantized value (e.g. 127).
    """

    statistic_cls: ClassVar[type[Statistic] | None] = MinMax
    buffer_names: ClassVar[Mapping[str, str]] = {
        "min_vals": "min_val",
        "max_vals": "max_val",
    }

    eps: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        eps: float = FLOAT32_EPS,
        *,
        nan_policy: NanPolicy = "raise",
    ) -> None:
        super().__init__(qspec, device, nan_policy=nan_policy)
        spec = self.qspec
        self.symmetric = spec.symmetric
        self.scale_type = spec.scale_type
        self.qscheme = spec.qscheme
        self.zero_point_type = spec.zero_point_type
        self.register_buffer("min_val", torch.tensor(math.inf, device=device))
        self.register_buffer("max_val", torch.tensor(-math.inf, device=device))
        self.register_buffer("eps", torch.tensor(eps, device=device))
        if self.dtype in (Dtype.mx, Dtype.bfp16):
            raise ValueError(
                f"{type(self).__name__} cannot observe dtype={self.dtype.value!r}; "
                "use PerBlockMXObserver or PerBlockBFPObserver"
            )
        self.quant_min, self.quant_max = quant_range(self.dtype)

    # -- statistic in Quark's buffers ----------------------------------------

    def _read_state(
        self, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        low = state["min_vals"]
        if low.dim() == 0 and bool(low == math.inf):
            return None  # Quark's "nothing observed": (inf, -inf), 0-d
        return state

    def _initial_statistic(self) -> Statistic:
        return MinMax.empty((), self.eps.device)

    # -- qparams --------------------------------------------------------------

    def _calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`calculate_qparams` of the recorded range, in the input's dtype."""
        dtype = self._model_dtype(self.min_val.dtype)
        return self.calculate_qparams(self.min_val.to(dtype), self.max_val.to(dtype))

    def calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point of a range, Quark's arithmetic.

        Args:
            min_val: `()` or `(*Q,)` minima; the arithmetic runs in its dtype.
            max_val: maxima, same shape.

        Returns:
            `(scale, zero_point)`, each of the range's shape. Integer dtypes:
            before any observation Quark's defaults `(tensor([1.]),
            tensor([0]))` with a warning. Float formats: zero point zeros of
            the scale's dtype.

        Ranges wider than their dtype holds (`max - min` past float32's or
        float16's max, asymmetric int) are computed in float64 and their
        scales cast back (Quark: infinite scales); the rest is Quark's
        arithmetic, in the range's dtype.

        Raises:
            ValueError: NaN / inf in the range, or `min_val > max_val`.
        """
        rule = self._rule(self.eps)
        scale, zero_point = rule(min_val, max_val)
        wide = ~torch.isfinite(scale)  # a finite range whose spread overflowed
        if not bool(wide.any()):
            return scale, zero_point
        wide_scale, wide_zero_point = rule(min_val.double(), max_val.double())
        scale = torch.where(wide, wide_scale.to(scale.dtype), scale)
        zero_point = torch.where(wide, wide_zero_point.to(zero_point.dtype), zero_point)
        if not bool(torch.isfinite(scale).all()):  # pragma: no cover - >= 3 levels
            raise ValueError(
                f"{type(self).__name__}: the range is too wide for "
                f"{self.dtype.value} scales in {scale.dtype}; scale the input down"
            )
        return scale, zero_point

    def reset_state(self) -> None:
        """Forget the range."""
        self.reset_min_max_vals()

    def reset_min_max_vals(self) -> None:
        """Forget the range (back to `(inf, -inf)`, on the same device)."""
        self.reset()

    def _channel_axis(self, x: torch.Tensor) -> int:
        axis = self.qspec.ch_axis
        if axis is None:
            raise ValueError(f"{type(self).__name__} needs qspec.ch_axis (e.g. 0)")
        return normalize_axis(axis, max(x.ndim, 1))

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"
