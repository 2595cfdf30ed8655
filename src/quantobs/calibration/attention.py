"""Attention states on a model: which modules, where the states are seen.

compressed-tensors (0.19) quantizes the attention states of a module it
accepts as *cached attention* (`is_cached_attention`): a class whose name
contains "attention", with a `k_proj`, `v_proj`, `qkv_proj` or `kv_b_proj`
child, whose `forward` takes `past_key_values` (or `past_key_value`). Its
`kv_cache_scheme` applies to every such module of the model, whatever the
config groups' targets and the ignore list; a config group that targets one
(narrowly) quantizes its query, key and value states with the group's
`input_activations` instead.

Where the states are seen, as compressed-tensors quantizes them:

    state   seen in                          shape
    q       the attention function           (B, heads, S, D)
    k, v    the cache update                 (B, kv_heads, S, D)
            (`past_key_values.update(k, v)`)

Keys and values are what the model writes into its cache: after rotary
embeddings, before any repetition for GQA / MQA (Llama, Mistral, Gemma 2/3,
Phi-3's split `qkv_proj`). DeepSeek-V3's multi-head latent attention (MLA)
caches its compressed latent instead: `k` is the normalized `kv_a_proj_with_mqa`
latent `(B, 1, S, kv_lora_rank)` and `v` the rotated shared key part
`(B, 1, S, qk_rope_head_dim)`; the per-head keys and values `kv_b_proj`
expands them into are never cached.

`hook_cache` feeds `k` / `v` observers from a forward pre-hook that hands
the attention module a cache which observes what it is given and passes it
on to the model's own cache (or back, when the model runs without one).
`hook_attention` routes the query states through an attention
implementation registered with transformers, which then calls the model's
own. Both keep only the batch's real tokens (`quantobs.calibration.tokens`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from quantobs.calibration.tokens import current_mask

if TYPE_CHECKING:
    from quantobs.calibration.attach import Entry

__all__ = [
    "CACHE_ARGS",
    "KV_PROJECTIONS",
    "cached_attention_modules",
    "check_attention_config",
    "check_kv_cache",
    "hook_attention",
    "hook_cache",
    "is_cached_attention",
    "is_latent_attention",
    "observe_state",
    "unhook_attention",
]

#: The children by which compressed-tensors recognizes attention.
KV_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj")
#: The `forward` arguments that carry the cache (transformers 5, then 4).
CACHE_ARGS = ("past_key_values", "past_key_value")
_ATTN_NAME = "quantobs_observed"


# --------------------------------------------------------------- discovery


def _forward_parameters(module: torch.nn.Module) -> list[str]:
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _looks_like_attention(module: torch.nn.Module) -> bool:
    return "attention" in type(module).__name__.lower()


def _why_not_cached(module: torch.nn.Module) -> str | None:
    """Why compressed-tensors does not quantize `module`'s states (None: it
    does)."""
    name = type(module).__name__
    if not _looks_like_attention(module):
        return f"{name}'s class name does not contain 'attention'"
    if not any(hasattr(module, p) for p in KV_PROJECTIONS):
        children = ", ".join(n for n, _ in module.named_children()) or "none"
        return (
            f"{name} has none of the projections compressed-tensors recognizes "
            f"attention by ({', '.join(KV_PROJECTIONS)}; its children: {children})"
        )
    parameters = _forward_parameters(module)
    if not any(arg in parameters for arg in CACHE_ARGS):
        if "cache" in parameters:  # transformers' newer name for it
            return (
                f"{name}.forward takes its kv cache as `cache` (this transformers'"
                " name for past_key_values), which compressed-tensors does not "
                "look for: it would write no k_scale / v_scale (a transformers "
                "whose attention takes past_key_values, e.g. 5.17, calibrates it)"
            )
        return f"{name}.forward takes no past_key_values (it keeps no kv cache)"
    return None


def is_cached_attention(module: torch.nn.Module) -> bool:
    """Whether compressed-tensors quantizes `module`'s attention states (its
    `is_cached_attention_module`, without importing it)."""
    return _why_not_cached(module) is None


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Whether `module` caches a compressed latent (MLA: DeepSeek-V2/V3)."""
    return hasattr(module, "kv_b_proj")


def cached_attention_modules(
    model: torch.nn.Module,
) -> list[tuple[str, torch.nn.Module]]:
    """`(name, module)` of every cached attention module, in module order."""
    return [(n, m) for n, m in model.named_modules() if is_cached_attention(m)]


def _config_problem(model: torch.nn.Module) -> str | None:
    """What compressed-tensors misses in the model's config to size the
    attention scales (it reads the decoder's text config), or None."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no transformers config"
    text = getattr(config, "get_text_config", None)
    config = text(decoder=True) if callable(text) else config
    name = type(config).__name__
    if not hasattr(config, "num_key_value_heads"):
        return f"{name} defines no num_key_value_heads"
    if not hasattr(config, "num_attention_heads") and not (
        hasattr(config, "hidden_size") and hasattr(config, "head_dim")
    ):
        return f"{name} defines no num_attention_heads"
    return None


def check_attention_config(
    model: torch.nn.Module, name: str, module: torch.nn.Module
) -> None:
    """Raise unless compressed-tensors can size the attention scales of the
    cached attention `module` from the model's config.

    Raises:
        ValueError: naming the module's class and what the config lacks.
    """
    problem = _config_problem(model)
    if problem is not None:
        raise ValueError(
            f"compressed-tensors cannot quantize the attention states of {name!r} "
            f"({type(module).__name__}): it sizes their scales from the model's "
            f"config, and {problem}; remove kv_cache_scheme (and any config "
            "group targeting the attention) from the recipe"
        )


def check_kv_cache(
    model: torch.nn.Module,
    kv_args: Any,
    ignored: Callable[[str, torch.nn.Module], str | None],
) -> list[tuple[str, torch.nn.Module]]:
    """The modules a `kv_cache_scheme` quantizes, checked.

    Args:
        model: the model.
        kv_args: the kv cache's `QuantizationArgs`.
        ignored: `(name, module) -> the ignore target matching it, or None`.

    Returns:
        `(name, module)` of every cached attention module.

    Raises:
        ValueError: the model has no attention compressed-tensors quantizes
            (each attention class named, with the reason), or its config
            lacks what compressed-tensors sizes the scales by; the ignore list
            names one (compressed-tensors would quantize it anyway); or
            per-head scales on latent attention.
    """
    found = cached_attention_modules(model)
    if not found:
        reasons = {
            type(m).__name__: _why_not_cached(m)
            for _, m in model.named_modules()
            if _looks_like_attention(m)
        }
        why = "; ".join(r for r in reasons.values() if r) or (
            f"{type(model).__name__} has no module whose class name contains "
            "'attention'"
        )
        raise ValueError(
            "kv_cache_scheme: compressed-tensors quantizes the kv cache of no "
            f"module of {type(model).__name__}: {why}. Its checkpoint would hold "
            "no k_scale / v_scale; remove kv_cache_scheme from the recipe"
        )
    check_attention_config(model, *found[0])
    for name, module in found:
        target = ignored(name, module)
        if target is not None:
            raise ValueError(
                f"kv_cache_scheme: ignore target {target!r} matches {name!r} "
                f"({type(module).__name__}), but compressed-tensors quantizes the "
                "kv cache of every attention module whatever the ignore list; "
                "narrow the ignore target to the layers inside the attention "
                "(e.g. its projections), or remove kv_cache_scheme"
            )
    strategy = str(getattr(kv_args.strategy, "value", kv_args.strategy))
    latent = [n for n, m in found if is_latent_attention(m)]
    if strategy == "attn_head" and latent:
        raise ValueError(
            f"kv_cache_scheme strategy 'attn_head' on latent attention "
            f"({latent[0]!r}, {type(dict(found)[latent[0]]).__name__}): it caches "
            "one compressed latent, not key/value heads, while compressed-tensors "
            "sizes k_scale / v_scale by the config's key/value heads; use "
            "strategy 'tensor'"
        )
    return found


# ----------------------------------------------------------------- observing


def observe_state(entry: Entry, state: torch.Tensor) -> None:
    """Feed one attention state `(B, heads, S, D)` to `entry`'s observer,
    keeping the batch's real tokens only."""
    if not entry.enabled:
        return
    mask = current_mask() if entry.masked else None
    if mask is not None:
        state = mask.select(state, "heads")  # (1, heads, n, D)
    if not state.numel():
        return
    with torch.no_grad():
        entry.observer.update(state.detach())
    entry.tokens += state.shape[0] * state.shape[2]


class _ObservingCache:
    """Stands for the model's cache inside one attention forward: `update`
    observes the key and value states, then is the model's cache's own (or
    returns them, when the model runs without a cache); everything else is
    the model's cache's."""

    def __init__(self, entries: Sequence[Entry], cache: Any) -> None:
        self._entries = entries
        self._cache = cache

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        **kw: Any,
    ) -> Any:
        states = {"k": key_states, "v": value_states}
        for entry in self._entries:
            observe_state(entry, states[entry.base_name])
        if self._cache is None:
            return key_states, value_states
        return self._cache.update(key_states, value_states, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("_cache")
        if cache is None:
            raise AttributeError(
                f"the model runs without a kv cache; {name!r} is not available"
            )
        return getattr(cache, name)


def hook_cache(module: torch.nn.Module, entries: Sequence[Entry]) -> RemovableHandle:
    """Observe `module`'s key / value states where it writes its cache.

    Args:
        module: a cached attention module (`is_cached_attention`).
        entries: its `k` / `v` entries.

    Returns:
        The forward pre-hook's handle.
    """
    parameters = _forward_parameters(module)
    arg = next(a for a in CACHE_ARGS if a in parameters)
    # `forward`'s parameters exclude self: the positional index of the cache
    index = parameters.index(arg)

    def hook(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(args) > index:
            args = (
                *args[:index],
                _ObservingCache(entries, args[index]),
                *args[index + 1 :],
            )
        else:
            kwargs[arg] = _ObservingCache(entries, kwargs.get(arg))
        return args, kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def _observed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The attention implementation `hook_attention` installs: observe the
    query states `(batch, heads, seq, head_dim)`, then call the model's own."""
    for entry in getattr(module, "_quantobs_entries", ()):
        observe_state(entry, query)
    impl = getattr(module, "_quantobs_impl", None)
    if impl is None:  # pragma: no cover - set by hook_attention
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
            f"cannot observe the query states of {type(module).__name__}: its "
            "modeling module has no eager_attention_forward"
        )
    return eager


def hook_attention(model: torch.nn.Module, query_entries: Iterable[Entry]) -> str:
    """Route the model's attention through an implementation that observes
    the query states of `query_entries`' modules.

    Returns:
        The model's attention implementation before (`unhook_attention`
        restores it).

    Raises:
        ValueError: not a transformers model, or already observed.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            "observing query states needs a transformers PreTrainedModel (the "
            "attention function is where they are seen); target the projections' "
            "outputs instead"
        )
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = str(config._attn_implementation)
    if original == _ATTN_NAME:
        raise ValueError("the model's attention is already observed; detach() first")
    by_module: dict[int, list[Entry]] = {}
    for entry in query_entries:
        by_module.setdefault(id(entry.module), []).append(entry)
    for entries in by_module.values():
        module = entries[0].module
        module._quantobs_impl = _original_attention(module, original)  # type: ignore[assignment]
        module._quantobs_entries = entries  # type: ignore[assignment]
    ALL_ATTENTION_FUNCTIONS.register(_ATTN_NAME, _observed_attention)
    if original in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(
            _ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS[original]
        )
    model.set_attn_implementation(_ATTN_NAME)  # type: ignore[operator]
    return original


def unhook_attention(
    model: torch.nn.Module, modules: Iterable[torch.nn.Module], original: str | None
) -> None:
    """Undo `hook_attention` (`original`: what it returned, None if not run)."""
    for module in modules:
        for attr in ("_quantobs_impl", "_quantobs_entries"):
            module.__dict__.pop(attr, None)
    if original is not None:
        model.set_attn_implementation(original)  # type: ignore[operator]
