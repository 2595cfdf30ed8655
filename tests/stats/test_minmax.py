"""Range statistics: min/max, latest, moving averages, absolute maxima."""

from __future__ import annotations

import torch

from quantobs.stats.minmax import MinMax, MovingAverage, lerp, lerp_ranges
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
