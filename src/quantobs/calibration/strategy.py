"""Where calibration runs: one process (`Local`) or a process group
(`ProcessGroup`), as one object the calibration loop calls.

A strategy owns everything that differs between the two: which weights this
process observes (`owned`: all of them locally; dealt by size across the
group, fused layers together, `quantobs.calibration.owners`), whether a
shared reference range must be agreed before any error accumulates
(`agrees_references`, `agree_references`), the combination of observer
statistics (`sync`: the importance gathered during the batches, the
activation statistics), the weight qparams sent from their owners
(`share_weights`), the token counts summed over processes (`summed`) and
which process keeps the combined statistics afterwards (`keeps_totals`).
`Local`'s are identities; `ProcessGroup`'s are the collectives of
`quantobs.calibration.distributed` and `quantobs.calibration.owners`, which
every process calls in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from quantobs.calibration import distributed as dist
from quantobs.calibration.owners import broadcast_from_owners, owners_by_size
from quantobs.calibration.transposed import linear_weight
from quantobs.core.layout import qparam_shape
from quantobs.observers.engine import ObserverEngine

if TYPE_CHECKING:
    from quantobs.calibration.attach import Entry
    from quantobs.calibration.qparams import QParams

__all__ = ["Local", "ProcessGroup", "Strategy", "strategy_for"]


class Strategy:
    """One process calibrating on all the batches (the base: `Local`)."""

    #: whether every process must share each reference range (`static_mse`)
    agrees_references = False

    @property
    def rank(self) -> int:
        """This process's rank (0 locally)."""
        return 0

    @property
    def world(self) -> int:
        """The number of processes (1 locally)."""
        return 1

    def owners(self, groups: Sequence[Sequence[Entry]]) -> list[int]:
        """The rank that observes each fused weight group."""
        return [0] * len(groups)

    def owned(self, groups: Sequence[Sequence[Entry]]) -> list[list[Entry]]:
        """The fused weight groups this process observes."""
        owners = self.owners(groups)
        return [list(g) for g, o in zip(groups, owners, strict=True) if o == self.rank]

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any process."""
        return flag

    def agree_references(self, observers: Sequence[ObserverEngine]) -> None:
        """Give every process the same reference ranges (nothing locally)."""

    def sync(self, engines: Sequence[ObserverEngine]) -> None:
        """Combine the engines' statistics over processes (nothing locally)."""

    def share_weights(
        self,
        groups: Sequence[Sequence[Entry]],
        owners: Sequence[int],
        qparams: dict[str, QParams],
    ) -> None:
        """Complete `qparams` with the weight qparams of the groups others
        own, bit for bit as their owner computed them (nothing locally)."""

    def summed(self, tokens: Mapping[str, int]) -> dict[str, int]:
        """Token counts summed over processes."""
        return dict(tokens)

    def keeps_totals(self) -> bool:
        """Whether this process keeps the combined statistics after a sync
        (the others empty theirs, so a later sync counts every batch once)."""
        return True


class Local(Strategy):
    """One process: every weight observed here, nothing communicated."""


class ProcessGroup(Strategy):
    """The processes of a `torch.distributed` group, each calibrating on its
    shard of the batches; every process ends with the qparams one process
    would compute from all of them.

    Args:
        group: the process group (None: the world).

    Raises:
        RuntimeError: `torch.distributed` is not initialized.
    """

    agrees_references = True

    def __init__(self, group: Any = None) -> None:
        if not dist.is_distributed():
            raise RuntimeError(
                "calibrate(sync=True) needs an initialized torch.distributed "
                "process group (e.g. started with torchrun)"
            )
        self.group = group
        self._rank, self._world = dist.rank_and_world(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world(self) -> int:
        return self._world

    def owners(self, groups: Sequence[Sequence[Entry]]) -> list[int]:
        # the sizes from the parameters' shapes: an offloaded weight (a meta
        # placeholder) is not loaded to be counted
        sizes = [sum(_weight_numel(e) for e in g) for g in groups]
        return owners_by_size(sizes, self._world)

    def any(self, flag: bool) -> bool:
        return dist.any_across(flag, self.group)

    def agree_references(self, observers: Sequence[ObserverEngine]) -> None:
        dist.agree_references(observers, self.group)

    def sync(self, engines: Sequence[ObserverEngine]) -> None:
        dist.sync_observers(engines, self.group)

    def share_weights(
        self,
        groups: Sequence[Sequence[Entry]],
        owners: Sequence[int],
        qparams: dict[str, QParams],
    ) -> None:
        tensors: list[torch.Tensor] = []
        tensor_owners: list[int] = []
        for group, owner in zip(groups, owners, strict=True):
            for entry in group:
                if owner != self._rank:
                    qparams[entry.key] = _placeholder(entry)
                for kind in sorted(qparams[entry.key]):
                    tensors.append(qparams[entry.key][kind])
                    tensor_owners.append(owner)
        broadcast_from_owners(tensors, tensor_owners, self.group)

    def summed(self, tokens: Mapping[str, int]) -> dict[str, int]:
        import torch.distributed as torch_dist

        if not tokens:
            return dict(tokens)
        keys = sorted(tokens)
        counts = torch.tensor(
            [tokens[k] for k in keys],
            dtype=torch.int64,
            device=dist.collective_device(self.group),
        )
        torch_dist.all_reduce(counts, group=self.group)
        return dict(zip(keys, (int(c) for c in counts.tolist()), strict=True))

    def keeps_totals(self) -> bool:
        return self._rank == 0


def _placeholder(entry: Entry) -> QParams:
    """Zero qparams of a weight another process owns (overwritten by the
    owner's broadcast)."""
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


def strategy_for(sync: bool, process_group: Any = None) -> Strategy:
    """`ProcessGroup(process_group)` when `sync`, else `Local()`.

    Raises:
        RuntimeError: `sync` outside an initialized process group.
    """
    return ProcessGroup(process_group) if sync else Local()


def _weight_numel(entry: Entry) -> int:
    """The number of values of `entry`'s weight, read from its shape."""
    found = linear_weight(entry.module)
    return entry.weight.numel() if found is None else found.numel()
