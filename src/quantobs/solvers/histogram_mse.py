"""Histogram MSE: the range minimizing the expected `|fake_quant(x) - x|**norm`.

The expectation is over the histogram with each bin's values at its center
(as NVIDIA ModelOpt's histogram MSE): `sum_j counts[j] * |fq(c_j) - c_j|**norm`.
`fq` is the real fake quantization of the args, with the format's own
rounding (int half-to-even, FP8, FP4, MX power-of-two scales) and the scale
and zero point `calculate_qparams` gives for the candidate range; NVFP4
candidates use unrounded group scales and no global scale, as the raw-data
MSE search does (`quantobs.core.scoring.search_args`). A histogram of |x| scores the
positive values only.

Candidates shrink the observed range, `(p * min, p * max)` for
`p = 1 - i / grid`, `i < maxshrink * grid` (llm-compressor's family); all
candidates of all qparams are scored at once, in bounded chunks. The first
minimum wins (ties go to the wider range).
"""

from __future__ import annotations

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.scoring import candidate_qparams, score, search_args, shrink_factors

__all__ = ["histogram_mse_search"]


def histogram_mse_search(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    *,
    norm: float = 2.0,
    maxshrink: float = 0.8,
    grid: float = 100.0,
    absolute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Range of least expected quantization error under the histogram.

    Args:
        counts: `(*Q, bins)` counts (of |x| when `absolute`).
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width.
        args: the quantization args (format, symmetry, scale dtype).
        min_vals: `(*Q,)` observed minima of x (the range candidates shrink).
        max_vals: `(*Q,)` observed maxima of x.
        norm: error exponent (2: mean squared error).
        maxshrink: largest fraction the range shrinks by, in (0, 1].
        grid: candidates per unit of shrink.
        absolute: the counts are of |x|; candidates are `[-p a, p a]`.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32 (`(0, 0)` where a qparam
        has no counts).
    """
    if not 0.0 < maxshrink <= 1.0 or grid <= 0 or norm <= 0:
        raise ValueError(
            f"need 0 < maxshrink <= 1, grid > 0 and norm > 0; got maxshrink="
            f"{maxshrink}, grid={grid}, norm={norm}"
        )
    qshape = tuple(counts.shape[:-1])
    bins = counts.shape[-1]
    weights = counts.reshape(-1, bins).to(torch.float64)
    device = weights.device
    index = torch.arange(bins, dtype=torch.float64, device=device) + 0.5
    centers = lo.reshape(-1, 1).to(torch.float64) + index * width.reshape(-1, 1)
    centers = centers.to(torch.float32)
    low, high = min_vals.reshape(-1).float(), max_vals.reshape(-1).float()
    has_data = low <= high
    low = torch.where(has_data, low, 0.0)
    high = torch.where(has_data, high, 0.0)
    if absolute:
        high = torch.maximum(-low, high)
        low = -high
    factors = shrink_factors(maxshrink, grid).to(device)
    scoring = search_args(args)
    scale, zero_point = candidate_qparams(
        factors[:, None] * low[None], factors[:, None] * high[None], scoring
    )  # (C, Q)
    errors = score(
        centers[None], scale, zero_point, args.format, norm, weights=weights
    )  # (C, Q)
    best = factors[errors.argmin(dim=0)]  # first minimum: widest of the ties
    return (best * low).reshape(qshape), (best * high).reshape(qshape)
