"""quantobs' llm-compressor observers on bfloat16 / float16 / float32 values
equal llm-compressor 0.14's own, in dtype and bits (issue 25).

Every observer name both registries have, on weights and activations, for
int8 per tensor / channel (symmetric and asymmetric), int4 groups of 128
(symmetric and asymmetric), FP8 per tensor / channel, NVFP4 and MXFP4.
llm-compressor computes in the observed dtype: scales come back in it
(float32 where NVFP4's float32 global scale multiplied them), moving
averages and the MSE searches' candidates, fake-quantized values and error
sums round in it. quantobs' default `arithmetic="observed"` does the same
for the scales and averages, and with `search_arithmetic="observed"` for the
MSE searches too; the default search scores the float32 copy (the design's
float32 statistics, the same choice on every device: tested at the end), as
`arithmetic="float32"` does for everything.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from llmcompressor.observers import Observer as LObserver

from quantobs import Observer, QuantizationArgs
from tests.format_args import MXFP4, NVFP4

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ASYM = {"symmetric": False}
WEIGHT_FORMATS: dict[str, dict[str, Any]] = {
    "int8-tensor": {"num_bits": 8},
    "int8-tensor-asym": {"num_bits": 8, **ASYM},
    "int8-channel": {"num_bits": 8, "strategy": "channel"},
    "int4-g128": {"num_bits": 4, "strategy": "group", "group_size": 128},
    "int4-g128-asym": {"num_bits": 4, "strategy": "group", "group_size": 128, **ASYM},
    "fp8-tensor": {"num_bits": 8, "type": "float"},
    "fp8-channel": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "nvfp4": NVFP4,
    "mxfp4": {**MXFP4, "strategy": "group"},
}
ACTIVATION_FORMATS: dict[str, dict[str, Any]] = {
    "int8-tensor": {"num_bits": 8},
    "int8-tensor-asym": {"num_bits": 8, **ASYM},
    "fp8-tensor": {"num_bits": 8, "type": "float"},
    "nvfp4": {**NVFP4, "dynamic": "local"},
}
MINMAX = ["memoryless_minmax", "static_minmax", "minmax"]
MSE = ["memoryless_mse", "mse"]
NVFP4_ONLY = ["nvfp4_expanded_mse", "nvfp4_expanded_imatrix"]
IMATRIX = ["imatrix_mse", "nvfp4_expanded_imatrix"]
#: llm-compressor's nightly (0.14.1a: `observers/grid_search.py`) sums its
#: imatrix errors in the weight's bf16 / fp16 up to 512 values at a time
#: (tests/observers/test_imatrix.py: NIGHTLY_DIFFERS); quantobs follows
#: 0.14.0.1. Measured under the nightly, these cases choose otherwise.
NIGHTLY_GRID = importlib.util.find_spec("llmcompressor.observers.grid_search")
NIGHTLY_DIFFERS = {
    ("imatrix_mse", "fp8-channel", torch.bfloat16),
    ("imatrix_mse", "fp8-channel", torch.float16),
    ("imatrix_mse", "nvfp4", torch.float16),
    ("nvfp4_expanded_imatrix", "nvfp4", torch.bfloat16),
    ("nvfp4_expanded_imatrix", "nvfp4", torch.float16),
}
#: the peer's search arithmetic on bfloat16 / float16 (an option of ours)
PEER_SEARCH = {"search_arithmetic": "observed"}
ROWS, COLS = 16, 256


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    # imatrix falls back to uniform MSE per tensor (both log it)
    caplog.set_level(logging.ERROR, logger="quantobs")
    yield


def _values(shape: tuple[int, ...], std: float, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * std + 0.003).to(dtype)


def _assert_equal_qparams(
    found: tuple[torch.Tensor, torch.Tensor], expected: dict[str, Any]
) -> None:
    scale, zero_point = found
    assert scale.dtype == expected["scale"].dtype
    assert torch.equal(scale, expected["scale"])
    assert zero_point.dtype == expected["zero_point"].dtype
    assert torch.equal(zero_point, expected["zero_point"])


def _weight_cases() -> list[tuple[str, str]]:
    cases = [(name, fmt) for name in [*MINMAX, *MSE] for fmt in WEIGHT_FORMATS]
    imatrix = ["int8-tensor", "int4-g128-asym", "fp8-channel", "nvfp4", "mxfp4"]
    cases += [("imatrix_mse", fmt) for fmt in imatrix]
    return cases + [(name, "nvfp4") for name in NVFP4_ONLY]


def _pair(name: str, base_name: str, args: dict[str, Any], layer=None):
    theirs = LObserver.load_from_registry(
        name, base_name=base_name, args=CTArgs(**args)
    )
    searches = name in (*MSE, *NVFP4_ONLY, *IMATRIX)
    ours = Observer.load_from_registry(
        name, base_name=base_name, args=QuantizationArgs(**args),
        **(PEER_SEARCH if searches else {}),
    )  # fmt: skip
    if layer is not None and name in IMATRIX:
        theirs.attach(layer)
        ours.attach(layer)
    return theirs, ours


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "fmt"), _weight_cases())
def test_weight_qparams_equal_llm_compressor(
    name: str, fmt: str, dtype: torch.dtype
) -> None:
    args = WEIGHT_FORMATS[fmt]
    layer = torch.nn.Linear(COLS, ROWS, bias=False, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(_values((ROWS, COLS), 0.05, dtype, 0))
    theirs, ours = _pair(name, "weight", args, layer)
    with torch.no_grad():  # the importance imatrix observers gather
        for seed in (1, 2):
            spread = torch.linspace(0.1, 3, COLS, dtype=dtype)
            layer(_values((3, COLS), 1.0, dtype, seed) * spread)
    expected = theirs(layer.weight).get_qparams()
    ours.update(layer.weight)
    if NIGHTLY_GRID is not None and (name, fmt, dtype) in NIGHTLY_DIFFERS:
        with pytest.raises(AssertionError):  # the nightly's changed search
            _assert_equal_qparams(ours.get_qparams(), expected)
        return
    _assert_equal_qparams(ours.get_qparams(), expected)
    if expected["global_scale"] is not None:
        global_scale = ours.get_global_scale()
        assert global_scale.dtype == expected["global_scale"].dtype
        assert torch.equal(global_scale, expected["global_scale"])
    if dtype != torch.float32 and expected["global_scale"] is None:
        assert expected["scale"].dtype == dtype  # the peer's rule, as we read it


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ACTIVATION_FORMATS)
@pytest.mark.parametrize("name", [*MINMAX, *MSE])
def test_activation_qparams_equal_llm_compressor(
    name: str, fmt: str, dtype: torch.dtype
) -> None:
    args = ACTIVATION_FORMATS[fmt]
    theirs, ours = _pair(name, "input", args)
    for seed in range(3):  # ranges that grow: the moving averages round
        batch = _values((2, 8, 64), 1.0 + 2 * seed, dtype, seed)
        theirs(batch)
        ours.update(batch)
    expected_global = theirs.get_global_scale()
    if expected_global is not None:
        assert torch.equal(ours.get_global_scale(), expected_global)
    if args.get("dynamic") == "local":
        return  # NVFP4 activations: only the global scale is static
    _assert_equal_qparams(ours.get_qparams(), theirs.get_qparams())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llm_compressor_plugin_returns_the_observed_dtype(dtype: torch.dtype) -> None:
    import quantobs.integrations.llmcompressor  # noqa: F401

    args = WEIGHT_FORMATS["int4-g128-asym"]
    weight = _values((ROWS, COLS), 0.05, dtype, 0)
    expected = LObserver.load_from_registry(
        "memoryless_mse", base_name="weight", args=CTArgs(**args)
    )(weight).get_qparams()
    plugin = LObserver.load_from_registry(
        "quantobs_memoryless_mse", base_name="weight", args=CTArgs(**args)
    )
    found = plugin(weight).get_qparams()
    _assert_equal_qparams((found["scale"], found["zero_point"]), expected)


# ---------------------------------------------------- arithmetic="float32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_arithmetic_is_the_float32_copy(dtype: torch.dtype) -> None:
    # arithmetic="float32": the bfloat16 / float16 values searched and
    # averaged as their float32 copies (float32 scales), which here picks
    # other candidates than llm-compressor's rounded error sums
    args = WEIGHT_FORMATS["int4-g128"]
    weight = _values((ROWS, COLS), 0.05, dtype, 0)
    for name in ("memoryless_mse", "mse", "imatrix_mse"):
        ours = Observer.load_from_registry(
            name, base_name="weight", args=QuantizationArgs(**args),
            arithmetic="float32",
        )  # fmt: skip
        copy = Observer.load_from_registry(
            name, base_name="weight", args=QuantizationArgs(**args)
        )
        ours.update(weight)
        copy.update(weight.float())
        scale = ours.get_qparams()[0]
        assert scale.dtype == torch.float32
        assert torch.equal(scale, copy.get_qparams()[0])
        theirs = LObserver.load_from_registry(
            name, base_name="weight", args=CTArgs(**args)
        )
        expected = theirs(weight).get_qparams()["scale"]
        assert not torch.equal(scale.to(dtype), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_moving_average_rounds_in_the_observed_dtype(dtype: torch.dtype) -> None:
    # minmax's average of two batches: 0.99 * a + 0.01 * b, each product and
    # the sum rounded to the dtype (llm-compressor's); float32 keeps the bits
    args = QuantizationArgs(num_bits=8, symmetric=False)
    first = torch.tensor([[-1.0, 3.0]], dtype=dtype)
    second = torch.tensor([[-2.0, 7.0]], dtype=dtype)
    rounded = Observer.load_from_registry("minmax", base_name="input", args=args)
    exact = Observer.load_from_registry(
        "minmax", base_name="input", args=args, arithmetic="float32"
    )
    for observer in (rounded, exact):
        observer.update(first)
        observer.update(second)
    high = rounded.get_range()[1]
    expected = (first.amax() * 0.99 + second.amax() * 0.01).float()  # in `dtype`
    assert torch.equal(high, expected.reshape(1))
    assert torch.equal(exact.get_range()[1], torch.tensor([3.0 * 0.99 + 7.0 * 0.01]))
    assert not torch.equal(high, exact.get_range()[1])


def test_float16_error_sums_overflow_as_the_peers() -> None:
    # float16 values whose int4 error sums pass 65504: llm-compressor's
    # errors are all inf, no candidate improves and its search returns the
    # min-max range; the peer's search arithmetic does the same, float32 searches
    args = WEIGHT_FORMATS["int4-g128"]
    weight = _values((8, 256), 300.0, torch.float16, 0)
    expected = LObserver.load_from_registry(
        "memoryless_minmax", base_name="weight", args=CTArgs(**args)
    )(weight).get_qparams()
    theirs = LObserver.load_from_registry(
        "memoryless_mse", base_name="weight", args=CTArgs(**args)
    )(weight).get_qparams()
    assert torch.equal(theirs["scale"], expected["scale"])
    for search, searched in (("observed", False), ("float32", True)):
        ours = Observer.load_from_registry(
            "memoryless_mse", base_name="weight", args=QuantizationArgs(**args),
            search_arithmetic=search,
        )  # fmt: skip
        ours.update(weight)
        scale = ours.get_qparams()[0].to(torch.float16)
        assert torch.equal(scale, expected["scale"]) is not searched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["memoryless_mse", "imatrix_mse"])  # mse averages
def test_the_default_search_scores_the_float32_copy(
    name: str, dtype: torch.dtype
) -> None:
    # the default search_arithmetic="float32": the range chosen for the
    # bfloat16 / float16 values is the float32 copy's, and it differs from
    # the peer's rounded search somewhere here (the option's reason to be)
    args = QuantizationArgs(**WEIGHT_FORMATS["int4-g128"])
    weight = _values((ROWS, COLS), 0.05, dtype, 0)
    default = Observer.load_from_registry(name, base_name="weight", args=args)
    copy = Observer.load_from_registry(name, base_name="weight", args=args)
    peer = Observer.load_from_registry(
        name, base_name="weight", args=args, **PEER_SEARCH
    )
    default.update(weight)
    copy.update(weight.float())
    peer.update(weight)
    low, high = default.get_range()
    assert torch.equal(low, copy.get_range()[0])
    assert torch.equal(high, copy.get_range()[1])
    assert not torch.equal(high, peer.get_range()[1])
    assert default.get_qparams()[0].dtype == dtype  # scales in the observed dtype
