"""Range statistics: min/max, latest, moving averages, absolute maxima."""

from __future__ import annotations

import pytest
import torch

from quantobs.stats.base import Batch, weighted_mean
from quantobs.stats.minmax import (
    LatestRange,
    MinMax,
    MovingAverage,
    lerp,
    lerp_ranges,
)
from quantobs.stats.reduce import minmax_omit_nonfinite

INF = float("inf")


def _average(value: float, count: int) -> MovingAverage:
    return MovingAverage(
        torch.tensor([-value]), torch.tensor([value]), torch.tensor(count)
    )


def test_empty_range_is_the_identity_of_minmax_merge() -> None:
    x = torch.tensor([[[1.0, float("nan")], [float("inf"), float("nan")]]])
    min_vals, max_vals = minmax_omit_nonfinite(x)
    empty_here = MinMax(min_vals, max_vals)
    merged = empty_here.merge(
        MinMax(torch.tensor([2.0, -1.0]), torch.tensor([2.0, -1.0]))
    )
    assert merged.min_vals.tolist() == [1.0, -1.0]
    assert merged.max_vals.tolist() == [2.0, -1.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bits of the values, every NaN as one (torch's minimum may return
    another NaN than its operand's)."""
    t = torch.where(torch.isnan(t), torch.nan, t)
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("cls", [MinMax, LatestRange])
@pytest.mark.parametrize("track_absmax", [False, True])
@pytest.mark.parametrize(
    ("stat_dtype", "batch_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float64),  # promoted: the batch's own dtype
        (torch.float64, torch.float32),  # widened: minimum/maximum then
    ],
)
def test_starting_updates_as_empty_does(
    cls: type[MinMax],
    track_absmax: bool,
    stat_dtype: torch.dtype,
    batch_dtype: torch.dtype,
) -> None:
    # the first batch's statistic, bit for bit (NaN as NaN) and dtype for
    # dtype; +-inf, +-0 and the empty range (+inf, -inf) kept as they came
    low = torch.tensor([[-1.5, float("nan"), -INF, -0.0], [0.0, 2.0, INF, 3.0]])
    high = torch.tensor([[2.5, float("nan"), INF, 0.0], [-0.0, 2.0, -INF, 3.0]])
    low, high = low.to(batch_dtype), high.to(batch_dtype)
    batch = Batch(None, low, high, 3, absmax=1.25 if track_absmax else None)
    config = {"track_absmax": track_absmax, "dtype": stat_dtype}
    starting = cls.starting((2, 4), torch.device("cpu"), **config)
    fresh = cls.empty((2, 4), torch.device("cpu"), **config)
    assert torch.equal(starting.min_vals, fresh.min_vals)  # the same value
    ours, theirs = starting.update(batch), fresh.update(batch)
    assert type(ours) is type(theirs) is cls
    for name, value in theirs.state().items():
        found = ours.state()[name]
        assert found.dtype == value.dtype and found.shape == value.shape, name
        assert torch.equal(_bits(found), _bits(value)), name
    assert ours.config() == theirs.config()
    again = ours.update(batch)  # a stored statistic updates as usual
    assert torch.equal(_bits(again.min_vals), _bits(theirs.update(batch).min_vals))


def test_lerp_matches_llm_compressor_form_and_skips_empty() -> None:
    old, new = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    assert torch.equal(lerp(old, new, 0.01), old * 0.99 + new * 0.01)
    low, high = lerp_ranges(
        (torch.tensor([INF, -1.0]), torch.tensor([-INF, 1.0])),
        (torch.tensor([-2.0, INF]), torch.tensor([2.0, -INF])),
        0.5,
    )
    assert low.tolist() == [-2.0, -1.0] and high.tolist() == [2.0, 1.0]


def test_step_form_matches_torch_ao() -> None:
    old, new = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    low, _ = lerp_ranges((old, old), (new, new), 0.01, form="step")
    assert torch.equal(low, old + 0.01 * (new - old))


def test_moving_average_merge_is_count_weighted() -> None:
    merged = _average(1.0, 1).merge(_average(4.0, 2))
    assert merged.max_vals.item() == 3.0 and int(merged.count) == 3
    assert _average(1.0, 0).merge(_average(4.0, 0)).max_vals.item() == 1.0


F32_MAX = torch.finfo(torch.float32).max


def test_step_of_opposite_extremes_does_not_overflow() -> None:
    # torch.ao's `old + c * (new - old)`: new - old = 2 * max is inf, so the
    # running range becomes +-inf; here that step is redone in float64
    old = (torch.tensor([-F32_MAX, 0.0]), torch.tensor([-F32_MAX, 1.0]))
    new = (torch.tensor([F32_MAX, 1.0]), torch.tensor([F32_MAX, 2.0]))
    for form in ("step", "blend"):
        low, high = lerp_ranges(old, new, 0.25, form=form)  # type: ignore[arg-type]
        assert torch.isfinite(low).all() and torch.isfinite(high).all()
        assert float(low[0]) == float(high[0])
        assert float(low[0]) == pytest.approx(-0.5 * F32_MAX, rel=1e-6)
        # ordinary qparams keep the form's own bits
        assert float(low[1]) == 0.25 and float(high[1]) == 1.25


def test_moving_average_of_extremes_stays_finite() -> None:
    stat = MovingAverage.empty((1,), torch.device("cpu"), constant=0.5, form="step")
    for value in (F32_MAX, -F32_MAX, F32_MAX):
        x = torch.tensor([value])
        stat = stat.update(Batch(None, x, x, 1))
    assert torch.isfinite(stat.min_vals).all() and torch.isfinite(stat.max_vals).all()


def test_weighted_mean_of_extremes_stays_finite() -> None:
    # value * count overflows float32; the mean falls back to float64
    values = [torch.tensor([F32_MAX, 1.0]), torch.tensor([F32_MAX, 3.0])]
    mean = weighted_mean(values, [torch.tensor(100), torch.tensor(300)])
    assert mean.dtype == torch.float32
    assert float(mean[0]) == F32_MAX and float(mean[1]) == 2.5
    merged = _average(F32_MAX, 1000).merge(_average(F32_MAX, 3000))
    assert float(merged.max_vals) == F32_MAX
