"""The sync counter sees every way code makes the host wait for a device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from quantobs.core.syncs import SyncCounter, count_syncs, on_host

X = torch.tensor([0.5, -1.0, 2.0, 0.0])

SYNCING: dict[str, Callable[[], Any]] = {
    "item": lambda: X[0].item(),
    "bool": lambda: bool(X[0] > 0),
    "if any": lambda: 1 if (X > 0).any() else 0,
    "int": lambda: int(X.argmax()),
    "float": lambda: float(X.sum()),
    "nonzero": lambda: X.nonzero(),
    "where one argument": lambda: torch.where(X > 0),
    "boolean index": lambda: X[X > 0],
    "boolean assignment": lambda: X.clone().__setitem__(X > 0, 0.0),
    "masked_select": lambda: X.masked_select(X > 0),
    "unique": lambda: X.unique(),
    "bincount": lambda: torch.bincount((X > 0).long(), minlength=2),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "equal": lambda: torch.equal(X, X),
    "allclose": lambda: torch.allclose(X, X),
    "histc from the data": lambda: torch.histc(X, 4),
    "tolist": lambda: X.tolist(),
    "numpy": lambda: X.numpy(),
}
FREE: dict[str, Callable[[], Any]] = {
    "aminmax": lambda: torch.aminmax(X),
    "where three arguments": lambda: torch.where(X > 0, X, 0.0),
    "long index": lambda: X[torch.tensor([0, 2])],
    "index_select": lambda: X.index_select(0, torch.tensor([1])),
    "histc on a range": lambda: torch.histc(X, 4, min=-1.0, max=2.0),
    "repeat_interleave sized": lambda: torch.repeat_interleave(
        torch.tensor([1, 2]), output_size=3
    ),
    "topk": lambda: X.topk(2),
    "searchsorted": lambda: torch.searchsorted(X.sort().values, X),
    "nan_to_num": lambda: X.nan_to_num(),
}


@pytest.mark.parametrize("name", SYNCING)
def test_each_syncing_operation_counts_once(name: str) -> None:
    counter = count_syncs(SYNCING[name])
    assert counter.count == 1, dict(counter.by_op)


@pytest.mark.parametrize("name", FREE)
def test_operations_on_the_device_count_none(name: str) -> None:
    assert count_syncs(FREE[name]).count == 0


def test_the_counter_restores_the_tensor_methods() -> None:
    tolist = torch.Tensor.tolist
    with SyncCounter() as counter:
        X.tolist()
        X.tolist()
    assert counter.count == 2 and counter.by_op["tolist"] == 2
    assert torch.Tensor.tolist is tolist
    assert X.tolist() == [0.5, -1.0, 2.0, 0.0]
    assert counter.count == 2  # not counted outside


def test_work_on_host_copies_is_not_counted() -> None:
    with SyncCounter() as counter:
        values = X.tolist()  # the read that brings the data to the host
        with on_host():  # work on the copy: its reads wait for nothing
            copy = torch.tensor(values)
            assert bool(copy.any()) and copy.nonzero().numel() == 3
            copy.tolist()
            with on_host():  # nested blocks
                float(copy.max())
        float(X.max())  # outside again: counted
    assert counter.count == 2, dict(counter.by_op)
    assert counter.by_op == {"tolist": 1, "aten._local_scalar_dense.default": 1}
