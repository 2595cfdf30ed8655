"""The one scorer: every chunking gives the errors of the plain definition."""

from __future__ import annotations

import pytest
import torch

from quantobs.core.formats import get_format
from quantobs.core.scoring import score


def reference(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    weights: torch.Tensor | None,
    norm: float,
    fmt_name: str,
) -> torch.Tensor:
    """`(C, Q)` sum over N, G of `w * |fake_quant(x) - x| ** norm`, one
    candidate and qparam at a time, in float64 (int formats)."""
    fmt = get_format(fmt_name)
    num_c, num_q = scale.shape
    out = torch.empty(num_c, num_q, dtype=torch.float64)
    for c in range(num_c):
        for q in range(num_q):
            x = x3[:, q].double()
            zp = 0.0 if zero_point is None else float(zero_point[c, q])
            s = float(scale[c, q])
            codes = (x / s + zp).clamp(fmt.min, fmt.max).round()
            err = ((codes - zp) * s - x).abs() ** norm
            w = 1.0 if weights is None else weights[q].double()
            out[c, q] = (err * w).sum()
    return out


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("chunk_elems", [1, 7, 64, 1 << 20])
def test_weighted_scores_equal_the_definition_under_any_chunking(
    asymmetric: bool, chunk_elems: int
) -> None:
    # Histogram-shaped input: (1, Q, bins) centers, (Q, bins) counts.
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(1, 3, 40, generator=g)
    counts = torch.randint(0, 50, (3, 40), generator=g)
    scale = torch.rand(5, 3, generator=g) * 0.05 + 0.001  # (C, Q)
    zero_point = torch.randint(-20, 20, (5, 3), generator=g).float()
    zero_point = zero_point if asymmetric else None
    fmt = get_format("int8")
    got = score(centers, scale, zero_point, fmt, 2.0, weights=counts,
                chunk_elems=chunk_elems)  # fmt: skip
    expected = reference(centers, scale, zero_point, counts, 2.0, "int8")
    assert got.shape == (5, 3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("chunk_elems", [1, 16, 1 << 20])
def test_unweighted_scores_equal_the_definition_under_any_chunking(
    chunk_elems: int,
) -> None:
    g = torch.Generator().manual_seed(1)
    x3 = torch.randn(6, 4, 8, generator=g)  # (N, Q, G)
    scale = torch.rand(3, 4, generator=g) * 0.1 + 0.01
    fmt = get_format("int4")
    got = score(x3, scale, None, fmt, 2.4, chunk_elems=chunk_elems)
    expected = reference(x3, scale, None, None, 2.4, "int4")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)
