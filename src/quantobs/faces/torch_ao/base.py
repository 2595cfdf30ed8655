"""Base classes of the torch.ao face and the `with_args` factories.

(One concept, a little over 500 lines: torch.ao's base-class contract —
constructor, attributes, state-dict versions, `calculate_qparams` with the
overflow repair — which every observer of the face inherits whole.)

`ObserverBase` and `UniformQuantizationObserverBase` are torch.ao's drop-in
names and derive from the observer engine
(`quantobs.observers.engine.ObserverEngine`): an observer's statistic lives
in the registered buffers torch uses (`min_val`, `max_val`, `histogram`), so
`.to()`, `state_dict()`, `copy.deepcopy` and `torch.save` work as on any
module, and observing a batch is the engine's (the statistic's scan, the NaN
policy, the update). What is the face's own:

* torch's constructor signatures, attributes (`dtype`, `qscheme`,
  `quant_min`, `quant_max`, `reduce_range`, `has_customized_qrange`,
  `is_dynamic`) and the `eps` buffer;
* torch's state-dict layout (version 3) and its legacy-version rules, so
  state dicts interchange with torch's observers both ways: buffers always
  present, per-tensor ranges 0-dim (`(+inf, -inf)` before data), per-channel
  ranges `(C,)` (empty `(0,)` before data: "no statistic");
* range -> qparams by torch's rule (`quantobs.core.qparams.torch_rule`,
  `TorchAORule`), its `ValueError` raised as the face's
  `InvalidObserverArgument`; shape and NaN errors in the face's types and
  words (`quantobs.faces.torch_ao.errors`).

NaN policy (the engine's, `quantobs.stats.reduce`'s table)::

    nan_policy   a batch with NaN (min-max observers: or +-inf)
    raise        ValueError naming the counts (default, beyond torch)
    omit         those values ignored (beyond torch); a batch with no
                 finite value is skipped, so an observer that saw nothing
                 else still warns and returns torch's default qparams
    propagate    the values reach the statistic (torch.ao's behaviour)
"""

from __future__ import annotations

import abc
import functools
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any, ClassVar, get_args

import torch

from quantobs.core.layout import channel_view
from quantobs.core.qparams.torch_repair import repair_qparams
from quantobs.core.qparams.torch_rule import (
    ALLOWED_DTYPES,
    ALLOWED_QSCHEMES,
    PER_TENSOR_QSCHEMES,
    TorchAORule,
    torch_quant_range,
)
from quantobs.faces.torch_ao.errors import (
    InvalidObserverArgument,
    UnsupportedObserverConfig,
)
from quantobs.observers.engine import ObserverEngine
from quantobs.stats.base import Statistic
from quantobs.stats.reduce import NanPolicy

__all__ = [
    "FLOAT32_EPS",
    "TORCHAO_OBSERVERS",
    "NanPolicy",
    "ObserverBase",
    "UniformQuantizationObserverBase",
    "register_twins",
    "reject_dynamic",
    "require_qscheme",
    "tensor_view",
]

FLOAT32_EPS = torch.finfo(torch.float32).eps

#: torchao's copy of torch.ao's observer module: its PT2E flow
#: (`prepare_pt2e` / `convert_pt2e`) tests `isinstance` against these classes.
TORCHAO_OBSERVERS = "torchao.quantization.pt2e.observer"


def register_twins(observer_module: ModuleType, classes: Iterable[type]) -> None:
    """Make each class a virtual subclass of its namesake in `observer_module`.

    Then `isinstance(ours, twin)` holds, and flows that test for their own
    observer classes (torch.ao's `prepare` / `convert`, torchao's PT2E
    `convert_pt2e`) take ours. Names the module lacks, and namesakes that are
    not ABCs, are skipped; registering twice is harmless.

    Args:
        observer_module: torch.ao's `torch.ao.quantization.observer`, or a copy
            of it (`TORCHAO_OBSERVERS`).
        classes: this face's observer classes.
    """
    for cls in classes:
        twin = getattr(observer_module, cls.__name__, None)
        if isinstance(twin, abc.ABCMeta) and not issubclass(cls, twin):
            twin.register(cls)


# Classes already registered with torchao's observer classes (the hook below).
_torchao_registered: set[type] = set()


def _register_with_torchao(cls: type) -> None:
    """Register `cls` and its face bases with torchao's PT2E observer classes,
    when torchao's observer module is loaded.

    Called at each construction: torchao's `prepare_pt2e` builds our observers
    after loading that module, and without the registration its
    `convert_pt2e` would silently leave them in the graph (float activations).
    The face never imports torchao itself (a slow import);
    `quantobs.integrations.torchao` registers every class eagerly.
    """
    if cls in _torchao_registered:
        return
    module = sys.modules.get(TORCHAO_OBSERVERS)
    if module is None:
        return
    # Only the face's classes: the MRO also holds abc.ABC, and torchao's
    # module has a class named "ABC" too.
    package = __name__.rpartition(".")[0]
    register_twins(module, [c for c in cls.__mro__ if c.__module__.startswith(package)])
    _torchao_registered.add(cls)


class _PartialWrapper:
    """A constructor with bound keyword arguments (what `with_args` returns).

    Calling it builds a new observer. `callable_args` are called at each
    construction (e.g. a device chosen late). The attributes `p` (a
    `functools.partial`) and `callable_args` are the ones torch's own code
    reads (`FakeQuantize` looks up `p.keywords["dtype"]`).

    `__name__` is the name of the class it builds: torchao's PT2E `prepare`
    reads it from a constructor it does not recognise as its own wrapper (it
    keeps `ch_axis` only for a name with "PerChannel"); torch's wrapper has
    none and fails there with an AttributeError.
    """

    def __init__(self, p: functools.partial[Any]) -> None:
        self.p = p
        self.callable_args: dict[str, Callable[[], Any]] = {}

    @property
    def __name__(self) -> str:
        """The name of the class this constructor builds."""
        func = self.p.func  # a class, another wrapper, or a partial of either
        while isinstance(func, functools.partial):
            func = func.func
        return str(getattr(func, "__name__", type(func).__name__))

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


class ObserverBase(ObserverEngine, abc.ABC):
    """Base of every observer: `forward(x) -> x` records, `calculate_qparams`.

    An `ObserverEngine` (a subclass that keeps a statistic names it in
    `Statistic`; the others keep none).

    Args:
        dtype: the quantized dtype the observer's qparams are meant for.
        is_dynamic: whether the quantize op built from this observer computes
            its qparams at run time (dynamic quantization).
        nan_policy: the engine's NaN policy (`NanPolicy`; observers without
            statistics never apply it).

    `with_args(**kwargs)` and `with_callable_args(**kwargs)` (class methods)
    return constructors with bound arguments, for `QConfig`.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        is_dynamic: bool = False,
        *,
        nan_policy: NanPolicy = "propagate",
    ) -> None:
        super().__init__(nan_policy=nan_policy)
        self.dtype = dtype
        self.is_dynamic = is_dynamic
        _register_with_torchao(type(self))

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


def tensor_view(x: torch.Tensor) -> torch.Tensor:
    """`x` as `(1, numel)`: the canonical layout of one qparam per tensor.

    A view for a contiguous tensor or a permutation of one (`channel_view`
    of `x` with a leading channel axis of size 1); a 0-dim `x` is `(1, 1)`.
    """
    if x.is_contiguous():
        return x.view(1, -1)  # (1, numel)
    return channel_view(x[None], 0)[:, 0]  # (1, 1, numel) -> (1, numel)


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
            batch with NaN (min-max observers: or inf) values; `"omit"`
            ignores them; `"propagate"` is torch.ao's behaviour (module
            docstring).

    Raises:
        InvalidObserverArgument: unknown qscheme or dtype, invalid custom
            range.
        TypeError: an unknown keyword argument.
        ValueError: an unknown `nan_policy`.
    """

    # torch's observer state-dict version: 3 (eps is a buffer; per-channel
    # buffers are `min_val` / `max_val`; histogram ranges are 0-dim).
    _version = 3
    # torch's names of the range buffers.
    buffer_names: ClassVar[Mapping[str, str]] = {
        "min_vals": "min_val",
        "max_vals": "max_val",
    }
    # float64 ranges of float64 inputs: the face casts them to its buffers'
    # dtype (torch computes in the buffers' dtype: float64 buffers stay exact).
    exact_dtype: ClassVar[bool] = True
    # The statistic's qparam shape before any data: () per tensor (torch's
    # (+inf, -inf) range), (0,) per channel (torch's empty buffers).
    _unobserved_shape: ClassVar[tuple[int, ...]] = ()
    # Whether +-inf inputs are the statistic's to handle (the histogram drops
    # them) rather than the NaN policy's.
    _allows_inf: ClassVar[bool] = False

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
        if nan_policy not in get_args(NanPolicy):
            raise ValueError(
                f"nan_policy={nan_policy!r} is not one of {list(get_args(NanPolicy))}"
            )
        factory_kwargs = torch.nn.factory_kwargs(factory_kwargs)
        super().__init__(dtype=dtype, is_dynamic=is_dynamic, nan_policy=nan_policy)
        self.qscheme = qscheme
        self.reduce_range = reduce_range
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

    # ------------------------------------------------------------ engine hooks

    def _read_state(
        self, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        # torch's "nothing observed": empty buffers (per channel), or the
        # initial range (+inf, -inf) (per tensor).
        if any(value.numel() == 0 for value in state.values()):
            return None
        low, high = state.get("min_vals"), state.get("max_vals")
        initial = (
            low is not None
            and high is not None
            and low.dim() == 0
            and bool((low == math.inf) & (high == -math.inf))  # one host read
        )
        return None if initial else state

    def _write_state(self, field: str, value: torch.Tensor) -> torch.Tensor:
        # A buffer keeps its dtype (the factory dtype, or one set by `.to()`),
        # as torch copies into it.
        current = self._buffers.get(self._buffer_name(field))
        if current is None or current.dtype == value.dtype:
            return value
        return value.to(current.dtype)

    def _may_drop(self, name: str) -> bool:
        return False  # torch's observers always have their buffers

    def _initial_statistic(self) -> Statistic | None:
        if self.statistic_type() is None:
            return None
        return self._new_statistic(self._unobserved_shape, self._device_marker.device)

    def _nonfinite_error(self, x_flat: torch.Tensor) -> Exception:
        nans = int(torch.isnan(x_flat).sum())
        kinds = f"{nans} NaN"
        if not self._allows_inf:
            kinds += f" and {int(torch.isinf(x_flat).sum())} inf"
        return ValueError(
            f"{type(self).__name__} got a batch with {kinds} value(s) among "
            f"{x_flat.numel()}; their range gives no usable scale. Clean the "
            "input (e.g. torch.nan_to_num), pass nan_policy='omit' to ignore "
            "them, or nan_policy='propagate' for torch.ao's behaviour."
        )

    def _check_merge(self, other: ObserverEngine) -> None:
        for what in ("dtype", "qscheme", "quant_min", "quant_max", "ch_axis", "bins"):
            if getattr(self, what, None) != getattr(other, what, None):
                raise ValueError(
                    f"cannot merge {type(self).__name__}s with different {what} "
                    f"({getattr(self, what)} and {getattr(other, what)})"
                )

    # ------------------------------------------------------------- state dicts

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
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
            state_dict[prefix + "eps"] = torch.tensor([FLOAT32_EPS])  # type: ignore[index]
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )

    # ----------------------------------------------------------------- qparams

    @property
    def qparams_rule(self) -> TorchAORule:
        """torch.ao's rule with this observer's current settings."""
        return TorchAORule(
            dtype=self.dtype,
            qscheme=self.qscheme,
            quant_min=self.quant_min,
            quant_max=self.quant_max,
            eps=self.eps,
            custom_range=self.has_customized_qrange,
        )

    def _calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point of the range `[min_val, max_val]` (per tensor
        or per channel) under this observer's dtype, qscheme and range:
        torch's, repaired where its float32 arithmetic overflows on a finite
        range (`quantobs.faces.torch_ao.overflow.repair_qparams`).

        Raises:
            InvalidObserverArgument: a range torch's rule rejects.
            ValueError: a range too wide for the quantized range (its scale
                exceeds the float32 maximum).
        """
        rule = self.qparams_rule
        try:
            scale, zero_point = rule(min_val, max_val)
        except ValueError as error:  # torch asserts: the face's own type
            raise InvalidObserverArgument(str(error)) from None
        return repair_qparams(
            rule, min_val, max_val, scale, zero_point, type(self).__name__
        )

    def reset_min_max_vals(self) -> None:
        """Forget the observed statistic (back to the state before any data).

        Raises:
            NotImplementedError: an observer that keeps no statistic.
        """
        if self.statistic_type() is None:
            raise NotImplementedError(
                f"{type(self).__name__} keeps no statistic to reset"
            )
        self.reset()
