"""Running calibration batches: moved to the model's device, one at a time,
with their real tokens current (`quantobs.calibration.tokens`)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence, Sized
from itertools import chain
from typing import Any

import torch

from quantobs.calibration.tokens import real_tokens

__all__ = [
    "device_of",
    "move",
    "peek",
    "progress_bar",
    "run_batch",
    "to_model_device",
    "unobserved_head",
]


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter not on the meta device (CPU
    for a model without any: accelerate's hooks move the inputs of the
    modules it offloads)."""
    return next(
        (p.device for p in model.parameters() if p.device.type != "meta"),
        torch.device("cpu"),
    )


def move(value: Any, device: torch.device) -> Any:
    """`value` (tensors, or mappings / lists / tuples of them) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: move(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(move(v, device) for v in value)
    return value


def to_model_device(batch: Any, model: torch.nn.Module) -> Any:
    """`batch` (tensors, or mappings / lists / tuples of them) moved to the
    device of `model`'s first parameter (`device_of`)."""
    return move(batch, device_of(model))


class _Cut(Exception):
    """Raised before the output head runs: the pass has nothing left to see."""


def _cut(module: torch.nn.Module, args: Any) -> None:
    raise _Cut


def unobserved_head(
    model: torch.nn.Module, observed: Iterable[torch.nn.Module]
) -> torch.nn.Module | None:
    """The output head (`get_output_embeddings()`, e.g. `lm_head`) a
    calibration pass may stop before, or None.

    It may when the head runs after the whole base model (it lies outside
    `model.base_model`, which transformers' task models call first) and
    every `observed` module lies inside the base model: by then every
    observation of the pass has been made, and the head's logits
    (`(B, S, vocab)`, often the largest activation of the pass) are never
    computed. Models without both (an encoder alone, a custom module) run
    whole.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    base = getattr(model, "base_model", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Module) or not isinstance(base, torch.nn.Module):
        return None
    if base is model:
        return None
    inside = {id(m) for m in base.modules()}
    if id(head) in inside or any(id(m) not in inside for m in observed):
        return None
    return head


def run_batch(
    model: torch.nn.Module, batch: Any, stop_before: torch.nn.Module | None = None
) -> Any:
    """Run one batch (keyword arguments, positional ones, or one tensor);
    the hooks see its real tokens only (`real_tokens`).

    With `stop_before` (a module of `model`, see `unobserved_head`) the pass
    ends where that module would start, and returns None.
    """
    batch = to_model_device(batch, model)
    handle = None
    if stop_before is not None:
        handle = stop_before.register_forward_pre_hook(_cut)
    try:
        with real_tokens(batch):
            if isinstance(batch, Mapping):
                return model(**batch)
            if isinstance(batch, list | tuple):
                return model(*batch)
            return model(batch)
    except _Cut:
        return None
    finally:
        if handle is not None:
            handle.remove()


def peek(batches: Iterable[Any]) -> tuple[Iterable[Any], Any]:
    """`(the same batches, the first one or None)`, streaming an iterator."""
    if isinstance(batches, Sequence):
        return batches, (batches[0] if batches else None)
    iterator = iter(batches)
    first = next(iterator, None)
    return (iterator if first is None else chain([first], iterator)), first


def progress_bar(
    items: Iterable[Any], enabled: bool | None, desc: str = "calibrating"
) -> Iterable[Any]:
    """`items` under a tqdm bar when `enabled` (None: when stderr is a tty)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return items
    from tqdm.auto import tqdm

    total = len(items) if isinstance(items, Sized) else None
    unit = "layer" if desc.endswith("layers") else "batch"
    return tqdm(items, total=total, desc=desc, unit=unit)
