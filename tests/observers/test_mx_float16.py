"""MX scales of float16 / bfloat16 values: compressed-tensors' and
llm-compressor's, in dtype and bits, and never 0 (issue 25).

compressed-tensors computes an MX scale in the observed dtype: it rounds the
block maximum's own bits to one mantissa bit (0.20: three for FP6 e2m3), so
a float16 subnormal maximum (below 2**-14) becomes 2**-14 from `0.75 *
2**-14` up and 0 below (exponent -inf); the biased exponent is clamped to
uint8, `2**(e - 127)` is computed in float32 and cast back to float16,
where every scale below 2**-24 is 0, and a zero scale is replaced by its
uint8 eps, 1.0. So an all-zero or tiny float16 block gets the scale 1.0.
bfloat16 holds every e8m0 scale (2**-127 up): there the e8m0 clamp alone
gives the peer's numbers. Inputs: every finite float16 / bfloat16 value,
and weights whose groups hold zeros, subnormal maxima on both sides of the
rounding thresholds, tiny normal maxima and ordinary values
(`tests/tiny_groups.py`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from quantobs import Observer, QuantizationArgs, calculate_qparams, fake_quantize
from quantobs.core.peer_versions import compressed_tensors_has_fp6
from quantobs.core.qparams import in_observed_dtype
from tests.format_args import MXFP4
from tests.tiny_groups import tiny_groups

pytest.importorskip("compressed_tensors", reason="the parity peer")
pytest.importorskip("llmcompressor", reason="the parity peer")

from compressed_tensors.quantization import (
    QuantizationArgs as CTArgs,
)
from compressed_tensors.quantization.utils.helpers import (
    calculate_qparams as ct_calculate_qparams,
)
from llmcompressor.observers import Observer as LObserver

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MX: dict[str, dict[str, Any]] = {
    "mxfp4": {**MXFP4, "strategy": "group"},
    "mxfp8": {**MXFP4, "strategy": "group", "num_bits": 8},
}
if compressed_tensors_has_fp6():  # 0.20: e2m3 elements, rounded to 3 bits
    MX["mxfp6"] = {**MXFP4, "strategy": "group", "num_bits": 6}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HALVES = [torch.float16, torch.bfloat16]
MINMAX = ["memoryless_minmax", "static_minmax", "minmax"]
MSE = ["memoryless_mse", "mse"]
PEER_SEARCH = {"search_arithmetic": "observed"}


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.ERROR, logger="quantobs")
    yield


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of a 16-bit float dtype, ascending."""
    top = 0x7C00 if dtype == torch.float16 else 0x7F80  # +inf's bits
    return torch.arange(0, top, dtype=torch.int16).view(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_the_rule_is_compressed_tensors_on_every_value(
    fmt: str, dtype: torch.dtype
) -> None:
    amax = _every_value(dtype)  # (V,): every block maximum the dtype has
    theirs, _ = ct_calculate_qparams(-amax, amax, CTArgs(**MX[fmt]))
    args = QuantizationArgs(**MX[fmt])
    ours, _ = calculate_qparams(-amax.float(), amax.float(), args, observed_dtype=dtype)
    ours = in_observed_dtype(ours, dtype)
    assert ours.dtype == theirs.dtype == dtype
    assert bool(torch.isfinite(ours).all() & (ours > 0).all())
    # compressed-tensors rounds the largest maxima past the dtype's max and
    # returns an infinite scale; ours is the next power of two's
    past = ~torch.isfinite(theirs)
    assert bool(past[-1]) and not bool(past[:-512].any())
    top_exponent = int(math.log2(torch.finfo(dtype).max)) + 1  # 16, 128
    assert bool((ours[past].float() == 2.0 ** (top_exponent - args.format.emax)).all())
    assert torch.equal(_bits(ours[~past]), _bits(theirs[~past]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_tiny_blocks_are_compressed_tensors(fmt: str, dtype: torch.dtype) -> None:
    weight = tiny_groups(8, 256, dtype)
    amax = weight.reshape(-1, 32).abs().amax(dim=1)  # (Q,)
    theirs, _ = ct_calculate_qparams(-amax, amax, CTArgs(**MX[fmt]))
    observed = dtype if dtype != torch.float32 else None
    ours, _ = calculate_qparams(
        -amax.float(), amax.float(), QuantizationArgs(**MX[fmt]),
        observed_dtype=observed,
    )  # fmt: skip
    ours = in_observed_dtype(ours, observed)
    assert ours.dtype == theirs.dtype
    assert torch.equal(_bits(ours), _bits(theirs))
    assert bool((ours > 0).all())
    if dtype == torch.float16:  # the zero and fp16-subnormal blocks: 1.0
        assert bool((ours[0::2][:3] == 1.0).all())


def _peer_and_ours(name: str, fmt: str, **options: Any) -> tuple[Any, Observer]:
    theirs = LObserver.load_from_registry(
        name, base_name="weight", args=CTArgs(**MX[fmt])
    )
    ours = Observer.load_from_registry(
        name, base_name="weight", args=QuantizationArgs(**MX[fmt]), **options
    )
    return theirs, ours


def _assert_same(found: tuple[torch.Tensor, torch.Tensor], expected: Any) -> None:
    scale, zero_point = found
    assert scale.dtype == expected["scale"].dtype
    assert torch.equal(_bits(scale), _bits(expected["scale"])), (
        scale[scale != expected["scale"]][:8],
        expected["scale"][scale != expected["scale"]][:8],
    )
    assert torch.equal(zero_point, expected["zero_point"])
    assert bool((scale > 0).all() & torch.isfinite(scale).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("name", [*MINMAX, *MSE])
def test_observers_equal_llm_compressor_on_tiny_groups(
    name: str, fmt: str, dtype: torch.dtype
) -> None:
    theirs, ours = _peer_and_ours(name, fmt, **(PEER_SEARCH if name in MSE else {}))
    weight = tiny_groups(8, 256, dtype)
    expected = theirs(weight).get_qparams()
    ours.update(weight)
    _assert_same(ours.get_qparams(), expected)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_the_float32_search_on_tiny_groups(fmt: str, dtype: torch.dtype) -> None:
    # The default search scores the float32 copy; its range then goes
    # through the rule in the observed dtype: the peer's dtype, never 0, the
    # peer's scale wherever the rule alone decides it (zero and float16
    # subnormal blocks). Tiny normal blocks may differ: llm-compressor's
    # float16 error sums of values near 2**-14 underflow to 0, every
    # candidate ties and its first (the unshrunk range) wins; the float32
    # sums choose a scale whose float32 error is no larger.
    theirs, ours = _peer_and_ours("memoryless_mse", fmt)
    weight = tiny_groups(8, 256, dtype)
    expected = theirs(weight).get_qparams()["scale"]
    ours.update(weight)
    scale, _ = ours.get_qparams()
    assert scale.dtype == expected.dtype == dtype
    assert bool((scale > 0).all() & torch.isfinite(scale).all())
    amax = weight.reshape(-1, 32).abs().amax(dim=1).float()  # (Q,)
    decided = amax < 2.0**-14  # the rule's cases: 0 and fp16 subnormals
    assert torch.equal(scale.reshape(-1)[decided], expected.reshape(-1)[decided])
    args = QuantizationArgs(**MX[fmt])

    def error(s: torch.Tensor) -> torch.Tensor:  # (Q,) float32 errors
        fake = fake_quantize(weight.float(), s.float(), None, args)
        return (fake - weight.float()).abs().pow(2.4).reshape(-1, 32).sum(dim=1)

    assert bool((error(scale) <= error(expected)).all())


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_float32_arithmetic_scales_are_positive(fmt: str, dtype: torch.dtype) -> None:
    # arithmetic="float32": the float32 copy's scales, as compressed-tensors
    # computes them on float32 values (2**-127 for an all-zero block)
    _, ours = _peer_and_ours("memoryless_minmax", fmt, arithmetic="float32")
    weight = tiny_groups(8, 256, dtype)
    ours.update(weight)
    expected = LObserver.load_from_registry(
        "memoryless_minmax", base_name="weight", args=CTArgs(**MX[fmt])
    )(weight.float()).get_qparams()
    _assert_same(ours.get_qparams(), expected)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("name", ["memoryless_minmax", "memoryless_mse"])
def test_the_plugin_equals_llm_compressor_on_tiny_groups(
    name: str, dtype: torch.dtype
) -> None:
    import quantobs.integrations.llmcompressor  # noqa: F401  (registers)

    weight = tiny_groups(8, 256, dtype)
    for fmt in MX:
        expected = LObserver.load_from_registry(
            name, base_name="weight", args=CTArgs(**MX[fmt])
        )(weight).get_qparams()
        plugin = LObserver.load_from_registry(
            f"quantobs_{name}", base_name="weight", args=CTArgs(**MX[fmt])
        )
        found = plugin(weight).get_qparams()
        _assert_same((found["scale"], found["zero_point"]), expected)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("arithmetic", ["observed", "float32"])
def test_legacy_face_scales_are_positive(arithmetic: str, dtype: torch.dtype) -> None:
    # The legacy face (llm-compressor 0.5 - 0.7) returns scales in the
    # input's dtype: "observed" is the rule above (compressed-tensors'
    # numbers), "float32" replaces the float32 scales that underflow the
    # dtype by its eps, as those versions did with zero scales
    from quantobs.faces.llmcompressor_legacy import MinMaxObserver

    weight = tiny_groups(8, 256, dtype)
    for fmt in MX:
        scale, _ = MinMaxObserver(QuantizationArgs(**MX[fmt]), arithmetic=arithmetic)(
            weight
        )
        assert scale.dtype == dtype
        assert bool((scale > 0).all() & torch.isfinite(scale).all())
        if arithmetic == "observed":
            amax = weight.reshape(-1, 32).abs().amax(dim=1)
            theirs, _ = ct_calculate_qparams(-amax, amax, CTArgs(**MX[fmt]))
            assert torch.equal(_bits(scale.reshape(-1)), _bits(theirs))
