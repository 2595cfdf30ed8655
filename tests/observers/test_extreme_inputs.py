"""Observers on extreme finite inputs (issues 15 and 16).

Every registered observer gives finite positive scales, zero points inside
the quantized range and finite fake quantization on finite inputs near the
limits of float32 / float16 / bfloat16 (subnormals, values near the max,
groups of zeros and of subnormal or tiny normal maxima under MX,
mixed-sign extremes whose range overflows, ranges growing by many orders of
magnitude between batches); `nan_policy="omit"` keeps "nothing observed"
for batches without a finite value; 1-D activations are one token, as in
llm-compressor; in-range values of subnormal ranges dequantize within half
a step.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from hypothesis import example, given, settings
from hypothesis import strategies as st
from llmcompressor.observers import Observer as LObserver

from quantobs import (
    Observer,
    QuantizationArgs,
    calculate_range,
    fake_quantize,
    preset_scheme,
)
from tests.tiny_groups import tiny_groups

F32_MAX = torch.finfo(torch.float32).max
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["near_max", "mixed", "subnormal", "scaled", "tiny_groups"]

_NVFP4 = preset_scheme("NVFP4").weights
_MXFP4 = preset_scheme("MXFP4").weights
assert _NVFP4 is not None and _MXFP4 is not None
# (name, args kwargs): int sym / asym, FP8 with every strategy; NVFP4, MXFP4
_STRATEGIES = {
    "tensor": {"strategy": "tensor"},
    "channel": {"strategy": "channel"},
    "group": {"strategy": "group", "group_size": 16},
}
_FORMATS = {
    "int8-sym": {"num_bits": 8},
    "int8-asym": {"num_bits": 8, "symmetric": False},
    "int4-sym": {"num_bits": 4},
    "int4-asym": {"num_bits": 4, "symmetric": False},
    "fp8": {"num_bits": 8, "type": "float"},
}
ARGS: dict[str, QuantizationArgs] = {
    f"{fmt}-{strategy}": QuantizationArgs(**kwargs, **extra)
    for fmt, kwargs in _FORMATS.items()
    for strategy, extra in _STRATEGIES.items()
}
ARGS["nvfp4"] = _NVFP4
ARGS["mxfp4"] = _MXFP4
ARGS["mxfp8"] = _MXFP4.model_copy(update={"num_bits": 8})


def _batch(kind: str, dtype: torch.dtype, draw: int, seed: int) -> torch.Tensor:
    """A `(4, 32)` finite batch of `dtype` (a weight: rows of 32 columns)."""
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    lowest = int(math.log2(info.tiny * info.eps))  # smallest subnormal
    if kind == "near_max":  # within 2**-8 of the max, both signs
        spread = torch.rand(4, 32, generator=gen, dtype=torch.float64)
        x = base.sign() * info.max * (1 - spread * 2.0**-8)
    elif kind == "mixed":  # +-max in every row and group, the rest small
        x = base * 2.0 ** (draw % 64 - 32)
        x[:, 0::16], x[:, 1::16] = info.max, -info.max
    elif kind == "subnormal":  # below the smallest normal number
        x = base * info.tiny * 2.0 ** -(draw % (1 - int(math.log2(info.eps))))
    elif kind == "tiny_groups":  # rows of zero, subnormal, tiny normal maxima
        start = (draw % 4) * 64  # a group of tiny_groups' tiny ones
        x = tiny_groups(4, 256, dtype, draw)[:, start : start + 32].double()
    else:  # any binade of the dtype, subnormals to the top
        x = base * 2.0 ** (lowest + draw % (int(math.log2(info.max)) - lowest + 1))
    x = x.clamp(-info.max, info.max).to(dtype)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _check_qparams(
    observer: Observer, args: QuantizationArgs, batches: list[torch.Tensor]
) -> None:
    scale, zero_point = observer.get_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()
    qmin, qmax = calculate_range(args)
    assert ((zero_point.float() >= qmin) & (zero_point.float() <= qmax)).all()
    if args.symmetric:
        assert not zero_point.any()
    global_scale = None
    if args.strategy == "tensor_group":
        global_scale = observer.get_global_scale()
        assert torch.isfinite(global_scale).all() and (global_scale > 0).all()
    zp = None if args.symmetric else zero_point
    for x in batches:
        out = fake_quantize(x, scale, zp, args, global_scale=global_scale)
        assert out.dtype == x.dtype and torch.isfinite(out).all()


# float16 NVFP4 global scales of tiny values overflow to 1.0 as the peer's
# do, with a warning (tests/observers/test_low_precision_parity.py)
@pytest.mark.filterwarnings("ignore:NVFP4 global scale .* overflows float16")
@pytest.mark.parametrize("name", Observer.registry.names())
@settings(max_examples=8, deadline=None)
@given(
    args_name=st.sampled_from(sorted(ARGS)),
    dtype=st.sampled_from(DTYPES),
    batches=st.lists(
        st.tuples(st.sampled_from(KINDS), st.integers(0, 1 << 16)),
        min_size=1,
        max_size=3,
    ),
)
# MX on float16 blocks of zeros / subnormal maxima, every observer (issue 25)
@example(args_name="mxfp4", dtype=torch.float16, batches=[("tiny_groups", 2)])
@example(args_name="mxfp8", dtype=torch.float16, batches=[("tiny_groups", 0)])
def test_every_observer_is_finite_on_extreme_inputs(
    name: str,
    args_name: str,
    dtype: torch.dtype,
    batches: list[tuple[str, int]],
) -> None:
    args = ARGS[args_name]
    observer = Observer.load_from_registry(name, base_name="weight", args=args)
    xs = [_batch(kind, dtype, draw, i) for i, (kind, draw) in enumerate(batches)]
    for x in xs:
        observer.update(x)
    _check_qparams(observer, args, xs)


# ------------------------------------------------------ item by item (15)

HISTOGRAM_AND_STATIC = ["histogram", "percentile", "entropy", "histogram_mse"]


@pytest.mark.parametrize(
    "values",
    [
        [F32_MAX, 1.0, -1.0],
        [F32_MAX, -F32_MAX, 0.5],  # max - min overflows float32
        [-F32_MAX, 1.0],
        [3.0e38, -3.0e38, 1.0],
    ],
    ids=["max", "both", "min", "near-max"],
)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("name", [*HISTOGRAM_AND_STATIC, "static_mse"])
def test_histogram_observers_near_float32_max(
    name: str, symmetric: bool, values: list[float]
) -> None:
    # The histogram's last bin edge passes float32's max, so the range the
    # solver picked was +-inf (and NaN after `lo + step / 2`): get_qparams
    # raised "non-finite range value(s) ... drop non-finite inputs" on finite
    # input. torch.ao's HistogramObserver gives a NaN scale there. Ours:
    # finite (the selected range saturates at float32's max).
    args = QuantizationArgs(num_bits=8, symmetric=symmetric)
    observer = Observer.load_from_registry(name, base_name="input", args=args)
    x = torch.tensor([values])
    observer.update(x)
    _check_qparams(observer, args, [x])
    low, high = observer.get_range()
    assert torch.isfinite(low).all() and torch.isfinite(high).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", [*HISTOGRAM_AND_STATIC, "static_mse"])
def test_half_precision_extremes(name: str, dtype: torch.dtype) -> None:
    top = torch.finfo(dtype).max
    args = QuantizationArgs(num_bits=8, symmetric=False, strategy="channel")
    observer = Observer.load_from_registry(name, base_name="weight", args=args)
    x = torch.tensor([[top, -top, 1.0, 0.0], [top, top, top, -1.0]], dtype=dtype)
    observer.update(x)
    _check_qparams(observer, args, [x])


@pytest.mark.parametrize("name", ["nvfp4_expanded_mse", "fouroversix"])
def test_expanded_search_near_float32_max(name: str) -> None:
    # 1.8 times data near float32's max overflows: llm-compressor 0.14's
    # nvfp4_expanded_mse returns an inf scale; ours saturates the candidates
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    x[0, 0] = F32_MAX * 0.9
    args = QuantizationArgs(num_bits=8, strategy="channel")
    observer = Observer.load_from_registry(name, base_name="weight", args=args)
    observer.update(x)
    _check_qparams(observer, args, [x])
    # ordinary rows are untouched by the saturation
    fresh = Observer.load_from_registry(name, base_name="weight", args=args)
    fresh.update(x[1:])
    assert torch.equal(observer.get_qparams()[0][1:], fresh.get_qparams()[0])


@pytest.mark.parametrize("name", ["mse", "memoryless_mse", "static_mse"])
def test_expand_past_float32_max_saturates(name: str) -> None:
    args = QuantizationArgs(num_bits=8, symmetric=False)
    observer = Observer.load_from_registry(
        name, base_name="weight", args=args, expand=1.5
    )
    x = torch.tensor([[F32_MAX, -F32_MAX, 1.0, 2.0]])
    observer.update(x)
    _check_qparams(observer, args, [x])


@pytest.mark.parametrize("nan_policy", ["raise", "omit"])
@pytest.mark.parametrize("name", [*sorted(Observer.registered_names())])
def test_float64_values_past_float32_are_too_wide(name: str, nan_policy: str) -> None:
    # Finite float64 values past float32's max overflow the float32
    # statistics. Before: "got 0 non-finite value(s)" (raise), or an inf
    # range and then "use nan_policy='omit'" (omit). Now: a clear refusal.
    x = torch.tensor([[1e300, -1.0, 0.5, 2.0] * 8], dtype=torch.float64)
    try:
        observer = Observer.load_from_registry(
            name,
            base_name="weight",
            args=QuantizationArgs(num_bits=8, strategy="channel"),
            nan_policy=nan_policy,
        )
    except (TypeError, ValueError):
        pytest.skip(f"{name} does not observe int8 channel weights alone")
    with pytest.raises(ValueError, match="beyond the float32 range") as caught:
        observer.update(x)  # histograms raise here
        observer.get_qparams()  # the others, with no host read in update
    assert "too wide" in str(caught.value) and "1e+300" in str(caught.value)
    assert "non-finite" not in str(caught.value)


# --------------------------------------------------- nan_policy="omit" (15)

OMIT_NAMES = ["static_minmax", "memoryless_minmax", "minmax", "mse", "static_mse"]


@pytest.mark.parametrize("name", [*OMIT_NAMES, "histogram", "percentile"])
def test_omit_keeps_nothing_observed_for_all_nonfinite_batches(name: str) -> None:
    # Before: the batch's empty range became (0, 0) and get_qparams returned
    # the smallest scale (eps) for data never seen. Now the batch is skipped.
    args = QuantizationArgs(num_bits=8, strategy="channel")
    observer = Observer.load_from_registry(
        name, base_name="weight", args=args, nan_policy="omit"
    )
    bad = torch.full((4, 32), float("nan"))
    bad[1] = float("inf")
    observer.update(bad)
    assert not observer.has_statistics and observer.num_observations == 0
    with pytest.raises(RuntimeError, match=r"no statistics.*nan_policy='omit'"):
        observer.get_qparams()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    observer.update(x)
    observer.update(bad)  # skipped: the statistic and counts stay
    clean = Observer.load_from_registry(name, base_name="weight", args=args)
    clean.update(x)
    for ours, reference in zip(
        observer.get_qparams(), clean.get_qparams(), strict=True
    ):
        assert torch.equal(ours, reference)
    assert observer.num_observations == clean.num_observations


def test_omit_skips_flattened_batches_too() -> None:
    args = QuantizationArgs(num_bits=8)
    observer = Observer.load_from_registry(
        "static_minmax", base_name="input", args=args, nan_policy="omit"
    )
    with pytest.raises(RuntimeError, match="no statistics"):
        observer.get_min_max(torch.full((2, 1, 8), float("nan")))
    assert observer.num_observations == 0 and not observer.has_statistics


def test_omit_ignores_only_the_nonfinite_values() -> None:
    args = QuantizationArgs(num_bits=8, strategy="channel")
    observer = Observer.load_from_registry(
        "static_minmax", base_name="weight", args=args, nan_policy="omit"
    )
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    with_nan = x.clone()
    with_nan[0, :5] = float("nan")
    observer.update(with_nan)
    low, high = (end.flatten() for end in observer.get_range())  # (4, 1) -> (4,)
    assert float(low[0]) == float(x[0, 5:].min())
    assert float(high[0]) == float(x[0, 5:].max())
    assert torch.equal(low[1:], x[1:].amin(1)) and torch.equal(high[1:], x[1:].amax(1))


# ------------------------------------------------ 1-D activations (15)

SHARED = ["memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_bits": 8},
        {"num_bits": 4, "symmetric": False},
        {"num_bits": 8, "type": "float"},
    ],
    ids=["int8", "int4-asym", "fp8"],
)
@pytest.mark.parametrize("name", SHARED)
def test_one_dim_activation_matches_llm_compressor(
    name: str, kwargs: dict[str, Any]
) -> None:
    # llm-compressor 0.14 reshapes any activation to (-1, 1, hidden): a 1-D
    # (hidden,) activation is one token of one tensor-wide qparam
    ours = Observer.load_from_registry(
        name, base_name="input", args=QuantizationArgs(**kwargs)
    )
    theirs = LObserver.load_from_registry(
        name, base_name="input", args=CTArgs(**kwargs)
    )
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        x = torch.randn(64, generator=gen) * (i + 1)
        ours.update(x)
        theirs(x)
    expected = theirs.get_qparams()
    scale, zero_point = ours.get_qparams()
    assert scale.shape == (1,)
    assert torch.equal(scale, expected["scale"])
    assert torch.equal(zero_point, expected["zero_point"])
    assert ours.num_observations == 3


# ------------------------------------------------ subnormal ranges (16)

INT_ARGS = [
    {"num_bits": bits, "symmetric": symmetric, **strategy}
    for bits in (2, 4, 8)
    for symmetric in (True, False)
    for strategy in ({"strategy": "tensor"}, {"strategy": "channel"})
]


@settings(max_examples=60, deadline=None)
@given(
    kwargs=st.sampled_from(INT_ARGS),
    exponent=st.integers(-149, -110),
    seed=st.integers(0, 1 << 16),
    name=st.sampled_from(["static_minmax", "memoryless_minmax"]),
)
def test_subnormal_ranges_dequantize_within_half_a_step(
    kwargs: dict[str, Any], exponent: int, seed: int, name: str
) -> None:
    # compressed-tensors rounds a subnormal scale to the nearest subnormal:
    # static_minmax int4 asym on [-9.67e-44, 3.92e-44] misses by 1.67 steps
    args = QuantizationArgs(**kwargs)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 16, generator=gen, dtype=torch.float64) * 2.0**exponent).float()
    observer = Observer.load_from_registry(name, base_name="weight", args=args)
    observer.update(x)
    scale, zero_point = observer.get_qparams()
    assert (scale >= torch.finfo(torch.float32).tiny).all()
    zp = None if args.symmetric else zero_point
    error = (fake_quantize(x, scale, zp, args) - x).abs()
    assert (error <= scale * (0.5 + 2.0**-10)).all()


def test_issue_16_example() -> None:
    x = torch.tensor([[-9.6689594038e-44, 3.9236357001e-44]])
    args = QuantizationArgs(num_bits=4, symmetric=False)
    observer = Observer.load_from_registry(
        "static_minmax", base_name="weight", args=args
    )
    observer.update(x)
    scale, zero_point = observer.get_qparams()
    error = (fake_quantize(x, scale, zero_point, args) - x).abs()
    assert (error <= scale / 2).all()


@pytest.mark.parametrize(
    "options",
    [{}, {"round_scales": True}, {"scale_search": "discrete"}],
    ids=["grid", "round_scales", "discrete"],
)
def test_nvfp4_expanded_search_past_float32_saturates(options: dict[str, Any]) -> None:
    # expand=100 on |x| ~ 1e37 passes float32's max. Before: the NVFP4 global
    # scale of the searched range raised "amax is not finite ... drop
    # non-finite inputs" on finite input (round_scales, discrete).
    observer = Observer.load_from_registry(
        "memoryless_mse", base_name="weight", args=_NVFP4, expand=100, **options
    )
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 1e37
    scale, _ = observer(x)
    global_scale = observer.get_global_scale(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.isfinite(global_scale).all() and (global_scale > 0).all()
