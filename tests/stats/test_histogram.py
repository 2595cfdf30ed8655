"""Exact-count histograms: binning, growth, merge laws; the histogram observers."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import Observer, QuantizationArgs, flatten_for_calibration, native
from quantobs.observers import HistogramL2Observer, HistogramStatObserver
from quantobs.solvers.torch_l2 import torch_l2_search
from quantobs.stats.histogram import (
    Histogram,
    check_budget,
    empty_histogram,
    histogram_grid,
    histogram_of,
    merge_histograms,
    rebin,
    update_histogram,
)
from quantobs.stats.speculate import speculate

NAMES = ["histogram", "percentile", "entropy", "histogram_mse"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference_counts(x_flat: torch.Tensor, hist: Histogram) -> torch.Tensor:
    """Obviously-correct binning: float64 floor of x / width, one qparam at a time."""
    _, width = hist.edges()
    qshape = hist.qparam_shape
    x3 = x_flat.reshape(x_flat.shape[0], -1, x_flat.shape[-1])
    out = []
    for q in range(x3.shape[1]):
        values = x3[:, q].reshape(-1).to(torch.float64)
        values = values[torch.isfinite(values)]
        if hist.absolute:
            values = values.abs()
        cells = torch.floor(values / width.reshape(-1)[q]).to(torch.int64)
        index = cells - hist.offset.reshape(-1)[q]
        out.append(torch.bincount(index, minlength=hist.bins))
    return torch.stack(out).reshape(*qshape, hist.bins)


def _same(a: Histogram, b: Histogram) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state().values(), b.state().values(), strict=True)
    )


# ------------------------------------------------------------------ statistic


@pytest.mark.parametrize("absolute", [False, True], ids=["signed", "abs"])
@pytest.mark.parametrize(
    ("shape", "scale", "shift"),
    [
        ((200, 3, 50), 1.0, 0.0),
        ((1, 4, 999), 1e-3, 5.0),
        ((64, 1, 8), 3e4, -1e5),
        ((1, 1, 300000), 1.0, 0.0),  # one qparam, cut in pieces between threads
        ((3, 1, 70000), 2.0, 1.0),
    ],
)
def test_binning_is_exact(
    shape: tuple[int, ...], scale: float, shift: float, absolute: bool, backend: str
) -> None:
    x = torch.randn(shape, generator=_gen(1)) * scale + shift
    hist = histogram_of(x, bins=64, absolute=absolute)
    assert torch.equal(hist.counts, _reference_counts(x, hist))
    assert hist.counts.dtype == torch.int64
    # The grid covers the data and uses at least half its bins.
    lo, width = hist.edges()
    low, high = hist.value_range()
    assert bool((lo <= low).all()) and bool((high < lo + 64 * width).all())
    assert bool(((high - low) / width >= 64 / 2 - 2).all())
    if absolute:
        assert bool((hist.offset == 0).all())


def test_counts_are_exact_past_float32_saturation(backend: str) -> None:
    # torch.histc counts in float32: a bin stops at 2**24 (per thread).
    n = (1 << 24) + 5
    x = torch.ones(n).reshape(-1, 1, 1)
    x[0, 0, 0] = 0.0  # a second value, so the range is not a point
    hist = histogram_of(x, bins=16)
    assert hist.counts.sum().item() == n
    assert hist.counts.max().item() == n - 1


def test_grid_is_a_function_of_the_range() -> None:
    min_vals = torch.tensor([0.0, -1.0, 1000.0, -3e-30, 5.0, math.inf])
    max_vals = torch.tensor([0.0, 1.0, 1000.001, 2e-30, 5.0, -math.inf])
    exponent, offset = histogram_grid(min_vals, max_vals, 64)
    for q in range(5):
        w = 2.0 ** exponent[q].item()
        cells = math.floor(max_vals[q].item() / w) - math.floor(min_vals[q].item() / w)
        assert cells + 1 <= 64  # fits
        w_fine = w / 2
        finer = math.floor(max_vals[q].item() / w_fine) - math.floor(
            min_vals[q].item() / w_fine
        )
        # The smallest fitting width (or the float32 floor on widths).
        assert finer + 1 > 64 or exponent[q].item() <= -126 or cells == 0
        assert offset[q].item() == math.floor(min_vals[q].item() / w)
    assert exponent[5].item() == -126 and offset[5].item() == 0  # no data


def test_nonfinite_values_are_not_counted(backend: str) -> None:
    x = torch.randn(10, 2, 6, generator=_gen(2))
    x[0, 0, 0], x[3, 1, 2], x[4, 1, 5] = math.nan, math.inf, -math.inf
    hist = histogram_of(x, bins=32)
    assert hist.total().tolist() == [59, 58]
    assert torch.equal(hist.counts, _reference_counts(x, hist))


def test_budget_error_names_the_size_and_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"1000 qparams x 2048 bins = 2048000 int64 counts \(16 MiB\), above "
        r"max_counts=1000000; use a coarser granularity.*'static_mse'",
    ):
        check_budget(1000, 2048, max_counts=1_000_000)
    with pytest.raises(ValueError, match="bins must be an int >= 8"):
        empty_histogram((2,), bins=4)


_batch = st.tuples(
    st.integers(1, 20),  # rows
    st.floats(1e-3, 1e3),  # scale
    st.floats(-50, 50),  # shift
    st.integers(0, 2**31 - 1),  # seed
)


def _data(rows: int, scale: float, shift: float, seed: int) -> torch.Tensor:
    return torch.randn(rows, 3, 4, generator=_gen(seed)) * scale + shift


@settings(max_examples=40)
@given(
    batches=st.lists(_batch, min_size=1, max_size=4),
    absolute=st.booleans(),
    nan_every=st.sampled_from([0, 3, 7]),
)
def test_update_equals_observing_the_concatenation(
    batches: list[tuple[int, float, float, int]], absolute: bool, nan_every: int
) -> None:
    data = [_data(*b) for b in batches]
    if nan_every:  # some non-finite values, which are not counted
        for x in data:
            x.view(-1)[::nan_every] = math.nan
    hist = empty_histogram((3,), 32, absolute)
    for x in data:
        finite = bool(torch.isfinite(x).all())
        hist = update_histogram(hist, x, has_nonfinite=not finite)
    whole = histogram_of(torch.cat(data), 32, absolute)
    assert _same(hist, whole)
    finite_per_qparam = sum(torch.isfinite(x).sum(dim=(0, 2)) for x in data)
    assert hist.total().tolist() == finite_per_qparam.tolist()
    assert torch.equal(hist.counts, _reference_counts(torch.cat(data), hist))


@settings(max_examples=40)
@given(a=_batch, b=_batch, c=_batch)
def test_merge_laws(
    a: tuple[int, float, float, int],
    b: tuple[int, float, float, int],
    c: tuple[int, float, float, int],
) -> None:
    xa, xb, xc = _data(*a), _data(*b), _data(*c)
    ha, hb, hc = (histogram_of(x, 32) for x in (xa, xb, xc))
    whole = histogram_of(torch.cat([xa, xb, xc]), 32)
    left = merge_histograms(merge_histograms(ha, hb), hc)
    right = merge_histograms(ha, merge_histograms(hc, hb))
    assert _same(left, whole) and _same(right, whole)
    assert _same(merge_histograms(ha, empty_histogram((3,), 32)), ha)


def test_all_reduce_recipe_equals_one_process() -> None:
    # MIN/MAX all-reduce of the ranges, the grid of the result, re-bin, SUM.
    parts = [torch.randn(50, 2, 8, generator=_gen(s)) * (s + 1) - s for s in range(3)]
    local = [histogram_of(part, 32) for part in parts]
    min_vals = torch.stack([h.min_vals for h in local]).amin(dim=0)
    max_vals = torch.stack([h.max_vals for h in local]).amax(dim=0)
    exponent, offset = histogram_grid(min_vals, max_vals, 32)
    counts = torch.stack([rebin(h, exponent, offset).counts for h in local]).sum(0)
    whole = histogram_of(torch.cat(parts), 32)
    assert torch.equal(counts, whole.counts)
    assert torch.equal(exponent, whole.exponent) and torch.equal(offset, whole.offset)


def test_merge_refuses_different_layouts() -> None:
    a = histogram_of(torch.randn(4, 2, 3), 16)
    with pytest.raises(ValueError, match="cannot merge histograms of counts"):
        merge_histograms(a, histogram_of(torch.randn(4, 3, 3), 16))
    with pytest.raises(ValueError, match="absolute=True"):
        merge_histograms(a, histogram_of(torch.randn(4, 2, 3), 16, absolute=True))


# ------------------------------------------------------------------ observers


def _named(name: str, base_name: str = "weight", **kwargs: Any) -> Observer:
    args = kwargs.pop("args", QuantizationArgs(num_bits=8))
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kwargs)


_NVFP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "scale_dtype": torch.float8_e4m3fn,
}
# (id, base_name, args, shape of one batch): every strategy of every base name.
CASES: list[tuple[str, str, dict[str, Any], tuple[int, ...]]] = [
    ("w-tensor-int8", "weight", {"num_bits": 8}, (16, 32)),
    ("w-channel-int4", "weight", {"num_bits": 4, "strategy": "channel"}, (16, 32)),
    (
        "w-group-int4-asym",
        "weight",
        {"num_bits": 4, "group_size": 16, "symmetric": False},
        (16, 32),
    ),
    (
        "w-block-fp8",
        "weight",
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "block",
            "block_structure": [8, 16],
        },
        (20, 32),
    ),
    ("w-nvfp4", "weight", _NVFP4, (16, 32)),
    ("in-tensor-uint8", "input", {"num_bits": 8, "symmetric": False}, (2, 8, 32)),
    (
        "in-token-int8",
        "input",
        {"num_bits": 8, "strategy": "token", "dynamic": True},
        (2, 8, 32),
    ),
    ("out-group-int8", "output", {"num_bits": 8, "group_size": 16}, (2, 8, 32)),
    ("k-tensor-fp8", "k", {"num_bits": 8, "type": "float"}, (2, 4, 8, 16)),
    ("v-head-int8", "v", {"num_bits": 8, "strategy": "attn_head"}, (2, 4, 8, 16)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_and_base_name(
    name: str, case: tuple[str, str, dict[str, Any], tuple[int, ...]]
) -> None:
    _, base_name, kwargs, shape = case
    args = QuantizationArgs(**kwargs)
    observer = _named(name, base_name=base_name, args=args, bins=64)
    gen = _gen(3)
    for scale in (1.0, 3.0):
        observer.update(torch.randn(shape, generator=gen) * scale)
    scale_t, _ = observer.get_qparams()
    expected = flatten_for_calibration(torch.empty(shape), base_name, args).shape[1:-1]
    assert tuple(scale_t.shape) == tuple(expected)
    assert bool(torch.isfinite(scale_t).all()) and bool((scale_t > 0).all())
    min_vals, max_vals = observer.get_range()
    assert bool((min_vals <= max_vals).all())
    # Within the histogram's window (symmetric ranges: its largest magnitude).
    assert isinstance(observer, HistogramStatObserver)
    lo, width = observer.histogram.edges()
    reach = torch.maximum(lo.abs(), (lo + 64 * width).abs())
    assert bool((min_vals.abs() <= reach).all() and (max_vals.abs() <= reach).all())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "kwargs",
    [{"num_bits": 8}, {"num_bits": 4, "symmetric": False}],
    ids=["int8-sym", "int4-asym"],
)
def test_per_channel_equals_per_tensor_channel_by_channel(
    name: str, kwargs: dict[str, Any]
) -> None:
    weight = (
        torch.randn(6, 256, generator=_gen(4))
        * torch.tensor([0.1, 1.0, 10.0, 1.0, 3.0, 0.5])[:, None]
    )
    weight[3, 7] = 40.0  # an outlier in one channel
    channel = _named(
        name, args=QuantizationArgs(strategy="channel", **kwargs), bins=128
    )
    channel.update(weight)
    got = channel.get_range()
    for row in range(weight.shape[0]):
        tensor = _named(name, args=QuantizationArgs(**kwargs), bins=128)
        tensor.update(weight[row : row + 1])
        expected = tensor.get_range()
        assert torch.equal(got[0][row].reshape(1), expected[0].reshape(1)), row
        assert torch.equal(got[1][row].reshape(1), expected[1].reshape(1)), row


@pytest.mark.parametrize("name", NAMES)
def test_merge_equals_observing_everything(name: str) -> None:
    args = QuantizationArgs(num_bits=4, group_size=16, symmetric=False)
    gen = _gen(5)
    batches = [torch.randn(4, 32, generator=gen) * s for s in (0.5, 4.0, 1.0)]
    whole = _named(name, base_name="input", args=args, bins=64)
    parts = [_named(name, base_name="input", args=args, bins=64) for _ in batches]
    for batch, part in zip(batches, parts, strict=True):
        whole.update(batch)
        part.update(batch)
    merged = parts[2].merge(parts[0]).merge(parts[1])
    for ours, expected in zip(merged.get_qparams(), whole.get_qparams(), strict=True):
        assert torch.equal(ours, expected)
    assert merged.num_observations == whole.num_observations


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_then_continue(name: str) -> None:
    args = QuantizationArgs(num_bits=8, strategy="channel")
    gen = _gen(6)
    batches = [torch.randn(8, 64, generator=gen) * s for s in (1.0, 2.0)]
    straight = _named(name, args=args, bins=64)
    for batch in batches:
        straight.update(batch)
    first = _named(name, args=args, bins=64)
    first.update(batches[0])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = _named(name, args=args, bins=64)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    resumed.update(batches[1])
    for ours, expected in zip(
        resumed.get_qparams(), straight.get_qparams(), strict=True
    ):
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("name", NAMES)
def test_nan_policy(name: str) -> None:
    x = torch.randn(4, 16, generator=_gen(7))
    x[1, 2], x[2, :] = math.nan, -math.inf
    with pytest.raises(ValueError, match=r"got 17 non-finite value\(s\)"):
        _named(name, bins=64).update(x)
    args = QuantizationArgs(num_bits=8, strategy="channel")
    observer = _named(name, args=args, bins=64, nan_policy="omit")
    observer.update(x)
    assert isinstance(observer, HistogramStatObserver)
    assert observer.histogram.total().reshape(-1).tolist() == [16, 15, 0, 16]
    scale, _ = observer.get_qparams()
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    min_vals, max_vals = observer.get_range()
    assert min_vals[2] == 0 and max_vals[2] == 0  # a channel with no finite value


@pytest.mark.parametrize("name", NAMES)
def test_errors(name: str) -> None:
    observer = _named(name)
    with pytest.raises(RuntimeError, match="has no statistics; call update"):
        observer.get_qparams()
    budget = _named(
        name, args=QuantizationArgs(num_bits=8, strategy="channel"), max_counts=4096
    )
    with pytest.raises(
        ValueError, match=rf"observer '{name}' for 'weight' would keep 8 qparams x 2048"
    ):
        budget.update(torch.randn(8, 4))
    with pytest.raises(ValueError, match=rf"options for observer '{name}': bins=4"):
        _named(name, bins=4)


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("percentile", {"percentile": 0.0}, "percentile"),
        ("percentile", {"percentile": 100.5}, "percentile"),
        ("entropy", {"start_bin": 0}, "start_bin"),
        ("entropy", {"stride": 0}, "stride"),
        ("entropy", {"num_quantized_bins": 0}, "num_quantized_bins"),
        ("histogram", {"mode": "greedy"}, "mode"),
        ("histogram_mse", {"norm": 0}, "norm"),
        ("histogram_mse", {"maxshrink": 1.5}, "maxshrink"),
        ("histogram", {"percentile": 99.0}, "Extra inputs are not permitted"),
    ],
)
def test_bad_options(name: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _named(name, **options)


def test_torch_mode_is_torchs_search_on_our_histogram() -> None:
    args = QuantizationArgs(num_bits=8, symmetric=False, strategy="channel")
    observer = _named("histogram", args=args, mode="torch", bins=256)
    weight = torch.randn(3, 500, generator=_gen(8))
    weight[1, 0] = 30.0
    observer.update(weight)
    assert isinstance(observer, HistogramL2Observer)
    hist = observer.histogram
    lo, width = hist.edges()
    min_vals, max_vals = observer.get_range()
    for q in range(3):
        expected = torch_l2_search(
            hist.counts[q, 0].float(),
            lo[q, 0].float(),
            (lo[q, 0] + 256 * width[q, 0]).float(),
            256,
        )
        assert torch.equal(min_vals[q, 0], expected[0])
        assert torch.equal(max_vals[q, 0], expected[1])


def test_histogram_levels_follow_the_format() -> None:
    # Global mode: the returned range's ends are destination-bin centers, so
    # scale = (max - min) / (qmax - qmin) is the destination bin width.
    x = torch.rand(4000, generator=_gen(9)).reshape(-1, 1)
    for bits in (4, 8):
        observer = _named(
            "histogram",
            base_name="input",
            args=QuantizationArgs(num_bits=bits, symmetric=False),
            bins=64,
        )
        observer.update(x)
        min_vals, max_vals = observer.get_range()
        levels = 2**bits
        step = (max_vals - min_vals) / (levels - 1)
        assert float(max_vals + step / 2) <= float(x.max()) + 1e-6 + 1 / 64
        assert float(min_vals) >= -step / 2 - 1e-6


# ----------------------------------------------- speculative one-pass update


def _speculation_batches(case: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(len(case))
    normal = [torch.randn(1 << 17, generator=gen) for _ in range(4)]
    if case == "growing":
        return [x * (1 + 0.5 * k) for k, x in enumerate(normal)]
    if case == "shrinking":
        return [x / (1 + k) for k, x in enumerate(normal)]
    if case == "sorted":  # a sample guesses the first grid from a spread
        return [torch.sort(x).values for x in normal]
    if case == "jump":  # most of batch 2 outside the window: set-aside overflow
        return [normal[0], normal[1] * 1000, normal[2]]
    if case == "tiny":  # -1e-42 in bin -1 of the first grid, 0 of the next
        mixed = normal[1] * 1e-20
        mixed[::997], mixed[::1001] = -1e-42, 1e10
        return [normal[0] * 1e-20, mixed, mixed]
    if case == "huge":  # grids past 2**49: counted twice, not speculated
        return [normal[0], normal[1] * 1e30]
    raise AssertionError(case)


SPECULATION_CASES = ["growing", "shrinking", "sorted", "jump", "tiny", "huge"]


@pytest.mark.parametrize("case", SPECULATION_CASES)
@pytest.mark.parametrize("absolute", [False, True])
def test_speculative_update_equals_two_passes(case: str, absolute: bool) -> None:
    hist = empty_histogram((1,), 2048, absolute)
    plain = empty_histogram((1,), 2048, absolute)
    used = 0
    for x in _speculation_batches(case):
        x_flat = x.reshape(1, 1, -1)
        spec = speculate(hist, x_flat)
        used += spec is not None
        batch_range = spec.batch_range if spec is not None else None
        hist = update_histogram(hist, x_flat, batch_range, speculation=spec)
        plain = update_histogram(plain, x_flat)
        for name, value in plain.state().items():
            assert torch.equal(hist.state()[name], value), (case, name)
    if native.available():
        assert used >= (1 if case in ("jump", "huge") else 3)


def test_speculation_declines_what_it_cannot_do() -> None:
    hist = update_histogram(empty_histogram((1,), 2048), torch.randn(1, 1, 1 << 17))
    big = torch.randn(1, 1, 1 << 17)
    assert speculate(hist, big * 1000) is None  # set-aside budget exceeded
    assert speculate(hist, big[..., :100]) is None  # small: two passes
    assert speculate(hist, big.double()) is None
    two = empty_histogram((2,), 2048)
    assert speculate(two, torch.randn(1, 2, 1 << 17)) is None  # per tensor only
    spec = speculate(hist, big)
    other = big.clone()
    if spec is not None:  # a speculation completes only its own batch
        assert spec.matches(hist, big) and not spec.matches(hist, other)


@pytest.mark.parametrize("policy", ["raise", "omit"])
def test_speculative_observer_handles_nonfinite_like_two_passes(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quantobs.stats.speculate as observers

    args = QuantizationArgs(num_bits=8, symmetric=False)
    x = torch.randn(64, 2048)
    bad = x.clone()
    bad[0, 5], bad[3, 77], bad[9, 1000] = math.nan, math.inf, -math.inf

    def run() -> Observer:
        obs = Observer.load_from_registry(
            "histogram", base_name="input", args=args, nan_policy=policy
        )
        obs.update(x)
        if policy == "raise":
            with pytest.raises(ValueError, match="3 non-finite"):
                obs.update(bad)
        else:
            obs.update(bad)
        obs.update(x * 2)
        return obs

    fast = run()
    monkeypatch.setattr(observers, "speculate", lambda hist, x_flat: None)
    slow = run()
    for name, value in slow.statistic().state().items():
        assert torch.equal(fast.statistic().state()[name], value), name


@settings(max_examples=25, deadline=None)
@given(
    scales=st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=4),
    shifts=st.lists(st.floats(-10.0, 10.0), min_size=4, max_size=4),
    absolute=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_speculative_updates_equal_two_passes_property(
    scales: list[float], shifts: list[float], absolute: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    hist = plain = empty_histogram((1,), 512, absolute)
    for scale, shift in zip(scales, shifts, strict=False):
        x = (torch.randn(1, 1, 1 << 16, generator=gen) + shift) * scale
        spec = speculate(hist, x)
        batch_range = spec.batch_range if spec is not None else None
        hist = update_histogram(hist, x, batch_range, speculation=spec)
        plain = update_histogram(plain, x)
    for name, value in plain.state().items():
        assert torch.equal(hist.state()[name], value), name


def test_histogram_observer_pickles_after_a_refused_batch() -> None:
    args = QuantizationArgs(num_bits=8, symmetric=False)
    obs = Observer.load_from_registry("histogram", base_name="input", args=args)
    x = torch.randn(64, 2048)
    obs.update(x)
    bad = x.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        obs.update(bad)  # speculated, then refused by the NaN policy
    buffer = io.BytesIO()
    torch.save(obs, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for name, value in obs.statistic().state().items():
        assert torch.equal(loaded.statistic().state()[name], value)
