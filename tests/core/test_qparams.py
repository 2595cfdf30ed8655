"""calculate_qparams / generate_gparam: parity with compressed-tensors 0.19."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams as ct_qparams
from compressed_tensors.quantization.utils import generate_gparam as ct_gparam
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import (
    QuantizationArgs,
    amax_to_global_scale,
    calculate_qparams,
    calculate_range,
    fake_quantize,
    generate_gparam,
    preset_scheme,
    scale_to_storage,
    storage_to_scale,
)
from quantobs.core.qparams.pow2 import pow2_exponent

ARGS: dict[str, dict[str, Any]] = {
    **{f"int{b}-sym": {"num_bits": b} for b in range(2, 9)},
    **{f"int{b}-asym": {"num_bits": b, "symmetric": False} for b in (2, 4, 8)},
    "fp8": {"num_bits": 8, "type": "float"},
    "fp8-asym": {"num_bits": 8, "type": "float", "symmetric": False},
    "fp4": {"num_bits": 4, "type": "float"},
    "fp8-scale-fp16": {"num_bits": 8, "type": "float", "scale_dtype": torch.float16},
    "int8-scale-bf16": {"num_bits": 8, "scale_dtype": torch.bfloat16},
    "nvfp4": {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "scale_dtype": torch.float8_e4m3fn,
    },
    "mxfp4": {
        "num_bits": 4,
        "type": "float",
        "group_size": 32,
        "scale_dtype": torch.uint8,
        "zp_dtype": torch.uint8,
    },
    "mxfp8": {
        "num_bits": 8,
        "type": "float",
        "group_size": 32,
        "scale_dtype": torch.uint8,
        "zp_dtype": torch.uint8,
    },
}


def _ranges(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if kind == "random":
        x = torch.randn(64, 32, generator=gen) * torch.logspace(-3, 2, 32)
        return x.amin(0), x.amax(0)
    if kind == "positive":
        x = torch.rand(16, 8, generator=gen) + 0.5
        return x.amin(0), x.amax(0)
    if kind == "negative":
        x = -torch.rand(16, 8, generator=gen) - 0.5
        return x.amin(0), x.amax(0)
    if kind == "constant":
        c = torch.full((8,), 0.37)
        return c, c.clone()
    if kind == "tiny":
        x = torch.randn(16, 8, generator=gen) * 1e-38
        return x.amin(0), x.amax(0)
    if kind == "huge-sym":
        x = torch.randn(16, 8, generator=gen) * 1e37
        return x.amin(0), x.amax(0)
    raise AssertionError(kind)


def _global_scale(
    args: dict[str, Any], min_vals: torch.Tensor, max_vals: torch.Tensor
) -> torch.Tensor | None:
    if args.get("strategy") != "tensor_group":
        return None
    return ct_gparam(min_vals.min().reshape(1), max_vals.max().reshape(1))


@pytest.mark.parametrize(
    "kind", ["random", "positive", "negative", "constant", "tiny", "huge-sym"]
)
@pytest.mark.parametrize("name", sorted(ARGS))
def test_parity_with_compressed_tensors(name: str, kind: str) -> None:
    kwargs = ARGS[name]
    min_vals, max_vals = _ranges(kind)
    global_scale = _global_scale(kwargs, min_vals, max_vals)
    theirs = ct_qparams(min_vals, max_vals, CTArgs(**kwargs), global_scale)
    ours = calculate_qparams(
        min_vals, max_vals, QuantizationArgs(**kwargs), global_scale
    )
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.dtype == other.dtype and mine.shape == other.shape
    # compressed-tensors keeps subnormal scales, rounded to the nearest
    # subnormal (its "tiny" int8-scale-bf16 scales here are 2**-133, one bit,
    # and miss in-range values by 52 steps); ours are raised to the smallest
    # normal number (calculate_qparams' docstring; MX powers of two are exact
    # and kept). Elsewhere: its bits.
    normal = theirs[0] >= torch.finfo(theirs[0].dtype).tiny
    if QuantizationArgs(**kwargs).is_mx:
        normal = torch.ones_like(normal)
    assert torch.equal(ours[0][normal], theirs[0][normal])
    assert torch.equal(ours[1][normal], theirs[1][normal])
    assert (ours[0][~normal] == torch.finfo(ours[0].dtype).tiny).all()
    assert kind == "tiny" or bool(normal.all())


@pytest.mark.parametrize(
    "name",
    [
        "W4A16",
        "W4A16_ASYM",
        "W8A8",
        "W8A16",
        "W4A8",
        "FP8",
        "FP8_DYNAMIC",
        "FP8_BLOCK",
        "NVFP4",
        "NVFP4A16",
        "MXFP4",
        "MXFP8",
    ],
)
def test_presets_parity(name: str) -> None:
    args = preset_scheme(name).weights
    ct_args = preset_name_to_scheme(name, ["Linear"]).weights
    assert args is not None
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    min_vals, max_vals = x.amin(0).reshape(8, 32), x.amax(0).reshape(8, 32)
    gs = ours_gs = None
    if args.strategy == "tensor_group":
        gs = ct_gparam(min_vals.min().reshape(1), max_vals.max().reshape(1))
        ours_gs = generate_gparam(min_vals.min().reshape(1), max_vals.max().reshape(1))
        assert torch.equal(gs, ours_gs)
    ours = calculate_qparams(min_vals, max_vals, args, ours_gs)
    theirs = ct_qparams(min_vals, max_vals, ct_args, gs)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_all_zero_range() -> None:
    zero = torch.zeros(4)
    for kwargs in ARGS.values():
        if kwargs.get("strategy") == "tensor_group":
            continue
        args = QuantizationArgs(**kwargs)
        scale, zero_point = calculate_qparams(zero, zero, args)
        assert (scale > 0).all() and torch.isfinite(scale).all()
        qmin, qmax = calculate_range(args)
        assert ((zero_point.float() >= qmin) & (zero_point.float() <= qmax)).all()
    # Symmetric: compressed-tensors' numbers (eps of the scale dtype).
    scale, zero_point = calculate_qparams(zero, zero, QuantizationArgs(num_bits=4))
    assert torch.equal(scale, torch.full((4,), torch.finfo(torch.float32).eps))
    assert torch.equal(zero_point, torch.zeros(4, dtype=torch.int8))
    # Asymmetric: compressed-tensors computes zp = qmin - 0 / 0 = NaN and casts
    # it to int8; we give qmin, which maps 0 exactly.
    scale, zero_point = calculate_qparams(zero, zero, QuantizationArgs(symmetric=False))
    assert torch.equal(zero_point, torch.full((4,), -128, dtype=torch.int8))
    # NVFP4: global scale 1 (as compressed-tensors), group scale the FP8 eps.
    nvfp4 = QuantizationArgs(**ARGS["nvfp4"])
    gs = generate_gparam(zero, zero)
    assert torch.equal(gs, torch.ones(1))
    assert torch.equal(gs, ct_gparam(zero[:1], zero[:1]))
    scale, _ = calculate_qparams(zero, zero, nvfp4, gs)
    assert torch.equal(scale, torch.full((4,), 0.125))


def test_huge_asymmetric_range_stays_finite() -> None:
    # compressed-tensors: (max - min) overflows to inf, scale inf, zp NaN.
    min_vals, max_vals = torch.tensor([-3e38]), torch.tensor([3e38])
    scale, zero_point = calculate_qparams(
        min_vals, max_vals, QuantizationArgs(symmetric=False)
    )
    assert torch.isfinite(scale).all() and scale.item() == pytest.approx(6e38 / 255)
    assert zero_point.item() == 0
    assert not torch.isfinite(
        ct_qparams(min_vals, max_vals, CTArgs(symmetric=False))[0]
    ).all()


def test_mx_scale_of_float32_max_is_finite() -> None:
    # compressed-tensors rounds amax = 3.4e38 up to 2**128 in float32 bits,
    # which is inf; log2(inf) - 8 clamps to exponent code 255 (NaN in e8m0) and
    # the scale is inf. The power of two above 3.4e38 is 2**128: scale 2**120.
    args = QuantizationArgs(**ARGS["mxfp8"])
    big = torch.tensor([torch.finfo(torch.float32).max])
    scale, _ = calculate_qparams(-big, big, args)
    assert scale.item() == 2.0**120
    assert scale_to_storage(scale, args).item() == 127 + 120
    assert torch.isinf(ct_qparams(-big, big, CTArgs(**ARGS["mxfp8"]))[0]).all()


def _pow2_reference(amax: float, mode: str) -> int:
    exponent = math.floor(math.log2(amax))
    mantissa = amax / 2.0**exponent
    if mode == "round":  # to one mantissa bit, ties up (compressed-tensors' MX)
        return exponent + (mantissa >= 1.75)
    if mode == "ceil":
        return exponent + (mantissa > 1.0)
    return exponent


@pytest.mark.parametrize("mode", ["round", "floor", "ceil"])
def test_mx_rounding_modes(mode: str) -> None:
    amax = torch.tensor(
        [1.0, 1.5, 1.74, 1.75, 1.99, 2.0, 3.0, 3.5, 6.0, 7.0, 0.3, 1e-30, 448.0, 500.0]
    )
    args = QuantizationArgs(**ARGS["mxfp4"])
    scale, zero_point = calculate_qparams(-amax, amax, args, pow2=mode)
    expected = [2.0 ** (_pow2_reference(a, mode) - 2) for a in amax.tolist()]
    assert scale.tolist() == expected
    assert zero_point.dtype == torch.uint8 and not zero_point.any()


def test_pow2_int_scales() -> None:
    amax = torch.tensor([1.0, 2.5, 100.0])
    args = QuantizationArgs(num_bits=8)
    plain, _ = calculate_qparams(-amax, amax, args)
    for mode in ("round", "floor", "ceil"):
        scale, _ = calculate_qparams(-amax, amax, args, pow2=mode)
        exps = torch.log2(scale)
        assert torch.equal(exps, exps.round())
        if mode == "ceil":
            assert (scale >= plain).all()
        if mode == "floor":
            assert (scale <= plain).all()


def test_pow2_exponent_rejects_bad_mode() -> None:
    with pytest.raises(
        ValueError, match="rounding='up'; use 'floor', 'ceil' or 'round'"
    ):
        pow2_exponent(torch.ones(1), "up")  # type: ignore[arg-type]


def test_zero_dim_range_gives_shape_one() -> None:
    scale, zero_point = calculate_qparams(
        torch.tensor(-1.0), torch.tensor(1.0), QuantizationArgs()
    )
    assert scale.shape == (1,) and zero_point.shape == (1,)


def test_scale_dtype_follows_input_dtype() -> None:
    # As compressed-tensors: the scale keeps the range's dtype (its values are
    # representable in scale_dtype); the zero point has zp_dtype.
    args = QuantizationArgs(**ARGS["nvfp4"])
    min_vals = -torch.rand(8, dtype=torch.bfloat16) - 0.1
    gs = generate_gparam(min_vals, -min_vals)
    scale, zero_point = calculate_qparams(min_vals, -min_vals, args, gs)
    assert scale.dtype == torch.bfloat16 and zero_point.dtype == torch.float8_e4m3fn
    assert torch.equal(scale.float(), scale.float().to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("amax", [1e-3, 1.0, 6.0, 1e4, 3e38])
def test_generate_gparam_parity(amax: float) -> None:
    min_vals, max_vals = torch.tensor([-amax / 2]), torch.tensor([amax])
    assert torch.equal(
        generate_gparam(min_vals, max_vals), ct_gparam(min_vals, max_vals)
    )


def test_global_scale_edge_cases() -> None:
    assert amax_to_global_scale(torch.tensor(0.0)).item() == 1.0
    assert amax_to_global_scale(torch.tensor(1e-38)).item() == 1.0  # overflow -> 1
    assert amax_to_global_scale(torch.tensor(6.0)).item() == 448.0
    fp8 = amax_to_global_scale(torch.tensor(6.0), "float8_e4m3fn", "float8_e4m3fn")
    assert fp8.item() == 448.0 * 448.0 / 6.0 or fp8.item() == pytest.approx(33450.67)
    with pytest.raises(ValueError, match="amax is not finite"):
        amax_to_global_scale(torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="non-finite range"):
        generate_gparam(torch.tensor([float("-inf")]), torch.tensor([1.0]))


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "nvfp4"])
def test_storage_round_trip(name: str) -> None:
    args = QuantizationArgs(**ARGS[name])
    x = torch.randn(4, 64)
    min_vals, max_vals = x.amin(-1), x.amax(-1)
    gs = generate_gparam(min_vals, max_vals) if name == "nvfp4" else None
    scale, _ = calculate_qparams(min_vals, max_vals, args, gs)
    stored = scale_to_storage(scale, args)
    assert stored.dtype == (torch.uint8 if args.is_mx else torch.float8_e4m3fn)
    assert torch.equal(storage_to_scale(stored, args), scale)
    e8m0 = (
        QuantizationArgs(**{**ARGS[name], "scale_dtype": torch.float8_e8m0fnu})
        if args.is_mx
        else None
    )
    if e8m0 is not None:
        codes = scale_to_storage(scale, e8m0)
        assert codes.dtype == torch.float8_e8m0fnu
        assert torch.equal(codes.float(), scale)
        assert torch.equal(storage_to_scale(codes, e8m0), scale)


@pytest.mark.parametrize(
    ("min_vals", "max_vals", "error", "match"),
    [
        (
            torch.tensor([float("nan")]),
            torch.tensor([1.0]),
            ValueError,
            r"1 non-finite range value\(s\)",
        ),
        (
            torch.tensor([-1.0, 0.0]),
            torch.tensor([float("inf"), 1.0]),
            ValueError,
            "non-finite",
        ),
        (torch.tensor([2.0]), torch.tensor([1.0]), ValueError, "min_vals > max_vals"),
        (torch.zeros(2), torch.zeros(3), ValueError, "must have the same shape"),
        (
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(2),
            TypeError,
            "must be a floating tensor",
        ),
        ([0.0], torch.zeros(1), TypeError, "must be a torch.Tensor"),
    ],
    ids=["nan", "inf", "min-gt-max", "shape", "int", "list"],
)
def test_errors(
    min_vals: Any, max_vals: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        calculate_qparams(min_vals, max_vals, QuantizationArgs())


@pytest.mark.parametrize(
    ("global_scale", "match"),
    [
        (torch.tensor([0.0]), "finite and positive"),
        (torch.tensor([float("nan")]), "finite and positive"),
        (torch.tensor([1.0, 2.0]), r"one value \(shape \(1,\)\)"),
        (torch.tensor([3e38]), "overflowed"),
    ],
    ids=["zero", "nan", "two", "overflow"],
)
def test_bad_global_scale(global_scale: torch.Tensor, match: str) -> None:
    args = QuantizationArgs(**{**ARGS["nvfp4"], "scale_dtype": None})
    with pytest.raises(ValueError, match=match):
        calculate_qparams(torch.tensor([-1e3]), torch.tensor([1e3]), args, global_scale)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(a=finite, b=finite, name=st.sampled_from(sorted(ARGS)))
def test_scale_positive_and_zero_point_in_range(a: float, b: float, name: str) -> None:
    kwargs = ARGS[name]
    args = QuantizationArgs(**kwargs)
    min_vals, max_vals = torch.tensor([min(a, b)]), torch.tensor([max(a, b)])
    gs = (
        generate_gparam(min_vals, max_vals) if args.strategy == "tensor_group" else None
    )
    scale, zero_point = calculate_qparams(min_vals, max_vals, args, gs)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    qmin, qmax = calculate_range(args)
    assert qmin <= zero_point.float().item() <= qmax


# ------------------------------------------------- subnormal scales (issue 16)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_subnormal_scale_is_floored_to_keep_half_a_step(symmetric: bool) -> None:
    x = torch.tensor([[-9.6689594038e-44, 3.9236357001e-44]])
    low, high = x.amin(1), x.amax(1)
    args = QuantizationArgs(num_bits=4, symmetric=symmetric)
    scale, zero_point = calculate_qparams(low, high, args)
    # compressed-tensors: (max - min) / 15 = 9.06e-45 rounds to the subnormal
    # 8.41e-45, the levels drift off the range and -9.67e-44 misses by 1.67
    # steps (asym). Ours: float32's smallest normal; everything dequantizes
    # to the nearest level, 0, within half a step.
    assert float(scale) == torch.finfo(torch.float32).tiny
    assert -8 <= int(zero_point) <= 7
    zp = None if symmetric else zero_point
    error = (fake_quantize(x, scale, zp, args) - x).abs()
    assert (error <= scale / 2).all()


@pytest.mark.parametrize(
    ("dtype", "scale_dtype"),
    [
        (torch.float32, None),
        (torch.float64, None),
        (torch.float16, None),
        (torch.float32, torch.bfloat16),
    ],
)
def test_subnormal_floor_is_the_dtype_tiny(
    dtype: torch.dtype, scale_dtype: torch.dtype | None
) -> None:
    info = torch.finfo(dtype)
    # scales about tiny / 16: subnormal, not 0 (a zero scale gets eps)
    low = torch.tensor([-info.tiny * 2.0, -1.0], dtype=dtype)
    high = torch.tensor([info.tiny, 1.0], dtype=dtype)
    for symmetric in (True, False):
        args = QuantizationArgs(
            num_bits=8, symmetric=symmetric, scale_dtype=scale_dtype
        )
        scale, _ = calculate_qparams(low, high, args)
        assert scale.dtype == dtype
        assert float(scale[0]) == info.tiny  # raised from a subnormal
        # a normal scale keeps its bits
        assert torch.equal(scale[1:], calculate_qparams(low[1:], high[1:], args)[0])


def test_fp8_group_scales_keep_their_subnormals() -> None:
    # NVFP4 group scales are rounded to e4m3 (subnormals down to 2**-9), as
    # compressed-tensors stores them: the floor does not touch them.
    kwargs = ARGS["nvfp4"]
    low, high = -torch.tensor([1e-3, 4.0]), torch.tensor([1e-3, 4.0])
    gs = ct_gparam(low.min().reshape(1), high.max().reshape(1))
    ours = calculate_qparams(low, high, QuantizationArgs(**kwargs), gs)
    theirs = ct_qparams(low, high, CTArgs(**kwargs), gs)
    assert torch.equal(ours[0], theirs[0])
