"""NVFP4 qparams of bfloat16 / float16 values equal llm-compressor 0.14's
(issue 25): its observers keep their statistics in the observed dtype and
compressed-tensors computes the global scale (`448 * 6 / amax`) and the
group scales (`amax / 6`) in it, each rounded; quantobs' default
`arithmetic="observed"` does the same, `arithmetic="float32"` does not.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization.utils import calculate_qparams as ct_qparams
from llmcompressor.observers import Observer as LObserver
from llmcompressor.observers.fusion import FusionHandler

from quantobs import Observer, QuantizationArgs, amax_to_global_scale
from quantobs.calibration import Recipe, attach, calibrate
from quantobs.core.qparams import calculate_qparams
from tests.format_args import NVFP4

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # float16 global scales that overflow as the peer's do (checked below)
    pytest.mark.filterwarnings("ignore:NVFP4 global scale .* overflows float16"),
]

LOW = [torch.bfloat16, torch.float16]
#: standard deviations of the random values: 0.01 puts a float16 absmax
#: below 448 * 6 / 65504, where the peer's global scale overflows to 1.0
STDS = [0.01, 0.02, 0.05, 0.3, 2.0]


def _values(shape: tuple[int, ...], std: float, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def _theirs(name: str, base_name: str, args: dict) -> LObserver:
    return LObserver.load_from_registry(name, base_name=base_name, args=CTArgs(**args))


def _ours(name: str, base_name: str, args: dict, **options: str) -> Observer:
    return Observer.load_from_registry(
        name, base_name=base_name, args=QuantizationArgs(**args), **options
    )


@pytest.mark.parametrize("std", STDS)
@pytest.mark.parametrize("dtype", [*LOW, torch.float32])
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax"])
def test_weight_scales_equal_llm_compressor(
    name: str, dtype: torch.dtype, std: float
) -> None:
    weight = _values((64, 128), std, dtype)
    theirs = _theirs(name, "weight", NVFP4)
    theirs(weight)
    expected = theirs.get_qparams()
    ours = _ours(name, "weight", NVFP4)
    ours.update(weight)
    scale, zero_point = ours.get_qparams()
    assert ours.observed_dtype == dtype
    assert torch.equal(ours.get_global_scale(), expected["global_scale"])
    assert scale.dtype == expected["scale"].dtype
    assert torch.equal(scale, expected["scale"])
    assert torch.equal(zero_point, expected["zero_point"])


@pytest.mark.parametrize("std", STDS)
@pytest.mark.parametrize("dtype", LOW)
def test_input_global_scale_equals_llm_compressor(
    dtype: torch.dtype, std: float
) -> None:
    args = {**NVFP4, "dynamic": "local"}
    theirs = _theirs("static_minmax", "input", args)
    ours = _ours("static_minmax", "input", args)
    for seed in range(3):
        batch = _values((2, 8, 128), std * (1 + seed), dtype, seed)
        theirs(batch)
        ours.update(batch)
    assert torch.equal(ours.get_global_scale(), theirs.get_global_scale())


@pytest.mark.parametrize("dtype", LOW)
def test_fp16_and_bf16_round_as_the_peer(dtype: torch.dtype) -> None:
    # bfloat16: 2688 / 0.4296875 is 6272.0 (reciprocal and product rounded),
    # not float32's 6255.709; float16: an absmax of 0.03 overflows 2688 /
    # amax past 65504, which becomes 1.0
    amax = torch.tensor([0.4296875 if dtype == torch.bfloat16 else 0.03])
    exact = amax_to_global_scale(amax.to(dtype))
    if dtype == torch.bfloat16:
        rounded = amax_to_global_scale(amax.to(dtype), observed_dtype=dtype)
        assert rounded.item() == 6272.0
    else:
        with pytest.warns(RuntimeWarning, match="arithmetic='float32'"):
            rounded = amax_to_global_scale(amax.to(dtype), observed_dtype=dtype)
        assert rounded.item() == 1.0 and exact.item() > 65504
        # an all-zero tensor gets 1.0 in any arithmetic: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            zero = amax_to_global_scale(torch.zeros(1), observed_dtype=dtype)
        assert zero.item() == 1.0
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)


@pytest.mark.parametrize("dtype", LOW)
def test_float32_arithmetic_option(dtype: torch.dtype) -> None:
    weight = _values((64, 128), 0.02, dtype)
    weight[0, 0] = 0.4296875  # the absmax: global scale 6255.709 or 6272.0
    ours = _ours("memoryless_minmax", "weight", NVFP4, arithmetic="float32")
    ours.update(weight)
    same_values = _ours("memoryless_minmax", "weight", NVFP4)
    same_values.update(weight.float())
    assert ours.arithmetic_dtype is None
    assert torch.equal(ours.get_global_scale(), same_values.get_global_scale())
    assert torch.equal(ours.get_qparams()[0], same_values.get_qparams()[0])
    theirs = _theirs("memoryless_minmax", "weight", NVFP4)
    theirs(weight)
    assert not torch.equal(ours.get_global_scale(), theirs.get_global_scale())


ASYM = {"symmetric": False}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize(
    "args",
    [
        {"num_bits": 8, "type": "float", "strategy": "channel"},
        {"num_bits": 4, "group_size": 16},
        {"num_bits": 8},
        {"num_bits": 4, "group_size": 16, **ASYM},
        {"num_bits": 8, "strategy": "channel", **ASYM},
        {"num_bits": 8, "type": "float", "strategy": "channel", **ASYM},
    ],
    ids=[
        "fp8-channel",
        "int4-group",
        "int8-tensor",
        "int4-group-asym",
        "int8-channel-asym",
        "fp8-channel-asym",
    ],
)
@pytest.mark.parametrize("std", [0.001, 0.05, 3.0])
def test_scales_and_zero_points_stored_as_the_peer(
    args: dict, dtype: torch.dtype, std: float
) -> None:
    # Symmetric scales without a global scale: the rounding in the observed
    # dtype is the one the scale's storage cast (to the module's dtype)
    # makes. Asymmetric ones round at every step (max - min, the quotient,
    # min / scale, qmin - min / scale): float32 arithmetic stores a
    # different scale in about 20% of these groups, zero point in 1-30%.
    x = (_values((64, 128), std, dtype) + 0.01).reshape(64, 8, 16)
    if args.get("group_size") is None:
        x = x.reshape(64, 1, 128)
    low, high = x.amin(-1), x.amax(-1)
    if args.get("strategy") is None:
        low, high = low.amin().reshape(1), high.amax().reshape(1)
    expected, expected_zp = ct_qparams(low, high, CTArgs(**args))
    scale, zero_point = calculate_qparams(
        low.float(), high.float(), QuantizationArgs(**args), observed_dtype=dtype
    )
    assert torch.equal(scale.to(dtype), expected)
    assert zero_point.dtype == expected_zp.dtype
    assert torch.equal(zero_point, expected_zp)
    theirs = _theirs("memoryless_minmax", "weight", args)
    theirs(x.reshape(64, 128))
    ours = _ours("memoryless_minmax", "weight", args)
    ours.update(x.reshape(64, 128))
    found = ours.get_qparams()
    expected_qparams = theirs.get_qparams()
    assert torch.equal(found[0].to(dtype), expected_qparams["scale"])
    assert torch.equal(found[1], expected_qparams["zero_point"])


class _Attention(torch.nn.Module):
    """q/k/v projections llm-compressor fuses (one weight global scale)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        for name, std in (("q_proj", 0.02), ("k_proj", 0.05), ("v_proj", 0.3)):
            layer = torch.nn.Linear(128, 64, bias=False, dtype=dtype)
            torch.nn.init.normal_(layer.weight, std=std)
            setattr(self, name, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) + self.k_proj(x) + self.v_proj(x)


@pytest.mark.parametrize("dtype", LOW)
def test_fused_qkv_share_the_peers_global_scale(dtype: torch.dtype) -> None:
    model = _Attention(dtype)
    layers = [model.q_proj, model.k_proj, model.v_proj]
    theirs = [_theirs("memoryless_minmax", "weight", NVFP4) for _ in layers]
    FusionHandler.fuse(zip(theirs, layers, strict=True))
    expected = []
    for observer, layer in zip(theirs, layers, strict=True):
        observer(layer.weight)
        expected.append(observer.get_qparams())
    attach(model, Recipe.from_scheme("NVFP4"))
    calibrate(model, [(_values((1, 4, 128), 1.0, dtype),)], progress=False)
    for layer, qparams in zip(layers, expected, strict=True):
        assert torch.equal(layer.weight_global_scale, qparams["global_scale"])
        assert torch.equal(
            layer.weight_scale, qparams["scale"].to(layer.weight_scale.dtype)
        )


def test_observed_dtype_kept_merged_and_reset() -> None:
    first = _ours("static_minmax", "input", {**NVFP4, "dynamic": "local"})
    first.update(_values((2, 8, 128), 1.0, torch.bfloat16))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    loaded = _ours("static_minmax", "input", {**NVFP4, "dynamic": "local"})
    loaded.load_state_dict(torch.load(buffer))
    assert loaded.observed_dtype == torch.bfloat16
    assert torch.equal(loaded.get_global_scale(), first.get_global_scale())
    other = _ours("static_minmax", "input", {**NVFP4, "dynamic": "local"})
    other.update(_values((2, 8, 128), 1.0, torch.float16, seed=1))
    loaded.merge(other)
    assert loaded.observed_dtype == torch.float32  # bf16 and fp16 promote
    loaded.reset()
    assert loaded.observed_dtype is None
