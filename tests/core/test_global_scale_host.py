"""The NVFP4 global scale and its check on the host (CPU tensors, native
kernels on) against the torch path (the one a CUDA tensor takes): the same
bits, the same errors in the same order."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import QuantizationArgs, native
from quantobs.core.qparams import amax_to_global_scale, calculate_qparams
from tests.format_args import NVFP4

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: the host path is off"
)

T = TypeVar("T")

EDGES = [
    0.0,
    -0.0,
    1e-45,  # subnormal: clamped to float32's tiny
    1e-40,
    1.1754943508222875e-38,  # tiny
    1e-38,  # the quotient overflows: 1.0
    2.5e-35,
    1.0,
    6.0,
    -6.0,
    2688.0,
    3e38,
    2.0**100,  # the largest the host takes
    2.0**100 * 1.5,  # the tensor path's
    1e300,  # float64: past float32
]


@pytest.fixture
def native_on() -> Iterator[None]:
    previous = native.set_enabled(True)
    yield
    native.set_enabled(previous)


def _torch_path(run: Callable[[], T]) -> T:
    previous = native.set_enabled(False)
    try:
        return run()
    finally:
        native.set_enabled(previous)


def _same(amax: torch.Tensor, **kwargs: object) -> None:
    host = amax_to_global_scale(amax, **kwargs)  # type: ignore[arg-type]
    reference = _torch_path(lambda: amax_to_global_scale(amax, **kwargs))  # type: ignore[arg-type]
    assert host.dtype == reference.dtype and host.shape == reference.shape == (1,)
    assert torch.equal(host.view(torch.uint8), reference.view(torch.uint8)), (
        float(amax.double().reshape(-1)[0]),
        host,
        reference,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("value", EDGES)
def test_edges_equal_the_torch_path(
    native_on: None, value: float, dtype: torch.dtype
) -> None:
    amax = torch.tensor([value], dtype=torch.float64).to(dtype)
    if not bool(torch.isfinite(amax).all()):
        return  # 1e300 in bfloat16: inf, an error on both paths (below)
    _same(amax)
    _same(amax.reshape(()))
    _same(amax, dtype=torch.bfloat16)  # the result's dtype
    _same(amax, observed_dtype=torch.bfloat16)  # bfloat16 arithmetic: torch
    _same(amax, observed_dtype=torch.float32)


@settings(max_examples=300, deadline=None)
@given(value=st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_float32_amax_equals_the_torch_path(value: float) -> None:
    previous = native.set_enabled(True)
    try:
        _same(torch.tensor([value]))
    finally:
        native.set_enabled(previous)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_amax_raises_alike(native_on: None, value: float) -> None:
    amax = torch.tensor([value])
    with pytest.raises(ValueError, match="amax is not finite"):
        amax_to_global_scale(amax)
    with pytest.raises(ValueError, match="amax is not finite"):
        _torch_path(lambda: amax_to_global_scale(amax))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("range_ok", [True, False])
def test_bad_global_scale_raises_first_alike(
    native_on: None, bad: float, range_ok: bool
) -> None:
    # the global scale is checked before the range: its error comes first
    args = QuantizationArgs(**{**NVFP4, "scale_dtype": None})
    low = torch.tensor([-1.0, -2.0])
    high = torch.tensor([1.0, 2.0 if range_ok else math.nan])
    global_scale = torch.tensor([bad])

    def run() -> object:
        return calculate_qparams(low, high, args, global_scale)

    with pytest.raises(ValueError, match="global_scale must be finite and positive"):
        run()
    with pytest.raises(ValueError, match="global_scale must be finite and positive"):
        _torch_path(run)


def test_good_global_scale_gives_the_torch_path_scales(native_on: None) -> None:
    args = QuantizationArgs(**NVFP4)
    gen = torch.Generator().manual_seed(0)
    low, high = -torch.rand(64, generator=gen), torch.rand(64, generator=gen)
    global_scale = amax_to_global_scale(torch.maximum(-low, high).amax())

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return calculate_qparams(low, high, args, global_scale)

    (scale, zero_point), (ref_scale, ref_zero_point) = run(), _torch_path(run)
    assert torch.equal(scale, ref_scale) and torch.equal(zero_point, ref_zero_point)
