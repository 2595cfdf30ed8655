"""compressed-tensors 0.20's FP6 (e2m3) and MX presets (MXFP6A16, MXFP6A8,
MXFP4XFP8): rounding, qparams, quantization and llm-compressor's observers,
bit for bit with compressed-tensors' own. Skipped (at collection, with the
reason) where compressed-tensors is older than 0.20: it has no FP6."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quantobs import (
    Observer,
    QuantizationArgs,
    calculate_qparams,
    dequantize,
    fake_quantize,
    get_format,
    preset_scheme,
    quantize,
)
from quantobs.core.peer_versions import compressed_tensors_has_fp6

pytestmark = pytest.mark.peers
pytest.importorskip("compressed_tensors")
if not compressed_tensors_has_fp6():
    pytest.skip(
        "compressed-tensors < 0.20 has no FP6 (e2m3) nor the MXFP6 / MXFP4XFP8 "
        "presets to compare with",
        allow_module_level=True,
    )

from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs as CTArgs,
)
from compressed_tensors.quantization import (  # noqa: E402
    dequantize as ct_dequantize,
)
from compressed_tensors.quantization import (  # noqa: E402
    fake_quantize as ct_fake_quantize,
)
from compressed_tensors.quantization import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import (  # noqa: E402
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import (  # noqa: E402
    calculate_qparams as ct_qparams,
)
from compressed_tensors.quantization.utils.fp6_utils import (  # noqa: E402
    cast_to_fp6,
)

NEW_PRESETS = ("MXFP6A16", "MXFP6A8", "MXFP4XFP8")
#: (preset, part): every args the new presets have
PARTS = [
    (name, part)
    for name in NEW_PRESETS
    for part in ("weights", "input_activations")
    if getattr(preset_scheme(name), part) is not None
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MXFP6: dict[str, Any] = {
    "num_bits": 6,
    "type": "float",
    "group_size": 32,
    "scale_dtype": torch.uint8,
    "zp_dtype": torch.uint8,
}


def _args(name: str, part: str) -> tuple[QuantizationArgs, Any]:
    ours = getattr(preset_scheme(name), part)
    theirs = getattr(preset_name_to_scheme(name, ["Linear"]), part)
    assert ours is not None and theirs is not None
    return ours, theirs


# ------------------------------------------------------------------ rounding


def _fp6_inputs() -> torch.Tensor:
    """Every e2m3 value, the midpoints between neighbours (ties), values a
    hair off them, subnormal and out-of-range magnitudes, both signs."""
    values = get_format("float6_e2m3fn").values()  # (63,) ascending
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    extra = torch.tensor([7.6, 7.75, 7.76, 8.0, 100.0, 1e30, 2.0**-10, 1e-40])
    grid = torch.linspace(-9, 9, 2001, dtype=torch.float64)
    found = torch.cat([values, mids, near, extra, -extra, grid, torch.zeros(1)])
    return found.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp6_rounding_matches_cast_to_fp6(dtype: torch.dtype) -> None:
    x = _fp6_inputs().to(dtype)
    ours = get_format("float6_e2m3fn").round(x)
    theirs = cast_to_fp6(x)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)
    assert torch.equal(ours.signbit(), theirs.signbit())  # -0.0 stays -0.0


def test_float64_is_rounded_once() -> None:
    # compressed-tensors rounds float64 to float32 before e2m3 (twice); we
    # round once (quantobs.core.quantize's docstring)
    x = torch.tensor([1.0625 + 1e-12, 1.0625 - 1e-12], dtype=torch.float64)
    assert get_format("float6_e2m3fn").round(x).tolist() == [1.125, 1.0]
    assert cast_to_fp6(x).tolist() == [1.0, 1.0]


def test_fp6_args_take_the_e2m3_format() -> None:
    args = QuantizationArgs(**MXFP6)
    assert args.format.name == "float6_e2m3fn" and args.is_mx
    assert (args.format.min, args.format.max) == (-7.5, 7.5)
    assert QuantizationArgs.from_compressed_tensors(CTArgs(**MXFP6)) == args
    with pytest.raises(ValueError, match="asymmetric FP6"):
        QuantizationArgs(num_bits=6, type="float", symmetric=False)


# ------------------------------------------------------------------- qparams


def _ranges(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if kind == "random":
        x = torch.randn(64, 32, generator=gen) * torch.logspace(-3, 2, 32)
        return x.amin(0), x.amax(0)
    if kind == "positive":
        x = torch.rand(16, 8, generator=gen) + 0.5
        return x.amin(0), x.amax(0)
    if kind == "constant":
        c = torch.full((8,), 0.37)
        return c, c.clone()
    if kind == "tiny":
        x = torch.randn(16, 8, generator=gen) * 1e-38
        return x.amin(0), x.amax(0)
    # amax at and around e2m3's top (7.5, and where the rounding to three
    # mantissa bits goes up: 1.9375 * 2**k) in several binades
    tops = torch.tensor([7.5, 7.74, 7.75, 7.76, 7.9, 6.0, 4.0, 3.875, 3.876])
    amax = torch.cat([tops * 2.0**k for k in (-8, 0, 5)])
    return -amax, amax


@pytest.mark.parametrize("kind", ["random", "positive", "constant", "tiny", "top"])
def test_mx_fp6_qparams_match(kind: str) -> None:
    min_vals, max_vals = _ranges(kind)
    ours = calculate_qparams(min_vals, max_vals, QuantizationArgs(**MXFP6))
    theirs = ct_qparams(min_vals, max_vals, CTArgs(**MXFP6))
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.dtype == other.dtype and mine.shape == other.shape
        assert torch.equal(mine, other)


def test_mx_fp6_rounds_the_amax_to_three_mantissa_bits() -> None:
    # FP4 and FP8 blocks round their amax to one mantissa bit (1.75 goes up);
    # FP6 to three (1.9375 goes up): 7.0 = 1.75 * 4 keeps the scale 1
    amax = torch.tensor([7.0, 7.74, 7.75])
    scale, _ = calculate_qparams(-amax, amax, QuantizationArgs(**MXFP6))
    assert scale.tolist() == [1.0, 1.0, 2.0]
    fp4 = QuantizationArgs(**{**MXFP6, "num_bits": 4})
    assert calculate_qparams(-amax, amax, fp4)[0].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "part"), PARTS, ids=lambda v: str(v))
def test_preset_quantization_matches(name: str, part: str, dtype: torch.dtype) -> None:
    ours, theirs = _args(name, part)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 256, generator=gen) * torch.logspace(-3, 2, 256)).to(dtype)
    groups = x.reshape(16, -1, int(ours.group_size or 0))
    min_vals, max_vals = groups.amin(-1), groups.amax(-1)  # (16, groups)
    scale, zero_point = calculate_qparams(min_vals, max_vals, ours)
    ct_scale, ct_zero_point = ct_qparams(min_vals, max_vals, theirs)
    assert scale.dtype == ct_scale.dtype == dtype
    assert torch.equal(scale, ct_scale) and torch.equal(zero_point, ct_zero_point)
    codes = quantize(x, scale, zero_point, ours)
    ct_codes = ct_quantize(x, ct_scale, ct_zero_point, theirs)
    assert codes.dtype == ct_codes.dtype and torch.equal(codes, ct_codes)
    assert torch.equal(
        dequantize(codes, scale, zero_point, ours),
        ct_dequantize(ct_codes, ct_scale, ct_zero_point, theirs),
    )
    found = fake_quantize(x, scale, zero_point, ours)
    assert torch.equal(found, ct_fake_quantize(x, ct_scale, ct_zero_point, theirs))


@pytest.mark.parametrize(("name", "part"), PARTS, ids=lambda v: str(v))
def test_columns_not_a_multiple_of_the_group_are_refused(name: str, part: str) -> None:
    # compressed-tensors 0.20 raises also where the columns are fewer than
    # one group (0.19 let them through); so do we
    ours, theirs = _args(name, part)
    x = torch.randn(4, 16)
    scale = torch.ones(4, 1)
    with pytest.raises(ValueError, match="divi"):
        ct_fake_quantize(x, scale, None, theirs)
    with pytest.raises(ValueError, match="does not divide"):
        fake_quantize(x, scale, None, ours)


# ----------------------------------------------------------------- observers

OBSERVERS = ["memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse"]


@pytest.mark.parametrize("observer", OBSERVERS)
@pytest.mark.parametrize(("name", "part"), PARTS, ids=lambda v: str(v))
def test_llm_compressor_observers_match(
    name: str, part: str, observer: str, backend: str
) -> None:
    lc_observers = pytest.importorskip("llmcompressor.observers")
    ours_args, theirs_args = _args(name, part)
    base, shape, count = ("weight", (32, 128), 1)
    if part == "input_activations":
        base, shape, count = ("input", (2, 8, 256), 3)
    options = {"patience": 1000} if "mse" in observer else {}
    ours = Observer.load_from_registry(observer, base_name=base, args=ours_args)
    theirs = lc_observers.Observer.load_from_registry(
        observer, base_name=base, args=theirs_args, **options
    )
    gen = torch.Generator().manual_seed(2)
    for i in range(count):
        batch = torch.randn(shape, generator=gen) * (1 + i)
        ours.update(batch)
        theirs(batch)
    expected = theirs.get_qparams()
    scale, zero_point = ours.get_qparams()
    assert torch.equal(scale, expected["scale"])
    assert torch.equal(zero_point, expected["zero_point"])
