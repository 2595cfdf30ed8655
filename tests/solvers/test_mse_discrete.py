"""The discrete scale search: stored scales, exactly, of least stored error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import QuantizationArgs, calculate_qparams, fake_quantize, generate_gparam
from quantobs.core.layout import flatten_for_calibration
from quantobs.core.qparams.pow2 import E8M0_MIN_EXP, pow2_exponent
from quantobs.solvers import mse_discrete
from quantobs.solvers.mse import mse_search
from quantobs.solvers.mse_discrete import (
    discrete_scale_search,
    discrete_scales_supported,
    stored_scale_candidates,
)
from tests.format_args import MXFP4 as _MXFP4
from tests.format_args import NVFP4 as _NVFP4

_MXFP8 = {**_MXFP4, "num_bits": 8}
ARGS = {"nvfp4": _NVFP4, "mxfp4": _MXFP4, "mxfp8": _MXFP8}


def _weight(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 128, generator=gen) * torch.rand(32, 1, generator=gen)
    w[1, 5] = 7.0  # an outlier sets the NVFP4 global scale
    w[3, :32] = 0.0  # an all-zero group
    return w


def _global(x_flat: torch.Tensor, args: QuantizationArgs) -> torch.Tensor | None:
    if args.strategy != "tensor_group":
        return None
    return generate_gparam(x_flat.amin(), x_flat.amax())


def _stored_error(
    w: torch.Tensor,
    args: QuantizationArgs,
    low: torch.Tensor,
    high: torch.Tensor,
    global_scale: torch.Tensor | None,
) -> torch.Tensor:
    """`(rows, groups)` error `|fq(w) - w| ** 2.4` of the stored qparams."""
    scale, zero_point = calculate_qparams(low, high, args, global_scale)
    fq = fake_quantize(w, scale, zero_point, args, global_scale=global_scale)
    g = args.group_size or 1
    return ((fq - w).abs() ** 2.4).reshape(w.shape[0], -1, g).sum(-1)


def _representable(scale: torch.Tensor, args: QuantizationArgs) -> bool:
    if args.is_mx:
        mantissa, _ = torch.frexp(scale)
        return bool((mantissa == 0.5).all())
    return torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)


@pytest.mark.parametrize("name", list(ARGS))
def test_returns_exactly_the_stored_scales(name: str, backend: str) -> None:
    args = QuantizationArgs(**ARGS[name])
    w = _weight()
    x_flat = flatten_for_calibration(w, "weight", args)
    gscale = _global(x_flat, args)
    low, high = discrete_scale_search(x_flat, args)
    scale, _ = calculate_qparams(low, high, args, gscale)
    assert _representable(scale, args)
    # the scale the rule gives back is one of the scored candidates
    amax = torch.maximum(-x_flat.amin(dim=(0, -1)), x_flat.amax(dim=(0, -1)))
    stored = stored_scale_candidates(amax.reshape(-1), args, 0.2, gscale)  # (K, Q)
    flat = scale.reshape(1, -1)
    nonzero = amax.reshape(-1) > 0
    assert ((stored == flat).any(dim=0) | ~nonzero).all()
    # all-zero groups keep their zero range
    assert (low.reshape(-1)[~nonzero] == 0).all()


@pytest.mark.parametrize("name", list(ARGS))
def test_least_stored_error_and_never_worse_than_the_grid(
    name: str, backend: str
) -> None:
    args = QuantizationArgs(**ARGS[name])
    w = _weight(1)
    x_flat = flatten_for_calibration(w, "weight", args)
    gscale = _global(x_flat, args)
    found = _stored_error(w, args, *discrete_scale_search(x_flat, args), gscale)
    default = _stored_error(w, args, *mse_search(x_flat, args), gscale)
    assert (found <= default * (1 + 1e-6)).all()
    # the choice is the best candidate under fake_quantize's own arithmetic
    amax = torch.maximum(-x_flat.amin(dim=(0, -1)), x_flat.amax(dim=(0, -1)))
    stored = stored_scale_candidates(amax.reshape(-1), args, 0.2, gscale)
    best = torch.full_like(found, float("inf"))
    for candidate in stored:
        scale = candidate.reshape(amax.shape)
        zero = torch.zeros_like(scale, dtype=torch.int8)
        fq = fake_quantize(w, scale, zero, args, global_scale=gscale)
        g = args.group_size or 1
        error = ((fq - w).abs() ** 2.4).reshape(w.shape[0], -1, g).sum(-1)
        best = torch.minimum(best, error)
    assert torch.allclose(found, best, rtol=1e-5, atol=0)


def test_nvfp4_gains_over_the_grid() -> None:
    # llm-compressor scores unrounded e4m3 scales without the global scale.
    args = QuantizationArgs(**_NVFP4)
    w = _weight(2)
    x_flat = flatten_for_calibration(w, "weight", args)
    gscale = _global(x_flat, args)
    found = _stored_error(w, args, *discrete_scale_search(x_flat, args), gscale)
    default = _stored_error(w, args, *mse_search(x_flat, args), gscale)
    assert found.sum() < 0.97 * default.sum()


def test_candidates_span_the_grid_and_one_neighbour() -> None:
    args = QuantizationArgs(**_MXFP4)
    amax = torch.tensor([6.0, 1.0, 0.0])  # fp4 emax 2
    stored = stored_scale_candidates(amax, args, 0.2)
    # The list's length is known before the data (no host read, issue 24):
    # 5 exponents at most for maxshrink 0.2; shorter lists repeat their last
    # value.
    assert stored.shape == (5, 3)
    # 6 -> exponent 2 (rounded mantissa 1.5) - 2 = 0; 4.8 -> 0: {1, 0, -1}
    assert stored[:, 0].tolist() == [2.0, 1.0, 0.5, 0.5, 0.5]
    # 1 -> 2**0 - 2; 0.8 -> mantissa 1.6: 2**-1 - 2; plus neighbours
    assert stored[:, 1].tolist() == [0.5, 0.25, 0.125, 0.0625, 0.0625]
    nvfp4 = QuantizationArgs(**_NVFP4)
    stored = stored_scale_candidates(torch.tensor([6.0]), nvfp4, 0.2)
    values = stored[:, 0].tolist()
    assert values == sorted(values, reverse=True)
    # 6 / 6 = 1.0 and 0.8 (stored as 0.8125), with the neighbours of both
    # (8 rows at most for maxshrink 0.2)
    assert values == [1.125, 1.0, 0.9375, 0.875, 0.8125, 0.75, 0.6875, 0.6875]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_bits": 4, "group_size": 16},
        {"num_bits": 8, "type": "float"},
        {**_NVFP4, "scale_dtype": None},
    ],
    ids=["int4", "fp8", "tensor-group-float32-scales"],
)
def test_rejects_continuous_scales(kwargs: dict[str, object]) -> None:
    args = QuantizationArgs(**kwargs)
    assert not discrete_scales_supported(args)
    x_flat = flatten_for_calibration(torch.randn(4, 32), "weight", args)
    with pytest.raises(ValueError, match="scale_search='discrete' needs"):
        discrete_scale_search(x_flat, args)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(list(ARGS)),
    magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
    seed=st.integers(0, 1000),
    sparse=st.booleans(),
)
def test_scales_positive_finite_and_stored(
    name: str, magnitude: float, seed: int, sparse: bool
) -> None:
    args = QuantizationArgs(**ARGS[name])
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 64, generator=gen) * magnitude
    if sparse:
        w = w * (torch.rand(4, 64, generator=gen) < 0.1)
    x_flat = flatten_for_calibration(w, "weight", args)
    low, high = discrete_scale_search(x_flat, args)
    assert torch.isfinite(low).all() and torch.isfinite(high).all()
    scale, _ = calculate_qparams(low, high, args, _global(x_flat, args))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert _representable(scale, args)


@pytest.mark.parametrize("maxshrink", [0.01, 0.2, 0.5, 1 - 0.8 / 1.8, 0.9, 0.999])
def test_candidate_count_known_before_the_data_suffices(maxshrink: float) -> None:
    # issue 24: the lists' length is fixed on the host; every qparam's list
    # still reaches its lowest candidate (then repeats it)
    gen = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.rand(20000, generator=gen) * 300 - 150)
    raw_hi, raw_lo = amax / 6.0, (amax * (1.0 - maxshrink)) / 6.0
    whole = mse_discrete._E4M3_TABLE.numel()
    full = mse_discrete._e4m3_candidates(raw_hi, raw_lo, whole)
    short = mse_discrete._e4m3_candidates(
        raw_hi, raw_lo, mse_discrete._e4m3_count(maxshrink)
    )
    assert torch.equal(short, full[: short.shape[0]])
    assert torch.equal(short[-1], full[-1])  # the lowest candidate reached
    mx = stored_scale_candidates(amax, QuantizationArgs(**_MXFP4), maxshrink)
    positive = torch.where(amax > 0, amax, torch.ones_like(amax))
    lowest = pow2_exponent(positive * (1.0 - maxshrink)) - 2 - 1  # fp4 emax 2
    assert torch.equal(mx[-1], torch.exp2(lowest.clamp(min=E8M0_MIN_EXP)))
