"""The native kernels against their eager torch twins.

Skipped where no C compiler builds them; `backend`-parametrized tests
elsewhere (llm-compressor parity, min/max layouts) run both paths.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from quantobs import QuantizationArgs, native
from quantobs.core.layout import flatten_for_calibration
from quantobs.core.qparams import calculate_qparams, generate_gparam
from quantobs.core.scoring import candidate_errors, search_args, shrink_factors
from quantobs.stats.reduce import minmax
from tests.observers.test_observers import _MXFP4, _NVFP4

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: the native kernels are not built"
)

FORMATS = {
    "int4": {"num_bits": 4},
    "int4-asym": {"num_bits": 4, "symmetric": False},
    "int8": {"num_bits": 8},
    "uint8-range-asym": {"num_bits": 8, "symmetric": False},
    "fp8-e4m3": {"num_bits": 8, "type": "float"},
    "fp4-e2m1": {"num_bits": 4, "type": "float"},
}


def _eager(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    previous = native.set_enabled(False)
    try:
        return run()
    finally:
        native.set_enabled(previous)


def _qparams(
    args: QuantizationArgs,
    mins: torch.Tensor,
    maxs: torch.Tensor,
    factors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    scale, zero_point = calculate_qparams(
        mins[None] * factors[:, None], maxs[None] * factors[:, None], args
    )
    return scale, None if args.symmetric else zero_point


def _values(count: int, seed: int = 0) -> torch.Tensor:
    """Values over many binades, plus exact grid points and rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.randint(-30, 12, (count,), generator=gen).float())
    x = torch.randn(count, generator=gen) * mags
    # k / 32: grid values and midpoints of every format at scales 1, 1/4, 2
    ties = torch.arange(-512, 513, dtype=torch.float32) / 32
    return torch.cat([x, ties, torch.tensor([0.0, -0.0, 1e-40, -3e-39, 448.0])])


@pytest.mark.parametrize("groups", [8, 9, 16, 32, 64, 128, 4096, 100])
@pytest.mark.parametrize("rows", [1, 3])
def test_minmax_equals_torch(groups: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(groups * 10 + rows)
    x = torch.randn(rows, 37, groups, generator=gen)
    x[0, 5, 0] = float("nan")
    x[-1, 7, -1] = float("nan")
    x[0, 9, 0] = float("inf")
    x[-1, 11, -1] = float("-inf")
    got = native.minmax(x)
    assert got is not None
    for ours, theirs in zip(got, (x.amin(dim=(0, 2)), x.amax(dim=(0, 2))), strict=True):
        nan = torch.isnan(theirs)
        assert torch.equal(torch.isnan(ours), nan)
        assert torch.equal(ours[~nan], theirs[~nan])
    assert torch.isnan(got[0][[5, 7]]).all() and torch.isnan(got[1][[5, 7]]).all()


def test_minmax_of_many_rows_equals_torch() -> None:
    # rows split between threads, partial min/max folded
    x = torch.randn(257, 5, 24, generator=torch.Generator().manual_seed(4))
    x[200, 3, 7] = float("nan")
    got = native.minmax(x)
    assert got is not None
    assert torch.equal(got[0][[0, 1, 2, 4]], x.amin(dim=(0, 2))[[0, 1, 2, 4]])
    assert torch.equal(got[1][[0, 1, 2, 4]], x.amax(dim=(0, 2))[[0, 1, 2, 4]])
    assert torch.isnan(got[0][3]) and torch.isnan(got[1][3])


def test_minmax_declines_what_it_does_not_handle() -> None:
    assert native.minmax(torch.randn(64, 8, 4)) is None  # short groups: torch
    x = torch.randn(2, 8, 16)
    assert native.minmax(x.to(torch.bfloat16)) is None  # float32 only
    assert native.minmax(x.transpose(0, 1)) is None  # contiguous only
    assert native.minmax(x[0]) is None  # (N, Q, G) only
    # ... and stats.minmax falls back to torch for them
    bf16 = x.to(torch.bfloat16)
    assert torch.equal(minmax(bf16)[0], bf16.float().amin(dim=(0, -1)))


@pytest.mark.parametrize("fused", [False, True], ids=["mul_add", "fma"])
@pytest.mark.parametrize(
    "stride", [11, pytest.param(1, marks=pytest.mark.slow)], ids=["strided", "every"]
)
def test_pow24_is_within_3e_7_of_exact(fused: bool, stride: int) -> None:
    """The float32 of [1, 32) (5 binades, one per residue of the exponent
    mod 5: every mantissa, or every 11th), and their products with powers of
    32: scaling a by 32 scales pow24(a) by 2**12 exactly (while the result
    stays normal), so with stride 1 this covers every a in [2**-52, 2**53)
    (largest error found: 2.9e-7 both ways)."""
    bits = torch.arange(0, 1 << 23, stride, dtype=torch.int32)
    for binade in range(5):
        a = ((127 + binade) << 23 | bits).view(torch.float32)  # [2**b, 2**(b+1))
        got = native.pow24(a, fused)
        if got is None:
            pytest.skip("no fused multiply-adds on this CPU or build")
        exact = a.double() ** 2.4
        assert ((got.double() - exact) / exact).abs().max().item() < 3e-7
    a, got = a[::373], got[::373]
    for power in range(-10, 11):  # a * 32**power in [2**-46, 2**60)
        scaled = native.pow24(a * 32.0**power, fused)
        assert scaled is not None
        want = got * 2.0 ** (12 * power)  # exact: a power of two
        normal = want.abs() >= torch.finfo(torch.float32).tiny
        assert torch.equal(scaled[normal], want[normal])
    edge = native.pow24(torch.tensor([0.0, 1e-40, 1.0, float("inf")]), fused)
    assert edge is not None and edge.tolist() == [0.0, 0.0, 1.0, float("inf")]


def test_pow24_of_the_kernels_is_one_of_both() -> None:
    a = torch.rand(4096) * 4
    got = native.pow24(a)
    assert got is not None
    fused = native.pow24(a, True)
    assert torch.equal(got, native.pow24(a, False)) or torch.equal(got, fused)


@pytest.mark.parametrize("fmt", FORMATS, ids=list(FORMATS))
def test_rounding_equals_eager_element_by_element(fmt: str) -> None:
    """Norm 2, one nonzero value per group (zeros score exactly 0): each error
    is one squared rounding error, computed with the same float32 operations
    on both sides, so equal exactly."""
    args = QuantizationArgs(**FORMATS[fmt], strategy="channel")
    values = _values(20000)
    x = torch.zeros(1, values.numel(), 8)  # (N=1, Q, G=8)
    x[0, :, 3] = values
    # candidate ranges +-factor: scales 1, 1/4, 2 (grids land exactly), tiny
    half = (args.format.max - args.format.min) / 2
    factors = half * torch.tensor([1.0, 0.25, 2.0, 1e-3, 1e-9])
    mins, maxs = torch.full((x.shape[1],), -1.0), torch.full((x.shape[1],), 1.0)
    got = native.mse_errors(x, *_qparams(args, mins, maxs, factors), args.format, 2.0)
    expected = _eager(lambda: candidate_errors(x, args, mins, maxs, factors, norm=2.0))
    assert got is not None and torch.equal(got, expected)


_WEIGHT, _INPUT = (256, 512), (4, 64, 512)
# (id, base_name, args, shape, round_scales)
CASES = [
    ("int4-group", "weight", {"num_bits": 4, "group_size": 128}, _WEIGHT, False),
    (
        "int4-asym-group",
        "weight",
        {"num_bits": 4, "group_size": 128, "symmetric": False},
        _WEIGHT,
        False,
    ),
    ("int8-channel", "weight", {"num_bits": 8, "strategy": "channel"}, _WEIGHT, False),
    ("fp8-tensor", "input", {"num_bits": 8, "type": "float"}, _INPUT, False),
    ("int8-groups", "input", {"num_bits": 8, "group_size": 64}, _INPUT, False),
    ("nvfp4", "weight", _NVFP4, _WEIGHT, False),
    ("nvfp4-rounded-scales", "weight", _NVFP4, _WEIGHT, True),
    ("mxfp4", "weight", _MXFP4, _WEIGHT, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_candidate_errors_equal_eager(
    case: tuple[str, str, dict[str, Any], tuple[int, ...], bool],
) -> None:
    _, base_name, kwargs, shape, round_scales = case
    args = QuantizationArgs(**kwargs)
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen)
    x = flatten_for_calibration(value, base_name, args)
    mins, maxs = minmax(x)
    scoring = search_args(args, round_scales)
    gscale = generate_gparam(mins.min(), maxs.max()) if round_scales else None
    factors = shrink_factors(0.2, 100)

    def errors() -> torch.Tensor:
        return candidate_errors(x, scoring, mins, maxs, factors, global_scale=gscale)

    got, expected = errors(), _eager(errors)
    assert torch.allclose(got, expected, rtol=2e-6, atol=0)
    # the chosen candidates agree wherever the eager errors do not nearly tie
    best = expected.min(dim=0).values
    runner_up = expected.where(expected > best, float("inf")).min(dim=0).values
    clear = runner_up > best * (1 + 1e-5)
    assert torch.equal(got.argmin(dim=0)[clear], expected.argmin(dim=0)[clear])


def _histc_inputs() -> list[tuple[torch.Tensor, int, float, float]]:
    gen = torch.Generator().manual_seed(5)
    cases = []
    for trial in range(60):
        x = torch.randn(int(torch.randint(1, 3000, (), generator=gen)), generator=gen)
        x = (x + trial) * [1.0, 1e-30, 1e4, 3e3][trial % 4]
        bins = int(torch.randint(1, 2500, (), generator=gen))
        lo, hi = (float(v) for v in torch.aminmax(x))
        if trial % 3 == 0:  # a wider range with values exactly on its bin edges
            lo, hi = lo - 1.0, hi * 2 + 1.0
            edges = torch.linspace(lo, hi, bins + 1)
            x = torch.cat([x, edges, torch.tensor([math.nan])])
        if trial % 5 == 0:  # values outside the range are skipped
            lo, hi = (lo + hi) / 2 - 0.1, hi - 0.25 * (hi - lo)
        cases.append((x, bins, lo, hi))
    return cases


def test_histc_equals_torch_bit_for_bit() -> None:
    for x, bins, lo, hi in _histc_inputs():
        got = native.histc(x, bins, lo, hi)
        assert got is not None
        assert torch.equal(got, torch.histc(x, bins, min=lo, max=hi))


def test_histc_declines_where_torch_counts_differently() -> None:
    x = torch.randn(100)
    assert native.histc(x.to(torch.bfloat16), 10, -1.0, 1.0) is None  # bf16 math
    assert native.histc(x, 10, 1.0, 1.0) is None  # torch widens a point range
    assert native.histc(x * 3e37, 300, -1e38, 1e38) is None  # (v - lo) * bins overflows
    many = torch.zeros((1 << 24) + 1)  # a bin past 2**24: float32 counts round
    assert native.histc(many, 4, -1.0, 1.0) is None


def test_unsupported_norms_and_formats_stay_eager() -> None:
    x = torch.randn(1, 4, 16)
    scale = torch.ones(2, 4)
    fmt = QuantizationArgs(num_bits=8).format
    assert native.mse_errors(x, scale, None, fmt, 3.0) is None
    assert native.mse_errors(x.double(), scale, None, fmt, 2.4) is None
    assert (
        native.mse_errors(x.reshape(1, 16, 4), scale.repeat(1, 4), None, fmt, 2.4)
        is None
    )
    assert native.mse_errors(x, scale, None, fmt, 2.4) is not None


def test_disabled_by_environment() -> None:
    code = "from quantobs import native; print(native.available())"
    env = {**os.environ, "QUANTOBS_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_set_enabled_switches_and_returns_previous() -> None:
    assert native.set_enabled(False) is True
    assert not native.available()
    assert native.set_enabled(True) is False
    assert native.available()


def test_l2_errors_equal_the_eager_closed_form() -> None:
    from quantobs.solvers.l2_error import exact_errors, prefix_moments

    gen = torch.Generator().manual_seed(9)
    for bins, levels in ((48, 4), (300, 16), (2048, 256)):
        counts = torch.rand(1, bins, generator=gen).double() ** 4 * 1000
        counts[0, torch.randint(0, bins, (bins // 3,), generator=gen)] = 0
        prefix = prefix_moments(counts)
        lo = torch.randint(0, bins - 1, (500,), generator=gen).double()
        hi = lo + 1 + (torch.rand(500, generator=gen) * (bins - lo - 1)).floor()
        lo = lo + torch.rand(500, generator=gen) * 0.5  # off the bin edges too
        got = native.l2_errors(prefix[0], lo, hi, levels)
        expected = exact_errors(prefix, counts, lo[None], hi[None], levels)[0]
        assert got is not None
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-9)


def test_shape_mismatches_are_errors_not_overruns() -> None:
    x = torch.randn(1, 4, 16)
    fmt = QuantizationArgs(num_bits=8).format
    with pytest.raises(ValueError, match="scale must be"):
        native.mse_errors(x, torch.ones(2, 3), None, fmt, 2.4)
    with pytest.raises(ValueError, match="counts must be"):
        native.add_counts(
            x,
            torch.ones(4),
            torch.zeros(4),
            torch.zeros(3, 8, dtype=torch.int64),
            False,
        )
    with pytest.raises(ValueError, match="table must be"):
        native.l2_errors(torch.zeros(8, 3, dtype=torch.float64), x[0, 0], x[0, 0], 4)


@pytest.mark.parametrize("counts", ["integer", "fractional"])
def test_entropy_divergences_equal_eager(counts: str) -> None:
    from quantobs.solvers.entropy import _divergences, _prefixes

    gen = torch.Generator().manual_seed(12)
    h = (torch.rand(7, 300, generator=gen) ** 3 * 50).floor().double()
    h[2, 150:] = 0  # empty tail: impossible candidates
    h[3] = 0  # no data at all
    if counts == "fractional":  # no log table: the kernel calls log
        h = h * 0.75
    prefixes = _prefixes(h)
    cands = torch.arange(20, 301, 3)
    for levels in (16, 128, 100):
        got = native.entropy(h, cands, levels)
        assert got is not None
        expected = _divergences(h, prefixes, cands, levels)
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        finite = torch.isfinite(expected)
        assert torch.allclose(got[finite], expected[finite], rtol=1e-9, atol=1e-12)


SCALE_ARGS = {
    "int4": {"num_bits": 4},
    "int8": {"num_bits": 8},
    "fp8-e4m3": {"num_bits": 8, "type": "float"},
    "fp4-e4m3-scales": {
        "num_bits": 4,
        "type": "float",
        "scale_dtype": torch.float8_e4m3fn,
    },
    "nvfp4": _NVFP4,
}


def _scale_ranges(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranges over every binade, zeros, and FP8 e4m3 rounding ties of amax / 6."""
    gen = torch.Generator().manual_seed(seed)
    count = 20000
    mags = torch.exp2(torch.randint(-140, 120, (2, count), generator=gen).float())
    lo, hi = -(torch.rand(2, count, generator=gen) * mags)
    hi = -hi
    # e4m3 grid points and midpoints k / 2**10 (subnormal step 2**-9) up to 480,
    # times 6: exact in float32, so amax / 6 lands on them exactly
    ties = torch.arange(0, 480 * 1024, 7, dtype=torch.float32) / 1024 * 6
    ties = torch.cat([ties, torch.tensor([0.0, -0.0, 1e-45, 448.0 * 6, 3e38])])
    lo = torch.cat([lo, -ties, torch.zeros_like(ties)])
    hi = torch.cat([hi, torch.zeros_like(ties), ties])
    return lo, hi


@pytest.mark.parametrize("name", sorted(SCALE_ARGS))
@pytest.mark.parametrize("global_scale", [None, 1.0, 3.7e-3])
def test_symmetric_scales_equal_eager_bit_for_bit(
    name: str, global_scale: float | None
) -> None:
    args = QuantizationArgs(**SCALE_ARGS[name])
    lo, hi = _scale_ranges(len(name))
    if global_scale is not None:  # products must stay finite
        lo, hi = lo.clamp(min=-1e36), hi.clamp(max=1e36)
    g = None if global_scale is None else torch.tensor([global_scale])
    # the kernel's result, not a fallback: the kernel itself must accept
    assert native.symmetric_scales(lo, hi, 1.0, None, False, 1.0, False) is not None
    scale, zero_point = calculate_qparams(lo, hi, args, g)
    eager_scale, eager_zp = _eager(lambda: calculate_qparams(lo, hi, args, g))
    assert scale.dtype == eager_scale.dtype == torch.float32
    assert torch.equal(scale.view(torch.int32), eager_scale.view(torch.int32))
    assert zero_point.dtype == eager_zp.dtype and torch.equal(zero_point, eager_zp)
    assert bool((scale > 0).all()) and bool(torch.isfinite(scale).all())


def test_symmetric_scales_leave_errors_to_the_torch_path() -> None:
    args = QuantizationArgs(**_NVFP4)
    lo, hi = -torch.rand(64), torch.rand(64)
    empty_lo, empty_hi = lo.clone(), hi.clone()
    empty_lo[3], empty_hi[3] = math.inf, -math.inf
    assert (
        native.symmetric_scales(empty_lo, empty_hi, 6.0, None, True, 1.0, False) is None
    )
    with pytest.raises(ValueError, match="non-finite range"):
        calculate_qparams(empty_lo, empty_hi, args)
    # an observer's empty qparam counts as the range (0, 0): eps scale
    scale, _ = calculate_qparams(empty_lo, empty_hi, args, empty_as_zero=True)
    eager, _ = _eager(
        lambda: calculate_qparams(empty_lo, empty_hi, args, empty_as_zero=True)
    )
    assert torch.equal(scale, eager) and float(scale[3]) == 0.125
    nan_lo = lo.clone()
    nan_lo[5] = math.nan
    with pytest.raises(ValueError, match="non-finite range"):
        calculate_qparams(nan_lo, hi, args, empty_as_zero=True)
    with pytest.raises(ValueError, match="min_vals > max_vals"):
        calculate_qparams(hi + 1, hi, args)
    with pytest.raises(ValueError, match="overflowed"):
        calculate_qparams(lo * 1e30, hi * 1e30, args, torch.tensor([1e30]))


def test_range_absmax_equals_eager() -> None:
    from quantobs.stats.reduce import absmax_or_zero

    lo, hi = _scale_ranges(3)
    lo[::7], hi[::7] = math.inf, -math.inf  # empty qparams count 0
    expected = _eager(lambda: absmax_or_zero(lo, hi))
    assert torch.equal(absmax_or_zero(lo, hi), expected)
    assert float(expected) == float(torch.maximum(-lo[lo <= hi], hi[lo <= hi]).max())
    hi[1] = math.inf  # a non-empty infinite range: the torch path's inf
    assert native.range_absmax(lo, hi) is None
    assert math.isinf(float(absmax_or_zero(lo, hi)))


def test_all_finite_equals_torch() -> None:
    x = torch.randn(100003)
    assert native.all_finite(x) is True
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, 50000, 100002):
            y = x.clone()
            y[where] = bad
            assert native.all_finite(y) is False
    extremes = torch.tensor([3.4e38, -1e-45, 0.0]).repeat(1 << 14)
    assert native.all_finite(extremes) is True
    assert native.all_finite(extremes[:3]) is None  # small: torch decides
    assert native.all_finite(x.double()) is None  # not float32: torch decides


@pytest.mark.parametrize("dst_nbins", [256, 128, 16, 3])
def test_torch_l2_terms_equal_eager_bit_for_bit(dst_nbins: int) -> None:
    from quantobs.solvers.torch_l2 import torch_l2_errors

    gen = torch.Generator().manual_seed(dst_nbins)
    for bins, width in ((2048, 1.3e-3), (256, 7.0), (101, 3.3e-7), (8, 1e4)):
        hist = torch.randint(0, 1000, (1, bins), generator=gen).float()
        hist[0, torch.rand(bins, generator=gen) < 0.3] = 0.0
        starts = torch.randint(0, bins, (64,), generator=gen)
        ends = torch.minimum(
            starts + torch.randint(0, bins, (64,), generator=gen),
            torch.tensor(bins - 1),
        )
        bin_width = torch.full((64,), width, dtype=torch.float64) * (
            1 + torch.rand(64, generator=gen, dtype=torch.float64)
        )
        # a zero destination width (torch: error 0), one below float32 (torch
        # divides by a float32 zero)
        bin_width[0], bin_width[1] = 0.0, 1e-50
        for shared in (True, False):
            h = hist if shared else hist.expand(64, bins) * 1.5
            got = torch_l2_errors(h, bin_width, dst_nbins, starts, ends)
            args = (h, bin_width, dst_nbins, starts, ends)
            expected = _eager(functools.partial(torch_l2_errors, *args))
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
            assert float(got[0]) == 0.0
    with pytest.raises(ValueError, match="starts, ends, widths"):
        native.torch_l2_terms(hist, starts, ends, bin_width[:3], 4)


def test_minmax_reports_the_absmax_of_finite_data() -> None:
    from quantobs.core.qparams import all_finite
    from quantobs.stats.reduce import absmax_or_zero

    x = torch.randn(4, 64, 16)
    found = native.minmax_absmax(x)
    assert found is not None
    mins, maxs, absmax = found
    assert absmax == float(x.abs().max())
    assert float(absmax_or_zero(mins, maxs)) == absmax
    bad = x.clone()
    bad[1, 2, 3] = math.inf  # nothing is reported for non-finite data
    lo, hi, none = native.minmax_absmax(bad)  # type: ignore[misc]
    assert none is None and not all_finite(lo, hi)
