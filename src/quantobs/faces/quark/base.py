"""`ObserverBase` and `UniformScalingObserver`: Quark's bases, on our core.

`ObserverBase(qspec, device=None)` holds the (validated) spec and Quark's
attributes (`dtype`, `qspec`, `scale_torch_dtype`, `scale_format`,
`scale_calculation_mode`); `UniformScalingObserver` adds `min_val` /
`max_val` / `eps` buffers, `calculate_qparams(min_val, max_val)` and
`reset_min_max_vals()`.

State. Statistics are float32 (float64 for float64 inputs) buffers that
travel in `state_dict` (Quark registers them non-persistent, so a saved
calibration loses them); buffers are resized to the saved shapes on load, and
small Python state (the input dtype, vote records, bin counts) travels as the
module's extra state. The input dtype is remembered because Quark computes
qparams in it (`ScaleType.float`: "the model's dtype"): ranges are cast back
to it, exactly, before the arithmetic.

NaN / inf inputs raise `ValueError` (Quark returns NaN or inf scales), except
in `PerBlockBFPObserver`, which maps them to 0 as Quark does.
"""

from __future__ import annotations

import abc
import inspect
import math
import warnings
from typing import Any, ClassVar

import torch

from quantobs.core.qparams import quark as qp
from quantobs.faces.quark.spec import (
    Dtype,
    QSchemeType,
    QTensorConfig,
    ScaleType,
    ZeroPointType,
    as_spec,
    element_format,
    mx_element_params,
    quant_range,
    register_observer,
)

__all__ = [
    "FLOAT32_EPS",
    "ObserverBase",
    "UniformScalingObserver",
    "check_finite",
    "stat_dtype",
    "warn_unobserved",
]

FLOAT32_EPS = torch.finfo(torch.float32).eps
_FP8 = (Dtype.fp8_e4m3, Dtype.fp8_e5m2)
_SMALL_FLOATS = (Dtype.fp4, Dtype.fp6_e2m3, Dtype.fp6_e3m2)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype statistics are kept in: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_finite(owner: str, *values: torch.Tensor) -> None:
    """Raise `ValueError` if a reduced statistic is NaN or infinite.

    The statistics are small (one value per qparam), so the check costs
    nothing next to the reduction; NaN and inf propagate into them.
    """
    for value in values:
        if bool(torch.isfinite(value).all()):
            continue
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise ValueError(
                f"{owner}: the input holds NaN or inf ({bad} qparam(s) affected); "
                "Quark would return NaN or inf scales. Clean the input first, "
                "e.g. torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)"
            )


def warn_unobserved(owner: str) -> None:
    """Quark's "must run observer before calling calculate_qparams" warning."""
    warnings.warn(
        f"{owner}: calculate_qparams() was called before any observation; "
        "returning Quark's defaults (scale 1.0, zero point 0). Run calibration "
        "batches through the observer first.",
        UserWarning,
        stacklevel=3,
    )


class ObserverBase(torch.nn.Module, abc.ABC):
    """Base of every observer of the Quark face.

    Args:
        qspec: a `QTensorConfig` (ours or Quark's; Quark's is converted).
        device: device of the statistics.

    Raises:
        ValueError: the spec is invalid, or names a qscheme this observer
            does not implement.
    """

    qschemes: ClassVar[tuple[QSchemeType, ...]] = ()

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

    def __init__(self, qspec: Any, device: torch.device | None = None) -> None:
        super().__init__()
        spec = as_spec(qspec)
        type(self).check_spec(spec)
        self.qspec = spec
        self.dtype = spec.dtype
        self.scale_torch_dtype: torch.dtype | None = (
            spec.scale_type.to_torch_dtype() if spec.scale_type is not None else None
        )
        self.scale_format = spec.scale_format
        self.scale_calculation_mode = spec.scale_calculation_mode
        self._num_observed_tokens = 0
        self.quant_max_first_level: float | None = None
        self._input_dtype: torch.dtype | None = None

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> Any:
        """Record statistics of `x`; return `x` unchanged."""

    @abc.abstractmethod
    def _calculate_qparams(self) -> Any:
        """`(scale, zero_point)` from the statistics recorded so far."""

    @abc.abstractmethod
    def reset_state(self) -> None:
        """Forget every statistic."""

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

    def get_scale(
        self, amax: torch.Tensor, eps: float | torch.Tensor, scale_format: str | None
    ) -> torch.Tensor:
        """Scales from absolute maxima in a scale format.

        Args:
            amax: `(*Q,)` absolute maxima.
            eps: replacement of zero scales.
            scale_format: `e8m0` (MX power of two, `scale_calculation_mode`),
                `e4m3` (two-level FP8 scales), `float32` (`amax / qmax`).

        Returns:
            `(*Q,)` scales (dtypes as Quark's `get_scale`).

        Raises:
            ValueError: an unknown `scale_format`.
        """
        eps_value = float(eps)
        element = self._element_dtype()
        if scale_format == "e8m0":
            mantissa_bits, emax = mx_element_params(element)
            mode = self.scale_calculation_mode or "even"
            return qp.e8m0_scale(amax, mode, mantissa_bits, emax, eps_value)
        quant_max = element_format(element).max
        if scale_format == "e4m3":
            scale = qp.e4m3_two_level_scale(amax, quant_max, eps_value)
            return scale.to(self.scale_torch_dtype) if self.scale_torch_dtype else scale
        if scale_format == "float32":
            return qp.float_scale(amax, quant_max, eps_value, self.scale_torch_dtype)
        raise ValueError(
            f"scale_format={scale_format!r} is not one of 'e8m0', 'e4m3', "
            "'float32'; set it in the QTensorConfig"
        )

    def _finish_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """`scale_type` rules: `pof2` rounds, float types cast."""
        if self.qspec.scale_type == ScaleType.pof2:
            scale = qp.pow2_round(scale)
        return scale.to(self.scale_torch_dtype) if self.scale_torch_dtype else scale

    def _remember_dtype(self, x: torch.Tensor) -> None:
        self._input_dtype = x.dtype

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
        # Statistics change shape as data arrives (per-channel ranges, MX
        # amax, grown histograms): take the saved shape and dtype.
        for name, buffer in list(self._buffers.items()):
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor) and buffer is not None:
                self._buffers[name] = torch.empty_like(saved, device=buffer.device)
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )


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

    eps: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        eps: float = FLOAT32_EPS,
    ) -> None:
        super().__init__(qspec, device)
        spec = self.qspec
        self.symmetric = spec.symmetric
        self.scale_type = spec.scale_type
        self.qscheme = spec.qscheme
        self.is_dynamic = spec.is_dynamic
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

        Raises:
            ValueError: NaN / inf in the range, or `min_val > max_val`.
        """
        if self.dtype in _FP8 or self.dtype in _SMALL_FLOATS:
            # Unobserved entries (inf, -inf) give amax 0 and the eps scale.
            check_finite(type(self).__name__, *_observed(min_val, max_val))
            return self._float_qparams(min_val, max_val)
        if _unobserved(min_val, max_val):
            warn_unobserved(type(self).__name__)
            device = min_val.device.type
            return torch.tensor([1.0], device=device), torch.tensor([0], device=device)
        check_finite(type(self).__name__, min_val, max_val)
        if bool((min_val > max_val).any()):
            raise ValueError(
                f"{type(self).__name__}: min_val > max_val somewhere; pass the "
                "range as (min, max)"
            )
        scale, zero_point = qp.int_qparams(
            min_val,
            max_val,
            self.quant_min,
            self.quant_max,
            bool(self.symmetric),
            self.eps,
            float_zero_point=self.zero_point_type == ZeroPointType.float32,
        )
        if self.qspec.scale_type == ScaleType.pof2 and not self.symmetric:
            scale = qp.pow2_round(scale)
            min_neg = torch.clamp(min_val, max=0)
            if self.zero_point_type == ZeroPointType.float32:
                zero_point = -1 * min_val / scale
            else:
                zero_point = int(self.quant_min) - torch.round(min_neg / scale).int()
                zero_point = zero_point.clamp(int(self.quant_min), int(self.quant_max))
        return self._finish_scale(scale), zero_point

    def _float_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        min_neg = torch.minimum(min_val, torch.zeros_like(min_val))
        max_pos = torch.maximum(max_val, torch.zeros_like(max_val))
        amax = torch.maximum(min_neg.abs(), max_pos.abs())
        eps = float(self.eps)
        if self.dtype in _FP8:
            scale = self.get_scale(amax, eps, "float32")
        else:
            scale = self.get_scale(amax, eps, self.scale_format)
            scale = scale.masked_fill(scale == 0.0, FLOAT32_EPS)
        scale = self._finish_scale(scale)
        return scale, torch.zeros_like(scale)

    def reset_state(self) -> None:
        """Forget the range."""
        self.reset_min_max_vals()

    def reset_min_max_vals(self) -> None:
        """Forget the range (back to `(inf, -inf)`, on the same device)."""
        device = self.min_val.device
        self.min_val = torch.tensor(math.inf, device=device)
        self.max_val = torch.tensor(-math.inf, device=device)

    def _store_range(
        self, min_val: torch.Tensor, max_val: torch.Tensor, x: torch.Tensor
    ) -> None:
        """Keep a new (already merged) range and the input dtype."""
        dtype = stat_dtype(x.dtype)
        self.min_val = min_val.detach().to(dtype)
        self.max_val = max_val.detach().to(dtype)
        self._remember_dtype(x)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"


def _unobserved(min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    if min_val.numel() == 0 or max_val.numel() == 0:
        return True
    return bool(
        min_val.dim() == 0 and bool(min_val == math.inf) and bool(max_val == -math.inf)
    )


def _observed(
    min_val: torch.Tensor, max_val: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The range without its unobserved `(inf, -inf)` entries."""
    seen = ~((min_val == math.inf) & (max_val == -math.inf))
    return min_val[seen], max_val[seen]
