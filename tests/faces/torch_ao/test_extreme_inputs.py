"""torch.ao face on extreme finite inputs (issue 16's fuzz findings).

Every observer gives finite positive scales and in-range zero points for
finite input, or raises a `ValueError` that says the range is too wide and
what to do. Where torch.ao returns inf / NaN / a wrapped zero point or raises
on the same input, a comment names its behaviour; the ordinary channels of
the same observer keep torch's numbers bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import observer as tob

import quantobs.torch_ao as TA

from .test_observers import assert_identical

F = torch.finfo(torch.float32).max
sym, aff = torch.per_tensor_symmetric, torch.per_tensor_affine
ch_sym, ch_float = torch.per_channel_symmetric, torch.per_channel_affine_float_qparams
UNSEARCHABLE = "ignore:HistogramObserver. the observed range:RuntimeWarning"


def qparams(obs: torch.nn.Module, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    for x in xs:
        obs(x)
    return tuple(obs.calculate_qparams())


def f32(value: float) -> torch.Tensor:
    """`value` (a double) rounded to float32, as a `(1,)` tensor."""
    return torch.tensor([value], dtype=torch.float64).float()


def represented(
    scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int
) -> tuple[float, float]:
    """The real range `[(qmin - zp) * scale, (qmax - zp) * scale]`, in float64."""
    s, z = float(scale), int(zero_point)
    return (qmin - z) * s, (qmax - z) * s


# ------------------------------------------------ the four findings


def test_histogram_of_a_range_wider_than_float32_gives_the_full_range() -> None:
    obs = TA.HistogramObserver(dtype=torch.qint8, qscheme=sym)
    obs(torch.tensor([-3.3895e38, 3.3895e38, 1.0]))
    # torch.ao: histc counts nothing over an infinite width -> a NaN scale.
    with pytest.warns(RuntimeWarning, match="wider than the float32 maximum"):
        scale, zero_point = obs.calculate_qparams()
    assert_identical(scale, f32(float(torch.tensor(3.3895e38)) / 127.5))
    assert_identical(zero_point, torch.tensor([0]))


def test_histogram_global_search_of_a_range_wider_than_float32() -> None:
    obs = TA.HistogramObserver(bins=64, search="global")
    obs(torch.tensor([-3e38, 3e38, 1.0]))
    with pytest.warns(RuntimeWarning, match="MinMaxObserver's would"):
        scale, zero_point = obs.calculate_qparams()
    expected = qparams(TA.MinMaxObserver(), torch.stack([obs.min_val, obs.max_val]))
    assert_identical(scale, expected[0])
    assert_identical(zero_point, expected[1])


def test_qint32_zero_point_does_not_wrap() -> None:
    obs = TA.MinMaxObserver(dtype=torch.qint32)
    theirs = tob.MinMaxObserver(dtype=torch.qint32)
    x = torch.tensor([-3000.0, 10.0])
    scale, zero_point = qparams(obs, x)
    # torch.ao: round(-3000 / scale) = -4.28e9 wraps in int32 and the zero
    # point becomes 0, so everything below -1505 is clipped.
    assert_identical(scale, qparams(theirs, x)[0])
    qmin, qmax = -(2**31), 2**31 - 1
    assert zero_point.dtype == torch.int32
    assert int(zero_point) == qmin - round(-3000.0 / float(scale))
    low, high = represented(scale, zero_point, qmin, qmax)
    ulp = 3010.0 * 2**-23  # of the width, through the float32 scale
    assert low == pytest.approx(-3000.0, abs=ulp)
    assert high == pytest.approx(10.0, abs=ulp)


def test_qint32_near_the_float32_limits() -> None:
    scale, zero_point = qparams(
        TA.MinMaxObserver(dtype=torch.qint32), torch.tensor([-1e38, 3e38])
    )
    # torch.ao: (max - min) overflows float32: scale inf, zero point -2**31.
    lo, hi = float(torch.tensor(-1e38)), float(torch.tensor(3e38))
    assert_identical(scale, f32((hi - lo) / (2**32 - 1)))
    low, high = represented(scale, zero_point, -(2**31), 2**31 - 1)
    assert low <= lo * (1 - 1e-6) and high >= hi * (1 - 1e-6)


@pytest.mark.parametrize(
    "name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"]
)
def test_per_channel_overflow_is_repaired_per_channel(name: str) -> None:
    x = torch.tensor([[-3e38, 3e38], [-1.0, 2.0]])
    ours, theirs = getattr(TA, name)(), getattr(tob, name)()
    (scale, zero_point), expected = qparams(ours, x), qparams(theirs, x)
    # torch.ao: channel 0's scale is inf and its zero point 0.
    assert_identical(scale[0:1], f32(2 * float(torch.tensor(3e38)) / 255))
    assert int(zero_point[0]) == 128
    assert_identical(scale[1:], expected[0][1:])  # channel 1: torch's numbers
    assert_identical(zero_point[1:], expected[1][1:])


def test_float_qparams_overflow_is_repaired() -> None:
    x = torch.tensor([[-3e38, 3e38], [1.0, 2.0]])
    ours = TA.PerChannelMinMaxObserver(qscheme=ch_float)
    theirs = tob.PerChannelMinMaxObserver(qscheme=ch_float)
    (scale, zero_point), expected = qparams(ours, x), qparams(theirs, x)
    # torch.ao: channel 0's scale is inf and its float zero point -0.
    assert_identical(scale[0:1], f32(2 * float(torch.tensor(3e38)) / 255))
    assert float(zero_point[0]) == pytest.approx(127.5)  # -min / scale
    assert_identical(scale[1:], expected[0][1:])
    assert_identical(zero_point[1:], expected[1][1:])


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("MovingAverageMinMaxObserver", (-1,)),
        ("MovingAveragePerChannelMinMaxObserver", (1, -1)),
    ],
)
def test_moving_average_step_does_not_overflow(
    name: str, shape: tuple[int, ...]
) -> None:
    first = torch.tensor([-3e38, 1.0]).reshape(shape)
    second = torch.tensor([3e38, 3.1e38]).reshape(shape)
    obs, theirs = getattr(TA, name)(), getattr(tob, name)()
    scale, zero_point = qparams(obs, first, second)
    # torch.ao: new - old = 6e38 overflows, min_val becomes inf and
    # calculate_qparams raises "min inf should be less than max".
    for x in (first, second):
        theirs(x)
    lo, hi = float(first.min()), float(second.min())
    assert_identical(obs.min_val.reshape(1), f32(lo * 0.99 + hi * 0.01))
    assert_identical(obs.max_val, theirs.max_val)  # no overflow: torch's step
    assert bool(torch.isfinite(scale).all()) and float(scale.min()) > 0
    assert int(zero_point.min()) >= 0 and int(zero_point.max()) <= 255


def test_affine_range_wider_than_float32() -> None:
    scale, zero_point = qparams(TA.MinMaxObserver(), torch.tensor([-3e38, 3e38]))
    # torch.ao: (max - min) / 255 overflows: scale inf, zero point 0.
    assert_identical(scale, f32(2 * float(torch.tensor(3e38)) / 255))
    assert_identical(zero_point, torch.tensor([128], dtype=torch.int32))


# ------------------------------------------------ what cannot be represented


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quant_min": 0, "quant_max": 1},
        {"dtype": torch.qint8, "qscheme": sym, "quant_min": -1, "quant_max": 0},
    ],
    ids=["affine_two_levels", "symmetric_two_levels"],
)
def test_a_scale_beyond_float32_raises(kwargs: dict[str, Any]) -> None:
    obs = TA.MinMaxObserver(**kwargs)
    obs(torch.tensor([-3e38, 3e38]))
    # torch.ao: an inf scale.
    with pytest.raises(ValueError, match=r"too wide .* \(quant_min / quant_max\)"):
        obs.calculate_qparams()


@pytest.mark.parametrize("name", ["MinMaxObserver", "HistogramObserver"])
def test_float64_values_beyond_float32_buffers_raise(name: str) -> None:
    obs = getattr(TA, name)()
    x = torch.tensor([-1e300, 1.0], dtype=torch.float64)
    # torch.ao: the float32 range is -inf: a NaN scale (histc raises).
    with pytest.raises(ValueError, match="factory_kwargs"):
        obs(x)
    assert not obs.has_statistics  # the batch left nothing behind
    wide = getattr(TA, name)(factory_kwargs={"dtype": torch.float64})
    if name == "MinMaxObserver":
        expected = torch.tensor([(1 + 1e300) / 255], dtype=torch.float64)
        assert_identical(qparams(wide, x)[0], expected)


@pytest.mark.parametrize(
    "x",
    [
        torch.full((4,), 1e30, dtype=torch.bfloat16),
        torch.full((4,), 65504.0, dtype=torch.float16),
    ],
    ids=["bf16_constant_1e30", "fp16_constant_max"],
)
def test_histogram_counts_in_float32_what_histc_refuses(x: torch.Tensor) -> None:
    obs = TA.HistogramObserver(bins=64)
    # torch.ao: histc over [c - 1, c + 1] in the input's dtype raises
    # RuntimeError ("max must be larger than min" / "cannot be converted").
    scale, _ = qparams(obs, x)
    assert float(obs.histogram.sum()) == 4
    assert_identical(scale, qparams(TA.HistogramObserver(bins=64), x.float())[0])


def test_global_search_refuses_32_bit_ranges() -> None:
    # Its exact error costs memory per level: 2**32 levels would need 32 GiB.
    with pytest.raises(ValueError, match="search='torch'"):
        TA.HistogramObserver(dtype=torch.qint32, search="global")
    TA.HistogramObserver(dtype=torch.int16, qscheme=sym, search="global")


# ------------------------------------------------ property: any finite input

EXTREMES = [0.0, -0.0, 2**-149, -(2**-149), 2**-126, -(2**-126), F, -F, 3e38]
EXTREMES += [-3e38, 1.7e38, -1.7e38, 1.0, -1.0, 65504.0, -65504.0]

PER_TENSOR = [
    {},
    {"dtype": torch.qint8, "qscheme": sym},
    {"dtype": torch.qint32},
    {"dtype": torch.qint32, "qscheme": sym},
    {"dtype": torch.quint4x2},
    {"dtype": torch.uint16, "qscheme": sym},
    {"reduce_range": True},
    {"quant_min": 0, "quant_max": 1},  # can be too wide: the ValueError
]
PER_CHANNEL = [
    {},
    {"dtype": torch.qint8, "qscheme": ch_sym},
    {"qscheme": ch_float},
    {"dtype": torch.qint32},
    {"quant_min": 0, "quant_max": 1},
]
OBSERVERS = (
    [("MinMaxObserver", kw) for kw in PER_TENSOR]
    + [
        ("MovingAverageMinMaxObserver", {**kw, "averaging_constant": 0.3})
        for kw in PER_TENSOR
    ]
    + [("HistogramObserver", {**kw, "bins": 64}) for kw in PER_TENSOR]
    + [("HistogramObserver", {"bins": 64, "search": "global", "qscheme": sym})]
    + [("PerChannelMinMaxObserver", kw) for kw in PER_CHANNEL]
    + [("MovingAveragePerChannelMinMaxObserver", kw) for kw in PER_CHANNEL]
)


@st.composite
def extreme_batches(draw: st.DrawFn) -> list[torch.Tensor]:
    """1 to 4 batches of shape (2, n): float32, fp16 or bf16 values with
    extremes, subnormals and mixed signs, each batch scaled by its own power
    of ten (ranges grow or shrink by many orders of magnitude)."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
        width = draw(st.integers(1, 4))
        values = draw(
            st.lists(
                st.sampled_from(EXTREMES)
                | st.floats(width=32, allow_nan=False, allow_infinity=False),
                min_size=2 * width,
                max_size=2 * width,
            )
        )
        scale = 10.0 ** draw(st.sampled_from([0, -30, 30, -300, 300]))
        x = torch.tensor(values, dtype=torch.float64) * scale
        big = torch.finfo(dtype).max  # finite in the batch's dtype
        out.append(x.clamp(-big, big).to(dtype).reshape(2, width))
    return out


def assert_sound(obs: Any, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
    """Finite positive scales; zero points in `[quant_min, quant_max]`
    (finite for float zero points)."""
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all()), scale
    if zero_point.is_floating_point():
        assert bool(torch.isfinite(zero_point).all()), zero_point
    else:
        assert obs.quant_min <= int(zero_point.min()), zero_point
        assert int(zero_point.max()) <= obs.quant_max, zero_point


@pytest.mark.filterwarnings(UNSEARCHABLE)
@settings(max_examples=100)
@given(observer=st.sampled_from(OBSERVERS), xs=extreme_batches())
def test_any_finite_input_gives_sound_qparams(
    observer: tuple[str, dict[str, Any]], xs: list[torch.Tensor]
) -> None:
    name, kwargs = observer
    obs = getattr(TA, name)(**kwargs)
    for x in xs:
        assert obs(x) is x
    try:
        scale, zero_point = obs.calculate_qparams()
    except ValueError as error:  # only a scale beyond float32
        assert kwargs.get("quant_max") == 1, error
        assert "too wide" in str(error)
        return
    assert_sound(obs, scale, zero_point)


@settings(max_examples=20)
@given(xs=extreme_batches())
def test_observers_without_statistics_ignore_extreme_inputs(
    xs: list[torch.Tensor],
) -> None:
    fixed = TA.FixedQParamsObserver(scale=1.0 / 256.0, zero_point=0)
    placeholder = TA.PlaceholderObserver(dtype=torch.float16)
    for x in xs:
        assert fixed(x) is x and placeholder(x) is x
    assert_identical(fixed.calculate_qparams()[0], torch.tensor([1.0 / 256.0]))
    assert_sound(fixed, *fixed.calculate_qparams())


def test_ordinary_inputs_keep_torchs_numbers() -> None:
    """The repairs are not reached by ordinary inputs: a spot check next to
    the parity suites of `test_observers.py` (which must keep passing)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=g) * 10.0**k for k in (-3, 0, 3, 30)]
    for name in ("MinMaxObserver", "MovingAverageMinMaxObserver"):
        for kwargs in (
            {},
            {"dtype": torch.qint32},
            {"dtype": torch.qint8, "qscheme": sym},
        ):
            ours, theirs = getattr(TA, name)(**kwargs), getattr(tob, name)(**kwargs)
            for a, b in zip(qparams(ours, *xs), qparams(theirs, *xs), strict=True):
                assert_identical(a, b)
