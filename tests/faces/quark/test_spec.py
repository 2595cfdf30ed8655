"""Quark face without Quark: the spec, pure math, state, errors, and what goes
beyond Quark (per-channel / per-group histogram observers, state_dict).

Parity with the real amd-quark lives in `test_quark.py`; nothing here imports
it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import quantobs.faces.quark as ours
from quantobs.core.layout import channel_view, group_view
from quantobs.core.qparams import quark_rule as qp
from quantobs.core.qparams.pow2 import pow2_exponent, pow2_nearest
from quantobs.faces.quark import QTensorConfig
from quantobs.stats.reduce import minmax


def block_minmax(
    x: torch.Tensor, axis: int, block: int, *, pad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block min / max as the block observers take them."""
    view = group_view(x, axis, block, pad=pad)  # (1, rows, num_blocks, block)
    return minmax(view, exact_dtype=True)


def channel_minmax(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min / max as the per-channel observers take them."""
    return minmax(channel_view(x, axis), exact_dtype=True)


INT_SPEC = {"round_method": "half_even", "scale_type": "float", "is_dynamic": False}


def spec(observer: str, **kwargs: Any) -> QTensorConfig:
    return QTensorConfig(observer_cls=observer, **kwargs)


def observer(name: str, **kwargs: Any) -> Any:
    return getattr(ours, name)(spec(name, **kwargs))


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ------------------------------------------------------------ spec


def test_strings_and_enums_are_interchangeable() -> None:
    by_string = QTensorConfig(
        dtype="INT8",
        qscheme="per_channel",
        ch_axis=0,
        symmetric=True,
        round_method="half_even",
        scale_type="float",
        is_dynamic=False,
        observer_cls="PerChannelMinMaxObserver",
    )
    by_enum = QTensorConfig(
        dtype=ours.Dtype.int8,
        qscheme=ours.QSchemeType.per_channel,
        ch_axis=0,
        symmetric=True,
        round_method=ours.RoundType.half_even,
        scale_type=ours.ScaleType.float,
        is_dynamic=False,
        observer_cls=ours.PerChannelMinMaxObserver,
    )
    assert by_string == by_enum
    assert by_string.round_method is ours.RoundType.half_even
    assert QTensorConfig(**{**by_string.to_dict(), "round_method": 8}) == by_enum
    assert QTensorConfig.from_dict(by_enum.to_dict()) == by_enum
    assert ours.QuantizationSpec is QTensorConfig


MX = {"qscheme": "per_group", "ch_axis": -1, "group_size": 32, "is_dynamic": True}
BAD_SPECS = [
    ("unknown_dtype", {"dtype": "int7"}, "dtype='int7' is not valid"),
    ("unsupported_dtype", {"dtype": "mx6", "ch_axis": 0, "group_size": 16}, "mx6"),
    (
        "no_observer",
        {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC},
        "needs observer_cls",
    ),
    (
        "unknown_observer",
        {"dtype": "int8", "observer_cls": "TQTObserver"},
        "not an observer of quantobs.faces.quark",
    ),
    (
        "no_qscheme",
        {"dtype": "int8", "observer_cls": "PerTensorMinMaxObserver", **INT_SPEC},
        "needs qscheme",
    ),
    (
        "no_symmetric",
        {
            "dtype": "int4",
            "qscheme": "per_tensor",
            **INT_SPEC,
            "observer_cls": "PerTensorMinMaxObserver",
        },
        "needs symmetric",
    ),
    (
        "no_is_dynamic",
        {
            "dtype": "fp8_e4m3",
            "qscheme": "per_tensor",
            "observer_cls": "PerTensorMinMaxObserver",
        },
        "needs is_dynamic",
    ),
    (
        "wrong_qscheme",
        {
            "dtype": "int8",
            "qscheme": "per_channel",
            "ch_axis": 0,
            "symmetric": True,
            **INT_SPEC,
            "observer_cls": "PerTensorMinMaxObserver",
        },
        "does not support qscheme='per_channel'",
    ),
    (
        "channel_without_axis",
        {
            "dtype": "int8",
            "qscheme": "per_channel",
            "symmetric": True,
            **INT_SPEC,
            "observer_cls": "PerChannelMinMaxObserver",
        },
        "needs ch_axis",
    ),
    (
        "group_without_size",
        {
            "dtype": "int8",
            "qscheme": "per_group",
            "ch_axis": 1,
            "symmetric": True,
            **INT_SPEC,
            "observer_cls": "PerGroupMinMaxObserver",
        },
        "needs group_size",
    ),
    (
        "zero_group",
        {"dtype": "int8", "group_size": 0, "observer_cls": "PerGroupMinMaxObserver"},
        "group_size=0 must be positive",
    ),
    (
        "per_block",
        {
            "dtype": "fp8_e4m3",
            "qscheme": "per_block",
            "block_size": (128, 128),
            "is_dynamic": False,
            "observer_cls": "PerTensorMinMaxObserver",
        },
        "per_block",
    ),
    (
        "asymmetric_fp8",
        {
            "dtype": "fp8_e4m3",
            "qscheme": "per_tensor",
            "symmetric": False,
            "is_dynamic": False,
            "observer_cls": "PerTensorMinMaxObserver",
        },
        "float format without zero point",
    ),
    (
        "fp4_without_scale_format",
        {"dtype": "fp4", **MX, "observer_cls": "PerBlockMXObserver"},
        "needs scale_format",
    ),
    (
        "e5m3_scales",
        {
            "dtype": "fp4",
            **MX,
            "scale_format": "e5m3",
            "observer_cls": "PerBlockMXObserver",
        },
        "e5m3 scales are not supported",
    ),
    (
        "bad_mode",
        {
            "dtype": "fp4",
            **MX,
            "scale_format": "e8m0",
            "scale_calculation_mode": "nearest",
            "observer_cls": "PerBlockMXObserver",
        },
        "scale_calculation_mode='nearest'",
    ),
    (
        "mx_without_element",
        {"dtype": "mx", "ch_axis": -1, "group_size": 32},
        "needs mx_element_dtype",
    ),
    (
        "mx_int4_element",
        {"dtype": "mx", "ch_axis": -1, "group_size": 32, "mx_element_dtype": "int4"},
        "needs mx_element_dtype",
    ),
    (
        "mx_int8_in_quarks_spelling",
        {
            "dtype": "int8",
            **MX,
            "symmetric": True,
            "round_method": "half_even",
            "scale_type": "float",
            "scale_format": "e8m0",
            "observer_cls": "PerBlockMXObserver",
        },
        "dtype='mx' with mx_element_dtype",
    ),
    (
        "bfp16_block_16",
        {"dtype": "bfp16", "ch_axis": -1, "group_size": 16},
        "group_size=8",
    ),
    (
        "bfp16_with_mx_observer",
        {
            "dtype": "bfp16",
            "ch_axis": -1,
            "group_size": 8,
            "observer_cls": "PerBlockMXObserver",
        },
        "observed by PerBlockBFPObserver",
    ),
    (
        "bf16_without_placeholder",
        {"dtype": "bfloat16"},
        "observer_cls=PlaceholderObserver",
    ),
    (
        "pow2_int4",
        {
            "dtype": "int4",
            "qscheme": "per_tensor",
            "symmetric": True,
            **INT_SPEC,
            "observer_cls": "PerTensorPowOf2MinMaxObserver",
        },
        "supports int8, uint8 and int32",
    ),
    (
        "pro_per_channel",
        {
            "dtype": "int8",
            "qscheme": "per_channel",
            "ch_axis": 0,
            "symmetric": True,
            **INT_SPEC,
            "observer_cls": "PerTensorHistogramObserverPro",
        },
        "does not support qscheme='per_channel'",
    ),
    (
        "pro_int4",
        {
            "dtype": "int4",
            "qscheme": "per_tensor",
            "symmetric": True,
            **INT_SPEC,
            "observer_cls": "PerTensorHistogramObserverPro",
        },
        "supports dtype uint4, int8 and uint8",
    ),
    (
        "mse_fp4",
        {
            "dtype": "fp4",
            "qscheme": "per_tensor",
            "scale_format": "float32",
            "observer_cls": "PerTensorMSEObserver",
        },
        "searches integer and fp8 dtypes",
    ),
    (
        "float_zero_point_fp8",
        {
            "dtype": "fp8_e4m3",
            "qscheme": "per_tensor",
            "is_dynamic": False,
            "zero_point_type": "float32",
            "observer_cls": "PerTensorMinMaxObserver",
        },
        "zero_point_type='float32' needs an integer dtype",
    ),
]


@pytest.mark.parametrize(
    "kwargs, match", [pytest.param(k, m, id=i) for i, k, m in BAD_SPECS]
)
def test_invalid_specs_raise_clear_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QTensorConfig(**kwargs)


def test_observer_rejects_a_spec_it_cannot_observe() -> None:
    int_spec = spec(
        "PerTensorMinMaxObserver",
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        **INT_SPEC,
    )
    with pytest.raises(ValueError, match="PerBlockMXObserver observes"):
        ours.PerBlockMXObserver(int_spec)
    with pytest.raises(ValueError, match="float16 / bfloat16"):
        ours.PlaceholderObserver(int_spec)
    with pytest.raises(TypeError, match="qspec must be a QTensorConfig"):
        ours.PerTensorMinMaxObserver({"dtype": "int8"})


def test_placeholder_passes_through() -> None:
    placeholder = observer("PlaceholderObserver", dtype="bfloat16")
    x = torch.randn(3)
    assert placeholder(x) is x
    assert placeholder._calculate_qparams() is None
    assert "bfloat16" in placeholder.extra_repr()


# ------------------------------------------------------------ pure math


def test_mx_exponent_truth_table() -> None:
    amax = torch.tensor([1.5, 1.75, 1.875, 1.9375, 1.96875, 2.0, 3.0, 0.75])
    floor = [0, 0, 0, 0, 0, 1, 1, -1]
    assert pow2_exponent(amax, "floor", 1).tolist() == floor
    assert pow2_exponent(amax, "ceil", 1).tolist() == [1, 1, 1, 1, 1, 1, 2, 0]
    # Quark's "even" rounds to the element's mantissa width M, up from
    # 2 - 2**-(M+1): fp4 1.75, e3m2 / e5m2 1.875, e2m3 / e4m3 1.9375
    assert pow2_exponent(amax, "round", 1).tolist() == [0, 1, 1, 1, 1, 1, 1, -1]
    assert pow2_exponent(amax, "round", 2).tolist() == [0, 0, 1, 1, 1, 1, 1, -1]
    assert pow2_exponent(amax, "round", 3).tolist() == [0, 0, 0, 1, 1, 1, 1, -1]
    with pytest.raises(ValueError, match="'floor', 'ceil' or 'round'"):
        pow2_exponent(amax, "up", 1)  # type: ignore[arg-type]


def test_e8m0_scale_edges() -> None:
    amax = torch.tensor([0.0, 6.0, 1e-40, 3e38])
    even = qp.e8m0_scale(amax, "round", 1, 2, 1e-7)
    # 3e38 = 1.76 * 2**127 rounds up to 2**128, beyond float32: saturates.
    assert even.tolist() == [2.0**-127, 2.0**0, 2.0**-127, 2.0**127]
    floor = qp.e8m0_scale(amax, "floor", 1, 2, 1e-7)
    assert floor[0].item() == pytest.approx(1e-7)  # eps for all-zero blocks
    assert floor[1:].tolist() == [2.0**0, 2.0**-127, 2.0**125]


@given(st.floats(min_value=1e-30, max_value=1e30))
def test_pow2_round_is_nearest_in_log2(value: float) -> None:
    rounded = pow2_nearest(torch.tensor([value], dtype=torch.float64)).item()
    exponent = math.log2(rounded)
    assert exponent == int(exponent)
    assert abs(math.log2(value) - exponent) <= 0.5 + 1e-12


def test_int_qparams_follow_quarks_dtype_promotion() -> None:
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    low, high = torch.tensor(-1.0, dtype=torch.bfloat16), torch.tensor(3.0).bfloat16()
    scale, zero_point = qp.int_qparams(low, high, -128, 127, True, eps)
    assert scale.dtype == torch.float32 and zero_point.dtype == torch.int32
    scale, _ = qp.int_qparams(low.reshape(1), high.reshape(1), -128, 127, True, eps)
    assert scale.dtype == torch.bfloat16  # n-d bfloat16 wins over a 0-d float32
    scale, zero_point = qp.int_qparams(low, high, 0, 255, False, eps)
    assert zero_point.item() == round(1.0 / scale.item())


def _quark_blocks(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Quark's reshape_to_blocks, written out: transpose, flatten, zero-pad."""
    moved = x.transpose(axis, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    pad = (-rows.shape[1]) % block
    rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, block)


@pytest.mark.parametrize(
    "shape, axis, block",
    [
        ((4, 64), -1, 32),
        ((4, 70), -1, 32),
        ((70, 4), 0, 32),
        ((3, 10, 5), 1, 4),
        ((2, 3, 9, 4), 2, 8),
        ((17,), 0, 8),
        ((5, 6), 1, 6),
        ((6, 64), -1, 8),  # max-pooled
        ((3, 5, 48), 2, 16),  # max-pooled
    ],
    ids=str,
)
def test_block_minmax_equals_quarks_padded_blocks(
    shape: tuple[int, ...], axis: int, block: int
) -> None:
    x = randn(*shape)
    low, high = block_minmax(x, axis, block, pad=True)
    blocks = _quark_blocks(x, axis, block)
    assert torch.equal(low, blocks.amin(-1)) and torch.equal(high, blocks.amax(-1))


def test_block_minmax_needs_divisible_groups() -> None:
    with pytest.raises(ValueError, match="does not divide into groups of 32"):
        block_minmax(randn(4, 70), -1, 32, pad=False)
    with pytest.raises(ValueError, match="ch_axis=2 is out of range"):
        channel_minmax(randn(4, 70), 2)


# ------------------------------------------------------------ observers


def test_nonfinite_inputs_raise() -> None:
    x = torch.tensor([[1.0, math.nan], [0.5, 2.0]])
    for name, kwargs in (
        ("PerTensorMinMaxObserver", {"qscheme": "per_tensor"}),
        ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
        ("PerTensorPercentileObserver", {"qscheme": "per_tensor"}),
    ):
        obs = observer(name, dtype="int8", symmetric=True, **kwargs, **INT_SPEC)
        with pytest.raises(ValueError, match="NaN or inf"):
            obs(x)
    mx = observer("PerBlockMXObserver", dtype="fp4", **MX, scale_format="e8m0")
    with pytest.raises(ValueError, match="NaN or inf"):
        mx(torch.tensor([[math.inf] + [0.0] * 31]))


def test_static_channel_count_change_raises() -> None:
    obs = observer(
        "PerChannelMinMaxObserver",
        dtype="int8",
        qscheme="per_channel",
        ch_axis=0,
        symmetric=True,
        **INT_SPEC,
    )
    obs(randn(4, 8))
    with pytest.raises(ValueError, match="3 channels along ch_axis=0"):
        obs(randn(3, 8))
    obs.reset_min_max_vals()
    obs(randn(3, 8))
    assert obs.min_val.shape == (3,)


def test_pof2_scale_type_rounds_scales() -> None:
    common = {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}
    x = randn(6, 16)
    exact = observer("PerChannelMinMaxObserver", symmetric=False, **common, **INT_SPEC)
    pof2 = observer(
        "PerChannelMinMaxObserver",
        symmetric=False,
        **common,
        **{**INT_SPEC, "scale_type": "pof2"},
    )
    exact(x)
    pof2(x)
    scale, zero_point = pof2._calculate_qparams()
    assert torch.equal(scale, pow2_nearest(exact._calculate_qparams()[0]))
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    expected = (-128 - torch.round(x.amin(1).clamp(max=0) / scale)).int()
    assert torch.equal(zero_point, expected.clamp(-128, 127))


def test_record_observed_tokens() -> None:
    obs = observer(
        "PerTensorMinMaxObserver",
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        **INT_SPEC,
    )
    x = torch.zeros(2, 5, 4)
    x[0, 1, 2] = 1.0
    x[1, 4, 0] = -2.0
    obs.record_observed_tokens(x)
    obs.record_observed_tokens(torch.ones(7))  # ignored: fewer than 2 dims
    assert obs._num_observed_tokens == 2


def test_histogram_qparams_before_data_raise() -> None:
    obs = observer(
        "PerTensorMSEObserver",
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        **INT_SPEC,
    )
    with pytest.raises(ValueError, match="no data observed yet"):
        obs._calculate_qparams()


def test_all_zero_percentile_warns_and_gives_eps() -> None:
    obs = observer(
        "PerTensorPercentileObserver",
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        **INT_SPEC,
    )
    obs(torch.zeros(16))
    with pytest.warns(UserWarning, match="histogram is empty"):
        scale, zero_point = obs._calculate_qparams()
    assert scale.tolist() == [torch.finfo().eps] and zero_point.tolist() == [0]


# ------------------------------------------------------------ beyond Quark

CHANNEL = {"qscheme": "per_channel", "ch_axis": 0}
GROUP = {"qscheme": "per_group", "ch_axis": 1, "group_size": 16}


@pytest.mark.parametrize("layout", [CHANNEL, GROUP], ids=["channel", "group"])
def test_full_percentile_per_qparam_is_minmax(layout: dict[str, Any]) -> None:
    x = randn(8, 64, seed=1)
    x[2, 5] = 40.0  # an outlier the default percentile keeps
    kwargs = {"dtype": "int8", "symmetric": True, **layout, **INT_SPEC}
    percentile = observer("PerTensorPercentileObserver", **kwargs)
    percentile.percentile = 100.0
    minmax_name = (
        "PerChannelMinMaxObserver" if layout is CHANNEL else "PerGroupMinMaxObserver"
    )
    minmax = observer(minmax_name, **kwargs)
    percentile(x)
    minmax(x)
    got, want = percentile._calculate_qparams(), minmax._calculate_qparams()
    assert got[0].shape == want[0].shape
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"]
)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_per_channel_search_equals_channel_alone(name: str, symmetric: bool) -> None:
    # Vectorized over channels = each channel searched on its own.
    kwargs = {"dtype": "uint8", "symmetric": symmetric, **CHANNEL, **INT_SPEC}
    x = torch.cat([randn(1, 256, seed=2), randn(1, 256, seed=3, scale=5).relu()])
    together = observer(name, **kwargs)
    together(x)
    scale, zero_point = together._calculate_qparams()
    for channel in range(2):
        alone = observer(name, **kwargs)
        alone(x[channel : channel + 1])
        one_scale, one_zero_point = alone._calculate_qparams()
        assert scale[channel] == one_scale[0]
        assert zero_point[channel] == one_zero_point[0]


def test_per_channel_mse_picks_one_of_quarks_candidates() -> None:
    obs = observer(
        "PerTensorMSEObserver", dtype="int8", symmetric=True, **CHANNEL, **INT_SPEC
    )
    x = randn(4, 512, seed=4)
    obs(x)
    low, high = obs._search_range()
    amax = x.abs().amax(dim=1)
    candidates = amax[:, None] * (torch.tensor([2045, 2046, 2047]) + 0.5) / 2048
    assert torch.all(low == 0)
    assert torch.all((candidates == high[:, None]).any(dim=1))


def test_plain_histogram_per_group_is_minmax() -> None:
    kwargs = {"dtype": "int4", "symmetric": True, **GROUP, **INT_SPEC}
    hist = observer("PerTensorHistogramObserver", **kwargs)
    minmax = observer("PerGroupMinMaxObserver", **kwargs)
    x = randn(6, 48, seed=5)
    hist(x)
    minmax(x)
    for a, b in zip(
        hist._calculate_qparams(), minmax._calculate_qparams(), strict=True
    ):
        assert a.shape == (6, 3) and torch.equal(a, b)


def test_histogram_budget_is_enforced() -> None:
    obs = observer(
        "PerTensorPercentileObserver",
        dtype="int8",
        symmetric=True,
        qscheme="per_group",
        ch_axis=1,
        group_size=2,
        **INT_SPEC,
    )
    with pytest.raises(ValueError, match="max_counts"):
        obs(torch.randn(128, 256))


STATEFUL = {
    "PerTensorMinMaxObserver": {"dtype": "int8", "qscheme": "per_tensor"},
    "PerChannelMinMaxObserver": {
        "dtype": "uint8",
        "qscheme": "per_channel",
        "ch_axis": 1,
    },
    "PerGroupMinMaxObserver": {"dtype": "int4", **GROUP},
    "PerTensorPercentileObserver": {"dtype": "int8", "qscheme": "per_tensor"},
    "PerTensorMSEObserver": {"dtype": "int8", "qscheme": "per_tensor"},
    "PerTensorHistogramObserver": {"dtype": "int8", **CHANNEL},
    "PerTensorPowOf2MinMaxObserver": {"dtype": "int8", "qscheme": "per_tensor"},
    "PerChannelPowOf2MinMSEObserver": {"dtype": "int8", **CHANNEL},
    "PerTensorHistogramObserverPro": {"dtype": "uint8", "qscheme": "per_tensor"},
}
BLOCKS = {
    "PerBlockMXObserver": {
        "dtype": "fp8_e4m3",
        **MX,
        "is_dynamic": False,
        "scale_format": "e8m0",
    },
    "PerBlockBFPObserver": {"dtype": "bfp16", "ch_axis": -1, "group_size": 8},
}


@pytest.mark.parametrize("name", list(STATEFUL) + list(BLOCKS))
def test_state_dict_resumes_calibration(name: str) -> None:
    if name in BLOCKS:
        kwargs = BLOCKS[name]
    else:
        kwargs = {"symmetric": True, **STATEFUL[name], **INT_SPEC}
    first, second = randn(8, 64, seed=6), randn(8, 64, seed=7, scale=3)
    whole = observer(name, **kwargs)
    whole(first)
    whole(second)
    saved = observer(name, **kwargs)
    saved(first)
    state = saved.state_dict()
    resumed = observer(name, **kwargs)
    resumed.load_state_dict(state)
    resumed(second)
    for a, b in zip(
        whole._calculate_qparams(), resumed._calculate_qparams(), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_state_dict_keeps_the_input_dtype() -> None:
    kwargs = {"dtype": "int8", "symmetric": True, **CHANNEL, **INT_SPEC}
    saved = observer("PerChannelMinMaxObserver", **kwargs)
    saved(randn(4, 8).bfloat16())
    resumed = observer("PerChannelMinMaxObserver", **kwargs)
    resumed.load_state_dict(saved.state_dict())
    assert resumed._calculate_qparams()[0].dtype == torch.bfloat16
    for a, b in zip(
        saved._calculate_qparams(), resumed._calculate_qparams(), strict=True
    ):
        assert torch.equal(a, b)


@given(st.floats(min_value=2.0**-100, max_value=2.0**100, width=32))
def test_mx_scales_bracket_the_amax(amax: float) -> None:
    # floor: the largest element value covers amax up to its next binade;
    # ceil: never clips; even: amax / scale below the next power of two
    # after the element's rounding.
    value = torch.tensor([amax])
    for element in ("fp4", "fp6_e3m2", "fp8_e4m3", "fp8_e5m2"):
        bits, emax = ours.spec.mx_element_params(ours.Dtype(element))
        floor = qp.e8m0_scale(value, "floor", bits, emax, 1e-7).item()
        ceil = qp.e8m0_scale(value, "ceil", bits, emax, 1e-7).item()
        even = qp.e8m0_scale(value, "round", bits, emax, 1e-7).item()
        assert floor * 2**emax <= amax < floor * 2 ** (emax + 1)
        assert amax <= ceil * 2**emax < 2 * amax
        assert even in (floor, 2 * floor)


def test_static_block_layout_change_raises() -> None:
    for name, kwargs in BLOCKS.items():
        obs = observer(name, **{**kwargs, "is_dynamic": False})
        obs(randn(4, 64))
        with pytest.raises(ValueError, match="set is_dynamic=True"):
            obs(randn(8, 64))
        dynamic = observer(name, **{**kwargs, "is_dynamic": True})
        dynamic(randn(4, 64))
        dynamic(randn(8, 64))
        assert dynamic._calculate_qparams()[0].shape[0] == 8
