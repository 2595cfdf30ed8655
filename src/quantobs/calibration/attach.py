"""Carry observers to a model: one per module and tensor, fed by hooks.

`attach(model, recipe)` registers, on every module a config group targets,
one observer per quantized tensor as a submodule named as llm-compressor
names them: `weight_observer`, `input_observer`, `output_observer`, and on
attention modules `q_observer`, `k_observer`, `v_observer`. Forward
pre-hooks feed the inputs, forward hooks the outputs; the query, key and
value states are observed where the attention function receives them
(`(batch, heads, seq, head_dim)`, after rotary embeddings) through an
attention implementation registered with transformers, which then calls the
model's own. While `calibrate` runs a batch, hooks keep only its real tokens
(`quantobs.calibration.tokens`: the attention mask). Weights are observed
once, by `calibrate`. No hook keeps an activation after it returns.
MoE experts stored as fused 3-D parameters are replaced, while attached, by
per-expert Linears that recipes target like any other
(`quantobs.calibration.experts`).
`detach(model)` removes every hook and observer (the qparams written stay,
except those of fused experts: `detach` puts the fused modules back, and
their per-expert Linears go with their qparams; export before detaching).
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from quantobs.calibration.experts import expert_tag, linearize, restore
from quantobs.calibration.recipe import Recipe, observer_for
from quantobs.calibration.tokens import current_mask
from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import BASE_NAMES, qparam_shape
from quantobs.core.presets import QuantizationScheme
from quantobs.observers.base import Observer

__all__ = [
    "ATTACHMENT_ATTR",
    "QPARAM_KINDS",
    "Attachment",
    "Entry",
    "attach",
    "attachment_of",
    "detach",
    "is_attention",
    "observers_of",
]

#: Attribute of the model holding its `Attachment`.
ATTACHMENT_ATTR = "_quantobs_attachment"
_ATTN_NAME = "quantobs_observed"
#: The qparams written per tensor: `{base_name}_{kind}`.
QPARAM_KINDS = ("scale", "zero_point", "global_scale")
# Projections of an attention module: Llama-style, then BERT-style.
_QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))


@dataclass
class Entry:
    """One observed tensor: `module`'s `base_name` under `args`.

    Attributes:
        name: the module's full name in the model.
        module: the module (its `{base_name}_observer` is the observer).
        base_name: `weight`, `input`, `output`, `q`, `k` or `v`.
        args: the quantization args.
        group: the recipe's config group (`"kv_cache"` for `k` / `v`).
        tokens: tokens observed so far (activations and attention states).
        enabled: whether the hooks feed the observer (calibrate's reference
            pass turns the others off).
        masked: whether the hooks keep only the batch's real tokens (off
            where the module sees tokens already selected, e.g. an expert).
    """

    name: str
    module: torch.nn.Module
    base_name: str
    args: QuantizationArgs
    group: str
    tokens: int = 0
    enabled: bool = True
    masked: bool = True

    @property
    def key(self) -> str:
        """`"{module name}.{base_name}"`: the entry's name in reports and files."""
        return f"{self.name}.{self.base_name}" if self.name else self.base_name

    @property
    def observer(self) -> Observer:
        """The observer (a submodule of `module`)."""
        found = getattr(self.module, f"{self.base_name}_observer")
        if not isinstance(found, Observer):  # pragma: no cover - set by attach
            raise TypeError(f"{self.key}: observer missing")
        return found

    @property
    def weight(self) -> torch.Tensor:
        """The module's weight (weight entries)."""
        found = getattr(self.module, "weight", None)
        if not isinstance(found, torch.Tensor):  # pragma: no cover - checked
            raise TypeError(f"{self.key}: the module has no weight tensor")
        return found

    def observed_dtype(self) -> torch.dtype:
        """The module's parameter dtype (compressed-tensors' scale dtype rule)."""
        for param in self.module.parameters(recurse=False):
            return param.dtype
        for param in self.module.parameters():
            return param.dtype
        return torch.float32


@dataclass
class Attachment:
    """What `attach` did to a model (kept on it as `ATTACHMENT_ATTR`).

    Attributes:
        recipe: the recipe attached.
        entries: every observed tensor, in module order.
        handles: the hooks registered.
        attn_impl: the model's attention implementation before attach (None
            when no attention state is observed).
        experts: the fused experts modules replaced while attached
            (`quantobs.calibration.experts`), by name.
    """

    recipe: Recipe
    entries: list[Entry] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)
    attn_impl: str | None = None
    experts: list[str] = field(default_factory=list)

    def by_key(self) -> dict[str, Entry]:
        """Entries by `Entry.key`."""
        return {e.key: e for e in self.entries}


# ---------------------------------------------------------------- matching


def _matches(target: str, name: str, module: torch.nn.Module) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == type(module).__name__


def is_attention(module: torch.nn.Module) -> bool:
    """Whether `module` computes attention from q / k / v projections
    (Llama-style `q_proj`... or BERT-style `query`...)."""
    if not type(module).__name__.endswith("Attention"):
        return False
    return any(all(hasattr(module, n) for n in names) for names in _QKV_NAMES)


def _close_names(target: str, model: torch.nn.Module) -> str:
    names = {n for n, _ in model.named_modules() if n}
    names |= {type(m).__name__ for m in model.modules()}
    bare = target[3:] if target.startswith("re:") else target
    close = difflib.get_close_matches(bare, sorted(names), n=5, cutoff=0.5)
    return ", ".join(repr(c) for c in close) if close else "none"


def _resolve(
    model: torch.nn.Module, recipe: Recipe
) -> list[tuple[str, torch.nn.Module, str, QuantizationScheme]]:
    """`(name, module, group, scheme)` of every module a group targets and
    the ignore list spares, in module order.

    Raises:
        ValueError: a target that matches no module (close names listed).
    """
    found: list[tuple[str, torch.nn.Module, str, QuantizationScheme]] = []
    used: set[tuple[str, str]] = set()
    for name, module in model.named_modules():
        for group, scheme in recipe.config_groups.items():
            hit = next((t for t in scheme.targets if _matches(t, name, module)), None)
            if hit is None:
                continue
            used.add((group, hit))
            if not any(_matches(t, name, module) for t in recipe.ignore):
                found.append((name, module, group, scheme))
            break
    for group, scheme in recipe.config_groups.items():
        for target in scheme.targets:
            if (group, target) not in used:
                raise ValueError(
                    f"config group {group!r}: target {target!r} matches no module; "
                    f"close names: {_close_names(target, model)}"
                )
    return found


# ------------------------------------------------------------------ checks


def _check_takes(
    name: str, module: torch.nn.Module, base_name: str, args: QuantizationArgs
) -> None:
    """Raise if the module's tensor cannot be quantized under `args`."""
    weight = getattr(module, "weight", None)
    shape: tuple[int, ...] | None = None
    if base_name == "weight":
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(
                f"layer {name!r} ({type(module).__name__}) has no 2-D weight to "
                "quantize; target Linear-like modules or add it to the recipe's "
                "ignore list"
            )
        shape = tuple(weight.shape)
    elif base_name == "input" and isinstance(weight, torch.Tensor) and weight.ndim == 2:
        shape = (1, int(weight.shape[1]))
    elif (
        base_name == "output" and isinstance(weight, torch.Tensor) and weight.ndim == 2
    ):
        shape = (1, int(weight.shape[0]))
    if shape is None:
        return
    try:
        qparam_shape(shape, base_name, args)
    except ValueError as err:
        raise ValueError(
            f"layer {name!r} ({type(module).__name__}, {base_name} shape "
            f"{list(shape)}) cannot take its scheme: {err}; add {name!r} to the "
            "recipe's ignore list or change the scheme"
        ) from err


def _observed_args(scheme: QuantizationScheme, part: str) -> QuantizationArgs | None:
    """The args of a part if calibration computes anything for them (static,
    or NVFP4's locally dynamic activations with a static global scale)."""
    args: QuantizationArgs | None = getattr(scheme, part)
    if args is None or args.dynamic is True:
        return None
    return args


# ------------------------------------------------------------------- hooks


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _input_hook(entry: Entry) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: Any) -> None:
        _observe(entry, _first_tensor(args, kwargs))

    return hook


def _output_hook(entry: Entry) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        _observe(entry, output[0] if isinstance(output, tuple) else output)

    return hook


def _observe(entry: Entry, value: Any) -> None:
    if not entry.enabled or not isinstance(value, torch.Tensor):
        return
    mask = current_mask() if entry.masked else None
    if mask is not None:
        value = mask.select(value)
    if not value.numel():
        return
    with torch.no_grad():
        entry.observer.update(value.detach())
    entry.tokens += value.numel() // max(1, value.shape[-1])


def _observed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The attention implementation `attach` installs: observe the states
    `(batch, heads, seq, head_dim)`, then call the model's own."""
    states = {"q": query, "k": key, "v": value}
    mask = current_mask()
    for entry in getattr(module, "_quantobs_entries", ()):
        state = states[entry.base_name]
        if mask is not None and entry.masked:
            state = mask.select(state, "heads")  # (1, heads, n, D)
        if entry.enabled and state.numel():
            with torch.no_grad():
                entry.observer.update(state.detach())
            entry.tokens += state.shape[0] * state.shape[2]
    impl = getattr(module, "_quantobs_impl", None)
    if impl is None:  # pragma: no cover - set by attach
        raise RuntimeError("attention module has no quantobs implementation to call")
    return impl(module, query, key, value, *args, **kwargs)


def _original_attention(module: torch.nn.Module, name: str) -> Callable[..., Any]:
    """The attention function the module would call under implementation
    `name` (its modeling file's `eager_attention_forward` for "eager")."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        found: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS[name]
        return found
    eager = getattr(
        sys.modules[type(module).__module__], "eager_attention_forward", None
    )
    if eager is None:
        raise ValueError(
            f"cannot observe q/k/v of {type(module).__name__}: its modeling module "
            "has no eager_attention_forward"
        )
    return eager


def _hook_attention(
    model: torch.nn.Module, attachment: Attachment, modules: dict[str, torch.nn.Module]
) -> None:
    """Route the model's attention through `_observed_attention`."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            "observing q/k/v needs a transformers PreTrainedModel (the attention "
            "function is where the states are seen); target the projections' "
            "outputs instead"
        )
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = str(config._attn_implementation)
    if original == _ATTN_NAME:
        raise ValueError("the model's attention is already observed; detach() first")
    for entry_module in modules.values():
        entry_module._quantobs_impl = _original_attention(entry_module, original)  # type: ignore[assignment]
        entry_module._quantobs_entries = [  # type: ignore[assignment]
            e for e in attachment.entries if e.module is entry_module
        ]
    ALL_ATTENTION_FUNCTIONS.register(_ATTN_NAME, _observed_attention)
    if original in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(
            _ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS[original]
        )
    model.set_attn_implementation(_ATTN_NAME)  # type: ignore[operator]
    attachment.attn_impl = original


# ------------------------------------------------------------------ public


def attachment_of(model: torch.nn.Module) -> Attachment:
    """The model's `Attachment`.

    Raises:
        RuntimeError: no observers are attached.
    """
    found = getattr(model, ATTACHMENT_ATTR, None)
    if not isinstance(found, Attachment):
        raise RuntimeError(
            "the model has no quantobs observers; call "
            "quantobs.calibration.attach(model, recipe) first"
        )
    return found


def observers_of(model: torch.nn.Module) -> Iterator[tuple[Entry, Observer]]:
    """Every `(entry, observer)` attached to the model, in module order."""
    for entry in attachment_of(model).entries:
        yield entry, entry.observer


def _add(attachment: Attachment, entry: Entry) -> None:
    name, kwargs = observer_for(entry.base_name, entry.args)
    observer = Observer.load_from_registry(
        name, base_name=entry.base_name, args=entry.args, module=entry.module, **kwargs
    )
    entry.module.register_module(f"{entry.base_name}_observer", observer)
    attachment.entries.append(entry)


def attach(model: torch.nn.Module, recipe: Any) -> Attachment:
    """Register the recipe's observers and hooks on `model`.

    Args:
        model: any `nn.Module`; q/k/v states need a transformers model.
        recipe: a `Recipe`, a preset name (`"W4A16"`: every `Linear`), or a
            compressed-tensors `QuantizationConfig` / its dict.

    Returns:
        The `Attachment` (also kept on the model).

    Raises:
        RuntimeError: observers are already attached.
        ValueError: a target that matches nothing (close names listed), or a
            layer its scheme cannot take (named, with the fix).
        KeyError: an unknown observer name.
    """
    if isinstance(getattr(model, ATTACHMENT_ATTR, None), Attachment):
        raise RuntimeError("observers are already attached; call detach(model) first")
    recipe = Recipe.coerce(recipe)
    attachment = Attachment(recipe)
    try:
        targets = [t for g in recipe.config_groups.values() for t in g.targets]
        attachment.experts = linearize(model, targets, recipe.ignore)
        resolved = _resolve(model, recipe)
        _keep_targeted_experts(model, attachment, resolved)
        attention = _add_observers(attachment, resolved)
        _add_hooks(attachment)
        if attention:
            _hook_attention(model, attachment, attention)
    except Exception:
        _undo(model, attachment)
        raise
    for _, module, _, _ in resolved:
        _drop_qparams(module)
    setattr(model, ATTACHMENT_ATTR, attachment)
    return attachment


def _keep_targeted_experts(
    model: torch.nn.Module,
    attachment: Attachment,
    resolved: list[tuple[str, torch.nn.Module, str, QuantizationScheme]],
) -> None:
    """Put back the fused experts modules no config group reaches."""
    reached = {tag.experts for _, m, _, _ in resolved if (tag := expert_tag(m))}
    idle = [name for name in attachment.experts if name not in reached]
    restore(model, idle)
    attachment.experts = [name for name in attachment.experts if name in reached]


def _drop_qparams(module: torch.nn.Module) -> None:
    """Remove a previous calibration's qparams (a new attach starts afresh)."""
    for base in BASE_NAMES:
        for kind in QPARAM_KINDS:
            if f"{base}_{kind}" in module._parameters:
                delattr(module, f"{base}_{kind}")


def _add_observers(
    attachment: Attachment,
    resolved: list[tuple[str, torch.nn.Module, str, QuantizationScheme]],
) -> dict[str, torch.nn.Module]:
    """One observer per quantized tensor; returns the attention modules."""
    attention: dict[str, torch.nn.Module] = {}
    kv = attachment.recipe.kv_cache_scheme
    for name, module, group, scheme in resolved:
        attn = is_attention(module)
        parts = ["input_activations"] if attn else ["weights", *_ACT_PARTS]
        for part in parts:
            args = _observed_args(scheme, part)
            if args is None:
                continue
            base = "q" if attn else _BASE[part]
            _check_takes(name, module, base, args)
            # an expert's Linears see the real tokens routed to it already
            masked = expert_tag(module) is None
            _add(attachment, Entry(name, module, base, args, group, masked=masked))
            if attn:
                attention[name] = module
        if attn and kv is not None and kv.dynamic is not True:
            for base in ("k", "v"):
                _add(attachment, Entry(name, module, base, kv, "kv_cache"))
            attention[name] = module
    return attention


def _add_hooks(attachment: Attachment) -> None:
    for entry in attachment.entries:
        if entry.base_name == "input":
            handle = entry.module.register_forward_pre_hook(
                _input_hook(entry), with_kwargs=True
            )
        elif entry.base_name == "output":
            handle = entry.module.register_forward_hook(_output_hook(entry))
        else:
            continue
        attachment.handles.append(handle)


_ACT_PARTS = ("input_activations", "output_activations")
_BASE = {
    "weights": "weight",
    "input_activations": "input",
    "output_activations": "output",
}


def _undo(model: torch.nn.Module, attachment: Attachment) -> None:
    for handle in attachment.handles:
        handle.remove()
    for entry in attachment.entries:
        observer_name = f"{entry.base_name}_observer"
        observer = entry.module._modules.get(observer_name)
        stop = getattr(observer, "detach", None)
        if callable(stop):  # observers with hooks of their own (imatrix)
            stop()
        if observer is not None:
            del entry.module._modules[observer_name]
        for attr in ("_quantobs_impl", "_quantobs_entries"):
            entry.module.__dict__.pop(attr, None)
    if attachment.attn_impl is not None:
        model.set_attn_implementation(attachment.attn_impl)  # type: ignore[operator]
    restore(model, attachment.experts)
    attachment.handles.clear()


def detach(model: torch.nn.Module) -> None:
    """Remove every hook and observer `attach` added (the qparams stay).

    Raises:
        RuntimeError: no observers are attached.
    """
    attachment = attachment_of(model)
    _undo(model, attachment)
    delattr(model, ATTACHMENT_ATTR)
