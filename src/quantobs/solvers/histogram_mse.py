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

`histogram_mse_uniform` scores the same candidates another way, for integer
formats and the squared error: each bin's values spread evenly over the bin
(not piled at its centre), and the exact expected error of the candidate's
quantizer (its scale and rounded zero point from `calculate_qparams`:
levels `(k - zero_point) * scale`, `qmin <= k <= qmax`, values beyond the
end levels clamped) in closed form (`quantobs.solvers.l2_error`: the
destination range `[(qmin - zp - 1/2) * scale, (qmax - zp + 1/2) * scale]`
of `qmax - qmin + 1` levels). Bin centres alias with the levels when a bin
is as wide as a quantization step (a per-channel histogram of a few hundred
bins under int8), which makes the centre rule pick noise; the uniform rule
does not, and costs O(1) per candidate: every candidate is scored with the
O(1) form (clipping exact, `scale**2 / 12` per unit mass inside), and up to
32 levels (`l2_error.EXACT_LEVELS`, int4) the best 4 of it are scored exactly
(O(levels)) and the least exact error wins.
"""

from __future__ import annotations

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.scoring import candidate_qparams, score, search_args, shrink_factors
from quantobs.solvers.l2_error import EXACT_LEVELS, as_rows, l2_candidate_errors

__all__ = ["histogram_mse_search", "histogram_mse_uniform", "uniform_applies"]

_FINISH = 4  # uniform: best candidates of the O(1) form scored exactly
_ELEMS = 1 << 18  # uniform: (qparams x candidates) scored per block


def uniform_applies(args: QuantizationArgs, norm: float) -> bool:
    """Whether `histogram_mse_uniform` scores these args (integer formats,
    squared error)."""
    return not args.format.is_float and float(norm) == 2.0


def _check(maxshrink: float, grid: float, norm: float) -> None:
    if not 0.0 < maxshrink <= 1.0 or grid <= 0 or norm <= 0:
        raise ValueError(
            f"need 0 < maxshrink <= 1, grid > 0 and norm > 0; got maxshrink="
            f"{maxshrink}, grid={grid}, norm={norm}"
        )


def _candidates(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    maxshrink: float,
    grid: float,
    absolute: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(factors (C,), low (Q,), high (Q,))`: the shrunk ranges are
    `factors * low`, `factors * high` (`(0, 0)` where there is no data)."""
    low, high = min_vals.reshape(-1).float(), max_vals.reshape(-1).float()
    has_data = low <= high
    low = torch.where(has_data, low, 0.0)
    high = torch.where(has_data, high, 0.0)
    if absolute:
        high = torch.maximum(-low, high)
        low = -high
    return shrink_factors(maxshrink, grid).to(low.device), low, high


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
    _check(maxshrink, grid, norm)
    qshape = tuple(counts.shape[:-1])
    bins = counts.shape[-1]
    weights = counts.reshape(-1, bins).to(torch.float64)  # (Q, bins)
    device = weights.device
    index = torch.arange(bins, dtype=torch.float64, device=device) + 0.5  # (bins,)
    centers = lo.reshape(-1, 1).to(torch.float64) + index * width.reshape(-1, 1)
    centers = centers.to(torch.float32)  # (Q, bins)
    factors, low, high = _candidates(min_vals, max_vals, maxshrink, grid, absolute)
    scoring = search_args(args)
    scale, zero_point = candidate_qparams(
        factors[:, None] * low[None], factors[:, None] * high[None], scoring
    )  # (C, Q)
    errors = score(
        centers[None], scale, zero_point, args.format, norm, weights=weights
    )  # (C, Q)
    best = factors[errors.argmin(dim=0)]  # first minimum: widest of the ties
    return (best * low).reshape(qshape), (best * high).reshape(qshape)


def histogram_mse_uniform(
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
    widths_positive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`histogram_mse_search`'s candidates, scored with values spread evenly
    in their bins (the module docstring): integer formats, `norm=2` only.

    Args: as `histogram_mse_search`'s, and
        widths_positive: the caller knows every `width` is > 0 (a
            `Histogram`'s power-of-two bins): the check, a host read, is
            skipped.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32 (`(0, 0)` where a qparam
        has no counts).

    Raises:
        ValueError: a float format or another norm (`uniform_applies`), bad
            `maxshrink`, `grid`, or a bin width that is not positive (values
            spread in a bin need one; `histogram_mse_search` takes it).
    """
    _check(maxshrink, grid, norm)
    if not widths_positive and bool((width <= 0).any()):
        raise ValueError(
            "the uniform-bin histogram MSE needs bin widths > 0; use "
            "objective='bin_centers' (histogram_mse_search) for a histogram of "
            "equal values"
        )
    if not uniform_applies(args, norm):
        raise ValueError(
            "the uniform-bin histogram MSE scores integer formats with norm=2; "
            f"got {args.format.name} with norm={norm}: use objective='bin_centers'"
        )
    qshape = tuple(counts.shape[:-1])
    rows, lo64, width64 = as_rows(counts, lo, width)
    factors, low, high = _candidates(min_vals, max_vals, maxshrink, grid, absolute)
    scale, zero_point = candidate_qparams(
        factors[:, None] * low[None], factors[:, None] * high[None], args
    )  # (C, Q)
    fmt = args.format
    levels = int(fmt.max - fmt.min) + 1
    shift = 0.0 if zero_point is None else zero_point.to(torch.float64)
    scale64 = scale.to(torch.float64)
    below = (fmt.min - shift - 0.5) * scale64  # (C, Q) destination range
    above = (fmt.max - shift + 0.5) * scale64
    lo_u = ((below - lo64) / width64).T  # (Q, C) bin units
    hi_u = ((above - lo64) / width64).T
    num_q, num_c = lo_u.shape
    best = torch.empty(num_q, dtype=torch.int64, device=rows.device)
    block = max(1, _ELEMS // max(1, num_c))
    for q0 in range(0, num_q, block):
        part = slice(q0, q0 + block)
        lo_p, hi_p = lo_u[part], hi_u[part]
        errors = l2_candidate_errors(rows[part], lo_p, hi_p, levels, False)
        if levels <= EXACT_LEVELS:
            # the best by the O(1) form (first of ties: the widest), scored
            # exactly; the least exact error wins, the widest of ties
            top = torch.argsort(errors, dim=1, stable=True)[:, :_FINISH]
            exact = l2_candidate_errors(
                rows[part], lo_p.gather(1, top), hi_p.gather(1, top), levels, True
            )
            least = exact.min(dim=1, keepdim=True).values
            tied = torch.where(exact == least, top, num_c)
            best[part] = tied.min(dim=1).values
        else:
            best[part] = errors.argmin(dim=1)  # first minimum: the widest of ties
    chosen = factors[best]
    return (chosen * low).reshape(qshape), (chosen * high).reshape(qshape)
