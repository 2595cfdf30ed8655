"""Embedding metrics: hand-computed cases, error paths, properties."""

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from quantobs.report.metrics import (
    cosine_to_reference,
    mean_pool,
    neighbour_agreement,
    pairwise_spearman,
    spearman,
    sqnr_db,
    sqnr_db_from_energies,
)


def _angles(*degrees: float) -> torch.Tensor:
    """Unit vectors in the plane at the given angles: (N, 2)."""
    radians = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    return torch.stack([radians.cos(), radians.sin()], dim=1)


# ---------------------------------------------------------------- mean_pool


def test_mean_pool_hand_case() -> None:
    last_hidden = torch.tensor(
        [
            [[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],  # last token is padding
            [[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]],
            [[5.0, 5.0], [6.0, 6.0], [7.0, 7.0]],  # all padding
        ]
    )  # (B=3, S=3, H=2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # Sentence 0: ([1, 2] + [3, 4]) / 2 = [2, 3].
    # Sentence 1: ([1, 0] + [0, 1] + [2, 2]) / 3 = [1, 1].
    # Sentence 2: no tokens: 0 / max(0, 1e-9) = [0, 0].
    pooled = mean_pool(last_hidden, mask)
    assert pooled.dtype == torch.float64
    torch.testing.assert_close(
        pooled, torch.tensor([[2.0, 3.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    )
    # Normalised: [2, 3] / sqrt(13), [1, 1] / sqrt(2); the zero vector stays 0.
    unit = mean_pool(last_hidden, mask.bool(), normalize=True)
    expected = torch.tensor(
        [
            [2 / math.sqrt(13), 3 / math.sqrt(13)],
            [1 / math.sqrt(2), 1 / math.sqrt(2)],
            [0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(unit, expected)


@pytest.mark.parametrize(
    ("last_hidden", "mask", "match"),
    [
        pytest.param(torch.zeros(2, 3), torch.ones(2, 3), r"\(B, S, H\)", id="2d"),
        pytest.param(torch.zeros(2, 3, 4), torch.ones(2, 4), "does not match", id="S"),
        pytest.param(torch.zeros(2, 3, 4), torch.ones(3, 3), "does not match", id="B"),
        pytest.param(
            torch.full((1, 2, 2), math.nan), torch.ones(1, 2), "NaN", id="nan"
        ),
    ],
)
def test_mean_pool_rejects(
    last_hidden: torch.Tensor, mask: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        mean_pool(last_hidden, mask)


# ---------------------------------------------------------------- cosine


def test_cosine_to_reference_hand_case() -> None:
    reference = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    test = torch.tensor([[1.0, 0.0], [1.0, 1.0], [2.0, 2.0]])
    # Row cosines: 1; <[0,1],[1,1]> / sqrt(2) = 1/sqrt(2); 1 (same direction).
    # Mean (2 + 1/sqrt(2)) / 3 = 0.902369..., worst 1/sqrt(2) = 0.707106...
    mean, worst = cosine_to_reference(reference, test)
    assert mean == pytest.approx((2 + 1 / math.sqrt(2)) / 3, rel=1e-12)
    assert worst == pytest.approx(1 / math.sqrt(2), rel=1e-12)


# ---------------------------------------------------------------- neighbours


def test_neighbour_agreement_hand_case() -> None:
    # Reference at 0, 10, 90, 100 degrees: nearest others 1, 0, 3, 2.
    # Test at 0, 10, 50, 100 degrees: sentence 2 is 40 degrees from sentence 1
    # and 50 from sentence 3, so the nearest others are 1, 0, 1, 2.
    # They agree on sentences 0, 1 and 3: 3 / 4.
    reference = _angles(0, 10, 90, 100)
    test = _angles(0, 10, 50, 100)
    assert neighbour_agreement(reference, test) == 0.75


def test_neighbour_agreement_ties_go_to_lowest_index() -> None:
    # Reference: sentence 0 = [1, 0] is orthogonal to both [0, 1] and [0, -1]
    # (cosine 0 each): the tie goes to sentence 1. Sentences 1 and 2 are
    # opposite (cosine -1), so both pick sentence 0. Nearest: 1, 0, 0.
    reference = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    # Test: tilting sentence 2 to [0.1, -1] gives it cosine 0.0995 with
    # sentence 0, breaking the tie towards 2. Nearest: 2, 0, 0.
    # Agreement 2 / 3 (with the highest index winning ties it would be 1).
    test = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, -1.0]])
    assert neighbour_agreement(reference, test) == pytest.approx(2 / 3)
    assert neighbour_agreement(reference, reference) == 1.0


# ---------------------------------------------------------------- Spearman


def test_spearman_average_ranks_for_ties() -> None:
    # Ranks of [1, 2, 2, 3]: [1, 2.5, 2.5, 4]; of [1, 2, 3, 4]: [1, 2, 3, 4].
    # Centred: [-1.5, 0, 0, 1.5] and [-1.5, -0.5, 0.5, 1.5].
    # rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9) = 0.948683...
    x = torch.tensor([1.0, 2.0, 2.0, 3.0])
    y = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, y) == pytest.approx(math.sqrt(0.9), rel=1e-12)
    assert spearman(y, -y) == pytest.approx(-1.0, abs=1e-12)


def test_pairwise_spearman_hand_case() -> None:
    # In the plane the cosine of a pair falls with the angle between them, so
    # ranking the cosines ranks the angle differences (both reversed, which
    # leaves the correlation unchanged). Pairs (0,1) (0,2) (0,3) (1,2) (1,3)
    # (2,3):
    #   reference angles 0, 20, 50, 90: differences 20 50 90 30 70 40,
    #     ranks 1 4 6 2 5 3;
    #   test angles 0, 30, 50, 90:      differences 30 50 90 20 60 40,
    #     ranks 2 4 6 1 5 3.
    # No ties: rho = 1 - 6 * sum d^2 / (M (M^2 - 1)) = 1 - 6*2 / (6*35) = 33/35.
    reference = _angles(0, 20, 50, 90)
    test = _angles(0, 30, 50, 90)
    assert pairwise_spearman(reference, test) == pytest.approx(33 / 35, rel=1e-12)


# ---------------------------------------------------------------- SQNR


def test_sqnr_db_hand_case() -> None:
    # Signal 3^2 + 4^2 = 25, noise 0^2 + 1^2 = 1: 10 log10(25) = 13.9794 dB.
    x = torch.tensor([3.0, 4.0])
    assert sqnr_db(x, torch.tensor([3.0, 3.0])) == pytest.approx(
        10 * math.log10(25), rel=1e-12
    )
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(torch.zeros(2), torch.zeros(2)) == math.inf
    assert sqnr_db(torch.zeros(2), torch.ones(2)) == -math.inf


@pytest.mark.parametrize(
    ("x", "x_hat", "match"),
    [
        pytest.param(torch.zeros(2), torch.zeros(3), "differ in shape", id="shape"),
        pytest.param(torch.zeros(0), torch.zeros(0), "empty", id="empty"),
        pytest.param(torch.tensor([math.inf]), torch.zeros(1), "NaN", id="inf"),
        pytest.param(torch.zeros(1), torch.tensor([math.nan]), "x_hat", id="nan"),
    ],
)
def test_sqnr_db_rejects(x: torch.Tensor, x_hat: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sqnr_db(x, x_hat)


def test_sqnr_db_from_energies_hand_case() -> None:
    # Two batches: x = [3, 4] estimated as [3, 3], then x = [0, 5] as [0, 5]:
    # signal 25 + 25 = 50, noise 1 + 0 = 1, 10 log10(50) = 16.9897 dB.
    assert sqnr_db_from_energies(25.0 + 25.0, 1.0 + 0.0) == pytest.approx(
        10 * math.log10(50), rel=1e-12
    )
    assert sqnr_db_from_energies(0.0, 0.0) == math.inf
    assert sqnr_db_from_energies(1.0, 0.0) == math.inf
    assert sqnr_db_from_energies(0.0, 2.0) == -math.inf


@pytest.mark.parametrize(
    ("signal", "noise", "match"),
    [
        (-1.0, 1.0, "signal energy"),
        (1.0, -0.5, "noise energy"),
        (math.nan, 1.0, "signal energy"),
        (1.0, math.inf, "noise energy"),
    ],
)
def test_sqnr_db_from_energies_rejects(signal: float, noise: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sqnr_db_from_energies(signal, noise)


# ---------------------------------------------------------------- bad input

#: An embedding metric: (reference, test) -> its value(s).
Metric = Callable[[torch.Tensor, torch.Tensor], object]

EMBEDDING_METRICS = [
    pytest.param(cosine_to_reference, id="cosine"),
    pytest.param(neighbour_agreement, id="neighbours"),
    pytest.param(pairwise_spearman, id="spearman"),
]


@pytest.mark.parametrize("metric", EMBEDDING_METRICS)
@pytest.mark.parametrize(
    ("reference", "test", "match"),
    [
        pytest.param(torch.ones(4, 3), torch.ones(4, 2), "differ in shape", id="H"),
        pytest.param(torch.ones(4, 3), torch.ones(5, 3), "differ in shape", id="N"),
        pytest.param(torch.ones(4), torch.ones(4), "2-D", id="1d"),
        pytest.param(torch.ones(4, 0), torch.ones(4, 0), "H = 0", id="no-features"),
        pytest.param(
            torch.eye(4),
            torch.eye(4).masked_fill(torch.eye(4) > 0, math.nan),
            "test holds NaN",
            id="nan",
        ),
        pytest.param(
            torch.eye(4),
            torch.eye(4).index_fill(0, torch.tensor([2]), 0.0),
            r"zero embeddings \(rows \[2\]\)",
            id="zero-row",
        ),
    ],
)
def test_embedding_metrics_reject(
    metric: Metric, reference: torch.Tensor, test: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        metric(reference, test)


@pytest.mark.parametrize(
    ("metric", "n_rows"),
    [
        pytest.param(cosine_to_reference, 0, id="cosine-0"),
        pytest.param(neighbour_agreement, 1, id="neighbours-1"),
        pytest.param(pairwise_spearman, 2, id="spearman-2"),
    ],
)
def test_embedding_metrics_reject_too_few_sentences(
    metric: Metric, n_rows: int
) -> None:
    x = torch.ones(n_rows, 3)
    with pytest.raises(ValueError, match="at least"):
        metric(x, x)


def test_spearman_rejects() -> None:
    with pytest.raises(ValueError, match="1-D"):
        spearman(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="at least 2"):
        spearman(torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="all values"):
        spearman(torch.ones(3), torch.arange(3.0))
    # Every pair equally similar (three orthogonal sentences): no ranking.
    with pytest.raises(ValueError, match="all values"):
        pairwise_spearman(torch.eye(3), torch.eye(3))


# ---------------------------------------------------------------- properties


def _embeddings(n_min: int) -> st.SearchStrategy[torch.Tensor]:
    """(N, H) float64 embeddings with entries in [-10, 10], no zero rows."""
    shapes = st.tuples(st.integers(n_min, 8), st.integers(1, 6))
    return shapes.flatmap(
        lambda shape: st.lists(
            st.floats(-10, 10, allow_nan=False),
            min_size=shape[0] * shape[1],
            max_size=shape[0] * shape[1],
        ).map(lambda v: torch.tensor(v, dtype=torch.float64).reshape(shape))
    )


def _has_zero_row(x: torch.Tensor) -> bool:
    return bool((torch.linalg.vector_norm(x, dim=1) < 1e-3).any())


@settings(max_examples=60)
@given(_embeddings(n_min=3))
def test_identical_embeddings_score_perfectly(x: torch.Tensor) -> None:
    assume(not _has_zero_row(x))
    mean, worst = cosine_to_reference(x, x)
    assert mean == pytest.approx(1.0, abs=1e-12)
    assert worst == pytest.approx(1.0, abs=1e-12)
    assert neighbour_agreement(x, x) == 1.0
    try:
        rho = pairwise_spearman(x, x)
    except ValueError:  # all pairwise cosines equal: no ranking
        return
    assert rho == pytest.approx(1.0, abs=1e-12)


@settings(max_examples=60)
@given(
    _embeddings(n_min=3),
    st.lists(st.floats(0.1, 100), min_size=8, max_size=8),
)
def test_metrics_ignore_embedding_scale(x: torch.Tensor, scales: list[float]) -> None:
    # Cosine sees only directions: scaling each test row by c > 0 changes
    # nothing.
    assume(not _has_zero_row(x))
    test = x.flip(0)
    scaled = test * torch.tensor(scales[: x.shape[0]], dtype=torch.float64)[:, None]
    assert cosine_to_reference(x, scaled) == pytest.approx(
        cosine_to_reference(x, test), abs=1e-12
    )
    assert neighbour_agreement(x, scaled) == neighbour_agreement(x, test)


@settings(max_examples=100)
@given(
    st.lists(st.integers(-50, 50), min_size=2, max_size=30).flatmap(
        lambda xs: st.tuples(
            st.just(xs),
            st.lists(st.integers(-50, 50), min_size=len(xs), max_size=len(xs)),
        )
    )
)
def test_spearman_invariant_to_monotone_transforms(
    pair: tuple[list[int], list[int]],
) -> None:
    # Small integers (ties likely) keep the transforms strictly monotone in
    # float64 too: no two distinct values round to one.
    x = torch.tensor(pair[0], dtype=torch.float64)
    y = torch.tensor(pair[1], dtype=torch.float64)
    assume(torch.unique(x).numel() > 1 and torch.unique(y).numel() > 1)
    rho = spearman(x, y)
    assert -1.0 <= rho <= 1.0
    assert spearman(y, x) == pytest.approx(rho, abs=1e-12)
    # Strictly increasing maps keep every rank, ties included.
    assert spearman(x.pow(3) + 2 * x, torch.exp(y / 10)) == pytest.approx(
        rho, abs=1e-12
    )
    assert spearman(torch.atan(x), y) == pytest.approx(rho, abs=1e-12)
    # A decreasing map reverses them.
    assert spearman(-x, y) == pytest.approx(-rho, abs=1e-12)


@settings(max_examples=100)
@given(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=20).flatmap(
        lambda xs: st.tuples(
            st.just(xs),
            st.lists(st.floats(-1e3, 1e3), min_size=len(xs), max_size=len(xs)),
        )
    ),
    st.sampled_from([1e-3, 0.5, 2.0, 1024.0, -3.0]),
)
# an error whose square underflows at one scale and not at another
@example(pair=([0.0], [2.473148777473458e-164]), scale=1024.0)
def test_sqnr_db_scale_invariant(
    pair: tuple[list[float], list[float]], scale: float
) -> None:
    x = torch.tensor(pair[0], dtype=torch.float64)
    x_hat = torch.tensor(pair[1], dtype=torch.float64)
    expected = sqnr_db(x, x_hat)
    got = sqnr_db(x * scale, x_hat * scale)
    if math.isinf(expected):
        assert got == expected
    else:
        assert got == pytest.approx(expected, abs=1e-9)


def test_neighbour_agreement_ignores_scale_in_float64_ties() -> None:
    # [1, 1] and [1.5, 1.5] are one direction, but their float64 unit rows
    # differ in the last bit: the tie still goes to the lowest index
    x = torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    test = x.flip(0)
    scaled = test * torch.tensor([1.0, 1.5, 1.0], dtype=torch.float64)[:, None]
    assert neighbour_agreement(x, scaled) == neighbour_agreement(x, test)
