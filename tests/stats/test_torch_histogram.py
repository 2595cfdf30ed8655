"""TorchHistogram: torch.ao's histogram update bit for bit, and the laws of
its (approximate) merge and reduction."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization.observer import HistogramObserver

from quantobs import native
from quantobs.stats.base import Batch, reduce_states
from quantobs.stats.torch_histogram import (
    TorchHistogram,
    histc,
    move_histogram,
    rebin_histogram,
)

CPU = torch.device("cpu")


def empty(bins: int = 32) -> TorchHistogram:
    return TorchHistogram.empty((), CPU, bins=bins)


def observe(stat: TorchHistogram, x: torch.Tensor) -> TorchHistogram:
    """What an observer does with one batch: scan, attach the values, update."""
    x_flat = x.reshape(1, -1)
    batch = stat.scan(x_flat)
    if batch.x_flat is None:
        batch = replace(batch, x_flat=x_flat)
    return stat.update(batch)


def of(x: torch.Tensor, bins: int = 32) -> TorchHistogram:
    return observe(empty(bins), x)


def assert_same(a: TorchHistogram, b: TorchHistogram) -> None:
    for name in ("histogram", "min_vals", "max_vals"):
        torch.testing.assert_close(
            getattr(a, name), getattr(b, name), rtol=0, atol=0, equal_nan=True
        )


# ------------------------------------------------------------------ torch parity


def _sequences() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(700, generator=g)
    return {
        "same_range": [x, x.flip(0) * 0.5],
        "grow_both_sides": [x, x * 3, x * 7 - 2, x * 0.1],
        "constant_then_wider": [torch.full((40,), 2.0), x],
        "bf16_then_float64": [x.bfloat16() * 3, x.double() * 5],
        "2d": [x.reshape(7, 100), x.reshape(70, 10) * 2],
    }


@pytest.mark.parametrize("sequence", list(_sequences()))
def test_update_is_torchs(sequence: str, backend: str) -> None:
    theirs = HistogramObserver(bins=64)
    mine = empty(64)
    for x in _sequences()[sequence]:
        theirs(x)
        mine = observe(mine, x)
    torch.testing.assert_close(mine.histogram, theirs.histogram, rtol=0, atol=0)
    torch.testing.assert_close(mine.min_vals, theirs.min_val, rtol=0, atol=0)
    torch.testing.assert_close(mine.max_vals, theirs.max_val, rtol=0, atol=0)


def test_inf_is_dropped_with_a_warning() -> None:
    x = torch.tensor([1.0, math.inf, -2.0, -math.inf])
    with pytest.warns(UserWarning, match="inf values in the input are ignored"):
        stat = of(x)
    assert_same(stat, of(torch.tensor([1.0, -2.0])))
    with pytest.warns(UserWarning, match="inf values"):
        batch = stat.scan(torch.full((1, 3), math.inf))
    assert batch.x_flat is not None and batch.x_flat.numel() == 0
    assert batch.absmax == 0.0  # nothing left to check for non-finite values
    assert_same(stat.update(batch), stat)


def test_nan_range_fails_like_torch() -> None:
    x = torch.tensor([[1.0, math.nan]])
    with pytest.raises(RuntimeError, match="not finite"):
        empty().update(Batch(x, *torch.aminmax(x)))


def test_omitted_values_are_not_counted() -> None:
    x = torch.tensor([[1.0, math.nan, 3.0, math.inf]])
    marked, skipped = empty().omit_nonfinite(x)
    assert skipped
    batch = Batch(marked, torch.tensor(1.0), torch.tensor(3.0), has_skipped=True)
    assert_same(empty().update(batch), of(torch.tensor([1.0, 3.0])))


def test_per_tensor_only() -> None:
    with pytest.raises(ValueError, match="one histogram per tensor"):
        TorchHistogram.empty((4,), CPU)


def test_histc_kernel_pair_agrees() -> None:
    x = torch.randn(10000, generator=torch.Generator().manual_seed(2))
    expected = histc.torch(x, 100, -1.5, 2.0)
    assert torch.equal(histc(x, 100, -1.5, 2.0), expected)
    implementation = histc.native("cpu")
    assert implementation is not None
    if native.available():
        found = implementation(x, 100, -1.5, 2.0)
        assert found is not None and torch.equal(found, expected)


def test_move_keeps_the_total_and_refuses_to_narrow() -> None:
    hist = torch.rand(64, generator=torch.Generator().manual_seed(5)) * 100
    lo, hi = torch.tensor(-1.0), torch.tensor(1.0)
    moved = move_histogram(hist, lo, hi, torch.tensor(-3.0), torch.tensor(2.5))
    torch.testing.assert_close(moved.sum(), hist.sum())
    assert torch.equal(
        moved, rebin_histogram(hist, lo, hi, torch.tensor(-3.0), torch.tensor(2.5))
    )
    with pytest.raises(ValueError, match="narrower"):
        move_histogram(hist, lo, hi, torch.tensor(0.0), hi)


# ------------------------------------------------------------------ merge laws

_values = st.lists(
    st.floats(-1e3, 1e3, allow_nan=False, width=32) | st.sampled_from([0.0, 1.0, -1.0]),
    min_size=1,
    max_size=40,
)


def _tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@settings(max_examples=60)
@given(a=_values, b=_values, bins=st.sampled_from([4, 16, 64]))
def test_reduce_states_of_two_is_their_merge(
    a: list[float], b: list[float], bins: int
) -> None:
    """The declared reductions (MIN, MAX, SUM after align) compute the merge,
    in either order (merge is commutative)."""
    sa, sb = of(_tensor(a), bins), of(_tensor(b), bins)
    merged = sa.merge(sb)
    assert_same(merged, sb.merge(sa))
    reduced = reduce_states(TorchHistogram, [sa.state(), sb.state()])
    assert_same(TorchHistogram.from_state(reduced), merged)
    assert float(merged.min_vals) == min(a + b)
    assert float(merged.max_vals) == max(a + b)
    torch.testing.assert_close(
        merged.histogram.sum(), sa.histogram.sum() + sb.histogram.sum()
    )


@settings(max_examples=60)
@given(x=_values, bins=st.sampled_from([4, 16, 64]))
def test_merge_into_empty_is_the_update(x: list[float], bins: int) -> None:
    """Merging a batch's statistic into an empty one equals updating the
    empty one with the batch, and the empty statistic is the identity."""
    batch = of(_tensor(x), bins)
    assert_same(empty(bins).merge(batch), observe(empty(bins), _tensor(x)))
    assert_same(batch.merge(empty(bins)), batch)
    reduced = reduce_states(TorchHistogram, [empty(bins).state(), batch.state()])
    assert_same(TorchHistogram.from_state(reduced), batch)


@settings(max_examples=40)
@given(a=_values, b=_values)
def test_align_to_its_own_range_changes_nothing(a: list[float], b: list[float]) -> None:
    stat = of(_tensor(a))
    same = {"min_vals": stat.min_vals, "max_vals": stat.max_vals}
    assert stat.align(same) is stat
    union = stat.merge(of(_tensor(b)))
    wide = {"min_vals": union.min_vals, "max_vals": union.max_vals}
    torch.testing.assert_close(stat.align(wide).histogram.sum(), stat.histogram.sum())


def test_merge_refuses_other_bins() -> None:
    with pytest.raises(ValueError, match="32 and 16 bins"):
        of(torch.ones(3)).merge(of(torch.ones(3), bins=16))


def test_merge_is_not_exact_and_says_so() -> None:
    assert not TorchHistogram.exact
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = of(x).merge(of(x * 4))
    assert float(merged.histogram.sum()) == pytest.approx(600)
