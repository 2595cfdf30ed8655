"""Carry observers to a model: one per module and tensor, fed by hooks.

`attach(model, recipe)` registers, on every module a config group targets,
one observer per quantized tensor as a submodule named as llm-compressor
names them: `weight_observer`, `input_observer`, `output_observer`, and on
attention modules `q_observer`, `k_observer`, `v_observer`. Forward
pre-hooks feed the inputs, forward hooks the outputs; attention states are
observed where compressed-tensors quantizes them
(`quantobs.calibration.attention`): the query states in the attention
function, the key and value states where the model writes its kv cache.
A `kv_cache_scheme` observes `k` / `v` on every attention module
compressed-tensors quantizes, whatever the config groups' targets, and is
refused on a model where it quantizes none (GPT-2). `Conv1D` weights
(stored transposed) are observed as the Linear weight they are
(`quantobs.calibration.transposed`). A recipe that quantizes nothing, or
whose `"Linear"` target misses a model's `Conv1D` layers, is refused.
While `calibrate` runs a batch, hooks keep only its real tokens
(`quantobs.calibration.tokens`: the attention mask). Weights are observed
once, by `calibrate`. No hook keeps an activation after it returns.
MoE experts stored as fused 3-D parameters are replaced, while attached, by
per-expert Linears that recipes target like any other
(`quantobs.calibration.experts`).
`detach(model)` removes every hook and observer (the qparams written stay,
except those of fused experts: `detach` puts the fused modules back, and
their per-expert Linears go with their qparams; export before detaching).

(Over 500 lines: target resolution, the checks of what a recipe reaches and
the hooks are the one attach step; issue 23's lifecycle splits it.)
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from quantobs.calibration.attention import (
    check_attention_config,
    check_kv_cache,
    hook_attention,
    hook_cache,
    is_cached_attention,
    unhook_attention,
)
from quantobs.calibration.experts import expert_tag, linearize, restore
from quantobs.calibration.offload import read_tensor
from quantobs.calibration.recipe import Recipe, observer_for
from quantobs.calibration.tokens import current_mask
from quantobs.calibration.transposed import (
    is_transposed,
    linear_weight,
    transposed_layers,
)
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
        """The module's weight as a Linear holds it, `(out_features,
        in_features)` (a transposed view for `Conv1D`; weight entries). An
        offloaded module's weight (accelerate, meta placeholder) is loaded
        for the caller alone (`offload.read_tensor`): nothing stays loaded
        (an offloaded expert's reads its fused tensor whole: the loop reads
        a layer's experts together, `experts.loaded_together`)."""
        found = linear_weight(self.module)
        if found is None:  # pragma: no cover - checked
            raise TypeError(f"{self.key}: the module has no weight tensor")
        if found.is_meta:
            value = read_tensor(self.module, "weight")
            found = value.t() if is_transposed(self.module) else value
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
            when no query state is observed: keys and values are observed at
            the cache, without it).
        experts: the fused experts modules replaced while attached
            (`quantobs.calibration.experts`), by name.
        calibration: its `quantobs.calibration.lifecycle.Calibration` (None
            until first used).
    """

    recipe: Recipe
    entries: list[Entry] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)
    attn_impl: str | None = None
    experts: list[str] = field(default_factory=list)
    calibration: Any = None

    def by_key(self) -> dict[str, Entry]:
        """Entries by `Entry.key`."""
        return {e.key: e for e in self.entries}


# ---------------------------------------------------------------- matching


def _matches(target: str, name: str, module: torch.nn.Module) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == type(module).__name__


def is_attention(module: torch.nn.Module) -> bool:
    """Whether `module` computes attention from q / k / v projections: one
    compressed-tensors quantizes (`attention.is_cached_attention`: Llama,
    Phi-3's `qkv_proj`, DeepSeek's MLA...), or a Llama-style `q_proj`... or
    BERT-style `query`... module whose class name ends with `Attention`."""
    if is_cached_attention(module):
        return True
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
    weight = linear_weight(module)  # (out, in), Conv1D's transposed
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


# ------------------------------------------------------------------ public


def attachment_of(model: torch.nn.Module) -> Attachment:
    """The model's `Attachment`.

    Raises:
        RuntimeError: no observers are attached.
    """
    found = getattr(model, ATTACHMENT_ATTR, None)
    if not isinstance(found, Attachment):
        if _compressed(model):
            raise RuntimeError(
                "the model was exported in place: save_compressed compressed "
                "its weights and removed its observers; load the model again "
                "to calibrate it (save_compressed(..., copy=True) keeps it)"
            )
        raise RuntimeError(
            "the model has no quantobs observers; call "
            "quantobs.calibration.attach(model, recipe) first"
        )
    return found


def _compressed(model: torch.nn.Module) -> bool:
    """Whether compressed-tensors compressed the model's weights (an export
    in place: `quantobs.calibration.freeze`)."""
    return any(
        str(getattr(getattr(m, "quantization_status", None), "value", ""))
        == "compressed"
        for m in model.modules()
    )


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
        model: any `nn.Module`; attention states need a transformers model.
        recipe: a `Recipe`, a preset name (`"W4A16"`: every `Linear`), or a
            compressed-tensors `QuantizationConfig` / its dict.

    Returns:
        The `Attachment` (also kept on the model).

    Raises:
        RuntimeError: observers are already attached.
        ValueError: a target that matches nothing (close names listed), a
            layer its scheme cannot take (named, with the fix), a recipe
            that quantizes nothing, a `"Linear"` target that misses the
            model's `Conv1D` layers, or a `kv_cache_scheme` compressed-tensors
            cannot apply to the model (`attention.check_kv_cache`).
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
        _check_transposed(model, recipe, resolved)
        _check_quantizes(model, recipe, resolved)
        kv_modules = (
            []
            if recipe.kv_cache_scheme is None
            else check_kv_cache(
                model, recipe.kv_cache_scheme, lambda n, m: _ignored_by(recipe, n, m)
            )
        )
        _add_observers(model, attachment, resolved)
        _add_kv_observers(attachment, kv_modules)
        _sort_entries(model, attachment)
        _add_hooks(attachment)
        queries = [e for e in attachment.entries if e.base_name == "q"]
        if queries:
            attachment.attn_impl = hook_attention(model, queries)
    except Exception:
        _undo(model, attachment)
        raise
    for module in {id(e.module): e.module for e in attachment.entries}.values():
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


def _ignored_by(recipe: Recipe, name: str, module: torch.nn.Module) -> str | None:
    """The first ignore target matching the module, or None."""
    return next((t for t in recipe.ignore if _matches(t, name, module)), None)


def _check_transposed(
    model: torch.nn.Module,
    recipe: Recipe,
    resolved: list[tuple[str, torch.nn.Module, str, QuantizationScheme]],
) -> None:
    """Refuse a `"Linear"` target on a model whose `Conv1D` layers no target
    or ignore entry mentions (they would be skipped silently)."""
    layers = transposed_layers(model)
    if not layers:
        return
    taken = {name for name, *_ in resolved}
    skipped = [
        n
        for n in layers
        if n not in taken and _ignored_by(recipe, n, model.get_submodule(n)) is None
    ]
    groups = [g for g, s in recipe.config_groups.items() if "Linear" in s.targets]
    if skipped and groups:
        raise ValueError(
            f"config group {groups[0]!r} targets 'Linear', which does not match the "
            f"{len(skipped)} Conv1D layers of {type(model).__name__} (e.g. "
            f"{skipped[0]!r}: transformers' Conv1D, weight stored transposed); add "
            "'Conv1D' to the targets to quantize them, or to the ignore list to "
            "leave them unquantized"
        )


def _fused_experts(model: torch.nn.Module) -> list[str]:
    """Modules holding 3-D weights of their own (MoE experts stored fused)."""
    return [
        n
        for n, m in model.named_modules()
        if any(p.ndim == 3 for p in m.parameters(recurse=False))
    ]


def _check_quantizes(
    model: torch.nn.Module,
    recipe: Recipe,
    resolved: list[tuple[str, torch.nn.Module, str, QuantizationScheme]],
) -> None:
    """Refuse a recipe whose every targeted module is ignored."""
    if resolved:
        return
    targets = [t for s in recipe.config_groups.values() for t in s.targets]
    hints = []
    if layers := transposed_layers(model):
        hints.append(
            f"the model's linear layers are Conv1D (weights stored transposed, "
            f"e.g. {layers[0]!r}): target 'Conv1D'"
        )
    if experts := _fused_experts(model):
        hints.append(
            f"its MoE experts are fused 3-D parameters (e.g. {experts[0]!r}), "
            "which no Linear target matches"
        )
    hint = f"; {'; '.join(hints)}" if hints else ""
    raise ValueError(
        f"the recipe quantizes nothing: every module its targets {targets} match "
        f"is in its ignore list {recipe.ignore}{hint}"
    )


def _add_observers(
    model: torch.nn.Module,
    attachment: Attachment,
    resolved: list[tuple[str, torch.nn.Module, str, QuantizationScheme]],
) -> None:
    """One observer per quantized tensor of the modules the groups target.

    An attention module a group targets gets its query states observed under
    the group's `input_activations`, and, where compressed-tensors caches
    them (`is_cached_attention`), its key and value states too: as
    compressed-tensors, the group's args then replace the kv cache's. Like
    compressed-tensors, a group quantizes a cached attention's states only
    where a target matches it narrowly (neither its parent nor a module
    inside it): `"re:.*layers\\.0\\..*"` quantizes layer 0's projections,
    not its attention states.
    """
    for name, module, group, scheme in resolved:
        attn = is_attention(module)
        if is_cached_attention(module) and not _narrow(model, name, scheme):
            continue
        parts = ["input_activations"] if attn else ["weights", *_ACT_PARTS]
        for part in parts:
            args = _observed_args(scheme, part)
            if args is None:
                continue
            bases = [_BASE[part]]
            if attn and is_cached_attention(module):
                check_attention_config(model, name, module)
                bases = ["q", "k", "v"]
            elif attn:
                bases = ["q"]
            # an expert's Linears see the real tokens routed to it already
            masked = expert_tag(module) is None
            for base in bases:
                _check_takes(name, module, base, args)
                _add(
                    attachment,
                    Entry(name, module, base, args, group, masked=masked),
                )


def _narrow(model: torch.nn.Module, name: str, scheme: QuantizationScheme) -> bool:
    """Whether a target of `scheme` matches module `name` but neither its
    parent nor any module inside it (compressed-tensors' narrow match)."""
    module = model.get_submodule(name)
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    inside = [(f"{name}.{n}", m) for n, m in module.named_modules() if n]
    return any(
        _matches(t, name, module)
        and not _matches(t, parent_name, parent)
        and not any(_matches(t, n, m) for n, m in inside)
        for t in scheme.targets
    )


def _add_kv_observers(
    attachment: Attachment, modules: list[tuple[str, torch.nn.Module]]
) -> None:
    """`k` / `v` observers under the kv cache's args on every cached
    attention module a group's attention args do not cover already."""
    kv = attachment.recipe.kv_cache_scheme
    if kv is None or kv.dynamic is True:
        return
    covered = {id(e.module) for e in attachment.entries if e.base_name == "k"}
    for name, module in modules:
        if id(module) in covered:
            continue
        for base in ("k", "v"):
            _add(attachment, Entry(name, module, base, kv, "kv_cache"))


def _sort_entries(model: torch.nn.Module, attachment: Attachment) -> None:
    """Entries in module order (stable: a module's keep their order)."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    attachment.entries.sort(key=lambda e: order.get(id(e.module), len(order)))


def _add_hooks(attachment: Attachment) -> None:
    caches: dict[int, list[Entry]] = {}
    for entry in attachment.entries:
        if entry.base_name == "input":
            handle = entry.module.register_forward_pre_hook(
                _input_hook(entry), with_kwargs=True
            )
        elif entry.base_name == "output":
            handle = entry.module.register_forward_hook(_output_hook(entry))
        else:
            if entry.base_name in ("k", "v"):
                caches.setdefault(id(entry.module), []).append(entry)
            continue
        attachment.handles.append(handle)
    for entries in caches.values():
        attachment.handles.append(hook_cache(entries[0].module, entries))


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
    unhook_attention(
        model, (e.module for e in attachment.entries), attachment.attn_impl
    )
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
