"""The calibration loop: observe weights once, run the batches, write qparams.

`calibrate(model, batches)` runs the forward passes under `torch.no_grad()`
with the attached observers' hooks, then writes every qparam onto the model
(`quantobs.calibration.qparams`) and returns a `CalibrationReport`. Calling
it again continues the calibration (the statistics accumulate); so does it
after `load_state` (`quantobs.calibration.state`).

Under `torch.distributed` (`sync=True`), each process passes its own shard
of the batches: each observes a share of the weights (balanced by size,
fused layers together) and broadcasts their qparams; the activation
statistics are all-reduced as each statistic declares
(`quantobs.calibration.distributed`), so every process ends with the qparams
one process would compute from all the batches.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from quantobs.calibration.attach import Attachment, Entry, attachment_of
from quantobs.calibration.experts import (
    observe_all_experts,
    routed_tokens,
    uncounted,
)
from quantobs.calibration.offload import first_device
from quantobs.calibration.owners import broadcast_from_owners, owners_by_size
from quantobs.calibration.qparams import (
    EmptyPolicy,
    QParams,
    compute_qparams,
    empty_experts,
    fused_groups,
    set_qparams,
)
from quantobs.calibration.tokens import real_tokens
from quantobs.observers.base import Observer
from quantobs.observers.engine import ObserverEngine
from quantobs.observers.mse import StaticMSEObserver
from quantobs.stats.candidate_errors import CandidateErrors

__all__ = [
    "CalibrationReport",
    "calibrate",
    "needs_data",
    "sync",
    "text_batches",
    "to_model_device",
    "write_qparams",
]


@dataclass
class CalibrationReport:
    """What a `calibrate` call did.

    Attributes:
        modules: names of the modules whose qparams were written.
        tokens: tokens each activation / attention observer has seen in all
            (`"{module}.{base}"` -> count; the legacy token count, for every
            activation shape), summed over processes when synced.
        empty: observers that saw no data (their qparams fell back).
        batches: batches run by this call (this process's; 0 when no
            observer needs data: weight-only schemes).
        seconds: wall time of this call.
        experts: real tokens the router sent to each observed MoE expert
            (`"...mlp.experts.3"` -> count) by the batches of every calibrate
            call since attach (this process's; not kept by `save_state`;
            empty when no batch ran).
        unrouted: experts no token was routed to (count 0).
        fallen_back: experts some of whose observers fell back to their
            siblings' range (`on_empty="fallback"`).
    """

    modules: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    empty: list[str] = field(default_factory=list)
    batches: int = 0
    seconds: float = 0.0
    experts: dict[str, int] = field(default_factory=dict)
    unrouted: list[str] = field(default_factory=list)
    fallen_back: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        data = (
            f"on {self.batches} batches"
            if self.batches or self.tokens
            else "from their weights alone (no observer needs data)"
        )
        lines = [
            f"calibrated {len(self.modules)} modules {data} in {self.seconds:.2f} s"
        ]
        if self.tokens:
            counts = sorted(self.tokens.values())
            lines.append(
                f"tokens per observer: min {counts[0]}, max {counts[-1]} "
                f"({len(counts)} observers)"
            )
        if self.experts:
            counts = sorted(self.experts.values())
            lines.append(
                f"tokens per expert: min {counts[0]}, max {counts[-1]} "
                f"({len(counts)} experts)"
            )
        if self.unrouted:
            lines.append(f"experts no token was routed to: {', '.join(self.unrouted)}")
        if self.fallen_back:
            lines.append(
                f"experts with siblings' ranges: {', '.join(self.fallen_back)}"
            )
        if self.empty:
            lines.append(f"saw no data (fallback range): {', '.join(self.empty)}")
        return "\n".join(lines)


def text_batches(
    tokenizer: Any,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
    max_length: int = 256,
) -> list[dict[str, torch.Tensor]]:
    """Tokenized batches of `texts` for `calibrate` (padded, truncated).

    Raises:
        ValueError: no texts, or a batch size below 1.
    """
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty sequence of strings")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [
        dict(
            tokenizer(
                list(texts[i : i + batch_size]),
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
        )
        for i in range(0, len(texts), batch_size)
    ]


def _device_of(model: torch.nn.Module) -> torch.device:
    return first_device(model)  # offloaded parameters are on the meta device


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device) for v in value)
    return value


def to_model_device(batch: Any, model: torch.nn.Module) -> Any:
    """`batch` (tensors, or mappings / lists / tuples of them) moved to the
    device of `model`'s first parameter (CPU for a model without any)."""
    return _to(batch, _device_of(model))


def _forward(model: torch.nn.Module, batch: Any) -> None:
    """Run one batch; the hooks see its real tokens only (`real_tokens`)."""
    batch = to_model_device(batch, model)
    with real_tokens(batch):
        if isinstance(batch, Mapping):
            model(**batch)
        elif isinstance(batch, list | tuple):
            model(*batch)
        else:
            model(batch)


def needs_data(attachment: Attachment) -> bool:
    """Whether any attached observer needs the calibration batches: one of
    activations or attention states, or a weight search weighted by its
    inputs' importance. Weight-only schemes with memoryless weight observers
    need none, and `calibrate` then runs no batch."""
    return any(
        e.base_name != "weight" or _gathers_importance(e) for e in attachment.entries
    )


def _progress(batches: Iterable[Any], enabled: bool | None) -> Iterable[Any]:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return batches
    from tqdm.auto import tqdm

    total = len(batches) if isinstance(batches, Sized) else None
    return tqdm(batches, total=total, desc="calibrating", unit="batch")


def _gathers_importance(entry: Entry) -> bool:
    """Whether a weight's observer weighs its search by the importance of
    the layer's inputs (`imatrix_mse`...), gathered while the batches run."""
    return isinstance(getattr(entry.observer, "importance", None), ObserverEngine)


def _importance_entries(attachment: Attachment) -> list[Any]:
    """The weight observers gathering an input importance (every process)."""
    return [
        e.observer
        for e in attachment.entries
        if e.base_name == "weight" and _gathers_importance(e)
    ]


def _observe_weights(entries: Iterable[Entry]) -> None:
    for entry in entries:
        entry.observer.update(entry.weight.detach())


def write_qparams(
    model: torch.nn.Module,
    *,
    on_empty: EmptyPolicy = "raise",
    qparams: Mapping[str, QParams] | None = None,
) -> list[str]:
    """Write every attached observer's qparams onto its module.

    Returns:
        The observers that fell back to a default range.
    """
    attachment = attachment_of(model)
    fell_back: list[str] = []
    if qparams is None:
        qparams, fell_back = compute_qparams(attachment, on_empty=on_empty)
    by_key = attachment.by_key()
    for key, values in qparams.items():
        set_qparams(by_key[key], values)
    return fell_back


def calibrate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    progress: bool | None = None,
    on_empty: EmptyPolicy = "raise",
    sync: bool = False,
    process_group: Any = None,
    all_experts: bool = False,
) -> CalibrationReport:
    """Run the batches through the model with its observers, write the qparams.

    Activation observers see the real tokens of each batch only (its
    `attention_mask`), so qparams do not depend on how texts were batched.
    When no observer needs data (`needs_data`), no batch is run.

    Args:
        model: a model with observers attached (`attach`).
        batches: each a dict of keyword arguments (`model(**batch)`), a tuple
            of positional ones, or one tensor; moved to the model's device.
        progress: show a progress bar (None: when stderr is a terminal).
        on_empty: `"raise"` when an observer saw no data, or `"fallback"`
            (see `quantobs.calibration.qparams`).
        sync: all-reduce the statistics across the processes of
            `torch.distributed` (each process passes its shard of batches).
        process_group: the process group to sync over (default: world).
        all_experts: feed every real token to every MoE expert's observers
            (llm-compressor's `moe_calibrate_all_experts`), not only the
            tokens routed to it; the model's outputs are unchanged (only the
            routed experts' outputs are summed). Off by default: an expert's
            inputs are then those it sees at inference.

    Returns:
        The `CalibrationReport`.

    Raises:
        RuntimeError: no observers attached, `sync=True` outside an
            initialized process group, or an observer with no data under
            `on_empty="raise"`.
    """
    attachment = attachment_of(model)
    start = time.perf_counter()
    groups = fused_groups(attachment.entries)
    owned = groups
    if sync:
        from quantobs.calibration import distributed as dist

        if not dist.is_distributed():
            raise RuntimeError(
                "calibrate(sync=True) needs an initialized torch.distributed "
                "process group (e.g. started with torchrun)"
            )
        rank, world = dist.rank_and_world(process_group)
        sizes = [sum(e.weight.numel() for e in g) for g in groups]
        owners = owners_by_size(sizes, world)
        owned = [g for g, o in zip(groups, owners, strict=True) if o == rank]
    first = None
    if sync:  # its first batch fixes the static_mse references
        batches, first = _peek(batches)
    mine = [e for g in owned for e in g]
    late = [e for e in mine if _gathers_importance(e)]  # need the batches first
    with torch.no_grad(), observe_all_experts(all_experts):
        _observe_weights(
            e for e in mine if e not in late and not e.observer.has_statistics
        )
        if sync:
            _agree_references(model, attachment, first, process_group)
        count = 0
        if needs_data(attachment):
            for batch in _progress(batches, progress):  # streamed, never all held
                _forward(model, batch)
                count += 1
        if sync:
            importance = [o.importance for o in _importance_entries(attachment)]
            dist.sync_observers(importance, process_group)
        _observe_weights(late)  # weighted by the importance of their inputs
        if sync:
            qparams, fell_back = _synced_qparams(
                attachment, groups, owned, on_empty, process_group
            )
        else:
            qparams, fell_back = compute_qparams(attachment, on_empty=on_empty)
        write_qparams(model, qparams=qparams)
    modules = list(dict.fromkeys(e.name for e in attachment.entries))
    tokens = {e.key: e.tokens for e in attachment.entries if e.base_name != "weight"}
    if sync:
        tokens = _summed_tokens(tokens, process_group)
        _keep_totals_on_first(attachment, tokens, process_group)
    by_key = attachment.by_key()
    experts = routed_tokens(model)
    return CalibrationReport(
        modules=modules,
        tokens=tokens,
        empty=fell_back,
        batches=count,
        seconds=time.perf_counter() - start,
        experts=experts,
        unrouted=[name for name, n in experts.items() if not n],
        fallen_back=empty_experts(by_key[k] for k in fell_back),
    )


def _peek(batches: Iterable[Any]) -> tuple[Iterable[Any], Any]:
    """`(the same batches, the first one or None)`, streaming an iterator."""
    if isinstance(batches, Sequence):
        return batches, (batches[0] if batches else None)
    iterator = iter(batches)
    first = next(iterator, None)
    return (iterator if first is None else chain([first], iterator)), first


def _activation_entries(attachment: Attachment) -> list[Entry]:
    return [e for e in attachment.entries if e.base_name != "weight"]


def sync(model: torch.nn.Module, process_group: Any = None) -> None:
    """All-reduce the attached activation / attention observers' statistics
    across the processes of `torch.distributed`, as each statistic declares
    (what `calibrate(..., sync=True)` does after its batches; weights are
    observed whole by their owner instead).

    Raises:
        RuntimeError: no observers attached.
    """
    from quantobs.calibration import distributed as dist

    entries = _activation_entries(attachment_of(model))
    dist.sync_observers([e.observer for e in entries], process_group)


def _agree_references(
    model: torch.nn.Module,
    attachment: Attachment,
    first: Any,
    group: Any,
) -> None:
    """Give every process's `static_mse` activation observers the reference
    range of the first batch of the lowest process with data (the global
    first batch), before any error is accumulated."""
    from quantobs.calibration import distributed as dist

    entries = [
        e for e in _activation_entries(attachment) if _lacks_reference(e.observer)
    ]
    if not dist.any_across(bool(entries), group):
        return
    if entries and first is not None:
        chosen = {id(e) for e in entries}
        for entry in attachment.entries:
            entry.enabled = id(entry) in chosen
        tokens = {e.key: e.tokens for e in entries}
        try:
            with uncounted():  # that batch runs again with the others
                _forward(model, first)  # each reference from the first batch
        finally:
            for entry in attachment.entries:
                entry.enabled = True
        for entry in entries:  # keep the reference, drop that batch's errors
            entry.tokens = tokens[entry.key]
            entry.observer.clear_data()
    dist.agree_references([e.observer for e in entries], group)


def _lacks_reference(observer: Observer) -> bool:
    """Whether a `static_mse` observer has yet to fix its reference range."""
    if not isinstance(observer, StaticMSEObserver):
        return False
    stat = observer.statistic()
    return not (isinstance(stat, CandidateErrors) and stat.has_reference)


def _keep_totals_on_first(
    attachment: Attachment, tokens: dict[str, int], group: Any
) -> None:
    """After a sync every process holds the combined statistics; keep them
    (and the token totals) on process 0 only and empty the others, so that
    a later synced `calibrate` (or `save_state` on process 0) counts every
    batch once."""
    from quantobs.calibration import distributed as dist

    rank, _ = dist.rank_and_world(group)
    for entry in _activation_entries(attachment):
        if rank == 0:
            entry.tokens = tokens[entry.key]
        else:
            entry.tokens = 0
            entry.observer.clear_data()
    if rank != 0:
        for observer in _importance_entries(attachment):
            observer.importance.clear_data()


def _synced_qparams(
    attachment: Attachment,
    groups: list[list[Entry]],
    owned: list[list[Entry]],
    on_empty: EmptyPolicy,
    group: Any,
) -> tuple[dict[str, QParams], list[str]]:
    from quantobs.calibration import distributed as dist

    rank, world = dist.rank_and_world(group)
    dist.sync_observers([e.observer for e in _activation_entries(attachment)], group)
    qparams, fell_back = compute_qparams(attachment, on_empty=on_empty, weights=owned)
    # Weight qparams: each from its owner; placeholders elsewhere.
    sizes = [sum(e.weight.numel() for e in g) for g in groups]
    owners = owners_by_size(sizes, world)
    tensors: list[torch.Tensor] = []
    tensor_owners: list[int] = []
    for weight_group, owner in zip(groups, owners, strict=True):
        for entry in weight_group:
            if owner != rank:
                qparams[entry.key] = _placeholder(entry)
            for kind in sorted(qparams[entry.key]):
                tensors.append(qparams[entry.key][kind])
                tensor_owners.append(owner)
    broadcast_from_owners(tensors, tensor_owners, group)
    return qparams, fell_back


def _placeholder(entry: Entry) -> QParams:
    from quantobs.core.layout import qparam_shape

    weight = entry.weight
    shape = qparam_shape(tuple(weight.shape), "weight", entry.args)
    device = weight.device
    found: QParams = {
        "scale": torch.zeros(shape, device=device),
        "zero_point": torch.zeros(shape, dtype=entry.args.zp_dtype, device=device),
    }
    if entry.args.strategy == "tensor_group":
        found["global_scale"] = torch.zeros(1, device=device)
    return found


def _summed_tokens(tokens: dict[str, int], group: Any) -> dict[str, int]:
    import torch.distributed as torch_dist

    if not tokens:
        return tokens
    keys = sorted(tokens)
    from quantobs.calibration.distributed import collective_device

    counts = torch.tensor(
        [tokens[k] for k in keys], dtype=torch.int64, device=collective_device(group)
    )
    torch_dist.all_reduce(counts, group=group)
    return dict(zip(keys, (int(c) for c in counts.tolist()), strict=True))
