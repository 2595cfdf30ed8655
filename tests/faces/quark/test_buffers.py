"""Every Quark-face observer keeps its statistics in registered buffers: they
move with `.to()` and survive `state_dict`, `copy.deepcopy` and
`torch.save`, on every available device (Quark's own are not saved)."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

import quantobs.faces.quark as ours
from tests.faces.quark.test_spec import BLOCKS, INT_SPEC, STATEFUL, observer

NAMES = [*STATEFUL, *BLOCKS]


def _kwargs(name: str) -> dict[str, Any]:
    if name in BLOCKS:
        return BLOCKS[name]
    return {"symmetric": True, **STATEFUL[name], **INT_SPEC}


def _same(a: Any, b: Any) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("name", NAMES)
def test_statistics_move_save_and_copy(name: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    first, second = (
        (torch.randn(8, 64, generator=gen) * s).to(device) for s in (1.0, 2.0)
    )
    mine = observer(name, **_kwargs(name)).to(device)
    mine(first)
    stat = mine.statistic()
    assert isinstance(mine, ours.ObserverBase) and stat is not None
    buffers = {id(b) for b in mine.buffers()}
    assert all(id(v) in buffers for v in stat.state().values())
    assert all(v.device.type == device.type for v in stat.state().values())
    straight = observer(name, **_kwargs(name)).to(device)
    straight(first)
    straight(second)
    expected = straight._calculate_qparams()  # once: pow2 observers vote per call
    buffer = io.BytesIO()
    torch.save(mine, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(mine), torch.load(buffer, weights_only=False)):
        other(second)
        _same(other._calculate_qparams(), expected)
