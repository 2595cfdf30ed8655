"""Quark's histogram range searches: percentile and MSE, as pure functions.

Percentile (Quark's `get_min_max_by_percentile`), over `counts` and
`edges`; `p` in 0..100, `cum` the cumulative counts::

    symmetric   max = left edge of the first bin with cum >= p% of the total
                (min = 0)
    asymmetric  tail t = (100 - p) / 200 on each side
                max = left edge of the first bin with cum >= (1 - t) total
                min = right edge of the last bin with at least (1 - t) total
                      at or above it (the mirror image), at most max

Quark's asymmetric branch returns the data minimum and the lower tail's
percentile (both ends at the bottom); counts are exact (Quark compares
float32 cumulative fractions).

MSE (Quark's `get_min_max_by_mse`): candidate maxima are the bin centers
from `start_bin` on (every `stride`-th; 3 of 2048 by default), the minimum
is 0 (symmetric) or the data minimum; each candidate's error is
`sum(counts * (fake_quant(center) - center)**2)` under the candidate's
qparams, and the first least error wins. Vectorized over candidates (and
over qparams for the per-channel histograms), in bounded chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["candidate_errors", "mse_candidates", "percentile_bounds"]

_CHUNK = 1 << 20  # float32 elements per (qparams, candidates, bins) temporary

FakeQuant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def percentile_bounds(
    counts: torch.Tensor, edges: torch.Tensor, percentile: float, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Percentile range of a histogram (module table).

    Args:
        counts: `(bins,)` counts (any real dtype).
        edges: `(bins + 1,)` bin edges.
        percentile: in 0..100.
        symmetric: a histogram of |x| (min is 0).

    Returns:
        `(min, max)` 0-d tensors of `edges.dtype`, or None if the histogram
        is empty.
    """
    cum = torch.cumsum(counts.to(torch.float64), dim=0)  # exact below 2**53
    total = float(cum[-1]) if cum.numel() else 0.0
    if total <= 0:
        return None
    last = counts.numel() - 1
    zero = torch.zeros((), dtype=edges.dtype, device=edges.device)
    if symmetric:
        need = torch.tensor([total * percentile / 100.0], dtype=torch.float64)
        upper = min(int(torch.searchsorted(cum.cpu(), need)), last)
        return zero, edges[upper]
    keep = total * (1.0 - (100.0 - percentile) / 200.0)
    upper = min(int(torch.searchsorted(cum.cpu(), torch.tensor([keep]))), last)
    before = torch.nn.functional.pad(cum[:-1], (1, 0)).cpu()  # counts below bin j
    lower = (
        int(torch.searchsorted(before, torch.tensor([total - keep]), right=True)) - 1
    )
    lower_edge = edges[max(lower, 0) + 1]
    return torch.minimum(lower_edge, edges[upper]), edges[upper]


def mse_candidates(num_centers: int, start_bin: int, stride: int) -> torch.Tensor:
    """Indices of the candidate centers: `start_bin` (at most the last) on."""
    if stride < 1:
        raise ValueError(f"stride={stride} must be a positive int")
    first = min(start_bin, max(0, num_centers - 1))
    return torch.arange(first, num_centers, stride)


def candidate_errors(
    centers: torch.Tensor,
    counts: torch.Tensor,
    low: torch.Tensor,
    candidates: torch.Tensor,
    fake_quant: FakeQuant,
) -> torch.Tensor:
    """Squared error of each candidate range, weighted by the counts.

    Args:
        centers: `(Q, B)` float32 bin centers.
        counts: `(Q, B)` counts.
        low: `(Q,)` lower ends of the candidate ranges.
        candidates: `(Q, C)` upper ends.
        fake_quant: `(values (q, 1, B), low (q, 1, 1), high (q, C, 1)) ->
            (q, C, B)` quantize-dequantize under each range's qparams.

    Returns:
        `(Q, C)` float64 errors.
    """
    num_q, bins = centers.shape
    num_c = candidates.shape[1]
    step_q = max(1, _CHUNK // max(1, num_c * bins))
    step_c = max(1, min(num_c, _CHUNK // max(1, bins)))
    weights = counts.to(torch.float64)
    out = torch.empty(candidates.shape, dtype=torch.float64, device=centers.device)
    for q0 in range(0, num_q, step_q):  # chunks of qparams x candidates
        rows = slice(q0, q0 + step_q)
        values = centers[rows, None, :]
        for c0 in range(0, num_c, step_c):
            cols = slice(c0, c0 + step_c)
            quantized = fake_quant(
                values, low[rows, None, None], candidates[rows, cols, None]
            )
            err = quantized.sub_(values).square_().to(torch.float64)
            # (q, c, B) @ (q, B, 1): the count-weighted sum of each row
            out[rows, cols] = torch.bmm(err, weights[rows, :, None]).squeeze(-1)
    return out
