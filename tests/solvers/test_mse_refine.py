"""Searches beyond the grid: never worse than it, valid on one-sided data."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import QuantizationArgs, calculate_qparams, calculate_range
from quantobs.core.layout import flatten_for_calibration
from quantobs.core.scoring import candidate_qparams, score, search_args
from quantobs.solvers.mse import mse_search
from quantobs.solvers.mse_refine import refined_mse_search
from tests.format_args import NVFP4 as _NVFP4

ARGS = {
    "int4-g32": {"num_bits": 4, "group_size": 32},
    "int4-g32-asym": {"num_bits": 4, "group_size": 32, "symmetric": False},
    "int8-channel": {"num_bits": 8, "strategy": "channel"},
    "int8-channel-asym": {"num_bits": 8, "strategy": "channel", "symmetric": False},
    "fp8-tensor": {"num_bits": 8, "type": "float"},
    "nvfp4": _NVFP4,
}
SEARCHES = [
    ("fine", False),
    ("refine", False),
    ("grid", True),
    ("fine", True),
    ("refine", True),
]


def _weight(seed: int = 0, rows: int = 24, cols: int = 128) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    w = w * torch.rand(rows, 1, generator=gen) + 0.3 * torch.rand(rows, 1)
    w[0, :4] = torch.tensor([6.0, -5.0, 4.0, 9.0])  # heavy tails
    return w


def _errors(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    ranges: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """`(R, Q)` errors of several ranges, scored in one call."""
    scoring = search_args(args)
    mins = torch.stack([r[0].reshape(-1) for r in ranges])
    maxs = torch.stack([r[1].reshape(-1) for r in ranges])
    scale, zero_point = candidate_qparams(mins, maxs, scoring)
    n, g = x_flat.shape[0], x_flat.shape[-1]
    x3 = x_flat.reshape(n, -1, g)
    return score(x3, scale, zero_point, args.format, 2.4)


CASES = [
    (name, search, independent)
    for name in ARGS
    for search, independent in SEARCHES
    if not independent or "asym" in name
]


@pytest.mark.parametrize(
    ("name", "search", "independent"),
    CASES,
    ids=[f"{n}-{s}{'-bounds' if i else ''}" for n, s, i in CASES],
)
def test_never_worse_than_the_grid(
    name: str, search: str, independent: bool, backend: str
) -> None:
    args = QuantizationArgs(**ARGS[name])
    x_flat = flatten_for_calibration(_weight(), "weight", args)
    default = mse_search(x_flat, args)
    found = refined_mse_search(
        x_flat, args, search=search, independent_bounds=independent
    )  # type: ignore[arg-type]
    errors = _errors(x_flat, args, [default, found])  # (2, Q)
    assert (errors[1] <= errors[0]).all()
    if errors.shape[1] > 1:  # many qparams: better somewhere
        assert errors[1].sum() < errors[0].sum()
    for got in found:
        assert got.shape == default[0].shape and torch.isfinite(got).all()


@pytest.mark.parametrize("search", ["fine", "refine"])
def test_joint_factors_stay_in_the_shrink_interval(search: str) -> None:
    args = QuantizationArgs(num_bits=4, group_size=32)
    x_flat = flatten_for_calibration(_weight(1), "weight", args)
    observed_max = x_flat.amax(dim=(0, -1))
    low, high = refined_mse_search(x_flat, args, search=search, maxshrink=0.3)  # type: ignore[arg-type]
    p = high / observed_max
    assert ((p >= 0.7 - 1e-6) & (p <= 1.0)).all()
    assert torch.allclose(low / x_flat.amin(dim=(0, -1)), p)


@pytest.mark.parametrize("side", ["positive", "negative", "zero", "constant"])
@pytest.mark.parametrize("search", ["grid", "fine", "refine"])
def test_independent_bounds_on_one_sided_data(side: str, search: str) -> None:
    args = QuantizationArgs(num_bits=4, group_size=32, symmetric=False)
    w = _weight(2).abs() + 0.5
    w = {"positive": w, "negative": -w, "zero": w * 0, "constant": w * 0 + 2}[side]
    x_flat = flatten_for_calibration(w, "weight", args)
    default = mse_search(x_flat, args)
    low, high = refined_mse_search(x_flat, args, search=search, independent_bounds=True)  # type: ignore[arg-type]
    errors = _errors(x_flat, args, [default, (low, high)])
    assert (errors[1] <= errors[0]).all()
    scale, zero_point = calculate_qparams(low, high, args)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    qmin, qmax = calculate_range(args)
    assert ((zero_point >= qmin) & (zero_point <= qmax)).all()
    assert (low <= high).all()
    observed = x_flat.amin(dim=(0, -1)), x_flat.amax(dim=(0, -1))
    # the side the rule extends to 0 keeps the joint search's factor (or
    # meets the other end where shrinking that one alone would cross it)
    joint = default
    if search != "grid":
        joint = refined_mse_search(x_flat, args, search=search)  # type: ignore[arg-type]
    if side in ("positive", "constant"):
        assert torch.equal(low, torch.minimum(joint[0], high))
    if side == "negative":
        assert torch.equal(high, torch.maximum(joint[1], low))
    if side == "zero":
        assert (low == 0).all() and (high == 0).all()
    # ranges only shrink, towards 0
    assert (low.abs() <= observed[0].abs()).all()
    assert (high.abs() <= observed[1].abs()).all()


def test_independent_bounds_rejects_symmetric_args() -> None:
    args = QuantizationArgs(num_bits=4, group_size=32)
    x_flat = flatten_for_calibration(_weight(), "weight", args)
    with pytest.raises(ValueError, match="independent_bounds=True needs asymmetric"):
        refined_mse_search(x_flat, args, independent_bounds=True)


def test_activations_and_round_scales() -> None:
    # several rows per qparam (activations); NVFP4 scored as stored
    args = QuantizationArgs(**_NVFP4)
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(3))
    x_flat = flatten_for_calibration(x, "input", args)
    default = mse_search(x_flat, args, round_scales=True)
    found = refined_mse_search(x_flat, args, search="refine", round_scales=True)
    assert found[0].shape == default[0].shape
    assert torch.isfinite(found[0]).all() and torch.isfinite(found[1]).all()


_KIND = st.sampled_from(["normal", "tiny", "huge", "sparse", "one-sided"])


def _sample(kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 32, generator=gen)
    if kind == "tiny":
        return x * 1e-30
    if kind == "huge":
        return x * 1e30
    if kind == "sparse":
        return x * (torch.rand(4, 32, generator=gen) < 0.1)
    if kind == "one-sided":
        return x.abs()
    return x


@settings(max_examples=30, deadline=None)
@given(
    kind=_KIND,
    seed=st.integers(0, 1000),
    search=st.sampled_from(["grid", "fine", "refine"]),
    asymmetric=st.booleans(),
)
def test_scales_positive_and_finite(
    kind: str, seed: int, search: str, asymmetric: bool
) -> None:
    kwargs: dict[str, Any] = {"num_bits": 4, "group_size": 16}
    args = QuantizationArgs(**kwargs, symmetric=not asymmetric)
    x_flat = flatten_for_calibration(_sample(kind, seed), "weight", args)
    low, high = refined_mse_search(
        x_flat, args, search=search, independent_bounds=asymmetric, grid=20.0
    )  # type: ignore[arg-type]
    assert torch.isfinite(low).all() and torch.isfinite(high).all()
    assert (low <= high).all()
    scale, _ = calculate_qparams(low, high, args)
    assert torch.isfinite(scale).all() and (scale > 0).all()
