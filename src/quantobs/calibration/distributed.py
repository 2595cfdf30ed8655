"""Calibrating across processes: statistics synced, weights observed once.

Each process of a `torch.distributed` group observes its shard of the
calibration batches; `sync_observers` then gives every process the statistic
one process observing every batch would hold, combining each state field as
it declares (`quantobs.stats.base`)::

    reduce   across processes                               exact
    MIN/MAX  all-reduce MIN / MAX                           yes
    GRID     re-aligned to the reduced MIN/MAX (`align`),   yes (power-of-two
             else copied from a process that has it         histogram grids)
    SUM      all-reduce SUM, after alignment                yes for integers;
                                                            floats up to the
                                                            order of the sum
    EQUAL    checked equal (MIN == MAX) on every process    yes
    LATEST   the highest process with a statistic           by definition
    MEAN     sum(value * count) / sum(count)                no (approximate)

Bucketed: one all-reduce per (reduce op, wire dtype) for all observers
together (their fields flattened and concatenated, then split back), after
one `all_gather_object` of what each process holds (presence, shapes,
dtypes, observation counts). An observer a process never saw (a process
without data, an MoE expert no token reached) takes part there with its
statistic's `empty` (the identity of every reduction); an observer no
process saw stays without a statistic. A typical sync is 1 object gather
and 2 to 4 all-reduces, whatever the number of observers.

Exactness on the wire: the reductions run in wire dtypes every backend
supports (gloo has no float8): floats of up to 32 bits as float32 (MIN / MAX
exact; a float16 SUM sums in float32), float64 as float64, integers and
bools as int64 (exact). Values copied from one process (GRID, LATEST, the
references of `agree_references`) travel as their bytes in an int64 SUM that
the other processes fill with zeros, so every bit (-0.0, NaN payloads)
arrives.

`static_mse` scores candidates of a reference range, which every process
must share: run each process's first batch in a reference-only pass, then
`agree_references` (the lowest process's reference wins: with contiguous or
round-robin shards, the global first batch), then observe every batch.

Weights are observed once: `owners_by_size` deals them to processes,
greedily by size, and `broadcast_from_owners` sends each owner's results
(qparams) to every process, one broadcast per owner (bytes of every dtype
packed together).

Device-agnostic: tensors stay on the observers' device (CPU tensors go
through the current CUDA device under NCCL). NCCL's object collectives use
the current CUDA device too, so set it (`torch.cuda.set_device`) first.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from quantobs.observers.base import Observer
from quantobs.observers.engine import ObserverEngine
from quantobs.stats.base import Reduce, Statistic

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "agree_references",
    "any_across",
    "broadcast_from_owners",
    "collective_device",
    "is_distributed",
    "owners_by_size",
    "rank_and_world",
    "sync_observers",
]

#: Largest packed buffer one broadcast of `broadcast_from_owners` sends (a
#: larger tensor goes alone).
DEFAULT_BUCKET_BYTES = 1 << 29
_ALIGN = 16  # byte alignment of each tensor in a packed buffer

# A field's (shape, dtype), as a process reports it.
_FieldMeta = tuple[tuple[int, ...], torch.dtype]


# ------------------------------------------------------------------ helpers


def is_distributed() -> bool:
    """Whether `torch.distributed` is available and initialized."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: ProcessGroup | None = None) -> tuple[int, int]:
    """`(rank, world_size)` in `group` (default: the world); `(0, 1)` when
    `torch.distributed` is not initialized."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: ProcessGroup | None = None) -> torch.device:
    """The device the group's backend communicates from: the current CUDA
    device under NCCL, else the CPU."""
    if is_distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_across(flag: bool, group: ProcessGroup | None = None) -> bool:
    """Whether `flag` is true on any process of `group` (a collective: every
    process calls it); `flag` itself outside `torch.distributed`."""
    _, world = rank_and_world(group)
    if world <= 1:
        return flag
    found = torch.tensor([int(flag)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())


def _wire_device(device: torch.device, group: ProcessGroup | None) -> torch.device:
    """Where a tensor on `device` is communicated from (CPU tensors go through
    the current CUDA device under NCCL)."""
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _global_rank(group: ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _gather(obj: Any, world: int, group: ProcessGroup | None) -> list[Any]:
    """Every process's `obj`, by rank (one `all_gather_object`)."""
    found: list[Any] = [None] * world
    dist.all_gather_object(found, obj, group=group)
    return found


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a field is reduced in: exact for MIN / MAX, and for SUM of
    integers (module table)."""
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    if dtype.is_complex:
        raise TypeError(f"cannot reduce complex statistics ({dtype})")
    return torch.int64


def _extreme(dtype: torch.dtype, largest: bool) -> float | int | bool:
    """The identity of MIN (`largest`) or MAX (not `largest`) in `dtype`."""
    if dtype == torch.bool:
        return largest
    if dtype.is_floating_point:
        return math.inf if largest else -math.inf
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


@dataclass(frozen=True)
class _Slot:
    """Where one tensor sits in a bucket, and what it was."""

    key: tuple[str, torch.dtype, str]
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _BitSlot:
    """A tensor carried as its bytes (in int64 words) in a SUM bucket."""

    words: _Slot
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class _Buckets:
    """Tensors reduced with one all-reduce per (op, wire dtype, device type).

    Every process must add tensors of the same shapes and dtypes in the same
    order (their values differ); `run` then reduces them all and `get`
    returns each one's result.
    """

    def __init__(self, group: ProcessGroup | None) -> None:
        self._group = group
        self._parts: dict[tuple[str, torch.dtype, str], list[torch.Tensor]] = {}
        self._wire: dict[tuple[str, torch.dtype, str], torch.device] = {}
        self._done: dict[tuple[str, torch.dtype, str], list[torch.Tensor]] = {}

    def add(self, op: str, value: torch.Tensor) -> _Slot:
        """Queue `value` for the all-reduce `op` (`"min"`, `"max"`, `"sum"`)."""
        wire_dtype = _wire_dtype(value.dtype)
        device = _wire_device(value.device, self._group)
        key = (op, wire_dtype, device.type)
        parts = self._parts.setdefault(key, [])
        wire = self._wire.setdefault(key, device)
        parts.append(value.reshape(-1).to(device=wire, dtype=wire_dtype))
        return _Slot(key, len(parts) - 1, tuple(value.shape), value.dtype, value.device)

    def add_bits(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        value: torch.Tensor | None,
    ) -> _BitSlot:
        """Queue a tensor copied from the one process passing its `value`
        (the others pass None), bit for bit."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        words = torch.zeros(-(-nbytes // 8), dtype=torch.int64, device=device)
        if value is not None:
            raw = value.to(dtype).contiguous().reshape(-1).view(torch.uint8)
            words.view(torch.uint8)[:nbytes].copy_(raw)
        return _BitSlot(self.add("sum", words), shape, dtype, device)

    def run(self) -> int:
        """Reduce every bucket; returns the number of all-reduces."""
        calls = 0
        for key in sorted(self._parts, key=lambda k: (k[0], str(k[1]), k[2])):
            parts = self._parts[key]
            flat = torch.cat(parts)
            if flat.numel():
                dist.all_reduce(flat, op=_OPS[key[0]], group=self._group)
                calls += 1
            self._done[key] = list(flat.split([p.numel() for p in parts]))
        self._parts.clear()
        return calls

    def get(self, slot: _Slot) -> torch.Tensor:
        """The reduced tensor of `slot`, in its dtype, shape and device."""
        piece = self._done[slot.key][slot.index]
        return piece.to(device=slot.device, dtype=slot.dtype, copy=True).reshape(
            slot.shape
        )

    def get_bits(self, slot: _BitSlot) -> torch.Tensor:
        """The tensor of `slot` as the process that passed it had it."""
        words = self.get(slot.words)
        itemsize = torch.empty((), dtype=slot.dtype).element_size()
        nbytes = math.prod(slot.shape) * itemsize
        raw = words.view(torch.uint8)[:nbytes]
        return raw.view(slot.dtype).reshape(slot.shape)


# ------------------------------------------------------------- sync_observers


@dataclass(frozen=True)
class _Report:
    """What one process holds of one observer (gathered from every process).

    Attributes:
        kind: observer class, statistic class and a digest of its config.
        qshape: the statistic's qparam shape (None: no statistic).
        fields: `(shape, dtype)` of each present state field.
        counts: `(num_observations, num_observed_tokens)` of an `Observer`.
    """

    kind: str
    qshape: tuple[int, ...] | None
    fields: dict[str, _FieldMeta]
    counts: tuple[int, int | None] | None


def _kind(obs: ObserverEngine) -> str:
    stype = obs.statistic_type()
    config = repr(sorted(obs.statistic_config().items())) if stype else ""
    digest = hashlib.blake2b(config.encode(), digest_size=8).hexdigest()
    name = stype.__qualname__ if stype else None
    return f"{type(obs).__qualname__}[{name}]#{digest}"


def _report(obs: ObserverEngine) -> _Report:
    stat = obs.statistic()
    counts = None
    if isinstance(obs, Observer):
        counts = (obs.num_observations, obs.num_observed_tokens)
    if stat is None:
        return _Report(_kind(obs), None, {}, counts)
    fields = {n: (tuple(v.shape), v.dtype) for n, v in stat.state().items()}
    return _Report(_kind(obs), stat.qparam_shape, fields, counts)


def _check_same_observers(reports: list[list[Any]], what: str) -> None:
    """Raise (on every process alike) unless every process passed the same
    number of observers of the same kinds."""
    lengths = [len(r) for r in reports]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"{what}: the processes passed different numbers of observers "
            f"({lengths}, by rank); pass the same observers in the same order"
        )
    for i, first in enumerate(reports[0]):
        for rank, theirs in enumerate(reports):
            if theirs[i].kind != first.kind:
                raise ValueError(
                    f"{what}: observer {i} is {theirs[i].kind} on rank {rank} but "
                    f"{first.kind} on rank 0; pass the same observers (same "
                    "classes and settings) in the same order on every process"
                )


@dataclass(frozen=True)
class _Plan:
    """How one observer's statistic is combined (the same on every process).

    Attributes:
        present: the ranks holding a statistic.
        qshape: its qparam shape.
        targets: `(shape, dtype)` every process's field takes (fields no
            process holds are left out).
        latest: the rank LATEST fields come from (the highest present).
        grid_sources: per GRID field, the rank it is copied from after
            alignment, or None where every process aligns its own.
        weighted: MEAN fields are weighted by the `count` field.
    """

    present: tuple[int, ...]
    qshape: tuple[int, ...]
    targets: dict[str, _FieldMeta]
    latest: int
    grid_sources: dict[str, int | None]
    weighted: bool


def _plan(
    index: int, stype: type[Statistic], reports: list[_Report], world: int
) -> _Plan | None:
    """The plan of observer `index` from every process's report (raises alike
    on every process).

    Raises:
        ValueError: qparam shapes or field shapes that differ across processes.
    """
    present = tuple(r for r, rep in enumerate(reports) if rep.qshape is not None)
    if not present:
        return None
    qshapes = {reports[r].qshape for r in present}
    if len(qshapes) > 1:
        raise ValueError(
            f"sync_observers: observer {index} has different qparam shapes on "
            f"different ranks ({sorted(qshapes)})"
        )
    targets: dict[str, _FieldMeta] = {}
    grid_sources: dict[str, int | None] = {}
    for field in stype.fields:
        held = [(r, reports[r].fields[field.name]) for r in present]
        held = [(r, meta) for r, meta in held if meta is not None]
        held = [(r, meta) for r, meta in held]
        held = [(r, reports[r].fields[field.name]) for r in present if field.name in reports[r].fields]
        if not held:
            continue
        filled = [(r, meta) for r, meta in held if math.prod(meta[0]) > 0]
        shapes = {meta[0] for _, meta in filled}
        if len(shapes) > 1:
            raise ValueError(
                f"sync_observers: observer {index}: {stype.__name__}.{field.name} "
                f"has different shapes on different ranks ({sorted(shapes)}); "
                "use the same observer settings on every process"
            )
        if filled:
            dtype = filled[0][1][1]
            for _, (_, other) in filled[1:]:
                dtype = torch.promote_types(dtype, other)
            targets[field.name] = (filled[0][1][0], dtype)
        else:
            targets[field.name] = held[0][1]
        if field.reduce == Reduce.GRID:
            everywhere = len(filled) == world
            grid_sources[field.name] = None if everywhere else (
                filled[0][0] if filled else None
            )
    weighted = all("count" in reports[r].fields for r in present)
    return _Plan(present, qshapes.pop() or (), targets, present[-1], grid_sources, weighted)
