"""Legacy llm-compressor face on extreme finite inputs (issue 16's law).

Every observer the face registers (`minmax` with each kind of averaging,
`mse`), under every strategy it supports (tensor, channel, group with and
without `g_idx`, tensor_group / NVFP4, MX groups, token on 2-D and 3-D
inputs) and int and float formats, gives finite positive scales and zero
points in the format's range on finite inputs near the limits of float32 /
float16 / bfloat16 / float64: subnormals, values near the max, mixed-sign
extremes whose range overflows the dtype, float64 values past float32's
max, all-zero and constant tensors, and ranges that grow by many orders of
magnitude between batches. `fake_quantize` with the returned qparams is
finite on the same input, and every running range stays within the data
(and 0). The law also admits a `ValueError` saying the range is too wide
for the format (the torch.ao and Quark faces' refusal); compressed-tensors'
rule, which this face uses, never needs it, so here every finite input
gives qparams.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import (
    QuantizationArgs,
    calculate_range,
    fake_quantize,
    generate_gparam,
    preset_scheme,
)
from quantobs.faces.llmcompressor_legacy import (
    MinMaxObserver,
    MovingAverageMSEObserver,
    Observer,
)

from .test_legacy import CASES as LEGACY_CASES
from .test_legacy import MSE_CASES, LegacyReference
from .test_legacy import _batches as legacy_batches
from .test_legacy import _g_idx as legacy_g_idx

F32_MAX = torch.finfo(torch.float32).max
#: float64 inputs keep float64 ranges: their values may lie past float32's max.
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ROWS, COLS = 4, 32

# id -> (observer class, options): every registered class, every kind of
# memory (moving average, latest batch only, static min / max).
OBSERVERS: dict[str, tuple[type[Observer], dict[str, Any]]] = {
    "minmax-c0.01": (MinMaxObserver, {}),
    "minmax-c1": (MinMaxObserver, {"averaging_constant": 1.0}),
    "minmax-static": (MinMaxObserver, {"averaging_constant": None}),
    "mse-c0.01": (MovingAverageMSEObserver, {}),
    "mse-c1-nopatience": (
        MovingAverageMSEObserver,
        {"averaging_constant": 1.0, "patience": None, "grid": 20},
    ),
}
MEMORY = ["minmax-c0.01", "minmax-static", "mse-c0.01"]

_FP8 = {"num_bits": 8, "type": "float"}
_NVFP4 = preset_scheme("NVFP4").weights
_MXFP4 = preset_scheme("MXFP4").weights
assert _NVFP4 is not None and _MXFP4 is not None
# id -> (args, input is 3-D (batch, tokens, hidden), use a shuffled g_idx)
CASES: dict[str, tuple[QuantizationArgs, bool, bool]] = {
    "tensor-int8-sym": (QuantizationArgs(num_bits=8), False, False),
    "tensor-int8-asym": (QuantizationArgs(num_bits=8, symmetric=False), False, False),
    "tensor-fp8": (QuantizationArgs(**_FP8), False, False),
    "channel-int8-asym": (
        QuantizationArgs(num_bits=8, strategy="channel", symmetric=False),
        False,
        False,
    ),
    "channel-int4-sym": (
        QuantizationArgs(num_bits=4, strategy="channel"),
        False,
        False,
    ),
    "group-int4-sym": (QuantizationArgs(num_bits=4, group_size=8), False, False),
    "group-int4-asym": (
        QuantizationArgs(num_bits=4, group_size=8, symmetric=False),
        False,
        False,
    ),
    "group-int4-asym-gidx": (
        QuantizationArgs(num_bits=4, group_size=8, symmetric=False, actorder="group"),
        False,
        True,
    ),
    "group-mxfp4": (_MXFP4, False, False),
    "tensor_group-nvfp4": (_NVFP4, False, False),
    "token-int8-sym-3d": (
        QuantizationArgs(num_bits=8, strategy="token", dynamic=True),
        True,
        False,
    ),
    "token-int8-asym-2d": (
        QuantizationArgs(num_bits=8, strategy="token", dynamic=True, symmetric=False),
        False,
        False,
    ),
    "token-fp8-3d": (
        QuantizationArgs(**_FP8, strategy="token", dynamic=True),
        True,
        False,
    ),
}

KINDS = ["subnormal", "near_max", "wide", "past_f32", "zeros", "constant", "scaled"]
_CONSTANTS = [0.0, 1e-44, -1e-44, 1.0, -3.0, 3e38, -3.4e38, F32_MAX, 65504.0]
# Values of the raw fuzz kind (saturated to the batch's dtype).
_SPECIAL = [0.0, -0.0, 1e-44, -1e-44, 1e-45, 1.2e-38, 1.0, -1.0, 65504.0]
_SPECIAL += [3e38, -3e38, F32_MAX, -F32_MAX, 3.4e38, -3.4e38, 1e300, -1e300]
_VALUE = st.one_of(
    st.sampled_from(_SPECIAL),
    st.floats(-F32_MAX, F32_MAX, allow_nan=False, width=32),
    st.floats(-(2.0**-100), 2.0**-100, allow_nan=False, width=32),
    st.floats(allow_nan=False, allow_infinity=False),  # float64 batches
)


_SHUFFLE = torch.randperm(ROWS * COLS, generator=torch.Generator().manual_seed(0))


def _saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 `x` rounded to `dtype`, finite (clamped to its max first)."""
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def make_batch(
    kind: str, dtype: torch.dtype, seed: int, exponent: int = 0
) -> torch.Tensor:
    """A finite `(4, 32)` batch of `dtype` of one kind of extreme.

    Args:
        kind: one of `KINDS`.
        dtype: float32, float16, bfloat16 or float64.
        seed: the generator's seed (and the choice of constant).
        exponent: the power of ten of the `scaled` kind.

    Returns:
        The batch: finite, `dtype`.
    """
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64)
    if kind == "subnormal":  # 1e-44 in float32; the dtype's subnormals else
        tiny = 1e-44 if dtype == torch.float32 else info.tiny * info.eps * 8
        x = base * tiny
    elif kind == "past_f32":  # float64 values beyond float32 (others: max)
        x = base * 2.0 ** (seed % 64 - 32)
        x[:, 0::8], x[:, 1::8] = 1e300, -1e39
    elif kind == "near_max":  # within 2**-8 of the max, both signs
        spread = torch.rand(ROWS, COLS, generator=gen, dtype=torch.float64)
        x = base.sign() * info.max * (1 - spread * 2.0**-8)
    elif kind == "wide":  # -3e38 and 3e38 in every row, group and token
        x = base * 2.0 ** (seed % 64 - 32)
        x[:, 0::8], x[:, 1::8] = 3e38, -3e38
    elif kind == "zeros":
        x = torch.zeros(ROWS, COLS, dtype=torch.float64)
    elif kind == "constant":
        x = torch.full((ROWS, COLS), _CONSTANTS[seed % len(_CONSTANTS)])
        x = x.double()
    else:  # "scaled": ordinary values times 10**exponent
        x = base * 10.0**exponent
    return _saturate(x, dtype)


def _global_scale(
    args: QuantizationArgs, seen: list[torch.Tensor]
) -> torch.Tensor | None:
    """NVFP4's global scale from the range of every batch seen so far (it
    bounds the running range of every observer: moving averages and MSE
    shrinks stay inside it); None for other args."""
    if args.strategy != "tensor_group":
        return None
    values = torch.cat([x.double().reshape(-1) for x in seen])
    low, high = (v.clamp(-F32_MAX, F32_MAX).float() for v in values.aminmax())
    return generate_gparam(low, high)


def _g_idx(use: bool, group_size: int | None) -> torch.Tensor | None:
    if not use:
        return None
    gen = torch.Generator().manual_seed(7)
    groups = torch.arange(COLS) // int(group_size or 1)
    return groups[torch.randperm(COLS, generator=gen)].to(torch.int32)


def assert_sound(
    args: QuantizationArgs,
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    g_idx: torch.Tensor | None,
    global_scale: torch.Tensor | None,
) -> None:
    """Finite positive scales, zero points in the format's range (0 for
    symmetric and float formats), finite `fake_quantize` of `x`."""
    assert scale.dtype == x.dtype, scale.dtype
    assert bool(torch.isfinite(scale).all()), scale
    assert bool((scale > 0).all()), scale
    zp = zero_point.float()  # FP8 / uint8 zero points as numbers
    assert bool(torch.isfinite(zp).all()), zero_point
    qmin, qmax = calculate_range(args)
    assert bool(((zp >= qmin) & (zp <= qmax)).all()), zero_point
    if args.symmetric:
        assert not bool(zp.any()), zero_point
    out = fake_quantize(
        x,
        scale,
        None if args.symmetric else zero_point,
        args,
        g_idx=g_idx,
        global_scale=global_scale,
    )
    assert out.dtype == x.dtype and out.shape == x.shape
    assert bool(torch.isfinite(out).all()), out


def assert_within_data(observer: Any, seen: list[torch.Tensor]) -> None:
    """Every running range lies within the values seen and 0 (up to the
    rounding of a moving-average step): min-max, moving averages of batch
    ranges and MSE shrinks toward 0 never reach beyond them, e.g. to the
    dtype's max."""
    values = torch.cat([x.double().reshape(-1) for x in seen])
    low, high = (float(v) for v in values.aminmax())
    low, high = min(low, 0.0), max(high, 0.0)
    info = torch.finfo(seen[-1].dtype)
    tol = 2.0**-6 * max(abs(low), abs(high)) + 2 * info.tiny * info.eps
    for tensor_id in observer.min_val:
        mins = observer.min_val[tensor_id].double()
        maxs = observer.max_val[tensor_id].double()
        assert bool((mins >= low - tol).all()), (tensor_id, mins, low)
        assert bool((maxs <= high + tol).all()), (tensor_id, maxs, high)


def observe_all(observer_id: str, case: str, batches: list[torch.Tensor]) -> None:
    """Feed `batches` to a fresh observer through `forward`, checking the law
    after every batch: sound qparams, or a "too wide" `ValueError`; and the
    running ranges within the data."""
    cls, options = OBSERVERS[observer_id]
    args, three_d, use_g_idx = CASES[case]
    observer = cls(args, **options)
    g_idx = _g_idx(use_g_idx, args.group_size)
    seen: list[torch.Tensor] = []
    for batch in batches:
        x = batch.reshape(2, ROWS // 2, COLS) if three_d else batch
        seen.append(x)
        global_scale = _global_scale(args, seen)
        try:
            scale, zero_point = observer(x, g_idx=g_idx, global_scale=global_scale)
        except ValueError as error:  # the one documented refusal
            assert "too wide" in str(error), error
            return
        assert scale is not None and zero_point is not None
        assert_sound(args, x, scale, zero_point, g_idx, global_scale)
        assert_within_data(observer, seen)
        cached = observer.get_qparams()
        assert cached[0] is scale and cached[1] is zero_point


# ------------------------------------------------- every combination, once


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("observer_id", list(OBSERVERS))
def test_every_kind_of_extreme_batch(observer_id: str, case: str) -> None:
    """Each kind of extreme batch alone (the first range), then all of them
    in turn after an ordinary batch (ranges to average with), in each dtype."""
    for dtype in DTYPES:
        extremes = [
            make_batch(kind, dtype, seed=i, exponent=30) for i, kind in enumerate(KINDS)
        ]  # the constant 3e38 (seed 5)
        extremes += [make_batch("constant", dtype, seed) for seed in (1, 4)]
        for extreme in extremes:
            observe_all(observer_id, case, [extreme])
        observe_all(observer_id, case, [make_batch("scaled", dtype, 99), *extremes])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("observer_id", MEMORY)
def test_ranges_growing_by_orders_of_magnitude(observer_id: str, case: str) -> None:
    """1e-9-scale batches then 1e8-scale ones (and back, and on to the
    float32 limits): the running range follows them, the qparams stay sound."""
    for dtype in DTYPES:
        exponents = [-9, 8, 8, -9, 30, -40]
        if dtype == torch.float16:  # its normals span 6e-5 .. 65504
            exponents = [-6, 4, 4, -6]
        batches = [
            make_batch("scaled", dtype, seed, exponent)
            for seed, exponent in enumerate(exponents)
        ]
        batches += [make_batch(kind, dtype, seed=5) for kind in ("wide", "subnormal")]
        observe_all(observer_id, case, batches)


# ------------------------------------------------- property: any sequence


@st.composite
def extreme_batches(draw: st.DrawFn) -> list[torch.Tensor]:
    """1 to 4 batches of one dtype, each an extreme kind, a scaled ordinary
    batch (its own power of ten: ranges grow or shrink by many orders of
    magnitude) or raw fuzzed values saturated to the dtype."""
    dtype = draw(st.sampled_from([torch.float32, *DTYPES]))  # float32 twice
    out = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from([*KINDS, "fuzz"]))
        if kind == "fuzz":
            values = draw(st.lists(_VALUE, min_size=16, max_size=16))
            x = torch.tensor(values, dtype=torch.float64).repeat(ROWS * COLS // 16)
            x = x[_SHUFFLE]  # the 16 values spread over rows and groups
            out.append(_saturate(x.reshape(ROWS, COLS), dtype))
            continue
        seed = draw(st.integers(0, 1 << 16))
        exponent = draw(st.integers(-45, 38))
        out.append(make_batch(kind, dtype, seed, exponent))
    return out


@settings(max_examples=40, deadline=None)
@given(
    observer_id=st.sampled_from(list(OBSERVERS)),
    case=st.sampled_from(list(CASES)),
    batches=extreme_batches(),
)
def test_any_finite_batches_give_sound_qparams(
    observer_id: str, case: str, batches: list[torch.Tensor]
) -> None:
    observe_all(observer_id, case, batches)


# ------------------------------------------------- direct legacy calls


@pytest.mark.parametrize("observer_id", list(OBSERVERS))
def test_direct_calls_on_extremes(observer_id: str) -> None:
    """`calculate_qparams` / `get_qparams_along_dim` with tensor ids, as
    llm-compressor's GPTQ called them, on the same extremes."""
    cls, options = OBSERVERS[observer_id]
    args = QuantizationArgs(num_bits=4, strategy="channel", symmetric=False)
    observer = cls(args, **options)
    for dtype in DTYPES:
        observer.reset()
        for i, kind in enumerate(KINDS):
            x = make_batch(kind, dtype, seed=i, exponent=-30 + 20 * i)
            scale, zero_point = observer.calculate_qparams(
                x, reduce_dims=(1,), tensor_id="w"
            )
            assert_sound(args, x, scale, zero_point, None, None)
            scale, zero_point = observer.get_qparams_along_dim(x, 0, tensor_id=i)
            assert_sound(args, x, scale, zero_point, None, None)


def test_float32_growth_moves_the_moving_average() -> None:
    """1e-9 then 1e8: the c = 0.01 step lands at ~1e6, finite and sound."""
    args = QuantizationArgs(num_bits=8)
    observer = MinMaxObserver(args)
    small = torch.full((ROWS, COLS), 1e-9)
    large = torch.full((ROWS, COLS), 1e8)
    observer(small)
    scale, _ = observer(large)
    expected = 1e-9 + 0.01 * (1e8 - 1e-9)
    assert float(observer.max_val["default"]) == pytest.approx(expected, rel=1e-6)
    assert float(scale) == pytest.approx(expected / 127.5, rel=1e-6)
    assert math.isfinite(float(scale))


# ------------------------------------------------- regressions (fixed here)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_mse_float64_values_past_float32_keep_their_range(
    symmetric: bool, backend: str
) -> None:
    # The legacy search returned float32 ranges: +-1e300 became +-inf, which
    # the engine saturated to float64's max, so the scale was ~1e4 times too
    # wide (1.41e306 for int8) and every value, 1e300 included, quantized to
    # 0. Now float64 ranges are searched and returned in float64.
    args = QuantizationArgs(num_bits=8, symmetric=symmetric)
    x = torch.linspace(-1.0, 1.0, ROWS * COLS, dtype=torch.float64)
    x = x.reshape(ROWS, COLS)
    x[0, 0], x[1, 1] = 1e300, -1e300
    observer = MovingAverageMSEObserver(args)
    scale, zero_point = observer(x)
    # every candidate's error is inf (1e300 in float32): the first wins, p = 1
    assert float(observer.min_val["default"]) == -1e300
    assert float(observer.max_val["default"]) == 1e300
    expected = MinMaxObserver(args)(x)
    assert torch.equal(scale, expected[0]) and torch.equal(zero_point, expected[1])
    assert_within_data(observer, [x])
    out = fake_quantize(x, scale, None if symmetric else zero_point, args)
    assert float(out[0, 0]) == pytest.approx(1e300, rel=0.01)


@pytest.mark.parametrize("case", MSE_CASES)
def test_mse_float64_matches_legacy_loop(case: str) -> None:
    # The legacy loop shrinks float64 ranges in float64 (`p * min` with the
    # Python float p); ours rounded them to float32 (ranges off by up to
    # 2**-24 relative, and different qparams).
    kwargs, shape, use_g_idx = LEGACY_CASES[case]
    args = QuantizationArgs(**kwargs)
    observer = MovingAverageMSEObserver(args)
    reference = LegacyReference(args, "mse")
    g_idx = legacy_g_idx(shape[-1], args.group_size or 1, 7) if use_g_idx else None
    global_scale = None
    if args.strategy == "tensor_group":
        global_scale = torch.tensor([448.0 * 6.0 / 4.0], dtype=torch.float64)
    for x in legacy_batches(shape, seed=len(case), count=2):
        x = x.double()
        ours = observer(x, g_idx=g_idx, global_scale=global_scale)
        theirs = reference.get_qparams(x, g_idx=g_idx, global_scale=global_scale)
        for mine, ref in zip(ours, theirs, strict=True):
            assert mine.dtype == ref.dtype and torch.equal(mine, ref)
