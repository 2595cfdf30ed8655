"""Weights observed once: which process observes which, and their results
sent to every process.

`owners_by_size` deals the weights to processes, greedily by size, and
`broadcast_from_owners` sends each owner's results (qparams) to every
process, one broadcast per owner: the bytes of tensors of every dtype
(float8 included) packed together, so every bit arrives.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from quantobs.calibration.distributed import (
    gather_objects,
    global_rank,
    rank_and_world,
    wire_device,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DEFAULT_BUCKET_BYTES", "broadcast_from_owners", "owners_by_size"]

#: Largest packed buffer one broadcast of `broadcast_from_owners` sends (a
#: larger tensor goes alone).
DEFAULT_BUCKET_BYTES = 1 << 29
_ALIGN = 16  # byte alignment of each tensor in a packed buffer


def owners_by_size(sizes: Sequence[int], world_size: int) -> list[int]:
    """Deal items to processes so that their total sizes balance.

    Greedy and deterministic: the largest item first (ties: the lower index)
    goes to the least-loaded process (ties: the lower rank). Every process
    computes the same answer, so each knows which weights it observes.

    Args:
        sizes: each item's size (e.g. a weight's `numel()`), `>= 0`.
        world_size: the number of processes, `>= 1`.

    Returns:
        The owning rank of each item, in the order of `sizes`.

    Raises:
        ValueError: `world_size < 1` or a negative size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError("owners_by_size needs sizes >= 0")
    loads = [(0, rank) for rank in range(world_size)]  # a heap of (load, rank)
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + sizes[i], rank))
    return owners


def _packed(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive runs of items (by index into `sizes`) of at most `limit`
    aligned bytes each (an item larger than `limit` alone)."""
    runs: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        padded = -(-size // _ALIGN) * _ALIGN
        if not runs or used + padded > limit:
            runs.append([])
            used = 0
        runs[-1].append(i)
        used += padded
    return runs


@torch.no_grad()
def broadcast_from_owners(
    tensors: Sequence[torch.Tensor],
    owners: Sequence[int],
    group: ProcessGroup | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Give every process each tensor's value on its owner, in place.

    Every process passes tensors of the same shapes and dtypes in the same
    order, and the same owners (e.g. from `owners_by_size`); afterwards each
    tensor holds, bit for bit, its owner's values. Each owner's tensors
    travel as their bytes packed together (any dtypes, float8 included):
    one `all_gather_object` (checking shapes, dtypes and owners), then one
    broadcast per owner (that owns any), or more where they exceed
    `bucket_bytes`, from the device of the owner's first tensor. Outside
    `torch.distributed` it does nothing.

    Args:
        tensors: this process's tensors (written in place where not owned).
        owners: the owning rank of each tensor.
        group: the process group (default: the world); owners are its ranks.
        bucket_bytes: the largest packed buffer (a larger tensor goes alone).

    Raises:
        ValueError: `owners` and `tensors` differ in length, an owner is not
            a rank of the group, or (on every process alike) the processes
            passed different owners, or a tensor whose shape or dtype differs
            from its owner's.
    """
    if len(tensors) != len(owners):
        raise ValueError(
            f"broadcast_from_owners got {len(tensors)} tensors but {len(owners)} owners"
        )
    rank, world = rank_and_world(group)
    bad = sorted({o for o in owners if not 0 <= o < world})
    if bad:
        raise ValueError(f"owners {bad} are not ranks of a group of {world}")
    if world <= 1:
        return
    _check_same_tensors(tensors, owners, world, group)
    for owner in range(world):
        indices = [i for i, o in enumerate(owners) if o == owner and tensors[i].numel()]
        if not indices:
            continue
        wire = wire_device(tensors[indices[0]].device, group)
        nbytes = [tensors[i].numel() * tensors[i].element_size() for i in indices]
        for run in _packed(nbytes, bucket_bytes):
            chosen = [tensors[indices[k]] for k in run]
            _broadcast_packed(chosen, rank == owner, owner, wire, group)


def _check_same_tensors(
    tensors: Sequence[torch.Tensor],
    owners: Sequence[int],
    world: int,
    group: ProcessGroup | None,
) -> None:
    """Raise (on every process alike) unless every process passed the same
    owners and each tensor with its owner's shape and dtype."""
    mine = (list(owners), [(tuple(t.shape), t.dtype) for t in tensors])
    found = gather_objects(mine, world, group)
    if any(theirs != found[0][0] for theirs, _ in found):
        raise ValueError(
            "broadcast_from_owners: the processes passed different owners; "
            "pass the same tensors and owners in the same order on every process"
        )
    for i, owner in enumerate(found[0][0]):
        shape, dtype = found[owner][1][i]
        for rank, (_, metas) in enumerate(found):
            if metas[i] != (shape, dtype):
                raise ValueError(
                    f"broadcast_from_owners: tensor {i} is {metas[i][0]} "
                    f"{metas[i][1]} on rank {rank} but {shape} {dtype} on its "
                    f"owner, rank {owner}; every process must pass tensors of "
                    "the owner's shapes and dtypes"
                )


def _broadcast_packed(
    tensors: list[torch.Tensor],
    mine: bool,
    owner: int,
    device: torch.device,
    group: ProcessGroup | None,
) -> None:
    """One broadcast of `tensors`' bytes from `owner`, unpacked elsewhere."""
    offsets = []
    end = 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(end, dtype=torch.uint8, device=device)
    if mine:
        for tensor, start in zip(tensors, offsets, strict=True):
            raw = tensor.detach().reshape(-1).view(torch.uint8)
            buffer[start : start + raw.numel()].copy_(raw)
    dist.broadcast(buffer, src=global_rank(group, owner), group=group)
    if mine:
        return
    for tensor, start in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        raw = buffer[start : start + nbytes]
        tensor.copy_(raw.view(tensor.dtype).view(tensor.shape))
