"""Pure statistics: fast paths equal the canonical-layout reductions."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from quantobs import QuantizationArgs, flatten_for_calibration
from quantobs.core.layout import num_observations_of
from quantobs.stats.reduce import (
    minmax,
    minmax_of,
    minmax_omit_nonfinite,
    range_or_zero,
)
from tests.core.test_layout import CASES


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_minmax_of_equals_layout_reduction(
    case: tuple[str, tuple[int, ...], dict[str, Any], tuple[int, ...]],
    backend: str,
) -> None:
    base_name, shape, kwargs, expected = case
    args = QuantizationArgs(**kwargs)
    value = torch.randn(shape) + 0.3
    flat = flatten_for_calibration(value, base_name, args)
    reference = (flat.amin(dim=(0, -1)), flat.amax(dim=(0, -1)))
    for got in (minmax(flat), minmax_of(value, base_name, args)):
        assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
    assert num_observations_of(shape, base_name, args) == expected[0]


def test_minmax_is_float32_and_propagates_nan() -> None:
    x = torch.randn(1, 4, 8, dtype=torch.bfloat16)
    x[0, 2, 3] = float("nan")
    min_vals, max_vals = minmax(x)
    assert min_vals.dtype == torch.float32
    assert torch.isnan(min_vals[2]) and torch.isnan(max_vals[2])
    assert torch.isfinite(min_vals[[0, 1, 3]]).all()


def test_omit_nonfinite_gives_empty_ranges() -> None:
    x = torch.tensor([[[1.0, float("nan")], [float("inf"), float("nan")]]])
    min_vals, max_vals = minmax_omit_nonfinite(x)
    assert min_vals.tolist() == [1.0, float("inf")]
    assert max_vals.tolist() == [1.0, float("-inf")]
    zeroed = range_or_zero(min_vals, max_vals)
    assert zeroed[0].tolist() == [1.0, 0.0] and zeroed[1].tolist() == [1.0, 0.0]


def test_finite_range_over_special_values() -> None:
    # every combination of special ends against the rule written out with
    # isfinite (the docstring's table), bit for bit
    from quantobs.stats.reduce import finite_range

    top = torch.finfo(torch.float32).max
    ends = torch.tensor([-math.inf, -top, -1.5, 0.0, 2.0, top, math.inf, math.nan])
    grid = torch.cartesian_prod(*[torch.arange(ends.numel())] * 4)
    low, high, data_low, data_high = (ends[grid[:, i]] for i in range(4))
    got = finite_range((low, high), (data_low.double(), data_high.double()))
    seen = torch.isfinite(data_low) & torch.isfinite(data_high)
    seen &= data_low <= data_high
    seen &= ~((low == math.inf) & (high == -math.inf))
    for end, data, found in ((low, data_low, got[0]), (high, data_high, got[1])):
        fixed = torch.where(torch.isnan(end), data, end.clamp(-top, top))
        want = torch.where(seen, fixed, end)
        assert found.dtype == torch.float32
        assert torch.equal(found.nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.equal(found.isnan(), want.isnan())
