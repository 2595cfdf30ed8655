"""Base classes of the torch.ao face and the `with_args` factories.

`ObserverBase` and `UniformQuantizationObserverBase` have torch.ao's
constructor signatures, attributes (`dtype`, `qscheme`, `quant_min`,
`quant_max`, `reduce_range`, `has_customized_qrange`, `is_dynamic`) and
buffers (`eps`), and the state-dict version (3) torch writes, so state dicts
interchange. Range -> qparams is `quantobs.core.qparams.torch_ao.torch_qparams`.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch

from quantobs.faces.torch_ao.errors import (
    InvalidObserverArgument,
    UnsupportedObserverConfig,
)
from quantobs.core.qparams.torch_ao import (
    ALLOWED_DTYPES,
    ALLOWED_QSCHEMES,
    PER_TENSOR_QSCHEMES,
    torch_qparams,
    torch_quant_range,
)

__all__ = [
    "FLOAT32_EPS",
    "NanPolicy",
    "ObserverBase",
    "UniformQuantizationObserverBase",
    "check_finite_range",
    "reject_dynamic",
    "require_qscheme",
]

NanPolicy = Literal["raise", "propagate"]
FLOAT32_EPS = torch.finfo(torch.float32).eps
_NAN_POLICIES = ("raise", "propagate")


class _PartialWrapper:
    """A constructor with bound keyword arguments (what `with_args` returns).

    Calling it builds a new observer. `callable_args` are called at each
    construction (e.g. a device chosen late). The attributes `p` (a
    `functools.partial`) and `callable_args` are the ones torch's own code
    reads (`FakeQuantize` looks up `p.keywords["dtype"]`).
    """

    def __init__(self, p: functools.partial[Any]) -> None:
        self.p = p
        self.callable_args: dict[str, Callable[[], Any]] = {}

    def __call__(self, *args: Any, **keywords: Any) -> Any:
        late = {
            name: make()
            for name, make in self.callable_args.items()
            if name not in keywords
        }
        return self.p(*args, **keywords, **late)

    def __repr__(self) -> str:
        return f"{self.p!r}{self.callable_args!r}"

    def __eq__(self, other: object) -> bool:
        # torch compares its own wrappers by content (qconfig_equals); do the
        # same so two equal QConfigs built from quantobs observers are equal.
        if not isinstance(other, _PartialWrapper):
            return NotImplemented
        return (
            self.p.func == other.p.func
            and self.p.args == other.p.args
            and self.p.keywords == other.p.keywords
            and self.callable_args == other.callable_args
        )

    def __hash__(self) -> int:  # equal wrappers share their constructor
        return hash(self.p.func)

    def with_args(self, **kwargs: Any) -> _PartialWrapper:
        """This constructor with more (or overriding) keyword arguments."""
        return _with_args(self, **kwargs)

    def with_callable_args(self, **kwargs: Callable[[], Any]) -> _PartialWrapper:
        """This constructor with arguments computed by calling each value."""
        result = _PartialWrapper(self.p)
        result.callable_args = {**self.callable_args, **kwargs}
        return result


def _with_args(cls_or_self: Any, **kwargs: Any) -> _PartialWrapper:
    return _PartialWrapper(functools.partial(cls_or_self, **kwargs))


def _with_callable_args(
    cls_or_self: Any, **kwargs: Callable[[], Any]
) -> _PartialWrapper:
    return _PartialWrapper(functools.partial(cls_or_self)).with_callable_args(**kwargs)


class ObserverBase(torch.nn.Module, abc.ABC):
    """Base of every observer: `forward(x) -> x` records, `calculate_qparams`.

    Args:
        dtype: the quantized dtype the observer's qparams are meant for.
        is_dynamic: whether the quantize op built from this observer computes
            its qparams at run time (dynamic quantization).

    `with_args(**kwargs)` and `with_callable_args(**kwargs)` (class methods)
    return constructors with bound arguments, for `QConfig`.
    """

    def __init__(self, dtype: torch.dtype, is_dynamic: bool = False) -> None:
        super().__init__()
        self.dtype = dtype
        self.is_dynamic = is_dynamic

    @abc.abstractmethod
    def forward(self, x: Any) -> Any:
        """Record statistics of `x` and return `x` unchanged."""

    @abc.abstractmethod
    def calculate_qparams(self, **kwargs: Any) -> Any:
        """The quantization parameters of what was observed."""

    with_args = classmethod(_with_args)
    with_callable_args = classmethod(_with_callable_args)


def require_qscheme(
    owner: str, qscheme: Any, allowed: tuple[torch.qscheme, ...]
) -> None:
    """Raise `UnsupportedObserverConfig` unless `qscheme` is in `allowed`."""
    if qscheme not in allowed:
        names = ", ".join(f"torch.{q}" for q in allowed)
        raise UnsupportedObserverConfig(
            f"{owner} does not support qscheme={qscheme}; use one of {names}"
            + (
                " (or a per-channel observer for per-channel schemes)"
                if allowed == PER_TENSOR_QSCHEMES
                else ""
            )
        )


def reject_dynamic(owner: str, is_dynamic: bool, hint: str = "") -> None:
    """Raise `UnsupportedObserverConfig` for `is_dynamic=True`."""
    if is_dynamic:
        raise UnsupportedObserverConfig(
            f"{owner} does not support dynamic quantization (is_dynamic=True)"
            + (f"; {hint}" if hint else "")
        )


def _range_is_usable(
    min_cur: torch.Tensor, max_cur: torch.Tensor, allow_inf: bool
) -> bool:
    if min_cur.dim() == 0:  # one range: two Python floats, no kernel launches
        lo, hi = float(min_cur), float(max_cur)
        if allow_inf:
            return not (math.isnan(lo) or math.isnan(hi))
        return math.isfinite(lo) and math.isfinite(hi)
    if allow_inf:
        return not bool(torch.isnan(min_cur).any() | torch.isnan(max_cur).any())
    # max - min is finite iff both ends are (or, rarely, it overflows: recheck)
    if bool(torch.isfinite(max_cur - min_cur).all()):
        return True
    return bool(torch.isfinite(min_cur).all() & torch.isfinite(max_cur).all())


def check_finite_range(
    owner: str,
    policy: NanPolicy,
    min_cur: torch.Tensor,
    max_cur: torch.Tensor,
    x: torch.Tensor,
    allow_inf: bool = False,
) -> None:
    """Under `nan_policy="raise"`, reject a batch whose range is not finite.

    Only the reduced range is inspected (NaN propagates through min / max);
    the input is scanned only to count the offending values for the message.
    """
    if policy != "raise" or _range_is_usable(min_cur, max_cur, allow_inf):
        return
    nans = int(torch.isnan(x).sum())
    infs = int(torch.isinf(x).sum())
    kinds = f"{nans} NaN" + ("" if allow_inf else f" and {infs} inf")
    raise ValueError(
        f"{owner} got a batch with {kinds} value(s) among {x.numel()}; their "
        "range gives no usable scale. Clean the input (e.g. torch.nan_to_num), "
        "or pass nan_policy='propagate' for torch.ao's behaviour."
    )


class UniformQuantizationObserverBase(ObserverBase):
    """Base of the observers that turn a range into affine qparams.

    Args:
        dtype: quantized dtype, one of `torch.qint8, quint8, quint4x2,
            qint32, int8, uint8, int16, int32, uint16, float8_e5m2,
            float8_e4m3fn`.
        qscheme: `torch.per_tensor_affine`, `per_tensor_symmetric`,
            `per_channel_affine`, `per_channel_symmetric` or
            `per_channel_affine_float_qparams`.
        reduce_range: drop one bit of the range (x86 overflow workaround;
            prefer `quant_min` / `quant_max`).
        quant_min: custom lower end of the quantized range (with `quant_max`).
        quant_max: custom upper end.
        factory_kwargs: `device` / `dtype` of the buffers.
        eps: smallest scale, kept as the `(1,)` buffer `eps`.
        is_dynamic: dynamic quantization marker.
        nan_policy: `"raise"` (default, beyond torch) raises `ValueError` on a
            batch with NaN (min-max observers: or inf) values; `"propagate"`
            is torch.ao's behaviour.

    Raises:
        InvalidObserverArgument: unknown qscheme or dtype, invalid custom
            range.
        TypeError: an unknown keyword argument.
    """

    # torch's observer state-dict version: 3 (eps is a buffer; per-channel
    # buffers are `min_val` / `max_val`; histogram ranges are 0-dim).
    _version = 3

    eps: torch.Tensor

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
        *,
        nan_policy: NanPolicy = "raise",
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword argument(s) "
                f"{sorted(kwargs)}; it takes torch.ao's arguments plus nan_policy"
            )
        if nan_policy not in _NAN_POLICIES:
            raise ValueError(
                f"nan_policy={nan_policy!r} is not one of {list(_NAN_POLICIES)}"
            )
        factory_kwargs = torch.nn.factory_kwargs(factory_kwargs)
        super().__init__(dtype=dtype, is_dynamic=is_dynamic)
        self.qscheme = qscheme
        self.reduce_range = reduce_range
        self.nan_policy: NanPolicy = nan_policy
        self.register_buffer("eps", torch.tensor([eps], **factory_kwargs))
        if qscheme not in ALLOWED_QSCHEMES:
            raise InvalidObserverArgument(
                f"qscheme={qscheme} is not supported; use one of "
                + ", ".join(f"torch.{q}" for q in ALLOWED_QSCHEMES)
            )
        if dtype not in ALLOWED_DTYPES:
            raise InvalidObserverArgument(
                f"dtype={dtype} is not supported; use one of "
                + ", ".join(str(d) for d in ALLOWED_DTYPES)
            )
        self.has_customized_qrange = quant_min is not None and quant_max is not None
        try:
            self.quant_min, self.quant_max = torch_quant_range(
                dtype, quant_min, quant_max, reduce_range
            )
        except ValueError as error:  # torch asserts: the face's own type
            raise InvalidObserverArgument(str(error)) from None

    def _reject_symmetric_reduced_quint8(self) -> None:
        if (
            self.qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric)
            and self.reduce_range
            and self.dtype == torch.quint8
        ):
            raise UnsupportedObserverConfig(
                f"{type(self).__name__}: reduce_range=True is not supported for "
                "symmetric quint8 (the zero point 128 needs the full range); use "
                "quant_min/quant_max or an affine qscheme"
            )

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
        # Version 1 state dicts predate the eps buffer: use torch's default.
        version = local_metadata.get("version")
        if (version is None or version == 1) and prefix + "eps" not in state_dict:
            state_dict[prefix + "eps"] = torch.tensor([FLOAT32_EPS])
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )

    def _calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point of the range `[min_val, max_val]` (per tensor
        or per channel) under this observer's dtype, qscheme and range."""
        try:
            return torch_qparams(
                min_val,
                max_val,
                dtype=self.dtype,
                qscheme=self.qscheme,
                quant_min=self.quant_min,
                quant_max=self.quant_max,
                eps=self.eps,
                custom_range=self.has_customized_qrange,
            )
        except ValueError as error:  # torch asserts: the face's own type
            raise InvalidObserverArgument(str(error)) from None

    def reset_min_max_vals(self) -> None:
        """Forget the observed range (not supported by every observer)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset its statistics")
