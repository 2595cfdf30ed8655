"""Exact-count histograms: binning, growth, merge laws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs.stats.histogram import (
    Histogram,
    check_budget,
    empty_histogram,
    histogram_grid,
    histogram_of,
    merge_histograms,
    rebin,
    update_histogram,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference_counts(x_flat: torch.Tensor, hist: Histogram) -> torch.Tensor:
    """Obviously-correct binning: float64 floor of x / width, one qparam at a time."""
    _, width = hist.edges()
    qshape = hist.qparam_shape
    x3 = x_flat.reshape(x_flat.shape[0], -1, x_flat.shape[-1])
    out = []
    for q in range(x3.shape[1]):
        values = x3[:, q].reshape(-1).to(torch.float64)
        values = values[torch.isfinite(values)]
        if hist.absolute:
            values = values.abs()
        cells = torch.floor(values / width.reshape(-1)[q]).to(torch.int64)
        index = cells - hist.offset.reshape(-1)[q]
        out.append(torch.bincount(index, minlength=hist.bins))
    return torch.stack(out).reshape(*qshape, hist.bins)


def _same(a: Histogram, b: Histogram) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state().values(), b.state().values(), strict=True)
    )


# ------------------------------------------------------------------ statistic


@pytest.mark.parametrize("absolute", [False, True], ids=["signed", "abs"])
@pytest.mark.parametrize(
    ("shape", "scale", "shift"),
    [
        ((200, 3, 50), 1.0, 0.0),
        ((1, 4, 999), 1e-3, 5.0),
        ((64, 1, 8), 3e4, -1e5),
        ((1, 1, 300000), 1.0, 0.0),  # one qparam, cut in pieces between threads
        ((3, 1, 70000), 2.0, 1.0),
    ],
)
def test_binning_is_exact(
    shape: tuple[int, ...], scale: float, shift: float, absolute: bool, backend: str
) -> None:
    x = torch.randn(shape, generator=_gen(1)) * scale + shift
    hist = histogram_of(x, bins=64, absolute=absolute)
    assert torch.equal(hist.counts, _reference_counts(x, hist))
    assert hist.counts.dtype == torch.int64
    # The grid covers the data and uses at least half its bins.
    lo, width = hist.edges()
    low, high = hist.value_range()
    assert bool((lo <= low).all()) and bool((high < lo + 64 * width).all())
    assert bool(((high - low) / width >= 64 / 2 - 2).all())
    if absolute:
        assert bool((hist.offset == 0).all())


def test_counts_are_exact_past_float32_saturation(backend: str) -> None:
    # torch.histc counts in float32: a bin stops at 2**24 (per thread).
    n = (1 << 24) + 5
    x = torch.ones(n).reshape(-1, 1, 1)
    x[0, 0, 0] = 0.0  # a second value, so the range is not a point
    hist = histogram_of(x, bins=16)
    assert hist.counts.sum().item() == n
    assert hist.counts.max().item() == n - 1


def test_grid_is_a_function_of_the_range() -> None:
    min_vals = torch.tensor([0.0, -1.0, 1000.0, -3e-30, 5.0, math.inf])
    max_vals = torch.tensor([0.0, 1.0, 1000.001, 2e-30, 5.0, -math.inf])
    exponent, offset = histogram_grid(min_vals, max_vals, 64)
    for q in range(5):
        w = 2.0 ** exponent[q].item()
        cells = math.floor(max_vals[q].item() / w) - math.floor(min_vals[q].item() / w)
        assert cells + 1 <= 64  # fits
        w_fine = w / 2
        finer = math.floor(max_vals[q].item() / w_fine) - math.floor(
            min_vals[q].item() / w_fine
        )
        # The smallest fitting width (or the float32 floor on widths).
        assert finer + 1 > 64 or exponent[q].item() <= -126 or cells == 0
        assert offset[q].item() == math.floor(min_vals[q].item() / w)
    assert exponent[5].item() == -126 and offset[5].item() == 0  # no data


def test_nonfinite_values_are_not_counted(backend: str) -> None:
    x = torch.randn(10, 2, 6, generator=_gen(2))
    x[0, 0, 0], x[3, 1, 2], x[4, 1, 5] = math.nan, math.inf, -math.inf
    hist = histogram_of(x, bins=32)
    assert hist.total().tolist() == [59, 58]
    assert torch.equal(hist.counts, _reference_counts(x, hist))


def test_budget_error_names_the_size_and_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"1000 qparams x 2048 bins = 2048000 int64 counts \(16 MiB\), above "
        r"max_counts=1000000; use a coarser granularity.*'static_mse'",
    ):
        check_budget(1000, 2048, max_counts=1_000_000)
    with pytest.raises(ValueError, match="bins must be an int >= 8"):
        empty_histogram((2,), bins=4)


_batch = st.tuples(
    st.integers(1, 20),  # rows
    st.floats(1e-3, 1e3),  # scale
    st.floats(-50, 50),  # shift
    st.integers(0, 2**31 - 1),  # seed
)


def _data(rows: int, scale: float, shift: float, seed: int) -> torch.Tensor:
    return torch.randn(rows, 3, 4, generator=_gen(seed)) * scale + shift


@settings(max_examples=40)
@given(
    batches=st.lists(_batch, min_size=1, max_size=4),
    absolute=st.booleans(),
    nan_every=st.sampled_from([0, 3, 7]),
)
def test_update_equals_observing_the_concatenation(
    batches: list[tuple[int, float, float, int]], absolute: bool, nan_every: int
) -> None:
    data = [_data(*b) for b in batches]
    if nan_every:  # some non-finite values, which are not counted
        for x in data:
            x.view(-1)[::nan_every] = math.nan
    hist = empty_histogram((3,), 32, absolute)
    for x in data:
        finite = bool(torch.isfinite(x).all())
        hist = update_histogram(hist, x, has_nonfinite=not finite)
    whole = histogram_of(torch.cat(data), 32, absolute)
    assert _same(hist, whole)
    finite_per_qparam = sum(torch.isfinite(x).sum(dim=(0, 2)) for x in data)
    assert hist.total().tolist() == finite_per_qparam.tolist()
    assert torch.equal(hist.counts, _reference_counts(torch.cat(data), hist))


@settings(max_examples=40)
@given(a=_batch, b=_batch, c=_batch)
def test_merge_laws(
    a: tuple[int, float, float, int],
    b: tuple[int, float, float, int],
    c: tuple[int, float, float, int],
) -> None:
    xa, xb, xc = _data(*a), _data(*b), _data(*c)
    ha, hb, hc = (histogram_of(x, 32) for x in (xa, xb, xc))
    whole = histogram_of(torch.cat([xa, xb, xc]), 32)
    left = merge_histograms(merge_histograms(ha, hb), hc)
    right = merge_histograms(ha, merge_histograms(hc, hb))
    assert _same(left, whole) and _same(right, whole)
    assert _same(merge_histograms(ha, empty_histogram((3,), 32)), ha)


def test_all_reduce_recipe_equals_one_process() -> None:
    # MIN/MAX all-reduce of the ranges, the grid of the result, re-bin, SUM.
    parts = [torch.randn(50, 2, 8, generator=_gen(s)) * (s + 1) - s for s in range(3)]
    local = [histogram_of(part, 32) for part in parts]
    min_vals = torch.stack([h.min_vals for h in local]).amin(dim=0)
    max_vals = torch.stack([h.max_vals for h in local]).amax(dim=0)
    exponent, offset = histogram_grid(min_vals, max_vals, 32)
    counts = torch.stack([rebin(h, exponent, offset).counts for h in local]).sum(0)
    whole = histogram_of(torch.cat(parts), 32)
    assert torch.equal(counts, whole.counts)
    assert torch.equal(exponent, whole.exponent) and torch.equal(offset, whole.offset)


def test_merge_refuses_different_layouts() -> None:
    a = histogram_of(torch.randn(4, 2, 3), 16)
    with pytest.raises(ValueError, match="cannot merge histograms of counts"):
        merge_histograms(a, histogram_of(torch.randn(4, 3, 3), 16))
    with pytest.raises(ValueError, match="absolute=True"):
        merge_histograms(a, histogram_of(torch.randn(4, 2, 3), 16, absolute=True))


def test_rebinning_every_row_equals_moving_the_changed_ones() -> None:
    # the device path (every row, no host read) and the CPU path (changed
    # rows only) of `rebin_counts`, on grids grown by `widen`
    from quantobs.stats.rebinning import rebin_counts

    gen = torch.Generator().manual_seed(11)
    x = (
        torch.randn(3, 6, 40, generator=gen)
        * torch.tensor([1, 1, 9, 1, 50, 1.0])[:, None]
    )
    hist = histogram_of(x, 64)
    grown = hist.max_vals * torch.tensor([1, 3, 1, 1, 2, 1.0])  # rows 1, 4 grow
    exponent, offset = histogram_grid(hist.min_vals, grown, 64)
    args = (
        hist.counts,
        (exponent != hist.exponent) | (offset != hist.offset),
        hist.offset,
        exponent - hist.exponent,
        offset,
    )
    assert 0 < int(args[1].sum()) < 6
    every = rebin_counts.torch(*args)
    assert torch.equal(every, rebin_counts.native("cpu")(*args))
    assert torch.equal(every.sum(dim=1), hist.counts.sum(dim=1))
    unchanged = ~args[1]
    assert torch.equal(every[unchanged], hist.counts[unchanged])
