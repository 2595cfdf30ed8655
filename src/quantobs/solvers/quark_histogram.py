"""Quark's histogram range searches (per-tensor linear histograms): percentile
and the MSE search's candidates, as pure functions.

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
qparams (scored by `quantobs.core.scoring.score`, weighted by the counts),
and the first least error wins.
"""

from __future__ import annotations

import torch

__all__ = ["mse_candidates", "percentile_bounds"]


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
    # float64 targets, as the counts: float32 ones past 2**24 values round
    # and cut the top bins (the Quark bug this module avoids)
    need = torch.tensor([keep], dtype=torch.float64)
    upper = min(int(torch.searchsorted(cum.cpu(), need)), last)
    before = torch.nn.functional.pad(cum[:-1], (1, 0)).cpu()  # counts below bin j
    drop = torch.tensor([total - keep], dtype=torch.float64)
    lower = int(torch.searchsorted(before, drop, right=True)) - 1
    lower_edge = edges[max(lower, 0) + 1]
    return torch.minimum(lower_edge, edges[upper]), edges[upper]


def mse_candidates(num_centers: int, start_bin: int, stride: int) -> torch.Tensor:
    """Indices of the candidate centers: `start_bin` (at most the last) on."""
    if stride < 1:
        raise ValueError(f"stride={stride} must be a positive int")
    first = min(start_bin, max(0, num_centers - 1))
    return torch.arange(first, num_centers, stride)
