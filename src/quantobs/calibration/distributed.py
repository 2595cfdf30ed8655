"""Calibrating across processes: observer statistics combined exactly.

(One concept, and over 500 lines on purpose: `sync_observers` is one
protocol — an object gather, then bucketed all-reduces driven by each
statistic's declared reductions — and its bucket and per-observer plan
classes serve only it; `agree_references` is its counterpart for shared
reference ranges. Who observes which weight is in `owners`.)

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

Weights are observed once, by their owner: see
`quantobs.calibration.owners`.

Device-agnostic: tensors stay on the observers' device (CPU tensors go
through the current CUDA device under NCCL). NCCL's object collectives use
the current CUDA device too, so set it (`torch.cuda.set_device`) first.
"""

from __future__ import annotations

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
    "agree_references",
    "any_across",
    "collective_device",
    "gather_objects",
    "global_rank",
    "is_distributed",
    "rank_and_world",
    "sync_observers",
    "wire_device",
]


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
    found = torch.tensor(
        [int(flag)], dtype=torch.int64, device=collective_device(group)
    )
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())


def wire_device(device: torch.device, group: ProcessGroup | None) -> torch.device:
    """Where a tensor on `device` is communicated from (CPU tensors go through
    the current CUDA device under NCCL)."""
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def global_rank(group: ProcessGroup | None, rank: int) -> int:
    """The world rank of `rank` in `group`."""
    return rank if group is None else dist.get_global_rank(group, rank)


def gather_objects(obj: Any, world: int, group: ProcessGroup | None) -> list[Any]:
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


@dataclass(frozen=True)
class _Slot:
    """Where one tensor sits in a bucket, and what it was."""

    key: tuple[str, torch.dtype]
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
    """Tensors reduced with one all-reduce per (op, wire dtype).

    Every process must add tensors of the same shapes and dtypes in the same
    order (their values differ); `run` then reduces them all and `get`
    returns each one's result. With `world == 1` nothing is communicated.
    """

    def __init__(self, group: ProcessGroup | None, world: int) -> None:
        self._group = group
        self._world = world
        self._parts: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._wire: dict[tuple[str, torch.dtype], torch.device] = {}
        self._done: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}

    def add(self, op: str, value: torch.Tensor) -> _Slot:
        """Queue `value` for the all-reduce `op` (`"min"`, `"max"`, `"sum"`)."""
        wire_dtype = _wire_dtype(value.dtype)
        device = value.device
        if self._world > 1:
            device = wire_device(device, self._group)
        key = (op, wire_dtype)
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
        for key in sorted(self._parts, key=lambda k: (k[0], str(k[1]))):
            parts = self._parts[key]
            flat = torch.cat(parts)
            if flat.numel() and self._world > 1:
                op = getattr(dist.ReduceOp, key[0].upper())
                dist.all_reduce(flat, op=op, group=self._group)
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
        kind: the observer's class and its statistic's.
        qshape: the statistic's qparam shape (None: no statistic).
        fields: `(shape, dtype)` of each present state field.
        counts: `(num_observations, num_observed_tokens)` of an `Observer`.
    """

    kind: str
    qshape: tuple[int, ...] | None
    fields: dict[str, _FieldMeta]
    counts: tuple[int, int | None] | None


def _kind(obs: ObserverEngine) -> str:
    """The observer's class and its statistic's (settings are checked by the
    shapes they give: some configs, like Quark's bin count, change with the
    data)."""
    stype = obs.statistic_type()
    name = stype.__qualname__ if stype is not None else None
    return f"{type(obs).__qualname__}[{name}]"


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
    """How one observer's statistic combines (the same on every process).

    Attributes:
        present: the ranks holding a statistic.
        qshape: its qparam shape.
        targets: `(shape, dtype)` each state field takes on every process
            (fields no process holds are left out).
        sources: per LATEST field, the highest rank holding it; per GRID
            field, the lowest rank holding it filled where some process may
            not align to it, else None (every process aligns its own).
        weighted: MEAN fields are weighted by the `count` field.
    """

    present: tuple[int, ...]
    qshape: tuple[int, ...]
    targets: dict[str, _FieldMeta]
    sources: dict[str, int | None]
    weighted: bool


def _plan(
    index: int, stype: type[Statistic], reports: list[_Report], world: int
) -> _Plan | None:
    """Observer `index`'s plan from every process's report (None: no process
    holds a statistic).

    Raises (on every process alike):
        ValueError: qparam or field shapes that differ across processes.
    """
    present = tuple(r for r, rep in enumerate(reports) if rep.qshape is not None)
    if not present:
        return None
    qshapes = sorted({reports[r].qshape or () for r in present})
    if len(qshapes) > 1:
        raise ValueError(
            f"sync_observers: observer {index} has different qparam shapes on "
            f"different ranks ({qshapes})"
        )
    targets: dict[str, _FieldMeta] = {}
    sources: dict[str, int | None] = {}
    for field in stype.fields:
        held = [
            (r, reports[r].fields[field.name])
            for r in present
            if field.name in reports[r].fields
        ]
        if not held:
            continue
        # Zero-size fields (e.g. a histogram with no bins yet) are empty.
        filled = [(r, meta) for r, meta in held if math.prod(meta[0]) > 0]
        shapes = sorted({meta[0] for _, meta in filled})
        if len(shapes) > 1:
            raise ValueError(
                f"sync_observers: observer {index}: {stype.__name__}."
                f"{field.name} has different shapes on different ranks "
                f"({shapes}); use the same observer settings on every process"
            )
        if filled:
            dtype = filled[0][1][1]
            for _, (_, other) in filled[1:]:
                dtype = torch.promote_types(dtype, other)
            targets[field.name] = (shapes[0], dtype)
        else:
            targets[field.name] = held[0][1]
        if field.reduce == Reduce.LATEST:
            sources[field.name] = held[-1][0]
        elif field.reduce == Reduce.GRID:
            aligned_everywhere = len(filled) == world or not filled
            sources[field.name] = None if aligned_everywhere else filled[0][0]
    weighted = all("count" in reports[r].fields for r in present)
    return _Plan(present, qshapes[0], targets, sources, weighted)


def _fill(
    meta: _FieldMeta, value: float | int | bool, device: torch.device
) -> torch.Tensor:
    return torch.full(meta[0], value, dtype=meta[1], device=device)


class _Sync:
    """One observer's part in `sync_observers`: its local statistic (an empty
    one where this process holds none), its slots in the buckets, and the
    combined statistic."""

    def __init__(self, index: int, obs: ObserverEngine, plan: _Plan, rank: int) -> None:
        self.index = index
        self.obs = obs
        self.plan = plan
        self.rank = rank
        self.holds = rank in plan.present
        stat = obs.statistic() if self.holds else None
        if stat is None:
            stat = obs._new_statistic(plan.qshape, obs._device_marker.device)
        state = stat.state()
        self.device = next(iter(state.values())).device
        cast = {
            n: v.to(plan.targets[n][1]) for n, v in state.items() if n in plan.targets
        }
        if any(cast[n].dtype != state[n].dtype for n in cast):
            stat = type(stat).from_state({**state, **cast}, **obs.statistic_config())
        self.stat = stat
        self.state = cast
        self.kinds = {f.name: f.reduce for f in stat.fields if f.name in plan.targets}
        self.slots: dict[str, Any] = {}
        self.reduced: dict[str, torch.Tensor] = {}  # MIN, MAX, EQUAL fields
        self.aligned: dict[str, torch.Tensor] = {}  # the state after align

    def _own(self, name: str, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """This process's value of a field, or None where it has none to give
        (absent, or zero-size where others are filled)."""
        value = state.get(name)
        target = self.plan.targets[name][0]
        if value is None or tuple(value.shape) == target:
            return value
        if value.numel():  # align() changed a filled field's shape
            raise RuntimeError(
                f"sync_observers: observer {self.index}: field {name!r} has shape "
                f"{tuple(value.shape)} here but {target} on other ranks"
            )
        return None

    def add_extremes(self, buckets: _Buckets) -> None:
        """Queue the MIN, MAX and EQUAL fields (EQUAL in both)."""
        for name, kind in self.kinds.items():
            meta = self.plan.targets[name]
            value = self._own(name, self.state)
            if kind == Reduce.EQUAL and not self.holds:
                value = None
            for op, reduce, identity_is_largest in (
                ("min", Reduce.MIN, True),
                ("max", Reduce.MAX, False),
            ):
                if kind not in (reduce, Reduce.EQUAL):
                    continue
                identity = _extreme(meta[1], identity_is_largest)
                own = value if value is not None else _fill(meta, identity, self.device)
                self.slots[f"{op}:{name}"] = buckets.add(op, own)

    def take_extremes(self, buckets: _Buckets) -> list[str]:
        """Read the reduced MIN / MAX fields; returns the EQUAL fields that
        differ across processes."""
        differ = []
        for name, kind in self.kinds.items():
            if kind == Reduce.MIN:
                self.reduced[name] = buckets.get(self.slots[f"min:{name}"])
            elif kind == Reduce.MAX:
                self.reduced[name] = buckets.get(self.slots[f"max:{name}"])
            elif kind == Reduce.EQUAL:
                low = buckets.get(self.slots[f"min:{name}"])
                high = buckets.get(self.slots[f"max:{name}"])
                if not torch.equal(low, high):
                    differ.append(name)
                self.reduced[name] = low
        return differ

    def add_sums(self, buckets: _Buckets) -> None:
        """Align to the reduced range, then queue the SUM and MEAN fields and
        the copied (LATEST, GRID) ones."""
        bounds = {
            n: v for n, v in self.reduced.items() if self.kinds[n] != Reduce.EQUAL
        }
        aligned = self.stat.align(bounds).state()
        self.aligned = {
            n: v.to(self.plan.targets[n][1])
            for n, v in aligned.items()
            if n in self.plan.targets
        }
        count = self.aligned.get("count")
        weight = (
            count.to(torch.float64)
            if self.plan.weighted and count is not None
            else torch.ones((), dtype=torch.float64, device=self.device)
        )
        for name, kind in self.kinds.items():
            meta = self.plan.targets[name]
            value = self._own(name, self.aligned)
            if kind == Reduce.SUM:
                total = value if value is not None else _fill(meta, 0, self.device)
                self.slots[f"sum:{name}"] = buckets.add("sum", total)
            elif kind == Reduce.MEAN:
                if value is None:
                    value = _fill(meta, math.inf, self.device)
                present = torch.isfinite(value)
                weighted = torch.where(present, value.to(torch.float64) * weight, 0.0)
                self.slots[f"num:{name}"] = buckets.add("sum", weighted)
                self.slots[f"den:{name}"] = buckets.add(
                    "sum", torch.where(present, weight, 0.0)
                )
            elif kind in (Reduce.LATEST, Reduce.GRID):
                source = self.plan.sources[name]
                if source is None:
                    continue
                own = value if self.rank == source else None
                self.slots[f"bits:{name}"] = buckets.add_bits(
                    meta[0], meta[1], self.device, own
                )

    def store(self, buckets: _Buckets) -> None:
        """Write the combined statistic into the observer."""
        state: dict[str, torch.Tensor] = {}
        for name, kind in self.kinds.items():
            if kind in (Reduce.MIN, Reduce.MAX, Reduce.EQUAL):
                state[name] = self.reduced[name]
            elif kind == Reduce.SUM:
                state[name] = buckets.get(self.slots[f"sum:{name}"])
            elif kind == Reduce.MEAN:
                num = buckets.get(self.slots[f"num:{name}"])
                den = buckets.get(self.slots[f"den:{name}"])
                own = self.aligned.get(
                    name, _fill(self.plan.targets[name], math.inf, self.device)
                )
                mean = torch.where(
                    den > 0, num / den.clamp_min(1e-300), own.to(torch.float64)
                )
                state[name] = mean.to(self.plan.targets[name][1])
            elif f"bits:{name}" in self.slots:
                state[name] = buckets.get_bits(self.slots[f"bits:{name}"])
            else:
                state[name] = self.aligned[name]
        stat = self.stat.from_state(state, **self.obs.statistic_config())
        self.obs._store(stat)


@torch.no_grad()
def sync_observers(
    observers: Sequence[ObserverEngine], group: ProcessGroup | None = None
) -> None:
    """Give every process the statistics of all processes' batches.

    Every process passes the same observers (same order, classes and
    settings), each having observed its own shard of the batches; afterwards
    each observer holds, on every process, the statistic one process
    observing every batch would hold: exactly for exact statistics (min-max,
    power-of-two histograms, summed candidate errors up to the order of
    their float64 sums), as the module table says for the others.
    `Observer` counts (`num_observations`, `num_observed_tokens`) are summed.
    Call it once: a second call would count every process's data again.
    Outside `torch.distributed` (or for a group of one) it does nothing.

    Collectives: one `all_gather_object`, then one all-reduce per (op, wire
    dtype) for all observers together (module docstring).

    Args:
        observers: this process's observers.
        group: the process group (default: the world).

    Raises (on every process alike):
        ValueError: different observers across processes, qparam or field
            shapes that differ, or EQUAL fields (a `static_mse` reference)
            that differ (the message names the observer and the field).
    """
    rank, world = rank_and_world(group)
    if world <= 1:
        return
    reports = gather_objects([_report(obs) for obs in observers], world, group)
    _check_same_observers(reports, "sync_observers")
    syncs: list[_Sync] = []
    for i, obs in enumerate(observers):
        stype = obs.statistic_type()
        plan = (
            None if stype is None else _plan(i, stype, [r[i] for r in reports], world)
        )
        if plan is not None:
            syncs.append(_Sync(i, obs, plan, rank))
    extremes = _Buckets(group, world)
    for sync in syncs:
        sync.add_extremes(extremes)
    extremes.run()
    differ = []
    for sync in syncs:
        for name in sync.take_extremes(extremes):
            differ.append(
                f"observer {sync.index} ({sync.obs._describe()}): "
                f"{type(sync.stat).__name__}.{name}"
            )
    if differ:
        raise ValueError(
            "sync_observers: fields that must be equal on every process (a "
            "shared reference, Reduce.EQUAL) differ: "
            + "; ".join(differ)
            + "; give every process the same reference before observing "
            "(agree_references)"
        )
    sums = _Buckets(group, world)
    for sync in syncs:
        sync.add_sums(sums)
    sums.run()
    for sync in syncs:
        sync.store(sums)
    for i, obs in enumerate(observers):
        if isinstance(obs, Observer):
            _sum_counts(obs, [r[i].counts for r in reports])


def _sum_counts(obs: Observer, counts: list[tuple[int, int | None] | None]) -> None:
    found = [c for c in counts if c is not None]
    obs.num_observations = sum(c[0] for c in found)
    tokens = [c[1] for c in found if c[1] is not None]
    obs.num_observed_tokens = sum(tokens) if tokens else None


# ---------------------------------------------------------- agree_references


def _reference_fields(index: int, obs: ObserverEngine) -> set[str]:
    """The EQUAL fields (the reference) of an observer's statistic.

    Raises:
        TypeError: the observer keeps no reference.
    """
    stype = obs.statistic_type()
    names = (
        set()
        if stype is None
        else {f.name for f in stype.fields if f.reduce == Reduce.EQUAL}
    )
    if not names:
        raise TypeError(
            f"agree_references: observer {index} ({obs._describe()}) keeps no "
            "reference range (no Reduce.EQUAL field); pass only observers "
            "such as static_mse"
        )
    return names


@torch.no_grad()
def agree_references(
    observers: Sequence[ObserverEngine], group: ProcessGroup | None = None
) -> None:
    """Give every process the reference range of the lowest process that has
    one, with nothing accumulated yet.

    For observers whose statistic keeps a reference (Reduce.EQUAL fields,
    e.g. `static_mse`'s `CandidateErrors`). Each process has set (or not) a
    reference, typically by observing its first batch; afterwards each
    observer is reset (statistic and counts) and holds, on every process,
    the reference of the lowest rank that had one (none if no rank had).
    Then observe every batch and `sync_observers`: with contiguous or
    round-robin shards the lowest rank's first batch is the global first
    batch, so the result equals one process observing every batch.
    Outside `torch.distributed` each observer keeps its own reference.

    Collectives: one `all_gather_object` and one int64 all-reduce.

    Raises:
        TypeError: an observer that keeps no reference.
        ValueError: different observers across processes (on every process).
    """
    rank, world = rank_and_world(group)
    mine = []
    for i, obs in enumerate(observers):
        names = _reference_fields(i, obs)
        stat = obs.statistic()
        if stat is None or not bool(getattr(stat, "has_reference", True)):
            mine.append(_Report(_kind(obs), None, {}, None))
            continue
        fields = {
            n: (tuple(v.shape), v.dtype) for n, v in stat.state().items() if n in names
        }
        mine.append(_Report(_kind(obs), stat.qparam_shape, fields, None))
    reports = gather_objects(mine, world, group) if world > 1 else [mine]
    _check_same_observers(reports, "agree_references")
    buckets = _Buckets(group, world)
    chosen: list[tuple[tuple[int, ...], torch.device, dict[str, _BitSlot]] | None] = []
    for i, obs in enumerate(observers):
        holders = [r for r in range(world) if reports[r][i].qshape is not None]
        if not holders:
            chosen.append(None)
            continue
        source = reports[holders[0]][i]
        stat = obs.statistic()
        own = stat.state() if rank == holders[0] and stat is not None else {}
        device = (
            next(iter(stat.state().values())).device
            if stat is not None
            else obs._device_marker.device
        )
        slots = {
            name: buckets.add_bits(shape, dtype, device, own.get(name))
            for name, (shape, dtype) in source.fields.items()
        }
        chosen.append((source.qshape or (), device, slots))
    buckets.run()
    for obs, found in zip(observers, chosen, strict=True):
        obs.reset()
        if found is None:
            continue
        qshape, device, slots = found
        empty = obs._new_statistic(qshape, device)
        reference = {name: buckets.get_bits(slot) for name, slot in slots.items()}
        obs._store(empty.replace(**reference))


# --------------------------------------------------------- weights by owner
