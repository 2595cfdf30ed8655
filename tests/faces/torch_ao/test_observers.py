"""torch.ao face: qparams parity with torch.ao's own observers, errors, NaN.

Every number here comes from running torch 2.13's `torch.ao.quantization.
observer` on the same batches; the face must match it bit for bit (dtype,
shape and value of scale and zero point, and the observer buffers).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import observer as tob

import quantobs.faces.torch_ao as ours
from quantobs.core.layout import channel_view
from quantobs.core.qparams import torch_rule as ours_qparams
from quantobs.faces.torch_ao.base import FLOAT32_EPS
from quantobs.stats import reduce as reduce_module
from quantobs.stats.reduce import minmax

sym, aff = torch.per_tensor_symmetric, torch.per_tensor_affine
ch_sym, ch_aff = torch.per_channel_symmetric, torch.per_channel_affine
ch_float = torch.per_channel_affine_float_qparams

# torch warns on reduce_range (a deprecation note); the face does not.
_TORCH_REDUCE_RANGE = "ignore:Please use quant_min and quant_max:UserWarning"

# ------------------------------------------------------------------ helpers


def batches(name: str) -> list[torch.Tensor]:
    """Seeded batches by scenario name; all batches of a scenario share a shape."""
    g = torch.Generator().manual_seed(1234)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {
        "normal": lambda: [randn(16, 24), randn(16, 24)],
        "all_zero": lambda: [torch.zeros(16, 24)],
        "constant": lambda: [torch.full((16, 24), 3.5), torch.full((16, 24), 3.5)],
        "negative_only": lambda: [-(randn(16, 24).abs() + 0.25)],
        "positive_only": lambda: [randn(16, 24).abs() + 0.25],
        "huge": lambda: [randn(16, 24) * 1e30],
        "tiny": lambda: [randn(16, 24) * 1e-30],
        "bf16": lambda: [randn(16, 24).bfloat16() * 3, randn(16, 24).bfloat16()],
        "float64": lambda: [randn(16, 24, dtype=torch.float64) / 3],
        "growing": lambda: [
            randn(16, 24),
            randn(16, 24) * 2 + 1,
            randn(16, 24) * 5 - 3,
        ],
        "shrinking": lambda: [randn(16, 24) * 4, randn(16, 24) * 0.5],
        "transposed": lambda: [randn(24, 16).t(), randn(24, 16).t() + 1],
        "4d": lambda: [randn(4, 16, 5, 6), randn(4, 16, 5, 6) * 3],
    }[name]()


SCENARIOS = [
    "normal",
    "all_zero",
    "constant",
    "negative_only",
    "positive_only",
    "huge",
    "tiny",
    "bf16",
    "float64",
    "growing",
    "shrinking",
    "transposed",
    "4d",
]


def observe(obs: torch.nn.Module, xs: Sequence[torch.Tensor]) -> torch.nn.Module:
    for x in xs:
        out = obs(x)
        assert out is x
    return obs


def assert_identical(ours_t: torch.Tensor, theirs: torch.Tensor) -> None:
    """Same dtype, shape, device and values (NaN where NaN)."""
    torch.testing.assert_close(ours_t, theirs, rtol=0, atol=0, equal_nan=True)


def assert_same_qparams(a: torch.nn.Module, b: torch.nn.Module) -> None:
    with warnings.catch_warnings():  # both warn alike before any data
        warnings.simplefilter("ignore", UserWarning)
        qa, qb = a.calculate_qparams(), b.calculate_qparams()
    assert_identical(qa[0], qb[0])
    assert_identical(qa[1], qb[1])


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert_identical(sa[key], sb[key])


def pair(name: str, **kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use quant_min", UserWarning)
        return getattr(ours, name)(**kwargs), getattr(tob, name)(**kwargs)


# ------------------------------------------------------------------ min-max

PER_TENSOR_CONFIGS: dict[str, dict[str, Any]] = {
    "quint8_affine": {},
    "quint8_symmetric": {"qscheme": sym},
    "quint8_symmetric_custom": {"qscheme": sym, "quant_min": 0, "quant_max": 100},
    "quint8_reduce_range": {"reduce_range": True},
    "qint8_symmetric": {"dtype": torch.qint8, "qscheme": sym},
    "qint8_affine_reduce": {"dtype": torch.qint8, "reduce_range": True},
    "qint8_custom_reduce": {
        "dtype": torch.qint8,
        "quant_min": -100,
        "quant_max": 100,
        "reduce_range": True,
    },
    "qint8_neg127": {
        "dtype": torch.qint8,
        "qscheme": sym,
        "quant_min": -127,
        "quant_max": 127,
        "eps": 2**-12,
    },
    "qint32_affine": {"dtype": torch.qint32},
    "qint32_symmetric": {"dtype": torch.qint32, "qscheme": sym},
    "int16_symmetric": {"dtype": torch.int16, "qscheme": sym},
    "uint16_symmetric": {"dtype": torch.uint16, "qscheme": sym},
    "uint8_symmetric": {"dtype": torch.uint8, "qscheme": sym},
    "quint4x2_fallback_0_15": {"dtype": torch.quint4x2},
    "float8_fallback_0_15": {"dtype": torch.float8_e4m3fn, "qscheme": sym},
    "eps_large": {"eps": 0.5},
}


@pytest.mark.filterwarnings(_TORCH_REDUCE_RANGE)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("config", PER_TENSOR_CONFIGS)
def test_minmax_matches_torch(config: str, scenario: str) -> None:
    a, b = pair("MinMaxObserver", **PER_TENSOR_CONFIGS[config])
    xs = batches(scenario)
    observe(a, xs)
    observe(b, xs)
    assert_same_state(a, b)
    assert_same_qparams(a, b)
    assert (a.quant_min, a.quant_max) == (b.quant_min, b.quant_max)


MOVING_AVERAGE_CONFIGS = {
    "default": {},
    "half": {"averaging_constant": 0.5},
    "qint8_symmetric": {
        "dtype": torch.qint8,
        "qscheme": sym,
        "averaging_constant": 0.1,
    },
    "dynamic_memoryless": {"averaging_constant": 1, "is_dynamic": True},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("config", MOVING_AVERAGE_CONFIGS)
def test_moving_average_matches_torch(config: str, scenario: str) -> None:
    a, b = pair("MovingAverageMinMaxObserver", **MOVING_AVERAGE_CONFIGS[config])
    xs = batches(scenario)
    observe(a, xs)
    observe(b, xs)
    assert_same_state(a, b)
    assert_same_qparams(a, b)


PER_CHANNEL_CONFIGS: dict[str, dict[str, Any]] = {
    "quint8_affine": {},
    "qint8_symmetric": {"dtype": torch.qint8, "qscheme": ch_sym},
    "quint8_symmetric": {"qscheme": ch_sym},
    "qint8_neg127": {
        "dtype": torch.qint8,
        "qscheme": ch_sym,
        "quant_min": -127,
        "quant_max": 127,
        "eps": 2**-12,
    },
    "qint8_reduce_range": {"dtype": torch.qint8, "reduce_range": True},
    "float_qparams": {"qscheme": ch_float},
    "float_qparams_4bit": {"dtype": torch.quint4x2, "qscheme": ch_float},
}


@pytest.mark.filterwarnings(_TORCH_REDUCE_RANGE)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("ch_axis", [0, 1, -1], ids=["axis0", "axis1", "axis-1"])
@pytest.mark.parametrize("config", PER_CHANNEL_CONFIGS)
@pytest.mark.parametrize(
    "name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"]
)
def test_per_channel_matches_torch(
    name: str, config: str, ch_axis: int, scenario: str
) -> None:
    a, b = pair(name, ch_axis=ch_axis, **PER_CHANNEL_CONFIGS[config])
    xs = batches(scenario)
    observe(a, xs)
    observe(b, xs)
    assert_same_state(a, b)
    assert_same_qparams(a, b)


@pytest.mark.parametrize(
    "shape, ch_axis",
    [
        ((300, 7), 0),
        ((300, 7), 1),
        ((5, 300, 3), 1),
        ((5, 3, 40), 1),
        ((64, 2, 8), 0),
        ((2, 3, 4, 64), 2),
        ((9,), 0),
        ((40, 6, 3), -1),
    ],
    ids=str,
)
@pytest.mark.parametrize("block_bytes", [64, 1 << 22], ids=["blocked", "whole"])
def test_channel_minmax_every_layout(
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, ...],
    ch_axis: int,
    block_bytes: int,
    backend: str,
) -> None:
    """Inner, outer (in cache-sized row blocks or whole) and mixed reductions
    of the channel view, natively and in torch."""
    monkeypatch.setattr(reduce_module, "_BLOCK_BYTES", block_bytes)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    others = [d for d in range(x.dim()) if d != ch_axis % x.dim()]
    expect_min = x.amin(others) if others else x
    expect_max = x.amax(others) if others else x
    got_min, got_max = minmax(channel_view(x, ch_axis))
    assert_identical(got_min, expect_min)
    assert_identical(got_max, expect_max)


@pytest.mark.parametrize(
    "view",
    ["transposed", "permuted_3d", "channels_last", "sliced"],
)
@pytest.mark.parametrize("ch_axis", [0, 1, -1], ids=["axis0", "axis1", "axis-1"])
def test_channel_minmax_non_contiguous(view: str, ch_axis: int) -> None:
    """Permuted tensors are reduced in memory order; others directly."""
    g = torch.Generator().manual_seed(9)
    x = {
        "transposed": lambda: torch.randn(40, 30, generator=g).t(),
        "permuted_3d": lambda: torch.randn(4, 5, 60, generator=g).permute(2, 0, 1),
        "channels_last": lambda: torch.randn(2, 8, 5, 5, generator=g).to(
            memory_format=torch.channels_last
        ),
        "sliced": lambda: torch.randn(30, 50, generator=g)[::2, 1::3],
    }[view]()
    others = [d for d in range(x.dim()) if d != ch_axis % x.dim()]
    got_min, got_max = minmax(channel_view(x, ch_axis))
    assert_identical(got_min, x.amin(others))
    assert_identical(got_max, x.amax(others))


# ------------------------------------------------------------------ range rules

CUSTOM_RANGES = [
    (None, None),
    (0, None),
    (0, 127),
    (-128, 127),
    (-127, 127),
    (-3, 7),
    (0, 255),
    (-100, 300),
    (-(2**31), 2**31 - 1),
    (1, 10),
    (5, 5),
]


@pytest.mark.filterwarnings(_TORCH_REDUCE_RANGE)
@pytest.mark.parametrize("reduce_range", [False, True], ids=["full", "reduced"])
@pytest.mark.parametrize("quant_range", CUSTOM_RANGES, ids=str)
@pytest.mark.parametrize("dtype", ours_qparams.ALLOWED_DTYPES, ids=str)
def test_quant_range_rules_match_torch(
    dtype: torch.dtype, quant_range: tuple[int | None, int | None], reduce_range: bool
) -> None:
    """Every dtype x custom range x reduce_range: same (qmin, qmax) or same error."""
    kwargs = {"quant_min": quant_range[0], "quant_max": quant_range[1]}
    kwargs.update(dtype=dtype, reduce_range=reduce_range)
    try:
        theirs = tob.MinMaxObserver(**kwargs)
    except AssertionError:
        with pytest.raises(AssertionError):
            ours.MinMaxObserver(**kwargs)
        return
    mine = ours.MinMaxObserver(**kwargs)
    assert (mine.quant_min, mine.quant_max) == (theirs.quant_min, theirs.quant_max)
    assert mine.has_customized_qrange == theirs.has_customized_qrange


QSCHEME_DTYPES = [
    (q, d)
    for q in (ch_aff, ch_sym, ch_float)
    for d in (torch.quint8, torch.qint8, torch.qint32, torch.uint16, torch.quint4x2)
]


@settings(max_examples=60)
@given(
    config=st.sampled_from(QSCHEME_DTYPES),
    quant_range=st.sampled_from([(None, None), (0, 127), (-127, 127), (-7, 8)]),
    reduce_range=st.booleans(),
    eps=st.sampled_from([FLOAT32_EPS, 2**-12, 0.25]),
    values=st.lists(
        st.tuples(
            st.floats(-1e6, 1e6, width=32) | st.sampled_from([0.0, -1e-30, 1e30]),
            st.floats(-1e6, 1e6, width=32) | st.sampled_from([0.0, 1e-30, -1e30]),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_qparams_of_any_range_match_torch(
    config: tuple[torch.qscheme, torch.dtype],
    quant_range: tuple[int | None, int | None],
    reduce_range: bool,
    eps: float,
    values: list[tuple[float, float]],
) -> None:
    """`_calculate_qparams` on arbitrary per-channel ranges (min <= max)."""
    qscheme, dtype = config
    kwargs: dict[str, Any] = {"qscheme": qscheme, "dtype": dtype, "eps": eps}
    kwargs.update(quant_min=quant_range[0], quant_max=quant_range[1])
    if qscheme == ch_sym and dtype == torch.quint8:
        reduce_range = False  # unsupported by both
    kwargs["reduce_range"] = reduce_range
    try:
        a, b = pair("PerChannelMinMaxObserver", **kwargs)
    except AssertionError:  # a custom range the dtype cannot hold: both reject
        return
    lo = torch.tensor([min(pair_) for pair_ in values])
    hi = torch.tensor([max(pair_) for pair_ in values])
    # per channel, and per tensor through the 0-dim path
    for low, high in ((lo, hi), (lo.min(), hi.max())):
        qa, qb = a._calculate_qparams(low, high), b._calculate_qparams(low, high)
        assert_identical(qa[0], qb[0])
        assert_identical(qa[1], unwrapped_zero_point(a, low, *qb))


def unwrapped_zero_point(
    obs: Any, min_val: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
) -> torch.Tensor:
    """torch.ao's zero point, except where torch's affine `round(min / scale)`
    is below -2**31 and wraps in int32 (qint32: the zero point becomes 0 and
    the negative side is clipped): there the face's, computed in float64
    and clamped (`test_extreme_inputs.py`)."""
    if obs.qscheme not in (aff, ch_aff):
        return zero_point
    min_neg = torch.clamp(min_val, max=0).reshape(scale.shape)
    wraps = torch.round(min_neg / scale) < -(2**31)  # torch's float32 quotient
    exact = obs.quant_min - torch.round(min_neg.double() / scale.double())
    exact = torch.clamp(exact, obs.quant_min, obs.quant_max).to(zero_point.dtype)
    return torch.where(wraps, exact, zero_point)


# ------------------------------------------------------------------ defaults

QPARAM_DEFAULTS = [
    "default_observer",
    "default_weight_observer",
    "weight_observer_range_neg_127_to_127",
    "default_per_channel_weight_observer",
    "per_channel_weight_observer_range_neg_127_to_127",
    "default_float_qparams_observer",
    "default_float_qparams_observer_4bit",
    "default_histogram_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_fixed_qparams_range_0to1_observer",
    "default_symmetric_fixed_qparams_observer",
    "default_affine_fixed_qparams_observer",
]


@pytest.mark.parametrize("scenario", ["normal", "growing", "negative_only", "bf16"])
@pytest.mark.parametrize("name", QPARAM_DEFAULTS)
def test_default_factories_match_torch(name: str, scenario: str) -> None:
    a, b = getattr(ours, name)(), getattr(tob, name)()
    assert type(a).__name__ == type(b).__name__
    xs = batches(scenario)
    observe(a, xs)
    observe(b, xs)
    assert_same_qparams(a, b)
    for attr in ("dtype", "qscheme", "quant_min", "quant_max", "is_dynamic"):
        assert getattr(a, attr) == getattr(b, attr), attr


CONFIG_ONLY_DEFAULTS = [
    "default_placeholder_observer",
    "default_debug_observer",
    "default_dynamic_quant_observer",
    "default_reuse_input_observer",
]


@pytest.mark.parametrize("name", CONFIG_ONLY_DEFAULTS)
def test_config_only_defaults_match_torch(name: str) -> None:
    a, b = getattr(ours, name)(), getattr(tob, name)()
    assert type(a).__name__ == type(b).__name__
    x = torch.randn(3, 4)
    assert a(x) is x
    for attr in ("dtype", "is_dynamic", "qscheme", "quant_min", "quant_max", "eps"):
        assert getattr(a, attr, None) == getattr(b, attr, None), attr
    with pytest.raises(RuntimeError, match="not defined"):
        a.calculate_qparams()
    with pytest.raises(Exception, match="should not be called"):
        b.calculate_qparams()


def test_aliases_are_the_same_objects() -> None:
    assert (
        ours.default_symmetric_fixed_qparams_observer
        is ours.default_fixed_qparams_range_neg1to1_observer
    )
    assert (
        ours.default_affine_fixed_qparams_observer
        is ours.default_fixed_qparams_range_0to1_observer
    )


def test_public_names_cover_torch() -> None:
    torch_names = set(tob.__all__)
    # torchao's experimental affine-quantization API is not part of the face.
    affine = {
        "AffineQuantizedObserverBase",
        "Granularity",
        "MappingType",
        "PerAxis",
        "PerBlock",
        "PerGroup",
        "PerRow",
        "PerTensor",
        "PerToken",
        "TorchAODType",
        "ZeroPointDomain",
        "get_block_size",
    }
    assert torch_names - affine <= set(ours.__all__)


def test_recording_observer_records_copies() -> None:
    a = ours.RecordingObserver()
    x = torch.randn(3)
    before = x.clone()
    a(x)
    x += 1
    (recorded,) = a.get_tensor_value()
    assert recorded is not None
    assert torch.equal(recorded, before)


def test_fixed_qparams_buffers_match_torch() -> None:
    a = ours.FixedQParamsObserver(scale=0.25, zero_point=3)
    b = tob.FixedQParamsObserver(scale=0.25, zero_point=3)
    assert_same_state(a, b)
    assert a.calculate_qparams()[0] is a.scale


def test_placeholder_compute_dtype_makes_it_dynamic() -> None:
    """Beyond torch: torch warns and then drops the flag."""
    with pytest.warns(DeprecationWarning, match="is_dynamic=True"):
        a = ours.PlaceholderObserver(dtype=torch.float, compute_dtype=torch.quint8)
    assert a.is_dynamic


# ------------------------------------------------------------------ before data


@pytest.mark.parametrize(
    "name",
    [
        "MinMaxObserver",
        "MovingAverageMinMaxObserver",
        "PerChannelMinMaxObserver",
        "MovingAveragePerChannelMinMaxObserver",
        "HistogramObserver",
    ],
)
def test_default_qparams_before_any_data(name: str) -> None:
    a, b = pair(name)
    with pytest.warns(UserWarning, match="before the observer saw any data"):
        qa = a.calculate_qparams()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        qb = b.calculate_qparams()
    assert_identical(qa[0], qb[0])
    assert_identical(qa[1], qb[1])


@pytest.mark.parametrize(
    "name",
    ["MinMaxObserver", "PerChannelMinMaxObserver", "HistogramObserver"],
)
def test_empty_input_is_ignored(name: str) -> None:
    a, b = pair(name)
    x = torch.randn(4, 3)
    for obs in (a, b):
        obs(torch.empty(0, 3))
        obs(x)
    assert_same_qparams(a, b)


@pytest.mark.parametrize(
    "name", ["MinMaxObserver", "PerChannelMinMaxObserver", "HistogramObserver"]
)
def test_reset_forgets_everything(name: str) -> None:
    a, fresh = getattr(ours, name)(), getattr(ours, name)()
    x = torch.randn(8, 3)
    a(x * 100)
    a.reset_min_max_vals()
    a(x)
    fresh(x)
    assert_same_state(a, fresh)


def test_integer_input_matches_torch() -> None:
    x = torch.randint(-50, 90, (6, 5))
    for name in ("MinMaxObserver", "PerChannelMinMaxObserver"):
        a, b = pair(name)
        observe(a, [x])
        observe(b, [x])
        assert_same_qparams(a, b)


# ------------------------------------------------------------------ NaN / inf

MINMAX_CLASSES = [
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
]


def _with_value(value: float) -> torch.Tensor:
    x = torch.randn(4, 5)
    x[2, 3] = value
    return x


@pytest.mark.parametrize("name", [*MINMAX_CLASSES, "HistogramObserver"])
def test_nan_raises_a_clear_error(name: str) -> None:
    """Beyond torch: torch gives a NaN scale (histogram: a histc error)."""
    a = getattr(ours, name)()
    a(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"1 NaN .*nan_policy='propagate'"):
        a(_with_value(float("nan")))


@pytest.mark.parametrize("name", MINMAX_CLASSES)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")], ids=["inf", "-inf"])
def test_inf_raises_in_minmax_observers(name: str, value: float) -> None:
    with pytest.raises(ValueError, match="1 inf"):
        getattr(ours, name)()(_with_value(value))


@pytest.mark.parametrize("name", MINMAX_CLASSES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_propagate_policy_is_torch(name: str, value: float) -> None:
    a, b = getattr(ours, name)(nan_policy="propagate"), getattr(tob, name)()
    for x in (torch.randn(4, 5), _with_value(value)):
        a(x)
        b(x)
    assert_same_state(a, b)
    assert_same_qparams(a, b)


def test_histogram_propagate_fails_like_torch() -> None:
    a = ours.HistogramObserver(nan_policy="propagate")
    with pytest.raises(RuntimeError, match="not finite"):
        a(_with_value(float("nan")))


def test_bad_nan_policy() -> None:
    with pytest.raises(ValueError, match="nan_policy='ignore'"):
        ours.MinMaxObserver(nan_policy="ignore")  # type: ignore[arg-type]


# ------------------------------------------------------------------ errors


def _make(module: Any, name: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: getattr(module, name)(*args, **kwargs)


# (id, class name, args, kwargs, the exception torch raises)
MISUSE: list[tuple[str, str, tuple[Any, ...], dict[str, Any], type[Exception]]] = [
    (
        "minmax_per_channel",
        "MinMaxObserver",
        (),
        {"qscheme": ch_aff},
        NotImplementedError,
    ),
    (
        "moving_average_per_channel",
        "MovingAverageMinMaxObserver",
        (),
        {"qscheme": ch_sym},
        NotImplementedError,
    ),
    (
        "per_channel_per_tensor",
        "PerChannelMinMaxObserver",
        (),
        {"qscheme": aff},
        NotImplementedError,
    ),
    (
        "moving_per_channel_per_tensor",
        "MovingAveragePerChannelMinMaxObserver",
        (),
        {"qscheme": sym},
        NotImplementedError,
    ),
    (
        "histogram_per_channel",
        "HistogramObserver",
        (),
        {"qscheme": ch_aff},
        NotImplementedError,
    ),
    (
        "per_channel_dynamic",
        "PerChannelMinMaxObserver",
        (),
        {"is_dynamic": True},
        NotImplementedError,
    ),
    (
        "moving_per_channel_dynamic",
        "MovingAveragePerChannelMinMaxObserver",
        (),
        {"is_dynamic": True},
        NotImplementedError,
    ),
    (
        "histogram_dynamic",
        "HistogramObserver",
        (),
        {"is_dynamic": True},
        NotImplementedError,
    ),
    (
        "moving_average_dynamic",
        "MovingAverageMinMaxObserver",
        (),
        {"is_dynamic": True},
        NotImplementedError,
    ),
    (
        "fixed_dynamic",
        "FixedQParamsObserver",
        (1.0, 0),
        {"is_dynamic": True},
        NotImplementedError,
    ),
    (
        "symmetric_quint8_reduce_range",
        "MinMaxObserver",
        (),
        {"qscheme": sym, "reduce_range": True},
        NotImplementedError,
    ),
    (
        "per_channel_symmetric_quint8_reduce_range",
        "PerChannelMinMaxObserver",
        (),
        {"qscheme": ch_sym, "reduce_range": True},
        NotImplementedError,
    ),
    ("float_dtype", "MinMaxObserver", (), {"dtype": torch.float32}, AssertionError),
    (
        "range_without_zero",
        "MinMaxObserver",
        (),
        {"quant_min": 1, "quant_max": 10},
        AssertionError,
    ),
    (
        "empty_range",
        "MinMaxObserver",
        (),
        {"quant_min": 0, "quant_max": 0},
        AssertionError,
    ),
    (
        "qint8_range_too_wide",
        "MinMaxObserver",
        (),
        {"dtype": torch.qint8, "quant_min": -200, "quant_max": 100},
        AssertionError,
    ),
    (
        "histogram_float8",
        "HistogramObserver",
        (),
        {"dtype": torch.float8_e4m3fn},
        TypeError,
    ),
    ("unknown_keyword", "MinMaxObserver", (), {"averaging_constnat": 0.1}, TypeError),
]


@pytest.mark.filterwarnings(_TORCH_REDUCE_RANGE)
@pytest.mark.parametrize(
    "name, args, kwargs, torch_error",
    [case[1:] for case in MISUSE],
    ids=[case[0] for case in MISUSE],
)
def test_same_exception_as_torch(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], torch_error: type
) -> None:
    with pytest.raises(torch_error):
        _make(tob, name, *args, **kwargs)()
    with pytest.raises(torch_error) as caught:
        _make(ours, name, *args, **kwargs)()
    message = str(caught.value)
    assert len(message) > 20
    if torch_error is not TypeError:
        assert isinstance(caught.value, ValueError)
    if "qscheme" in kwargs:
        assert str(kwargs["qscheme"]) in message or "reduce_range" in message


def test_channel_count_change_raises_like_torch() -> None:
    a, b = pair("PerChannelMinMaxObserver")
    a(torch.randn(4, 3))
    b(torch.randn(4, 3))
    with pytest.raises(RuntimeError):
        b(torch.randn(5, 3))
    with pytest.raises(ours.ObserverShapeError, match=r"saw 5 channels .* after 4"):
        a(torch.randn(5, 3))


@pytest.mark.parametrize(
    "name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"]
)
def test_channel_count_change_from_one_raises(name: str) -> None:
    """Beyond torch: torch broadcasts one channel to many without a word."""
    a = getattr(ours, name)()
    a(torch.randn(1, 3))
    with pytest.raises(ValueError, match="saw 4 channels"):
        a(torch.randn(4, 3))


@pytest.mark.parametrize("ch_axis", [2, -3])
def test_channel_axis_out_of_range(ch_axis: int) -> None:
    with pytest.raises(ours.ObserverShapeError, match=f"ch_axis={ch_axis}"):
        ours.PerChannelMinMaxObserver(ch_axis=ch_axis)(torch.randn(4, 3))


def test_per_channel_accepts_one_dim_input() -> None:
    """Beyond torch (IndexError there): each element is its own channel."""
    a = ours.PerChannelMinMaxObserver(dtype=torch.qint8, qscheme=ch_sym)
    x = torch.tensor([-2.0, 0.5, 3.0])
    a(x)
    assert_identical(a.min_val, x)
    assert a.calculate_qparams()[0].shape == (3,)


def test_inconsistent_state_raises() -> None:
    a = ours.MinMaxObserver()
    a.min_val.fill_(2.0)
    a.max_val.fill_(1.0)
    with pytest.raises(AssertionError, match="min_val > max_val"):
        a.calculate_qparams()


def test_histogram_bad_arguments() -> None:
    with pytest.raises(ValueError, match="search='best'"):
        ours.HistogramObserver(search="best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bins=0"):
        ours.HistogramObserver(bins=0)
