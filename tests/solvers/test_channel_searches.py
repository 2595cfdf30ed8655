"""The per-channel / per-group searches against exhaustive references.

`l2_search_batched` against brute force over every candidate, the
coarse-to-fine entropy search against the exhaustive one (equal where a
histogram has few possible candidates, never a lower divergence), and the
uniform-bin histogram MSE against a slow reference; each kernel's native
pass against its torch twin.
"""

from __future__ import annotations

import pytest
import torch

from quantobs import QuantizationArgs, calculate_qparams, fake_quantize, native
from quantobs.core.scoring import shrink_factors
from quantobs.solvers.entropy import (
    coarse_to_fine,
    entropy_divergences,
    entropy_search,
)
from quantobs.solvers.global_l2 import l2_search
from quantobs.solvers.histogram_mse import histogram_mse_uniform
from quantobs.solvers.l2_batched import l2_search_batched, symmetric_search
from quantobs.solvers.l2_error import l2_candidate_errors, l2_errors
from quantobs.stats.histogram import histogram_of


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = _gen(seed)
    x = torch.randn(rows, cols, generator=gen)
    if kind == "laplace":
        u = torch.rand(rows, cols, generator=gen).clamp(1e-6, 1 - 1e-6) - 0.5
        x = -u.sign() * torch.log1p(-2 * u.abs())
    elif kind == "student-t":
        chi2 = torch.randn(3, rows, cols, generator=gen).pow(2).sum(dim=0)
        x = x / (chi2 / 3).sqrt()
    elif kind == "outliers":
        x[:, 0] *= 20.0
    return x


def _per_channel(x: torch.Tensor, bins: int, absolute: bool = False):
    return histogram_of(x.reshape(1, x.shape[0], 1, -1), bins, absolute)


# ---------------------------------------------------------------- batched L2


def _symmetric_brute(hist, qmin: float, qmax: float):
    """Least exact error over every amax of the one-bin grid, per row."""
    lo, width = hist.edges()
    lo, width = lo.reshape(-1), width.reshape(-1)
    counts = hist.counts.reshape(lo.numel(), -1)
    half = (qmax - qmin) / 2
    best = []
    for q in range(lo.numel()):
        top = float(
            torch.maximum(
                hist.min_vals.reshape(-1)[q].abs(), hist.max_vals.reshape(-1)[q].abs()
            )
        )
        amax = torch.arange(1, int(top / float(width[q])) + 2, dtype=torch.float64)
        amax = amax * width[q]
        scale = amax / half
        errors = l2_errors(
            counts[q], lo[q], width[q], (qmin - 0.5) * scale, (qmax + 0.5) * scale,
            int(qmax - qmin + 1),
        )  # fmt: skip
        best.append(float(errors.min()))
    return torch.tensor(best, dtype=torch.float64)


def _symmetric_error(hist, amax: torch.Tensor, qmin: float, qmax: float):
    lo, width = hist.edges()
    lo, width = lo.reshape(-1), width.reshape(-1)
    counts = hist.counts.reshape(lo.numel(), -1)
    scale = amax.reshape(-1).double() / ((qmax - qmin) / 2)
    return l2_errors(
        counts,
        lo,
        width,
        ((qmin - 0.5) * scale)[:, None],
        ((qmax + 0.5) * scale)[:, None],
        int(qmax - qmin + 1),
    )[:, 0]


@pytest.mark.parametrize("kind", ["gaussian", "laplace", "student-t", "outliers"])
@pytest.mark.parametrize(
    ("qmin", "qmax", "tolerance"),
    [(-8.0, 7.0, 1e-9), (-128.0, 127.0, 0.02)],
    ids=["int4-exact", "int8-screened"],
)
def test_batched_symmetric_l2_against_brute_force(
    kind: str, qmin: float, qmax: float, tolerance: float, backend: str
) -> None:
    # int4: every amax scored exactly, so the minimum itself; int8: screened
    # with the O(1) form, within 2% of the exact minimum's error.
    hist = _per_channel(_weights(kind, 24, 512, 1), 128)
    lo, width = hist.edges()
    _, high = l2_search_batched(
        hist.counts, lo, width, int(qmax - qmin + 1), symmetric=(qmin, qmax)
    )
    ours = _symmetric_error(hist, high, qmin, qmax)
    best = _symmetric_brute(hist, qmin, qmax)
    assert bool((ours <= best * (1 + tolerance) + 1e-12).all())


@pytest.mark.parametrize("kind", ["gaussian", "laplace"])
def test_batched_asymmetric_l2_matches_the_certified_search(kind: str) -> None:
    # int4 (exact scoring): dense channels give the certified minimum.
    hist = _per_channel(_weights(kind, 8, 4096, 2) + 0.3, 64)
    lo, width = hist.edges()
    low_b, high_b = l2_search_batched(hist.counts, lo, width, 16)
    low_c, high_c = l2_search(hist.counts, lo, width, 16)
    counts = hist.counts.reshape(8, -1)
    error_b = l2_errors(
        counts,
        lo.reshape(-1),
        width.reshape(-1),
        low_b.reshape(-1, 1).double(),
        high_b.reshape(-1, 1).double(),
        16,
    )
    error_c = l2_errors(
        counts,
        lo.reshape(-1),
        width.reshape(-1),
        low_c.reshape(-1, 1).double(),
        high_c.reshape(-1, 1).double(),
        16,
    )
    assert bool((error_b <= error_c * (1 + 1e-9)).all())


def test_batched_l2_edge_cases() -> None:
    x = torch.randn(3, 64, generator=_gen(3))
    x[1] = 0.5  # one value
    x[2] = float("nan")  # nothing counted
    hist = histogram_of(torch.where(torch.isnan(x), 0.0, x).reshape(1, 3, 1, 64), 64)
    counts = hist.counts.clone()
    counts[2] = 0
    lo, width = hist.edges()
    for symmetric in (None, (-128.0, 127.0)):
        low, high = l2_search_batched(counts, lo, width, 256, symmetric=symmetric)
        assert float(low[2]) == 0.0 and float(high[2]) == 0.0
        assert bool((low <= high).all())
    with pytest.raises(ValueError, match="levels must be an int >= 2"):
        l2_search_batched(counts, lo, width, 1)


def test_l2_kernels_native_equal_torch() -> None:
    if not native.available():
        pytest.skip("no native kernels")
    hist = _per_channel(_weights("laplace", 40, 700, 4), 128)
    counts = hist.counts.reshape(40, -1)
    gen = _gen(5)
    lo_u = torch.rand(40, 30, generator=gen, dtype=torch.float64) * 60 - 10
    hi_u = lo_u + torch.rand(40, 30, generator=gen, dtype=torch.float64) * 140 - 5
    for exact, levels in ((False, 256), (True, 16)):
        got = l2_candidate_errors.native("cpu")(
            counts.double(), lo_u, hi_u, levels, exact
        )
        expected = l2_candidate_errors.torch(counts.double(), lo_u, hi_u, levels, exact)
        assert got is not None
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        finite = torch.isfinite(expected)
        assert torch.allclose(got[finite], expected[finite], rtol=1e-12, atol=1e-9)
    origin = torch.rand(40, generator=gen, dtype=torch.float64) * -64
    amax = torch.rand(40, generator=gen, dtype=torch.float64) * 100 + 1
    for qmin, qmax in ((-8.0, 7.0), (-128.0, 127.0)):
        got = symmetric_search.native("cpu")(counts, origin, amax, qmin, qmax)
        expected = symmetric_search.torch(counts, origin, amax, qmin, qmax)
        assert got is not None and torch.equal(got, expected)


# ------------------------------------------------------------------- entropy


@pytest.mark.parametrize("kind", ["gaussian", "laplace", "student-t"])
@pytest.mark.parametrize(("bins", "levels"), [(64, 8), (256, 128)])
def test_coarse_to_fine_entropy_against_exhaustive(
    kind: str, bins: int, levels: int, backend: str
) -> None:
    x = _weights(kind, 48, 2048, 6).abs()
    hist = _per_channel(x, bins, absolute=True)
    _, width = hist.edges()
    start = bins // 16
    args = {"start_bin": start, "amax": hist.max_vals}
    exhaustive = entropy_search(hist.counts, width, levels, **args)
    fast = entropy_search(hist.counts, width, levels, search="coarse_to_fine", **args)
    rows = hist.counts.reshape(48, -1)
    flat_width = width.reshape(-1)

    def kl(threshold: torch.Tensor) -> torch.Tensor:
        cand = torch.ceil(threshold.reshape(-1) / flat_width).clamp(1, bins).long()
        return entropy_divergences(rows, cand[:, None], levels)[:, 0]

    # Never below the exhaustive minimum (to the rounding of the torch and
    # native divergences); equal where few candidates exist.
    assert bool((kl(fast) >= kl(exhaustive) - 1e-10).all())
    few = (rows[:, start - 1 :] > 0).sum(dim=1) <= 24
    assert torch.equal(fast.reshape(-1)[few], exhaustive.reshape(-1)[few])


def test_coarse_to_fine_entropy_equals_exhaustive_with_few_candidates() -> None:
    hist = _per_channel(_weights("gaussian", 30, 300, 7).abs(), 64, absolute=True)
    _, width = hist.edges()
    for start in (40, 48):  # at most 24 candidates
        a = entropy_search(hist.counts, width, 8, start_bin=start)
        b = entropy_search(
            hist.counts, width, 8, start_bin=start, search="coarse_to_fine"
        )
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="search='both'"):
        entropy_search(hist.counts, width, 8, search="both")  # type: ignore[arg-type]


def test_coarse_to_fine_kernel_native_equals_torch() -> None:
    if not native.available():
        pytest.skip("no native kernels")
    hist = _per_channel(_weights("student-t", 64, 1024, 8).abs(), 256, absolute=True)
    rows = hist.counts.reshape(64, -1)
    rows[3] = 0  # no data
    levels = torch.where(torch.arange(64) % 2 == 0, 128, 64)
    for start, stride in ((16, 1), (5, 3)):
        got = coarse_to_fine.native("cpu")(rows, levels, start, stride)
        expected = coarse_to_fine.torch(rows, levels, start, stride)
        assert got is not None and torch.equal(got, expected)
        assert int(got[3]) == 0


# -------------------------------------------------------------- uniform MSE


def _slow_uniform_mse(counts, lo, width, args, low, high, factors):
    """Each bin as 256 evenly spread points, fake-quantized by quantobs."""
    sub = (torch.arange(256, dtype=torch.float64) + 0.5) / 256
    points = (lo + (torch.arange(counts.numel())[:, None] + sub) * width).reshape(-1)
    weights = (counts.double()[:, None] / 256).expand(-1, 256).reshape(-1)
    errors = []
    for p in factors:
        scale, zero_point = calculate_qparams(
            torch.tensor([p * low]), torch.tensor([p * high]), args
        )
        fq = fake_quantize(points.float(), scale, zero_point, args).double()
        errors.append(float(((fq - points) ** 2 * weights).sum()))
    return torch.tensor(errors)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_bits": 4}, {"num_bits": 4, "symmetric": False}, {"num_bits": 8}],
    ids=["int4", "int4-asym", "int8"],
)
def test_uniform_histogram_mse_against_slow_reference(kwargs: dict) -> None:
    args = QuantizationArgs(**kwargs)
    x = _weights("laplace", 3, 3000, 9) * 0.1 + 0.02
    hist = _per_channel(x, 64)
    lo, width = hist.edges()
    _, high = histogram_mse_uniform(
        hist.counts, lo, width, args, hist.min_vals, hist.max_vals
    )
    factors = shrink_factors(0.8, 100.0).tolist()
    for q in range(3):
        slow = _slow_uniform_mse(
            hist.counts[q, 0], float(lo[q, 0]), float(width[q, 0]), args,
            float(hist.min_vals[q, 0]), float(hist.max_vals[q, 0]), factors,
        )  # fmt: skip
        chosen = float(high[q, 0]) / float(hist.max_vals[q, 0])
        k = min(range(len(factors)), key=lambda i: abs(factors[i] - chosen))
        # the chosen candidate's error is the least (to the reference's
        # sampling accuracy at 256 points per bin)
        assert float(slow[k]) <= float(slow.min()) * 1.002 + 1e-12


def test_uniform_histogram_mse_refuses_float_formats_and_other_norms() -> None:
    hist = _per_channel(torch.randn(2, 64, generator=_gen(10)), 64)
    lo, width = hist.edges()
    for args, norm in (
        (QuantizationArgs(num_bits=8, type="float"), 2.0),
        (QuantizationArgs(num_bits=8), 2.4),
    ):
        with pytest.raises(ValueError, match="objective='bin_centers'"):
            histogram_mse_uniform(
                hist.counts, lo, width, args, hist.min_vals, hist.max_vals, norm=norm
            )
