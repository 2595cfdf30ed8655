"""AMD Quark 0.13's `ModelQuantizer` with `quantobs.quark` observers.

Quark takes an observer class only from the module-level sets of
`quark.torch.quantization.observer`; importing this module adds every
concrete observer of `quantobs.quark` to them, so Quark's own config names
ours and `ModelQuantizer` builds and drives them (`forward` on each batch,
`_calculate_qparams` after it, as it does its own)::

    import quantobs.integrations.quark  # noqa: F401  (the set-up)
    import quantobs.quark as qo
    from quark.torch import ModelQuantizer
    from quark.torch.quantization.config.config import (
        QConfig,
        QLayerConfig,
        QTensorConfig,
    )
    from quark.torch.quantization.config.type import (
        Dtype,
        QSchemeType,
        RoundType,
        ScaleType,
    )

    activations = QTensorConfig(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_tensor,
        observer_cls=qo.PerTensorPercentileObserver,  # instead of Quark's
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
    )
    config = QConfig(global_quant_config=QLayerConfig(input_tensors=activations))
    model = ModelQuantizer(config).quantize_model(model, dataloader)

A config already written with Quark's observers switches in one line:
`config = use_quantobs_observers(config)`. A `quantobs.quark.QTensorConfig`
is accepted wherever `QLayerConfig` (and `QConfig.softmax_quant_spec`) takes
Quark's: it is converted on construction (`to_quark`); `from_quark` goes the
other way, and our observers accept Quark's specs as they are.

What importing does (again: nothing more; Quark's files are not touched):

====================================  =========================================
where (in Quark)                      what is added
====================================  =========================================
`observer.OBSERVER_CLASSES`           every class of `OBSERVER_CLASSES`
`observer.PER_TENSOR_OBSERVERS`,      each class under every qscheme it
`PER_CHANNEL_OBSERVERS`,              implements (`cls.qschemes`: the
`PER_GROUP_OBSERVERS`                 histogram, percentile and MSE observers
                                      also per channel / per group)
`observer.OBSERVER_MAP`               `"quantobs.quark.<Name>"` (Quark's own
                                      names keep naming Quark's classes)
`graph.torch_utils` and               the power-of-two observers, so FX graph
`graph.optimization.                  mode picks its power-of-two passes
model_optimization.POW_OF_2_OBSERVER`
`QLayerConfig.__post_init__`,         a step that converts
`QConfig.__post_init__`               `quantobs.quark.QTensorConfig` specs
                                      (wrapped once, Quark's check runs after)
====================================  =========================================

Limits: float16 / bfloat16 specs need Quark's own `PlaceholderObserver`
(Quark tests its identity; it keeps no statistics, and `to_quark` maps ours
to it). Quark's MX buffer-reuse switch (`enable_buffer_reuse`) replaces only
its own `PerBlockMXObserver`. A config saved with `to_dict` names an
observer by class name, and `from_dict` reads a bare name as Quark's class
(the saved qparams do not depend on it; `"quantobs.quark.<Name>"` reads as
ours). Our observers keep their statistics in persistent buffers (Quark's
are not): a quantized model's `state_dict` has them until
`ModelQuantizer.freeze` or `export_safetensors` drops the observers. Our
specs are stricter than Quark's (see `quantobs.quark`'s docstring): a spec
Quark accepts but cannot compute fails when `ModelQuantizer` builds the
observer, with a `ValueError` that names the fix.

Raises:
    ImportError: on import, when amd-quark 0.13 (the `peers` extra) is not
        installed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from enum import Enum
from typing import Any

from quantobs.faces import quark as _face
from quantobs.faces.quark.spec import as_spec

try:
    import quark.torch.quantization.graph.torch_utils as _q_graph_utils
    import quark.torch.quantization.observer as _q_observers
    from quark.torch.quantization.config import config as _q_config
    from quark.torch.quantization.config import type as _q_type
    from quark.torch.quantization.graph.optimization import (
        model_optimization as _q_graph_opt,
    )
except ImportError as error:  # pragma: no cover - exercised without Quark
    raise ImportError(
        "quantobs.integrations.quark needs AMD Quark 0.13 "
        "(quark.torch.quantization.observer); install it with "
        "`pip install 'quantobs[peers]'` or `pip install 'amd-quark==0.13.*'`"
    ) from error

__all__ = [
    "MAP_PREFIX",
    "OBSERVER_CLASSES",
    "from_quark",
    "register",
    "to_quark",
    "use_quantobs_observers",
]

#: Prefix of our classes' keys in Quark's `OBSERVER_MAP`.
MAP_PREFIX = "quantobs.quark."

#: The concrete observer classes of `quantobs.quark` that Quark can take
#: (all but `PlaceholderObserver`, whose identity Quark tests).
OBSERVER_CLASSES: tuple[type[_face.ObserverBase], ...] = tuple(
    dict.fromkeys(
        obj
        for obj in (getattr(_face, name) for name in _face.__all__)
        if isinstance(obj, type)
        and issubclass(obj, _face.ObserverBase)
        and not obj.is_abstract()
        and obj is not _face.PlaceholderObserver
    )
)

# Quark's set of the observers of each qscheme, by the qscheme's value.
_SETS_BY_QSCHEME = {
    "per_tensor": "PER_TENSOR_OBSERVERS",
    "per_channel": "PER_CHANNEL_OBSERVERS",
    "per_group": "PER_GROUP_OBSERVERS",
}
# Quark's modules that hold a tuple of the power-of-two observer classes.
_POW2_HOLDERS = (_q_graph_utils, _q_graph_opt)
# Marks our wrapper of a config's `__post_init__` (holds Quark's original).
_WRAPPED = "__quantobs_wraps__"
# The spec fields of a `QLayerConfig`.
_LAYER_FIELDS = ("input_tensors", "output_tensors", "weight", "bias")


def register() -> None:
    """Make Quark accept `OBSERVER_CLASSES` and our specs (see the module).

    Done on import; calling it again changes nothing.
    """
    for cls in OBSERVER_CLASSES:
        _q_observers.OBSERVER_CLASSES.add(cls)
        for qscheme in cls.qschemes:
            name = _SETS_BY_QSCHEME.get(qscheme.value)
            if name is not None:
                getattr(_q_observers, name).add(cls)
        _q_observers.OBSERVER_MAP.setdefault(MAP_PREFIX + cls.__name__, cls)
    for holder in _POW2_HOLDERS:
        known: tuple[type, ...] = holder.POW_OF_2_OBSERVER
        twins = tuple(_twin(cls) for cls in known)
        added = tuple(cls for cls in twins if cls is not None and cls not in known)
        holder.POW_OF_2_OBSERVER = known + added
    _wrap_post_init(_q_config.QLayerConfig, _convert_layer_specs)
    _wrap_post_init(_q_config.QConfig, _convert_softmax_spec)


def _twin(cls: type) -> type[_face.ObserverBase] | None:
    """Our observer class of the same name as Quark's `cls`, if any."""
    for ours in OBSERVER_CLASSES:
        if ours.__name__ == cls.__name__:
            return ours
    return None


def _wrap_post_init(cls: type, convert: Callable[[Any], None]) -> None:
    """Run `convert(self)` before `cls.__post_init__` (once, however often
    called)."""
    original = getattr(cls, "__post_init__", None)
    if original is None or hasattr(original, _WRAPPED):
        return

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        convert(self)
        original(self)

    setattr(__post_init__, _WRAPPED, original)
    setattr(cls, "__post_init__", __post_init__)  # noqa: B010 - a dunder


def _convert_layer_specs(layer: Any) -> None:
    """Our specs in a `QLayerConfig`'s fields become Quark's."""
    for field in _LAYER_FIELDS:
        value = getattr(layer, field, None)
        if _holds_ours(value):
            setattr(layer, field, to_quark(value))


def _convert_softmax_spec(config: Any) -> None:
    """Our spec as a `QConfig`'s `softmax_quant_spec` becomes Quark's."""
    value = getattr(config, "softmax_quant_spec", None)
    if _holds_ours(value):
        config.softmax_quant_spec = to_quark(value)


def _holds_ours(value: Any) -> bool:
    if isinstance(value, list):
        return any(isinstance(item, _face.QTensorConfig) for item in value)
    return isinstance(value, _face.QTensorConfig)


# ---------------------------------------------------------------- specs


def to_quark(spec: Any) -> Any:
    """Quark's `QTensorConfig` for ours (field by field, same observer class).

    Args:
        spec: a `quantobs.quark.QTensorConfig`, Quark's (returned as it is),
            a list of them (converted one by one, as Quark's sequential
            specs), or None.

    Returns:
        `quark.torch.quantization.config.config.QTensorConfig` (a list for a
        list, None for None). Enum fields become Quark's members of the same
        name; our `PlaceholderObserver` becomes Quark's (a cast: no
        statistics, and Quark accepts only its own).

    Raises:
        TypeError: `spec` is none of these.
        ValueError: Quark rejects the converted spec.
    """
    if spec is None:
        return None
    if isinstance(spec, list):
        return [to_quark(item) for item in spec]
    if isinstance(spec, _q_config.QTensorConfig):
        return spec
    if not isinstance(spec, _face.QTensorConfig):
        raise TypeError(
            f"to_quark takes a quantobs.quark.QTensorConfig (or Quark's, or a list "
            f"of them), got {type(spec).__name__}; build the spec with "
            "quantobs.quark.QTensorConfig(...) or Quark's QTensorConfig(...)"
        )
    values = {
        field.name: _quark_value(getattr(spec, field.name))
        for field in dataclasses.fields(spec)
    }
    return _q_config.QTensorConfig(**values)


def _quark_value(value: Any) -> Any:
    """A field of our spec as Quark's spec holds it."""
    if isinstance(value, Enum):
        return getattr(_q_type, type(value).__name__)[value.name]
    if value is _face.PlaceholderObserver:
        return _q_observers.PlaceholderObserver
    return value


def from_quark(spec: Any) -> Any:
    """Our `quantobs.quark.QTensorConfig` for Quark's (or ours, as it is).

    Quark's observer classes become ours of the same name. A list is
    converted one by one; None gives None.

    Raises:
        TypeError: `spec` is not a spec.
        ValueError: the spec is one our observers cannot compute (see
            `quantobs.quark`'s docstring).
    """
    if spec is None:
        return None
    if isinstance(spec, list):
        return [from_quark(item) for item in spec]
    return as_spec(spec)


def use_quantobs_observers(config: Any) -> Any:
    """A copy of a Quark config with our observers instead of Quark's.

    Every Quark `QTensorConfig` inside `config` (a `QConfig`, `QLayerConfig`,
    `QTensorConfig`, or a list / dict of them) whose observer class has a
    namesake in `OBSERVER_CLASSES` gets ours; everything else is copied as
    it is (`PlaceholderObserver` included). `config` is not modified.

    Raises:
        ValueError: Quark rejects a spec with our class (not expected: ours
            are registered for every qscheme Quark's namesake has).
    """
    return _swap(copy.deepcopy(config))


def _swap(value: Any) -> Any:
    if isinstance(value, _q_config.QTensorConfig):
        ours = _twin(value.observer_cls) if value.observer_cls is not None else None
        if ours is None or value.observer_cls is ours:
            return value
        return dataclasses.replace(value, observer_cls=ours)
    if isinstance(value, list):
        items = [_swap(item) for item in value]
        changed = any(a is not b for a, b in zip(items, value, strict=True))
        return items if changed else value
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _swap(item)  # a copy's dict: changed in place
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            item = getattr(value, field.name, None)
            swapped = _swap(item)
            if swapped is not item:
                setattr(value, field.name, swapped)
    return value


register()
