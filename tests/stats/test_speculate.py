"""One-pass per-tensor histogram updates equal the two-pass histogram."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import native
from quantobs.stats.histogram import (
    empty_histogram,
    update_histogram,
)
from quantobs.stats.speculate import speculate

# ----------------------------------------------- speculative one-pass update


def _speculation_batches(case: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(len(case))
    normal = [torch.randn(1 << 17, generator=gen) for _ in range(4)]
    if case == "growing":
        return [x * (1 + 0.5 * k) for k, x in enumerate(normal)]
    if case == "shrinking":
        return [x / (1 + k) for k, x in enumerate(normal)]
    if case == "sorted":  # a sample guesses the first grid from a spread
        return [torch.sort(x).values for x in normal]
    if case == "jump":  # most of batch 2 outside the window: set-aside overflow
        return [normal[0], normal[1] * 1000, normal[2]]
    if case == "tiny":  # -1e-42 in bin -1 of the first grid, 0 of the next
        mixed = normal[1] * 1e-20
        mixed[::997], mixed[::1001] = -1e-42, 1e10
        return [normal[0] * 1e-20, mixed, mixed]
    if case == "huge":  # grids past 2**49: counted twice, not speculated
        return [normal[0], normal[1] * 1e30]
    raise AssertionError(case)


SPECULATION_CASES = ["growing", "shrinking", "sorted", "jump", "tiny", "huge"]


@pytest.mark.parametrize("case", SPECULATION_CASES)
@pytest.mark.parametrize("absolute", [False, True])
def test_speculative_update_equals_two_passes(case: str, absolute: bool) -> None:
    hist = empty_histogram((1,), 2048, absolute)
    plain = empty_histogram((1,), 2048, absolute)
    used = 0
    for x in _speculation_batches(case):
        x_flat = x.reshape(1, 1, -1)
        spec = speculate(hist, x_flat)
        used += spec is not None
        batch_range = spec.batch_range if spec is not None else None
        hist = update_histogram(hist, x_flat, batch_range, speculation=spec)
        plain = update_histogram(plain, x_flat)
        for name, value in plain.state().items():
            assert torch.equal(hist.state()[name], value), (case, name)
    if native.available():
        assert used >= (1 if case in ("jump", "huge") else 3)


def test_speculation_declines_what_it_cannot_do() -> None:
    hist = update_histogram(empty_histogram((1,), 2048), torch.randn(1, 1, 1 << 17))
    big = torch.randn(1, 1, 1 << 17)
    assert speculate(hist, big * 1000) is None  # set-aside budget exceeded
    assert speculate(hist, big[..., :100]) is None  # small: two passes
    assert speculate(hist, big.double()) is None
    two = empty_histogram((2,), 2048)
    assert speculate(two, torch.randn(1, 2, 1 << 17)) is None  # per tensor only
    spec = speculate(hist, big)
    other = big.clone()
    if spec is not None:  # a speculation completes only its own batch
        assert spec.matches(hist, big) and not spec.matches(hist, other)


@settings(max_examples=25, deadline=None)
@given(
    scales=st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=4),
    shifts=st.lists(st.floats(-10.0, 10.0), min_size=4, max_size=4),
    absolute=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_speculative_updates_equal_two_passes_property(
    scales: list[float], shifts: list[float], absolute: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    hist = plain = empty_histogram((1,), 512, absolute)
    for scale, shift in zip(scales, shifts, strict=False):
        x = (torch.randn(1, 1, 1 << 16, generator=gen) + shift) * scale
        spec = speculate(hist, x)
        batch_range = spec.batch_range if spec is not None else None
        hist = update_histogram(hist, x, batch_range, speculation=spec)
        plain = update_histogram(plain, x)
    for name, value in plain.state().items():
        assert torch.equal(hist.state()[name], value), name
