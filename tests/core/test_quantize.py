"""quantize / dequantize / fake_quantize: parity with compressed-tensors, laws."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization.lifecycle.forward import (
    dequantize as ct_dequantize,
)
from compressed_tensors.quantization.lifecycle.forward import (
    fake_quantize as ct_fake_quantize,
)
from compressed_tensors.quantization.lifecycle.forward import (
    quantize as ct_quantize,
)
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import (
    QuantizationArgs,
    calculate_qparams,
    calculate_range,
    dequantize,
    fake_quantize,
    flatten_for_calibration,
    generate_gparam,
    preset_scheme,
    quantize,
    scale_to_storage,
)

PRESETS = [
    "W4A16",
    "W4A16_ASYM",
    "W8A8",
    "W8A16",
    "W4A8",
    "W2A16",
    "FP8",
    "FP8_DYNAMIC",
    "FP8_BLOCK",
    "NVFP4",
    "NVFP4A16",
    "MXFP4",
    "MXFP8",
]


def _qparams(
    x: torch.Tensor, base_name: str, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    flat = flatten_for_calibration(x, base_name, args)
    min_vals, max_vals = flat.amin(dim=(0, -1)), flat.amax(dim=(0, -1))
    global_scale = None
    if args.strategy == "tensor_group":
        global_scale = generate_gparam(min_vals.min(), max_vals.max())
    scale, zero_point = calculate_qparams(min_vals, max_vals, args, global_scale)
    return scale, zero_point, global_scale


def _weight(rows: int = 96, cols: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    w[3, 17] = 0.5  # an outlier
    return w


@pytest.mark.parametrize("name", PRESETS)
def test_weight_parity_with_compressed_tensors(name: str) -> None:
    args = preset_scheme(name).weights
    ct_args = preset_name_to_scheme(name, ["Linear"]).weights
    assert args is not None
    w = _weight(rows=200 if args.strategy == "block" else 96)  # 200: padded blocks
    scale, zero_point, gs = _qparams(w, "weight", args)
    zp = None if args.symmetric else zero_point
    ours = fake_quantize(w, scale, zp, args, global_scale=gs)
    theirs = ct_fake_quantize(w, scale, zp, ct_args, global_scale=gs)
    assert ours.shape == w.shape and ours.dtype == w.dtype
    assert torch.equal(ours, theirs)
    codes = quantize(w, scale, zp, args, global_scale=gs)
    assert torch.equal(codes, ct_quantize(w, scale, zp, ct_args, global_scale=gs))
    back = dequantize(codes, scale, zp, args, global_scale=gs)
    assert torch.equal(back, ct_dequantize(codes, scale, zp, ct_args, global_scale=gs))
    assert torch.equal(back, ours)


@pytest.mark.parametrize(
    ("base_name", "shape", "kwargs"),
    [
        ("input", (2, 5, 64), {"num_bits": 8, "type": "float"}),
        ("input", (2, 5, 64), {"num_bits": 8, "symmetric": False}),
        ("input", (2, 5, 64), {"num_bits": 8, "strategy": "token", "dynamic": True}),
        ("output", (2, 5, 64), {"num_bits": 4, "group_size": 16}),
        ("k", (2, 4, 5, 16), {"num_bits": 8, "strategy": "attn_head"}),
        ("v", (2, 4, 5, 16), {"num_bits": 8, "type": "float"}),
    ],
    ids=["input-fp8", "input-asym", "token", "output-group", "k-head", "v-fp8"],
)
def test_activation_parity(
    base_name: str, shape: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    args = QuantizationArgs(**kwargs)
    scale, zero_point, _ = _qparams(x, base_name, args)
    zp = None if args.symmetric else zero_point
    ours = fake_quantize(x, scale, zp, args)
    if args.strategy == "group":
        # compressed-tensors only takes per-token group scales (its dynamic
        # shape (batch, seq, groups)); ours also take the static (groups,).
        scale = scale.expand(*shape[:-1], -1)
        zp = None if zp is None else zp.expand(*shape[:-1], -1)
    assert torch.equal(ours, ct_fake_quantize(x, scale, zp, CTArgs(**kwargs)))
    assert torch.equal(ours, fake_quantize(x, scale, zp, args))


def test_bf16_input() -> None:
    # compressed-tensors returns float32 here (the scale's dtype); we keep the
    # input's dtype, i.e. its float32 result rounded to bf16.
    args = preset_scheme("W8A8").weights
    ct_args = preset_name_to_scheme("W8A8", ["Linear"]).weights
    assert args is not None
    w = _weight().to(torch.bfloat16)
    scale, zero_point, _ = _qparams(w.float(), "weight", args)
    ours = fake_quantize(w, scale, zero_point, args)
    assert ours.dtype == torch.bfloat16
    theirs = ct_fake_quantize(w, scale, zero_point, ct_args)
    assert torch.equal(ours, theirs.to(torch.bfloat16))


def test_stored_scales_decode() -> None:
    for name in ("MXFP4", "NVFP4"):
        args = preset_scheme(name).weights
        assert args is not None
        w = _weight()
        scale, _, gs = _qparams(w, "weight", args)
        stored = scale_to_storage(scale, args)
        assert stored.dtype in (torch.uint8, torch.float8_e4m3fn)
        assert torch.equal(
            fake_quantize(w, stored, None, args, global_scale=gs),
            fake_quantize(w, scale, None, args, global_scale=gs),
        )


def _reference_g_idx(
    w: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor, args: QuantizationArgs
) -> torch.Tensor:
    # Slow and obvious: quantize column by column with that column's group.
    qmin, qmax = calculate_range(args)
    out = torch.empty_like(w)
    for j in range(w.shape[1]):
        s = scale[:, g_idx[j]]
        out[:, j] = torch.round((w[:, j] / s).clamp(qmin, qmax)) * s
    return out


def test_g_idx() -> None:
    w = _weight(rows=8, cols=64)
    args = QuantizationArgs(num_bits=4, group_size=16)
    g_idx = torch.randperm(64, generator=torch.Generator().manual_seed(3)) % 4
    flat = flatten_for_calibration(w, "weight", args, g_idx=g_idx)
    scale, zero_point = calculate_qparams(flat.amin((0, -1)), flat.amax((0, -1)), args)
    ours = fake_quantize(w, scale, zero_point, args, g_idx=g_idx)
    assert torch.equal(ours, _reference_g_idx(w, scale, g_idx, args))
    codes = quantize(w, scale, zero_point, args, g_idx=g_idx, dtype=torch.int8)
    assert codes.dtype == torch.int8
    assert torch.equal(dequantize(codes, scale, zero_point, args, g_idx=g_idx), ours)
    # the identity ordering is plain group quantization
    identity = torch.arange(64) // 16
    plain_scale, plain_zp = calculate_qparams(
        *(
            f((0, -1))
            for f in (
                flatten_for_calibration(w, "weight", args).amin,
                flatten_for_calibration(w, "weight", args).amax,
            )
        ),
        args,
    )
    assert torch.equal(
        fake_quantize(w, plain_scale, plain_zp, args, g_idx=identity),
        fake_quantize(w, plain_scale, plain_zp, args),
    )


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda w, s, a: fake_quantize(w, s[:3], None, a),
            ValueError,
            r"scale of shape \(3, 4\) does not broadcast",
        ),
        (
            lambda w, s, a: fake_quantize(w, s * 0, None, a),
            ValueError,
            "finite and positive",
        ),
        (
            lambda w, s, a: fake_quantize(w, s * float("nan"), None, a),
            ValueError,
            "finite and positive",
        ),
        (
            lambda w, s, a: fake_quantize(w[:, :60], s, None, a),
            ValueError,
            "group_size 16 does not divide",
        ),
        (
            lambda w, s, a: fake_quantize(w, s, None, CTArgs(num_bits=4)),
            TypeError,
            "from_compressed_tensors",
        ),
        (
            lambda w, s, a: fake_quantize(w.tolist(), s, None, a),
            TypeError,
            "x must be a torch.Tensor",
        ),
        (
            lambda w, s, a: fake_quantize(w, s.to(torch.int32), None, a),
            TypeError,
            "scale must be a floating tensor",
        ),
        (lambda w, s, a: dequantize(w, s, None, None), ValueError, "needs args"),
        (
            lambda w, s, a: fake_quantize(
                w, s, None, QuantizationArgs(), torch.zeros(64)
            ),
            ValueError,
            "g_idx applies to strategy",
        ),
        (
            lambda w, s, a: fake_quantize(w, s, None, a, global_scale=torch.zeros(1)),
            ValueError,
            "global_scale must be finite and positive",
        ),
        (
            lambda w, s, a: fake_quantize(
                w[None],
                s,
                None,
                QuantizationArgs(strategy="block", block_structure=[4, 4]),
            ),
            ValueError,
            "needs a 2-D tensor",
        ),
    ],
    ids=[
        "shape",
        "zero",
        "nan",
        "group",
        "ct-args",
        "list",
        "int-scale",
        "no-args",
        "g_idx",
        "global",
        "block-3d",
    ],
)
def test_errors(call: Any, error: type[Exception], match: str) -> None:
    w = _weight(rows=8, cols=64)
    args = QuantizationArgs(num_bits=4, group_size=16)
    scale, _, _ = _qparams(w, "weight", args)
    with pytest.raises(error, match=match):
        call(w, scale, args)


INT_ARGS = [{"num_bits": b, "symmetric": s} for b in (2, 4, 8) for s in (True, False)]


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=2, max_size=64
    ),
    kwargs=st.sampled_from(INT_ARGS),
)
def test_int_error_within_half_step(data: list[float], kwargs: dict[str, Any]) -> None:
    x = torch.tensor(data).reshape(1, -1)
    args = QuantizationArgs(**kwargs)
    scale, zero_point, _ = _qparams(x, "weight", args)
    zp = None if args.symmetric else zero_point
    codes = quantize(x, scale, zp, args)
    qmin, qmax = calculate_range(args)
    assert ((codes >= qmin) & (codes <= qmax)).all()
    assert torch.equal(codes, codes.round())
    err = (fake_quantize(x, scale, zp, args) - x).abs()
    # every observed value lies in the range, so within half a step (float slack)
    assert (err <= scale * (0.5 + 1e-4) + 1e-30).all()


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=2, max_size=64
    ),
    name=st.sampled_from(["FP8", "NVFP4", "MXFP4", "MXFP8"]),
)
def test_float_rounds_to_nearest_grid_value(data: list[float], name: str) -> None:
    args = preset_scheme(name).weights
    assert args is not None
    group = args.group_size or 1
    x = torch.tensor(data).repeat(group)[: max(group, len(data)) // group * group]
    x = x.reshape(1, -1)
    scale, _, gs = _qparams(x, "weight", args)
    codes = quantize(x, scale, None, args, global_scale=gs)
    grid = args.format.values().float()
    assert torch.isin(codes, grid).all()
    # no grid value is closer to x / step than the chosen code (clamped range)
    step = scale / gs if gs is not None else scale
    step = step.repeat_interleave(group, dim=-1) if group > 1 else step
    target = (x / step).clamp(float(grid.min()), float(grid.max()))
    best = (grid[None, None, :] - target[..., None]).abs().amin(-1)
    assert ((codes - target).abs() <= best * (1 + 1e-6) + 1e-30).all()


# ------------------------------------------------------ saturation (issue 15)

F32_MAX = torch.finfo(torch.float32).max
_MX = {"type": "float", "group_size": 32, "scale_dtype": torch.uint8}


def _range_qparams(
    x: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    scale, zero_point, _ = _qparams(x, "weight", args)
    return scale, None if args.symmetric else zero_point


@pytest.mark.parametrize(
    ("kwargs", "values", "dtype"),
    [
        # compressed-tensors: -inf (the level of -max lands a rounding past it)
        (
            {"num_bits": 8, "symmetric": False, "group_size": 4},
            [-F32_MAX, 1.0, 2.0, 3.0],
            torch.float32,
        ),
        # compressed-tensors: -inf (-128 * amax / 127.5 passes float32's max)
        ({"num_bits": 8}, [-F32_MAX, 1.0, F32_MAX, 2.0], torch.float32),
        # compressed-tensors: an inf scale, NaN outputs; ours: 6 * 2**126 -> max
        ({"num_bits": 4, **_MX}, [F32_MAX * 0.9] + [1.0] * 31, torch.float32),
        # 256 * 256 = 65536 in float16: inf (compressed-tensors with fp16 scales)
        ({"num_bits": 8, **_MX}, [65504.0] + [1.0] * 31, torch.float16),
        # -128 * scale in float32, cast back to float16: -65760 -> inf
        ({"num_bits": 8}, [-65504.0, 1.0, 65504.0, 2.0], torch.float16),
        ({"num_bits": 8}, [-3.38e38, 1.0, 3.38e38, 2.0], torch.bfloat16),
    ],
    ids=["int8-asym-group", "int8-sym", "mxfp4", "mxfp8-fp16", "int8-fp16", "bf16"],
)
def test_fake_quantize_saturates_to_the_dtype(
    kwargs: dict[str, Any], values: list[float], dtype: torch.dtype
) -> None:
    args = QuantizationArgs(**kwargs)
    x = torch.tensor([values], dtype=dtype)
    scale, zero_point = _range_qparams(x.float(), args)
    assert torch.isfinite(scale).all()
    out = fake_quantize(x, scale, zero_point, args)
    top = torch.finfo(dtype).max
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert out.abs().max() <= top
    # the saturated value is the dtype's max, of the sign of x
    saturated = out.abs() == top
    assert torch.equal(out[saturated].sign(), x[saturated].sign())
    codes = quantize(x.float(), scale, zero_point, args)
    back = dequantize(codes, scale, zero_point, args)
    assert torch.isfinite(back).all()


def test_saturation_keeps_nan_and_ordinary_bits() -> None:
    args = QuantizationArgs(num_bits=8)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    scale, zero_point = _range_qparams(x, args)
    ct_args = CTArgs(num_bits=8)
    ours = fake_quantize(x, scale, zero_point, args)
    assert torch.equal(
        ours, ct_fake_quantize(x, scale, torch.zeros_like(scale), ct_args)
    )
    x[0, 0] = float("nan")
    assert torch.isnan(fake_quantize(x, scale, zero_point, args)[0, 0])


@settings(max_examples=100, deadline=None)
@given(
    exponent=st.integers(-149, 127),
    signs=st.lists(st.sampled_from([-1.0, 1.0]), min_size=32, max_size=32),
    fractions=st.lists(st.floats(0.5, 1.0), min_size=32, max_size=32),
    name=st.sampled_from(["W8A16", "W4A16_ASYM", "FP8", "NVFP4", "MXFP4", "MXFP8"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_fake_quantize_of_finite_values_is_finite(
    exponent: int,
    signs: list[float],
    fractions: list[float],
    name: str,
    dtype: torch.dtype,
) -> None:
    # values of one binade up to the dtype's max (the top binade included)
    info = torch.finfo(dtype)
    magnitude = torch.tensor(fractions, dtype=torch.float64) * 2.0**exponent
    x = (torch.tensor(signs, dtype=torch.float64) * magnitude).clamp(
        -info.max, info.max
    )
    x = x.to(dtype).reshape(1, 32).repeat(1, 4)  # (1, 128): W8A16's group
    args = preset_scheme(name).weights
    assert args is not None
    scale, zero_point, gs = _qparams(x.float(), "weight", args)
    zp = None if args.symmetric else zero_point
    out = fake_quantize(x, scale, zp, args, global_scale=gs)
    assert out.dtype == dtype and torch.isfinite(out).all()
