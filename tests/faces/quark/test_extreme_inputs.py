"""Quark face on extreme finite inputs (issue 16): finite work, finite qparams.

Subnormals, values near float32's max, mixed-sign extremes and ranges that
grow by many orders of magnitude between batches. Real Quark 0.13 returns
inf / NaN / zero scales, raises low-level errors or never returns on these;
each test says which, and asserts our finite answer (or our documented
`ValueError`). Quark itself is not run here: some of these cases hang it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantobs.faces.quark as ours

F = torch.finfo(torch.float32).max
INT = {"is_dynamic": False, "round_method": "half_even", "scale_type": "float"}


def make(name: str, **spec: Any) -> Any:
    """Our observer `name` with an int8 symmetric per-tensor spec by default."""
    fields = {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT}
    fields.update(spec)
    return getattr(ours, name)(ours.QTensorConfig(observer_cls=name, **fields))


def observe(observer: Any, *batches: torch.Tensor) -> tuple[Any, Any]:
    for batch in batches:
        observer(batch)
    return observer._calculate_qparams()


def assert_sound(observer: Any, qparams: tuple[Any, Any]) -> None:
    """Finite positive scales; zero points finite and, for ints, in range."""
    scale, zero_point = qparams
    assert bool(torch.isfinite(scale).all()), scale
    assert bool((scale > 0).all()), scale
    assert bool(torch.isfinite(zero_point.double()).all()), zero_point
    if not zero_point.dtype.is_floating_point:  # block observers: zeros
        low, high = getattr(observer, "quant_min", 0), getattr(observer, "quant_max", 0)
        assert bool(((zero_point >= low) & (zero_point <= high)).all()), zero_point


HISTOGRAMS = [
    "PerTensorHistogramObserver",
    "PerTensorPercentileObserver",
    "PerTensorMSEObserver",
]

# ------------------------------------------------------ 1. histogram growth


@pytest.mark.parametrize("name", HISTOGRAMS)
def test_growth_is_bounded(name: str) -> None:
    # Quark grows by whole bins of the first batch's width: a 10x wider second
    # batch makes ~15,700 bins (and its MSE search, quadratic in them, takes
    # seconds; 100x: minutes). Here at most 4 times the first bin count.
    g = torch.Generator().manual_seed(0)
    observer = make(name)
    qparams = observe(
        observer, torch.randn(64, generator=g), torch.randn(64, generator=g) * 10
    )
    assert_sound(observer, qparams)
    first = observer._default_bins
    assert first * 2 <= observer.calib_hist.numel() <= first * 4
    assert observer.calib_bin_edges.numel() == observer.calib_hist.numel() + 1
    assert int(observer.calib_hist.sum()) == 128
    assert bool((observer.calib_bin_edges.diff() > 0).all())


def test_merged_growth_keeps_every_count() -> None:
    # 2048 bins over [0, 1], then |x| up to 10: 20,480 of Quark's bins. Ours
    # merges 3 old bins into one (6,827 bins of width 3 / 2048 from 0): each
    # old bin lies in one new bin, so its count moves whole.
    observer = make("PerTensorHistogramObserver")
    first, second = torch.linspace(0, 1, 2049), torch.linspace(-10, 10, 301)
    observer(first)
    old = observer.calib_hist.clone()
    observer(second)
    edges, counts = observer.calib_bin_edges, observer.calib_hist
    assert counts.numel() == 6827
    assert torch.equal(edges[:4], torch.tensor([0.0, 3.0, 6.0, 9.0]) / 2048)
    merged = torch.zeros(6827, dtype=torch.int64)
    merged.index_add_(0, torch.arange(2048) // 3, old)
    new = torch.histc(second.abs(), 6827, 0, float(edges[-1])).long()
    assert torch.equal(counts, merged + new)


@pytest.mark.parametrize(
    ("name", "symmetric"),
    [
        ("PerTensorHistogramObserver", True),  # symmetric only
        ("PerTensorPercentileObserver", True),
        ("PerTensorPercentileObserver", False),
        ("PerTensorMSEObserver", True),
        ("PerTensorMSEObserver", False),
    ],
)
def test_growth_over_many_orders_of_magnitude(name: str, symmetric: bool) -> None:
    # Quark: a batch at ~3e-9 then one at ~2e8 loops forever (a `while` adding
    # 1 to a bin count near 1e19); 1e-30 -> 1e30 raises OverflowError; near
    # float32's max its edges are infinite (torch.histc raises).
    g = torch.Generator().manual_seed(1)
    observer = make(name, symmetric=symmetric, dtype="int8" if symmetric else "uint8")
    scales = (3e-9, 2e8, 1e-30, 1e30, 1e-40, 1e37, 1.0)
    batches = [torch.randn(128, generator=g) * s for s in scales]
    batches.append(torch.tensor([F, -F, 3e38, 1e-45]))
    qparams = observe(observer, *batches)
    assert_sound(observer, qparams)
    assert observer.calib_hist.numel() <= 4 * observer._default_bins
    assert bool(torch.isfinite(observer.calib_bin_edges).all())
    assert bool((observer.calib_bin_edges.diff() > 0).all())
    total = sum(
        int((b != 0).sum()) if observer._skip_zeros else b.numel() for b in batches
    )
    assert int(observer.calib_hist.sum()) == total


def test_histogram_near_float32_max() -> None:
    # Quark: RuntimeError "torch.histc: range of [0, inf] is not finite".
    observer = make("PerTensorHistogramObserver")
    scale, _ = observe(observer, torch.tensor([1e38]), torch.tensor([F]))
    assert scale.item() == pytest.approx(F / 127.5, rel=1e-6)
    assert bool(torch.isfinite(observer.calib_bin_edges).all())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_mse_search_near_float32_max(symmetric: bool) -> None:
    # Quark: the bin centres (e[i] + e[i + 1]) / 2 overflow: an infinite scale
    # (symmetric) or an AssertionError (asymmetric). Ours: the MSE amax is a
    # bin centre near the data max.
    observer = make("PerTensorMSEObserver", symmetric=symmetric)
    scale, zero_point = observe(observer, torch.tensor([3e38, -F, 1.0]))
    assert_sound(observer, (scale, zero_point))
    spread = F if symmetric else F + 3e38
    levels = 127.5 if symmetric else 255.0
    assert scale.item() == pytest.approx(spread / levels, rel=0.01)


def test_first_batch_too_narrow_for_float32_edges() -> None:
    # [1, 1 + 2**-23] cannot be split into 4200 increasing float32 edges:
    # Quark's edges repeat, its bin width is 0, and the next batch divides
    # by it (OverflowError). Ours widens the first grid to bins of one step.
    observer = make("PerTensorPercentileObserver", symmetric=False, dtype="uint8")
    narrow = torch.tensor([1.0, 1.0 + 2.0**-23])
    qparams = observe(observer, narrow, torch.tensor([0.5, 3.0]))
    assert_sound(observer, qparams)
    assert bool((observer.calib_bin_edges.diff() > 0).all())


def test_subnormal_histogram() -> None:
    # Quark: the 2048 edges of [0, 1e-44] round to a few subnormals (width
    # 0), and the next batch raises OverflowError.
    observer = make("PerTensorMSEObserver")
    qparams = observe(observer, torch.tensor([1e-44, -3e-45]), torch.tensor([2.0]))
    assert_sound(observer, qparams)


# ------------------------------------------------------ 2. power of two


@pytest.mark.parametrize(
    "spec",
    [{"dtype": "int8"}, {"dtype": "uint8", "symmetric": False}],
    ids=["int8_sym", "uint8_asym"],
)
@pytest.mark.parametrize(
    "name", ["PerChannelPowOf2MinMaxObserver", "PerChannelPowOf2MinMSEObserver"]
)
def test_pow2_subnormal_channel(name: str, spec: dict[str, Any]) -> None:
    # Quark: scale 0 and zero point -2**31 for the subnormal channel.
    x = torch.tensor([[1e-44, -3e-44], [2.0, 1.0]])
    observer = make(name, qscheme="per_channel", ch_axis=0, **spec)
    scale, zero_point = observe(observer, x)
    assert_sound(observer, (scale, zero_point))
    if name == "PerChannelPowOf2MinMSEObserver":  # one shift 2**k for all
        assert math.log2(scale[0].item()) in (-128, -127, -126, -125, -124)
        return
    assert scale[0].item() == 2.0**-126  # float32's smallest normal power of 2
    # The ordinary channel keeps Quark's numbers (its own pow2 rule).
    alone = make(name, qscheme="per_channel", ch_axis=0, **spec)
    expected = observe(alone, x[1:])
    assert scale[1] == expected[0][0] and zero_point[1] == expected[1][0]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize(
    "name", ["PerTensorPowOf2MinMaxObserver", "PerTensorPowOf2MinMSEObserver"]
)
def test_pow2_range_wider_than_float32(name: str, symmetric: bool) -> None:
    # The spread 6e38 overflows float32. Quark: the scale 2**127 with the
    # zero point qmin (no negative value representable). Ours: the nearest
    # power of two of 6e38 / 255, 2**121 (MinMSE may shift it).
    dtype = "int8" if symmetric else "uint8"
    observer = make(name, symmetric=symmetric, dtype=dtype)
    scale, zero_point = observe(observer, torch.tensor([-3e38, 3e38, 1.0]))
    assert_sound(observer, (scale, zero_point))
    if name == "PerTensorPowOf2MinMaxObserver":
        assert scale.item() == 2.0**121


# ------------------------------------------------------ 3. BFP16


def _bfp(x: torch.Tensor) -> tuple[Any, Any]:
    observer = ours.PerBlockBFPObserver(
        ours.QTensorConfig(
            observer_cls="PerBlockBFPObserver",
            dtype="bfp16",
            qscheme="per_group",
            ch_axis=-1,
            group_size=8,
            is_dynamic=False,
            round_method="half_even",
        )
    )
    return observe(observer, x)


@pytest.mark.parametrize(
    ("dtype", "top", "exponent"),
    [
        (torch.float32, 3.4e38, 121),
        (torch.float32, F, 121),
        (torch.bfloat16, 3.38e38, 121),
        (torch.float16, 65300.0, 9),
    ],
)
def test_bfp_block_at_the_top_exponent(
    dtype: torch.dtype, top: float, exponent: int
) -> None:
    # The largest value rounds to mantissa 128, so Quark doubles the amax to
    # inf: an infinite scale (ours before: 2**-7, clipping every value of the
    # block). Ours keeps the top exponent's scale (the top values saturate).
    x = torch.tensor([[top, 1.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=dtype)
    scale, zero_point = _bfp(x)
    assert scale.item() == 2.0**exponent
    assert zero_point.item() == 0
    assert 127 * scale.item() >= x.max().item() * 127 / 128  # within 1 / 128


def test_bfp_doubling_below_the_top_is_quarks() -> None:
    # 1.9921875 * 2**3 rounds to mantissa 128 at 2**-3: doubled to 2**-2.
    scale, _ = _bfp(torch.tensor([[15.9375, 1.0, 0, 0, 0, 0, 0, 0]]))
    assert scale.item() == 2.0**-2


# ------------------------------------------------------ 4. asymmetric ranges


@pytest.mark.parametrize("dtype", ["uint8", "uint4"])
@pytest.mark.parametrize(
    "name", ["PerTensorMinMaxObserver", "PerChannelMinMaxObserver"]
)
def test_asymmetric_range_wider_than_float32(name: str, dtype: str) -> None:
    # max - min = 6e38 overflows float32: Quark's scale is inf. Ours computes
    # the range in float64 and casts the scale back.
    levels = 255 if dtype == "uint8" else 15
    per_channel = name == "PerChannelMinMaxObserver"
    spec = {"qscheme": "per_channel", "ch_axis": 0} if per_channel else {}
    observer = make(name, dtype=dtype, symmetric=False, **spec)
    x = torch.tensor([[-3e38, 3e38], [-1.0, 2.0]])
    scale, zero_point = observe(observer, x if per_channel else x[0])
    assert_sound(observer, (scale, zero_point))
    assert scale.reshape(-1)[0].item() == pytest.approx(6e38 / levels, rel=1e-6)
    if per_channel:  # the ordinary channel keeps Quark's float32 arithmetic
        alone = make(name, dtype=dtype, symmetric=False, **spec)
        expected = observe(alone, x[1:])
        assert scale[1] == expected[0][0] and zero_point[1] == expected[1][0]


@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
def test_asymmetric_float16_range_wider_than_float16(per_channel: bool) -> None:
    # 4e4 - (-4e4) overflows float16 (max 65504): Quark's scale is inf.
    name = "PerChannelMinMaxObserver" if per_channel else "PerTensorMinMaxObserver"
    spec = {"qscheme": "per_channel", "ch_axis": 0} if per_channel else {}
    observer = make(name, dtype="uint8", symmetric=False, **spec)
    x = torch.tensor([[-4e4, 4e4]], dtype=torch.float16)
    scale, zero_point = observe(observer, x if per_channel else x[0])
    assert_sound(observer, (scale, zero_point))
    assert scale.reshape(-1)[0].item() == pytest.approx(8e4 / 255, rel=1e-3)


def test_asymmetric_percentile_and_group_ranges_wider_than_float32() -> None:
    # The same float64 fallback behind every UniformScalingObserver.
    group = make(
        "PerGroupMinMaxObserver",
        dtype="uint8",
        symmetric=False,
        qscheme="per_group",
        ch_axis=1,
        group_size=2,
    )
    assert_sound(group, observe(group, torch.tensor([[-F, F, 1.0, 2.0]])))
    percentile = make(
        "PerTensorPercentileObserver",
        dtype="uint8",
        symmetric=False,
        qscheme="per_channel",
        ch_axis=0,
    )
    assert_sound(percentile, observe(percentile, torch.tensor([[-F, F], [1.0, 2.0]])))


@pytest.mark.parametrize(
    ("dtype", "symmetric"), [("int8", True), ("uint8", False), ("uint4", False)]
)
def test_histogram_pro_of_a_range_wider_than_float32_covers_it(
    dtype: str, symmetric: bool
) -> None:
    # torch's histogram bins max - min in float32: no usable counts, and inf
    # or NaN scales in torch and Quark. Ours: the policy of the torch.ao
    # face's HistogramObserver, the whole observed range with a warning.
    observer = make("PerTensorHistogramObserverPro", dtype=dtype, symmetric=symmetric)
    observer(torch.tensor([-1.0, 2.0]))
    observer(torch.tensor([-3e38, 3e38]))
    with pytest.warns(RuntimeWarning, match="wider than the float32 maximum"):
        scale, zero_point = observer._calculate_qparams()
    assert_sound(observer, (scale, zero_point))
    qmin, qmax = observer.torch_rule.quant_min, observer.torch_rule.quant_max
    low = (qmin - int(zero_point)) * float(scale)
    high = (qmax - int(zero_point)) * float(scale)
    # within one step of the observed range (torch's symmetric rule divides
    # by 127.5 levels: its top level is half a step short of the max)
    step = float(scale)
    assert low <= -3e38 + step and high >= 3e38 - step


@pytest.mark.parametrize(
    "name",
    [*HISTOGRAMS, "PerTensorPowOf2MinMaxObserver", "PerTensorPowOf2MinMSEObserver"],
)
def test_float64_values_past_float32_are_refused(name: str) -> None:
    # Their edges / arithmetic are float32. Quark: RuntimeError (histc range
    # [0, inf]) or the scale 2**127 with zero point -128.
    observer = make(name)
    with pytest.raises(ValueError, match="float32's max"):
        observe(observer, torch.tensor([1e300, -1.0], dtype=torch.float64))


def test_merging_extreme_histograms_stays_finite() -> None:
    # Quark has no merge; ours re-bins both onto the joint range's grid.
    wide, narrow = (make("PerTensorPercentileObserver", **_ASYM) for _ in "ab")
    wide(torch.tensor([-F, F, 1.0]))
    narrow(torch.tensor([1e-44, 2.0]))
    merged = wide.merge(narrow)
    assert bool(torch.isfinite(merged.calib_bin_edges).all())
    assert int(merged.calib_hist.sum()) == 5
    assert_sound(merged, merged._calculate_qparams())


# ------------------------------------------------------ property: every class

_PER_CHANNEL = {"qscheme": "per_channel", "ch_axis": 0}
_ASYM = {"dtype": "uint8", "symmetric": False}
_BLOCK = {"qscheme": "per_group", "ch_axis": -1, "is_dynamic": False}
_GROUP = {"qscheme": "per_group", "ch_axis": 1, "group_size": 4}
_MX = {**_BLOCK, "dtype": "fp4", "group_size": 4, "scale_format": "e8m0"}
_FP8 = {"dtype": "fp8_e4m3", "is_dynamic": False}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("PerTensorMinMaxObserver", {}),
    ("PerTensorMinMaxObserver", _ASYM),
    ("PerTensorMinMaxObserver", _FP8),
    ("PerChannelMinMaxObserver", {**_PER_CHANNEL, **_ASYM}),
    ("PerChannelMinMaxObserver", {**_PER_CHANNEL, **_ASYM, "dtype": "uint4"}),
    ("PerGroupMinMaxObserver", {**_GROUP, **_ASYM}),
    ("PerTensorHistogramObserver", {}),
    ("PerTensorPercentileObserver", {}),
    ("PerTensorPercentileObserver", _ASYM),
    ("PerTensorPercentileObserver", {**_PER_CHANNEL, **_ASYM}),
    ("PerTensorMSEObserver", {}),
    ("PerTensorMSEObserver", _ASYM),
    ("PerTensorMSEObserver", _FP8),
    ("PerTensorMSEObserver", {**_PER_CHANNEL, **_ASYM}),
    ("PerTensorHistogramObserverPro", {}),
    ("PerTensorHistogramObserverPro", _ASYM),
    ("PerTensorPowOf2MinMaxObserver", {}),
    ("PerTensorPowOf2MinMaxObserver", _ASYM),
    ("PerTensorPowOf2MinMSEObserver", {}),
    ("PerChannelPowOf2MinMaxObserver", {**_PER_CHANNEL, **_ASYM}),
    ("PerChannelPowOf2MinMSEObserver", _PER_CHANNEL),
    ("PerBlockMXObserver", _MX),
    ("PerBlockBFPObserver", {**_BLOCK, "dtype": "bfp16", "group_size": 8}),
    ("PlaceholderObserver", {"dtype": "bfloat16", "is_dynamic": False}),
]
#: Observers that cover their range: the grid reaches half its extremes.
_COVERING = ("MinMaxObserver", "PowOf2MinMaxObserver")

_SPECIAL = [0.0, 1.0, -1.0, F, -F, 3e38, -3e38, 1e-45, -1e-45, 3e-44, 1.2e-38, 2e-38]
_VALUE = st.one_of(
    st.sampled_from(_SPECIAL),
    st.floats(-F, F, allow_nan=False, width=32),
    st.floats(-(2.0**-100), 2.0**-100, allow_nan=False, width=32),
)
# Each batch: 16 values times 10**e (clamped to float32), e growing or not.
_BATCH = st.tuples(st.lists(_VALUE, min_size=16, max_size=16), st.integers(-45, 38))


def _tensor(values: list[float], exponent: int, dtype: torch.dtype) -> torch.Tensor:
    scaled = torch.tensor(values, dtype=torch.float64) * 10.0**exponent
    limit = torch.finfo(dtype).max
    return scaled.clamp(-limit, limit).to(dtype).reshape(2, 8)


@pytest.mark.filterwarnings(
    "ignore:PerTensorHistogramObserverPro. the observed range:RuntimeWarning"
)
@settings(max_examples=100)
@given(
    case=st.sampled_from(CASES),
    batches=st.lists(_BATCH, min_size=1, max_size=3),
    dtype=st.sampled_from(
        [torch.float32, torch.float32, torch.bfloat16, torch.float16]
    ),
)
def test_extreme_inputs_give_sound_qparams(
    case: tuple[str, dict[str, Any]],
    batches: list[tuple[list[float], int]],
    dtype: torch.dtype,
) -> None:
    name, spec = case
    observer = make(name, **spec)
    tensors = [_tensor(values, exponent, dtype) for values, exponent in batches]
    for x in tensors:
        observer(x)
    if name == "PlaceholderObserver":
        assert observer._calculate_qparams() is None
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # e.g. all-zero percentile
        qparams = observer._calculate_qparams()
    assert_sound(observer, qparams)
    if name.endswith(_COVERING):
        _assert_covers(observer, qparams, tensors, spec)
    if hasattr(observer, "calib_hist") and observer.calib_hist.dim() == 1:
        assert observer.calib_hist.numel() <= 4 * observer._default_bins


def _assert_covers(
    observer: Any,
    qparams: tuple[torch.Tensor, torch.Tensor],
    tensors: list[torch.Tensor],
    spec: dict[str, Any],
) -> None:
    """The quantization grid reaches at least half of the data's extremes, to
    a step (the zero point's rounding); float64, per channel / group the
    widest one's."""
    scale, zero_point = (q.double().reshape(-1) for q in qparams)
    data = torch.cat([t.double().reshape(-1) for t in tensors])
    if spec.get("qscheme") == "per_group":  # keeps only the latest batch
        data = tensors[-1].double().reshape(-1)
    qmin, qmax = float(observer.quant_min), float(observer.quant_max)
    step = float(scale.max())
    top = float(((qmax - zero_point) * scale).max())
    bottom = float(((qmin - zero_point) * scale).min())
    assert top + step >= max(float(data.max()), 0.0) / 2
    if qmin < 0 or not observer.symmetric:  # symmetric uint8: no negatives
        assert bottom - step <= min(float(data.min()), 0.0) / 2


@pytest.mark.parametrize("bins", [0, -3, 2.5, True])
def test_histogram_pro_rejects_bad_bins(bins: Any) -> None:
    # Before: torch's "bins must be > 0" / "Dimension size must be
    # non-negative" RuntimeErrors from deep inside.
    spec = ours.QTensorConfig(
        observer_cls="PerTensorHistogramObserverPro",
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        **INT,
    )
    with pytest.raises(ValueError, match="must be a positive int"):
        ours.PerTensorHistogramObserverPro(spec, bins=bins)
