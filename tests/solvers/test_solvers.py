"""Solvers: torch.ao parity of the L2 search, global L2 optimality, references."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.ao.quantization.observer import HistogramObserver

from quantobs import QuantizationArgs, calculate_qparams, fake_quantize, native
from quantobs.core.scoring import shrink_factors
from quantobs.solvers import (
    entropy_search,
    histogram_mse_search,
    l2_errors,
    l2_search,
    percentile_range,
    torch_l2_search,
    torch_l2_search_batched,
)
from quantobs.solvers.l2_bounds import L2Bounds, bound_survivors, certify
from quantobs.solvers.l2_error import exact_errors, prefix_moments, row_errors
from quantobs.solvers.percentile import percentile_upper
from quantobs.solvers.torch_l2 import torch_l2_terms
from quantobs.stats.histogram import histogram_of


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _student_t(n: int, gen: torch.Generator, df: float = 2.0) -> torch.Tensor:
    # Student-t from normals and a chi-square (seeded; Distribution.sample is not).
    normal = torch.randn(n, generator=gen)
    chi2 = torch.randn(n, int(df), generator=gen).pow(2).sum(dim=1)
    return normal / (chi2 / df).sqrt()


def _laplace(n: int, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=gen) - 0.5
    return -u.sign() * torch.log1p(-2 * u.abs())


def _outlier(n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen)
    x[n // 3] = 1e4
    return x


# (id, batches): the distributions of issue 4, several batches each.
DISTRIBUTIONS: dict[str, Callable[[torch.Generator], list[torch.Tensor]]] = {
    "normal": lambda g: [torch.randn(1 << 16, generator=g) for _ in range(3)],
    "laplace": lambda g: [_laplace(1 << 16, g) for _ in range(3)],
    "relu": lambda g: [torch.relu(torch.randn(1 << 16, generator=g)) for _ in range(3)],
    "student-t2": lambda g: [_student_t(1 << 16, g) for _ in range(3)],
    "outlier": lambda g: [torch.randn(1 << 16, generator=g), _outlier(1 << 16, g)],
    "growing": lambda g: [
        torch.randn(1 << 14, generator=g) * s for s in (0.1, 1.0, 10.0, 3.0)
    ],
    "shrinking-shifted": lambda g: [
        torch.randn(1 << 14, generator=g) * s + s for s in (10.0, 1.0, 0.1)
    ],
    "constant": lambda g: [torch.full((100,), 2.5)],
}

# (id, torch observer kwargs)
TORCH_CONFIGS = {
    "quint8-affine": {"dtype": torch.quint8, "qscheme": torch.per_tensor_affine},
    "qint8-symmetric": {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
    "quint8-0..127": {"dtype": torch.quint8, "quant_min": 0, "quant_max": 127},
    "qint8-256-bins": {"dtype": torch.qint8, "bins": 256},
}


def _torch_observer(config: str, batches: list[torch.Tensor]) -> HistogramObserver:
    observer = HistogramObserver(**TORCH_CONFIGS[config])
    for batch in batches:
        observer(batch)
    return observer


@pytest.mark.peers
@pytest.mark.parametrize("config", list(TORCH_CONFIGS))
@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_torch_l2_search_equals_torch(dist: str, config: str, backend: str) -> None:
    observer = _torch_observer(config, DISTRIBUTIONS[dist](_gen(0)))
    expected = observer._non_linear_param_search()
    got = torch_l2_search(
        observer.histogram, observer.min_val, observer.max_val, observer.dst_nbins
    )
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs)
    scale, zero_point = observer._calculate_qparams(*got)
    expected_scale, expected_zero_point = observer.calculate_qparams()
    assert torch.equal(scale, expected_scale)
    assert torch.equal(zero_point, expected_zero_point)


def _random_histogram(kind: str, bins: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "dense":
        return torch.rand(bins, generator=gen)
    if kind == "sparse":
        mask = torch.rand(bins, generator=gen) < 0.05
        return mask * torch.randint(1, 1000, (bins,), generator=gen).float()
    if kind == "spikes":
        hist = torch.zeros(bins)
        hist[torch.randint(0, bins, (3,), generator=gen)] = 1e5
        return hist
    if kind == "gauss-1e6":
        return torch.exp(-(torch.linspace(-5, 5, bins) ** 2)) * 1e6
    return torch.zeros(bins)  # "empty"


_STATES = [
    (256, 256, -1.0, 2.0),
    (64, 16, 3e-3, 1e-4),
    (101, 128, -7e3, 3e2),
    (3, 256, 0.5, 1.0),
]


@pytest.mark.peers
@pytest.mark.parametrize(
    ("kind", "bins", "dst_nbins", "min_val", "width"),
    [
        *[
            (kind, *state)
            for kind in ("dense", "sparse", "spikes", "gauss-1e6")
            for state in _STATES
        ],
        # torch's loop spins through 10**5 steps on these: one of each.
        ("empty", 256, 256, -1.0, 2.0),
        ("dense", 1, 256, 0.0, 1.0),
    ],
)
def test_torch_l2_search_on_arbitrary_state(
    kind: str, bins: int, dst_nbins: int, min_val: float, width: float, backend: str
) -> None:
    # torch's search run on a state set by hand: histograms no update rule
    # produces, odd bin counts and destination levels.
    observer = HistogramObserver(bins=bins)
    observer.histogram = _random_histogram(kind, bins, _gen(bins))
    observer.min_val = torch.tensor(min_val)
    observer.max_val = torch.tensor(min_val + width)
    observer.dst_nbins = dst_nbins
    expected = observer._non_linear_param_search()
    got = torch_l2_search(
        observer.histogram, observer.min_val, observer.max_val, dst_nbins
    )
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize(
    ("histogram", "dst_nbins", "error", "match"),
    [
        (torch.ones(8, dtype=torch.float64), 256, TypeError, r"float32.*\.float\(\)"),
        (torch.ones(2, 4), 256, ValueError, r"1-D with at least one bin.*\(2, 4\)"),
        (torch.ones(0), 256, ValueError, "at least one bin"),
        (torch.tensor([1.0, -1.0]), 256, ValueError, "non-negative"),
        (torch.tensor([1.0, float("nan")]), 256, ValueError, "finite"),
        (torch.ones(8), 0, ValueError, "dst_nbins must be a positive int.*0"),
    ],
)
def test_torch_l2_search_errors(
    histogram: torch.Tensor, dst_nbins: int, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        torch_l2_search(histogram, torch.tensor(0.0), torch.tensor(1.0), dst_nbins)


# ------------------------------------------------- batched torch search, global


def test_torch_l2_search_batched_equals_rows() -> None:
    gen = _gen(11)
    kinds = ["dense", "sparse", "spikes", "gauss-1e6", "empty"] * 2
    histograms = [_random_histogram(kind, 128, gen) for kind in kinds]
    for scale in (1.0, 5.0):
        x = torch.randn(5000, generator=gen) * scale
        x[0] = 40.0 * scale
        histograms.append(torch.histc(x, 128, float(x.min()), float(x.max())))
    histogram = torch.stack(histograms)
    min_val = torch.randn(len(histograms), generator=gen) * 3
    max_val = min_val + torch.rand(len(histograms), generator=gen) * 10
    for dst_nbins in (256, 16):
        got = torch_l2_search_batched(histogram, min_val, max_val, dst_nbins)
        for q in range(len(histograms)):
            expected = torch_l2_search(histogram[q], min_val[q], max_val[q], dst_nbins)
            assert torch.equal(got[0][q], expected[0]), q
            assert torch.equal(got[1][q], expected[1]), q


def _edges_of(observer: HistogramObserver) -> tuple[torch.Tensor, torch.Tensor]:
    lo = observer.min_val.double()
    return lo, (observer.max_val.double() - lo) / observer.bins


@pytest.mark.parametrize("dist", ["normal", "relu", "student-t2", "outlier"])
def test_l2_errors_is_torchs_closed_form(dist: str) -> None:
    observer = _torch_observer("quint8-affine", DISTRIBUTIONS[dist](_gen(0)))
    lo, width = _edges_of(observer)
    pairs = [(0, 2047), (100, 1900), (5, 10), (1000, 1000), (0, 3)]
    low = torch.tensor([lo + s * width for s, _ in pairs], dtype=torch.float64)
    high = torch.tensor([lo + (e + 1) * width for _, e in pairs], dtype=torch.float64)
    ours = l2_errors(observer.histogram, lo, width, low, high, 256)
    for k, (start, end) in enumerate(pairs):
        expected = observer._compute_quantization_error(start, end)
        assert ours[k].item() == pytest.approx(expected, rel=2e-4, abs=1e-6)


@pytest.mark.peers
@pytest.mark.parametrize("dist", [d for d in DISTRIBUTIONS if d != "constant"])
def test_global_l2_never_worse_than_torch(dist: str) -> None:
    observer = _torch_observer("quint8-affine", DISTRIBUTIONS[dist](_gen(0)))
    lo, width = _edges_of(observer)
    torch_range = observer._non_linear_param_search()
    ours = l2_search(observer.histogram, lo, width, 256)

    def error(low: torch.Tensor, high: torch.Tensor) -> float:
        return float(
            l2_errors(
                observer.histogram,
                lo,
                width,
                low.double().reshape(1),
                high.double().reshape(1),
                256,
            )
        )

    theirs_error, ours_error = error(*torch_range), error(*ours)
    assert ours_error <= theirs_error * (1 + 1e-9)
    if dist in ("student-t2", "outlier"):
        assert ours_error < 0.5 * theirs_error  # greedy stops far from the minimum
    if dist == "outlier":
        # torch collapses the range onto the bulk's first bin and clips half
        # of it; the global range keeps the bulk whole.
        assert float(torch_range[1]) < 1.0 and float(ours[1]) > 1000.0


def _brute_force(
    counts: torch.Tensor, lo: float, width: float, levels: int
) -> tuple[float, torch.Tensor, torch.Tensor]:
    bins = counts.numel()
    start, end = torch.triu_indices(bins + 1, bins + 1, offset=1)
    low, high = lo + start * width, lo + end * width
    errors = l2_errors(
        counts,
        torch.tensor(lo),
        torch.tensor(width),
        low.double(),
        high.double(),
        levels,
    )
    return float(errors.min()), low.double(), high.double()


@pytest.mark.parametrize(
    ("kind", "bins", "levels"),
    [
        *[
            (kind, 40, levels)
            for kind in ("dense", "sparse", "spikes")
            for levels in (4, 16)
        ],
        ("gauss-1e6", 40, 4),
        ("dense", 160, 256),
        ("gauss-1e6", 160, 256),
    ],
)
def test_global_l2_equals_brute_force(kind: str, bins: int, levels: int) -> None:
    # 40 bins: every candidate is scored (exhaustive); 160 bins x 256 levels:
    # the coarse-to-fine search, on a histogram dense enough for its screen.
    counts = _random_histogram(kind, bins, _gen(bins + levels))
    if bins == 160:
        counts = counts + 1.0  # dense
    best, _, _ = _brute_force(counts, -1.3, 0.1, levels)
    low, high = l2_search(
        counts, torch.tensor(-1.3), torch.tensor(0.1, dtype=torch.float64), levels
    )
    ours = l2_errors(
        counts,
        torch.tensor(-1.3),
        torch.tensor(0.1),
        low.double().reshape(1),
        high.double().reshape(1),
        levels,
    )
    assert float(ours) <= best * (1 + 1e-6) + 1e-12


def test_global_l2_symmetric_is_the_best_symmetric_range() -> None:
    x = _student_t(20000, _gen(12))
    counts = torch.histc(x, 64, -20.0, 20.0)
    lo, width = torch.tensor(-20.0), torch.tensor(40.0 / 64, dtype=torch.float64)
    low, high = l2_search(counts, lo, width, 256, symmetric=(-128.0, 127.0))
    assert float(low) == -float(high)
    # Brute force over amax on the one-bin grid, with the real symmetric levels.
    amax = torch.arange(1, 33, dtype=torch.float64) * width
    scale = amax / 127.5
    errors = l2_errors(counts, lo, width, -128.5 * scale, 127.5 * scale, 256)
    ours = l2_errors(
        counts,
        lo,
        width,
        (-128.5 * high.double() / 127.5).reshape(1),
        (127.5 * high.double() / 127.5).reshape(1),
        256,
    )
    assert float(ours) <= float(errors.min()) * (1 + 1e-6)


# ------------------------------------------------------- percentile, entropy


def _slow_percentile(
    counts: list[int], edges: list[float], percentile: float
) -> tuple[float, float]:
    """Walk the bins: right edge where the count reaches p%, left edge from the top."""
    total = sum(counts)
    need = total * percentile / 100
    running, upper = 0, edges[-1]
    for j, c in enumerate(counts):
        running += c
        if running >= need:
            upper = edges[j + 1]
            break
    running, lower = 0, edges[0]
    for j in range(len(counts) - 1, -1, -1):
        running += counts[j]
        if running >= need:
            lower = edges[j]
            break
    return lower, upper


@pytest.mark.parametrize("percentile", [50.0, 99.0, 99.99, 100.0])
def test_percentile_against_slow_reference(percentile: float) -> None:
    gen = _gen(13)
    x = torch.cat([_laplace(20000, gen), torch.tensor([30.0, -12.0])]).reshape(-1, 1, 1)
    hist = histogram_of(x.reshape(1, 1, -1), bins=512)
    lo, width = hist.edges()
    low, high = percentile_range(
        hist.counts, lo, width, percentile, hist.min_vals, hist.max_vals
    )
    edges = [float(lo + j * width) for j in range(513)]
    ref_low, ref_high = _slow_percentile(hist.counts[0].tolist(), edges, percentile)
    assert float(high) == pytest.approx(min(ref_high, float(hist.max_vals)), abs=0)
    assert float(low) == pytest.approx(max(ref_low, float(hist.min_vals)), abs=0)
    if percentile == 100.0:
        assert float(low) == -12.0 and float(high) == 30.0
    kept = ((x >= low) & (x <= high)).float().mean()
    assert kept >= (2 * percentile - 100) / 100 - 1e-6


def _modelopt_histogram(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # ModelOpt's HistogramCalibrator.collect: |x|, 2048 bins over [0, amax].
    x = x.abs().float()
    amax = x.max()
    return torch.histc(x, bins=2048, min=0, max=float(amax)), torch.linspace(
        0, float(amax), 2049
    )


def test_percentile_against_modelopt_semantics() -> None:
    x = _student_t(100003, _gen(14), df=4.0)  # no p% boundary on a whole count
    counts, edges = _modelopt_histogram(x)
    # ModelOpt's _compute_amax_percentile: the left edge of the bin where the
    # CDF reaches p (here 99.99); ours is that bin's right edge.
    cdf = torch.cumsum(counts.double() / counts.sum(), 0)
    theirs = int(torch.searchsorted(cdf, torch.tensor(0.9999, dtype=torch.float64)))
    ours = percentile_upper(
        counts, torch.tensor(0.0), edges[1] - edges[0], 99.99, x.abs().max()
    )
    assert float(ours) == pytest.approx(float(edges[theirs + 1]), rel=1e-6)


def _slow_entropy(
    counts: list[float], num_levels: int, start_bin: int, stride: int
) -> tuple[int, list[float]]:
    """TensorRT / ModelOpt KL calibration, one candidate at a time.

    Returns the chosen bin count (the last minimum) and every divergence.
    """
    hist = np.array(counts, dtype=np.float64)
    hist[0] = hist[1]
    candidates = list(range(start_bin, len(hist) + 1, stride))
    divergences = []
    for i in candidates:
        level = np.arange(i) * num_levels // i  # level of each of the i bins
        nonzero = hist[:i] != 0
        level_mass = np.bincount(level, weights=hist[:i], minlength=num_levels)
        level_bins = np.bincount(level[nonzero], minlength=num_levels)
        q = np.where(nonzero, level_mass[level] / np.maximum(level_bins[level], 1), 0)
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()  # clipped values pile into the last bin
        p, q = p / p.sum(), q / q.sum() if q.sum() > 0 else q
        if np.any((p > 0) & (q == 0)):
            divergences.append(math.inf)
            continue
        keep = p > 0
        divergences.append(float(np.sum(p[keep] * np.log(p[keep] / q[keep]))))
    best = min(divergences)
    last = max(k for k, d in enumerate(divergences) if d == best)
    return candidates[last], divergences


@pytest.mark.parametrize(
    ("dist", "levels", "start_bin", "stride"),
    [("laplace", 128, 128, 1), ("relu", 64, 100, 3), ("outlier", 16, 20, 1)],
)
def test_entropy_against_slow_reference(
    dist: str, levels: int, start_bin: int, stride: int, backend: str
) -> None:
    x = DISTRIBUTIONS[dist](_gen(15))[0][:20000].abs()
    counts = torch.histc(x, 300, 0, float(x.max()))
    width = x.max().double() / 300
    ours = entropy_search(
        counts, width, levels, start_bin=start_bin, stride=stride, amax=x.max()
    )
    best_bin, divergences = _slow_entropy(counts.tolist(), levels, start_bin, stride)
    expected = min(best_bin * float(width), float(x.max()))
    if float(ours) != pytest.approx(expected, rel=1e-12):
        # Only a tie within rounding may pick another candidate.
        chosen = round(float(ours) / float(width))
        k = (chosen - start_bin) // stride
        assert divergences[k] == pytest.approx(min(divergences), rel=1e-9)


def test_entropy_against_modelopt_defaults(backend: str) -> None:
    # 2048 bins, start_bin=128, 128 levels (int8), stride 1.
    x = _laplace(200000, _gen(16))
    counts, edges = _modelopt_histogram(x)
    ours = entropy_search(counts, edges[1] - edges[0], 128, amax=x.abs().max())
    best_bin, _ = _slow_entropy(counts.tolist(), 128, 128, 1)
    assert float(ours) == pytest.approx(float(edges[best_bin]), rel=1e-6)


def _slow_histogram_mse(
    counts: torch.Tensor,
    lo: float,
    width: float,
    args: QuantizationArgs,
    min_val: float,
    max_val: float,
    norm: float,
    factors: list[float],
) -> float:
    """One candidate at a time, fake-quantizing the bin centers with quantobs."""
    centers = (lo + (torch.arange(counts.numel()) + 0.5) * width).float()
    errors = []
    for p in factors:
        scale, zero_point = calculate_qparams(
            torch.tensor([p * min_val]), torch.tensor([p * max_val]), args
        )
        fq = fake_quantize(centers, scale, zero_point, args)
        errors.append(float(((fq - centers).abs() ** norm * counts.double()).sum()))
    return factors[errors.index(min(errors))]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_bits": 8},
        {"num_bits": 4, "symmetric": False},
        {"num_bits": 8, "type": "float"},
        {"num_bits": 4, "type": "float"},
    ],
    ids=["int8", "int4-asym", "fp8", "fp4"],
)
def test_histogram_mse_against_slow_reference(kwargs: dict[str, float]) -> None:
    args = QuantizationArgs(**kwargs)
    x = _outlier(30000, _gen(17))[:20000] * 0.01
    hist = histogram_of(x.reshape(1, 1, -1), bins=256)
    lo, width = hist.edges()
    low, high = histogram_mse_search(
        hist.counts, lo, width, args, hist.min_vals, hist.max_vals, norm=2.0
    )
    factors = shrink_factors(0.8, 100.0).tolist()
    best = _slow_histogram_mse(
        hist.counts[0],
        float(lo),
        float(width),
        args,
        float(hist.min_vals),
        float(hist.max_vals),
        2.0,
        factors,
    )
    assert float(high) == pytest.approx(best * float(hist.max_vals), rel=1e-6)
    assert float(low) == pytest.approx(best * float(hist.min_vals), rel=1e-6)


@pytest.mark.parametrize("kind", ["student-t2", "bimodal", "outlier"])
def test_global_l2_equals_brute_force_on_256_bins(kind: str, backend: str) -> None:
    # Beyond the exhaustive budget: coarse-to-fine + descent, then certified
    # by bounds (every other candidate bounded above the result or scored).
    g = _gen(21)
    n = 1 << 16
    x = {
        "student-t2": _student_t(n, g),
        "bimodal": torch.cat(
            [
                torch.randn(n // 2, generator=g) - 6,
                torch.randn(n // 2, generator=g) / 10 + 6,
            ]
        ),
        "outlier": torch.cat([torch.randn(n, generator=g), torch.tensor([1e3])]),
    }[kind]
    lo, hi = float(x.min()), float(x.max())
    width = (hi - lo) / 256
    counts = torch.histc(x, 256, lo, hi)
    best, _, _ = _brute_force(counts, lo, width, 256)
    low, high = l2_search(
        counts, torch.tensor(lo), torch.tensor(width, dtype=torch.float64), 256
    )
    ours = l2_errors(
        counts,
        torch.tensor(lo),
        torch.tensor(width),
        low.double().reshape(1),
        high.double().reshape(1),
        256,
    )
    # the result's ends are float32: its error is the optimum's to ~1e-7
    assert float(ours) <= best * (1 + 1e-6)


def test_certify_finds_the_optimum_from_a_poor_incumbent(backend: str) -> None:
    counts = _random_histogram("sparse", 64, _gen(22)).reshape(1, -1).double()
    levels = 8
    prefix = prefix_moments(counts)
    start = torch.tensor([[0.0, 64.0]], dtype=torch.float64)  # the whole range
    start_error = exact_errors(prefix, counts, start[:, :1], start[:, 1:], levels)[:, 0]
    best, proven = certify(prefix, counts, start, start_error.clone(), levels)
    assert bool(proven.all())
    pairs = torch.triu_indices(65, 65, offset=1).double()
    every = exact_errors(prefix, counts, pairs[:1], pairs[1:], levels)
    got = exact_errors(prefix, counts, best[:, :1], best[:, 1:], levels)
    assert float(got) <= float(every.min()) * (1 + 1e-9) + 1e-12
    assert float(got) < float(start_error)  # the incumbent was improved


@pytest.mark.parametrize("levels", [2, 4, 16, 256])
@pytest.mark.parametrize("kind", ["dense", "sparse", "spikes", "gauss-1e6"])
def test_certificate_bounds_never_exceed_the_exact_error(
    kind: str, levels: int
) -> None:
    # The certificate is only as sound as its bounds: check them on every pair.
    counts = _random_histogram(kind, 48, _gen(levels)).reshape(1, -1).double()
    prefix = prefix_moments(counts)
    bounds = L2Bounds(prefix, counts, levels)
    a = torch.arange(49)[:, None]
    b = torch.arange(49)[None, :]
    lower = bounds(0, a, b)
    valid = (b > a).expand(49, 49)
    starts, ends = a.expand(49, 49)[valid].double(), b.expand(49, 49)[valid].double()
    exact = exact_errors(prefix, counts, starts[None], ends[None], levels)[0]
    assert bool((lower[valid] <= exact * (1 + 1e-9) + 1e-9).all())
    # ... and the reach of a given error keeps every pair below it
    limit = exact.quantile(0.2).reshape(1)
    a_max, b_min = bounds.reach(limit)
    below = exact < limit
    assert bool((starts[below] < a_max).all()) and bool((ends[below] >= b_min).all())


def test_certify_covers_a_2048_bin_normal_histogram() -> None:
    if not native.available():
        pytest.skip("the 2**17-pair budget needs the native exact scorer")
    x = torch.randn(1 << 20, generator=_gen(31))
    lo, hi = float(x.min()), float(x.max())
    width = (hi - lo) / 2048
    counts = torch.histc(x, 2048, lo, hi)
    low, high = l2_search(
        counts, torch.tensor(lo), torch.tensor(width, dtype=torch.float64), 256
    )
    rows = counts[None].double()
    prefix = prefix_moments(rows)
    best = torch.tensor([[(float(low) - lo) / width, (float(high) - lo) / width]])
    best = best.double().round()
    error = exact_errors(prefix, rows, best[:, :1], best[:, 1:], 256)[:, 0]
    certified, proven = certify(prefix, rows, best, error, 256)
    assert bool(proven.all())
    assert torch.equal(certified, best)  # the search's result was the optimum


@pytest.mark.parametrize("levels", [2, 16, 256])
@pytest.mark.parametrize("kind", ["dense", "sparse", "spikes", "gauss-1e6"])
def test_bound_survivors_native_equal_torch_and_keep_every_better_pair(
    kind: str, levels: int
) -> None:
    if not native.available():
        pytest.skip("compares the native survivors with the torch rectangle")
    counts = _random_histogram(kind, 48, _gen(levels + 7)).reshape(1, -1).double()
    prefix = prefix_moments(counts)
    bounds = L2Bounds(prefix, counts, levels)
    pairs = torch.triu_indices(49, 49, offset=1)
    exact = exact_errors(prefix, counts, pairs[:1].double(), pairs[1:].double(), levels)
    for quantile in (0.01, 0.2, 0.6):
        limit = float(exact.quantile(quantile))
        a_max, b_min = bounds.reach(torch.tensor([limit], dtype=torch.float64))
        na, b0 = int(a_max[0]), int(b_min[0])
        got = bounds.survivors(0, na, b0, limit, 1 << 12)
        previous = native.set_enabled(False)
        try:
            expected = bounds.survivors(0, na, b0, limit, 1 << 12)
        finally:
            native.set_enabled(previous)
        assert got is not None and expected is not None
        assert torch.equal(got, expected)  # same pairs, same (a, b) order
        kept = {(int(a), int(b) + b0) for a, b in got}
        below = exact[0] < limit
        assert {(int(a), int(b)) for a, b in pairs.T[below]} <= kept
    assert bounds.survivors(0, 48, 1, math.inf, 10) is None  # over the cap


def test_l2_kernels_pair_torch_with_native_on_cpu() -> None:
    """Each former `native.x(...) or torch twin` call site is one kernel: a
    torch implementation with the native one registered for "cpu", both
    giving the same numbers (the over-cap answer included)."""
    for pair in (torch_l2_terms, row_errors, bound_survivors):
        assert pair.native("cpu") is not None
    if not native.available():
        pytest.skip("compares the native kernels with their torch implementations")
    counts = _random_histogram("sparse", 64, _gen(40)).reshape(1, -1).double()
    prefix = prefix_moments(counts)
    lo = torch.arange(0, 60, dtype=torch.float64)
    hi = lo + 4.5
    native_errors = row_errors.native("cpu")(prefix[0], lo, hi, 16)
    assert native_errors is not None
    torch.testing.assert_close(
        native_errors, row_errors.torch(prefix[0], lo, hi, 16), rtol=1e-12, atol=1e-9
    )
    bounds = L2Bounds(prefix, counts, 16)
    tables = (bounds.at[:, 0], bounds.start[:, 0, 0], bounds.total[:, 0, 0])
    for cap in (1 << 12, 3):  # room for every survivor; over the cap
        args = (*tables, bounds.jumps[0], 16, 40, 10, math.inf, cap)
        found = bound_survivors.native("cpu")(*args)
        assert found is not None
        expected = bound_survivors.torch(*args)
        assert found[1] == expected[1] and torch.equal(found[0], expected[0])
    hist = counts.float()
    starts, ends = torch.tensor([0, 3, 10]), torch.tensor([63, 40, 12])
    width = torch.full((3,), 0.01, dtype=torch.float64)
    terms = torch_l2_terms.native("cpu")(hist, starts, ends, width, 256)
    assert terms is not None
    assert torch.equal(terms, torch_l2_terms.torch(hist, starts, ends, width, 256))


def test_quark_asymmetric_percentile_keeps_the_top_past_2_to_24_counts() -> None:
    # Float32 targets round 2**24 + 1 down and cut the top bin: the Quark bug
    # the face avoids (its symmetric side always counted in float64).
    from quantobs.solvers.quark_histogram import percentile_bounds

    counts = torch.tensor([0, 2**24, 0, 1], dtype=torch.int64)
    edges = torch.arange(5, dtype=torch.float32)
    found = percentile_bounds(counts, edges, 100.0, symmetric=False)
    assert found is not None
    _, high = found
    assert float(high) == 3.0  # float32 targets: 1.0, the top bin cut


def test_entropy_rejects_bad_levels_and_candidates() -> None:
    # Before: levels 0 crashed the interpreter in the native kernel (integer
    # division by zero); a levels tensor of the wrong length left rows
    # unsearched.
    from quantobs.solvers.entropy import (
        coarse_to_fine,
        entropy_divergences,
        entropy_search,
    )

    counts = torch.randint(0, 10, (3, 64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="num_quantized_bins must be >= 1"):
        entropy_divergences(counts, torch.full((3, 2), 8), 0)
    with pytest.raises(ValueError, match=r"clip bins in \[1, 64\]"):
        entropy_divergences(counts, torch.tensor([[0, 70]] * 3), 8)
    with pytest.raises(ValueError, match=r"a \(3,\) tensor of ints"):
        entropy_search(counts, torch.ones(3), torch.tensor([8, 8]))
    with pytest.raises(ValueError, match=r"a \(3,\) tensor of ints"):
        entropy_search(counts, torch.ones(3), torch.tensor([8.5, 8.0, 8.0]))
    with pytest.raises(ValueError, match="must be >= 1"):
        coarse_to_fine(counts, torch.tensor([0, 8, 8]), 1, 1)
