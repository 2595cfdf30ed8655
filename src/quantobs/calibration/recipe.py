"""What to quantize in a model, in compressed-tensors' terms.

A `Recipe` is a set of config groups, each a list of `targets` and a
`QuantizationScheme`, plus an `ignore` list and an optional `kv_cache_scheme`
(the args of the attention states `k` and `v`), as in compressed-tensors'
`QuantizationConfig`. Targets and ignores match a module by

* its class name (`"Linear"`, `"LlamaAttention"`), or
* its full name (`"model.layers.0.mlp.down_proj"`), or
* a regular expression over its full name (`"re:.*self_attn$"`, matched with
  `re.match` as compressed-tensors does).

The observer of each tensor is the args' `observer` (with `observer_kwargs`),
or a default: `memoryless_minmax` for weights, `static_minmax` for static
activations, and llm-compressor 0.14's moving-average `minmax` for the
attention states `q`, `k`, `v` (its `initialize_observer`).

A scheme whose target is an attention module (one that has `q_proj` /
`query`-style projections, or whose class name says `Attention`) quantizes
the query states with its `input_activations`, as compressed-tensors does,
and the key and value states too where compressed-tensors caches them
(`quantobs.calibration.attention`). The `kv_cache_scheme` quantizes the key
and value states of every attention module compressed-tensors caches,
whatever the targets and the ignore list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantobs.core.args import QuantizationArgs
from quantobs.core.presets import QuantizationScheme, preset_scheme

__all__ = ["DEFAULT_OBSERVERS", "Recipe", "observer_for"]

#: The observers used when the args name none: llm-compressor 0.14's for
#: weights and attention states (`q`, `k`, `v`: the moving-average `minmax`).
DEFAULT_OBSERVERS = {
    "weight": "memoryless_minmax",
    "activation": "static_minmax",
    "attention": "minmax",
}
_ATTENTION_STATES = ("q", "k", "v")

_PARTS = {
    "weights": "weight",
    "input_activations": "input",
    "output_activations": "output",
}


def observer_for(base_name: str, args: QuantizationArgs) -> tuple[str, dict[str, Any]]:
    """The observer name and options calibrating `base_name` under `args`."""
    if args.observer is not None:
        return args.observer, dict(args.observer_kwargs)
    kind = "weight" if base_name == "weight" else "activation"
    if base_name in _ATTENTION_STATES:
        kind = "attention"
    return DEFAULT_OBSERVERS[kind], dict(args.observer_kwargs)


def _scheme(value: Any, targets: list[str] | None = None) -> QuantizationScheme:
    """A scheme from a scheme, a preset name, or a dict (compressed-tensors'
    scheme dump, with args as dicts or compressed-tensors objects)."""
    if isinstance(value, QuantizationScheme):
        return value
    if isinstance(value, str):
        return preset_scheme(value, targets)
    if isinstance(value, BaseModel):  # a compressed-tensors QuantizationScheme
        value = {k: getattr(value, k, None) for k in ("targets", *_PARTS)}
    if not isinstance(value, Mapping):
        raise TypeError(
            "a scheme is a QuantizationScheme, a preset name (e.g. 'W4A16') or "
            f"a dict; got {type(value).__name__}"
        )
    data = {k: v for k, v in value.items() if v is not None}
    for part in _PARTS:
        if part in data and not isinstance(data[part], QuantizationArgs):
            data[part] = QuantizationArgs.from_compressed_tensors(data[part])
    if targets is not None:
        data["targets"] = targets
    return QuantizationScheme.model_validate(data)


def _with_observer(
    scheme: QuantizationScheme, part: str, observer: Any
) -> QuantizationScheme:
    """`scheme` with `part`'s observer replaced: a name or `(name, options)`."""
    args = getattr(scheme, part)
    if args is None or observer is None:
        return scheme
    pair = (observer, {}) if isinstance(observer, str) else observer
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        pair = (None, None)
    name, options = pair
    if not isinstance(name, str) or not isinstance(options, Mapping):
        raise TypeError(
            f"an observer is a name or (name, options); got {observer!r} for {part}"
        )
    update = {"observer": name, "observer_kwargs": dict(options)}
    return scheme.model_copy(update={part: args.model_copy(update=update)})


class Recipe(BaseModel):
    """Config groups of targets and schemes, an ignore list, kv-cache args.

    Build one with `Recipe.from_scheme("W4A16", ignore=["lm_head"])`, from a
    compressed-tensors `QuantizationConfig` (or its dict) with
    `Recipe.from_compressed_tensors`, or field by field::

        Recipe(
            config_groups={"group_0": {"targets": ["Linear"], "weights": {...}}},
            ignore=["lm_head", "re:.*pooler.*"],
        )

    Attributes:
        config_groups: name -> scheme (its `targets` say where it applies);
            a module matched by several groups takes the first.
        ignore: targets never quantized.
        kv_cache_scheme: args of the `k` and `v` attention states of every
            attention module compressed-tensors caches, whatever the targets
            (or None).
    """

    model_config = ConfigDict(extra="forbid")

    config_groups: dict[str, QuantizationScheme]
    ignore: list[str] = Field(default_factory=list)
    kv_cache_scheme: QuantizationArgs | None = None

    @field_validator("config_groups", mode="before")
    @classmethod
    def _groups(cls, value: Any) -> Any:
        if not isinstance(value, Mapping) or not value:
            raise ValueError("config_groups must be a non-empty mapping")
        return {name: _scheme(scheme) for name, scheme in value.items()}

    @field_validator("kv_cache_scheme", mode="before")
    @classmethod
    def _kv_args(cls, value: Any) -> Any:
        if value is None or isinstance(value, QuantizationArgs):
            return value
        return QuantizationArgs.from_compressed_tensors(value)

    # ---------------------------------------------------------- builders

    @classmethod
    def from_scheme(
        cls,
        scheme: str | QuantizationScheme,
        *,
        targets: list[str] | None = None,
        ignore: list[str] | None = None,
        weight_observer: str | tuple[str, Mapping[str, Any]] | None = None,
        input_observer: str | tuple[str, Mapping[str, Any]] | None = None,
        output_observer: str | tuple[str, Mapping[str, Any]] | None = None,
        kv_cache_scheme: QuantizationArgs | None = None,
    ) -> Recipe:
        """One config group: a scheme (preset name or object) on `targets`.

        Args:
            scheme: e.g. `"W4A16"`, `"FP8"`, `"NVFP4"`.
            targets: default `["Linear"]`.
            ignore: e.g. `["lm_head"]`.
            weight_observer, input_observer, output_observer: an observer
                name, or `(name, options)`, overriding the scheme's.
            kv_cache_scheme: args of the `k` / `v` attention states.
        """
        found = _scheme(scheme, targets)
        found = _with_observer(found, "weights", weight_observer)
        found = _with_observer(found, "input_activations", input_observer)
        found = _with_observer(found, "output_activations", output_observer)
        return cls(
            config_groups={"group_0": found},
            ignore=list(ignore or []),
            kv_cache_scheme=kv_cache_scheme,
        )

    @classmethod
    def from_compressed_tensors(cls, config: Any) -> Recipe:
        """From a compressed-tensors `QuantizationConfig` or its dict (the
        `quantization_config` of a checkpoint's `config.json`)."""
        if isinstance(config, BaseModel):
            data = {
                "config_groups": dict(config.config_groups),  # type: ignore[attr-defined]
                "ignore": list(getattr(config, "ignore", None) or []),
                "kv_cache_scheme": getattr(config, "kv_cache_scheme", None),
            }
        elif isinstance(config, Mapping):
            data = {
                "config_groups": config.get("config_groups"),
                "ignore": list(config.get("ignore") or []),
                "kv_cache_scheme": config.get("kv_cache_scheme"),
            }
        else:
            raise TypeError(
                "expected a compressed-tensors QuantizationConfig or its dict, got "
                f"{type(config).__name__}"
            )
        return cls.model_validate(data)

    @classmethod
    def coerce(cls, value: Any) -> Recipe:
        """A recipe from a `Recipe`, a preset name, a `QuantizationScheme`, or a
        compressed-tensors config (object or dict)."""
        if isinstance(value, Recipe):
            return value
        if isinstance(value, str | QuantizationScheme):
            return cls.from_scheme(value)
        if isinstance(value, Mapping) and "config_groups" not in value:
            return cls.model_validate(value)
        return cls.from_compressed_tensors(value)

    # ----------------------------------------------------------- exports

    def to_json(self) -> str:
        """The recipe as JSON (dtypes by name); `Recipe.from_json` reads it."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        """Inverse of `to_json`."""
        return cls.model_validate(json.loads(text))

    def to_compressed_tensors(self, format: str | None = None) -> Any:
        """The compressed-tensors `QuantizationConfig` of this recipe (needs
        compressed-tensors).

        Args:
            format: the checkpoint format (e.g. `"pack-quantized"`), or None.
        """
        from compressed_tensors.quantization import (
            QuantizationConfig,
        )
        from compressed_tensors.quantization import (
            QuantizationScheme as CTScheme,
        )

        groups = {}
        for name, scheme in self.config_groups.items():
            parts = {
                part: args.to_compressed_tensors()
                for part in _PARTS
                if (args := getattr(scheme, part)) is not None
            }
            groups[name] = CTScheme(targets=list(scheme.targets), **parts)
        kv = self.kv_cache_scheme
        extra = {} if format is None else {"format": format}
        return QuantizationConfig(
            config_groups=groups,
            ignore=list(self.ignore),
            kv_cache_scheme=None if kv is None else kv.to_compressed_tensors(),
            **extra,
        )
