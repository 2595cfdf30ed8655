"""Percentile ranges from histograms: two-sided, or one-sided on |x|.

Boundary convention (counts are exact, so the guarantee is exact)::

    side    returned value                                   guarantee
    upper   right edge of the first bin where the            >= p% of the values
            cumulative count reaches p% of the total,        are <= it
            at most the largest value observed
    lower   left edge of the last bin at or above which      >= p% of the values
            p% of the total lies, at least the smallest      are >= it
            value observed

`percentile=100` gives the observed min / max exactly. NVIDIA ModelOpt
returns the *left* edge of the bin where the CDF reaches p% (one bin lower,
so it can clip slightly more than `100 - p` percent, and p = 100 does not
give the maximum); the right edge is the conservative choice.
"""

from __future__ import annotations

import torch

__all__ = ["percentile_lower", "percentile_range", "percentile_upper"]


def _check(percentile: float) -> None:
    if not 0.0 < float(percentile) <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")


def _cumulative(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cum = torch.cumsum(counts.to(torch.float64), dim=-1)  # exact below 2**53
    return cum, cum[..., -1:]


def percentile_upper(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    percentile: float,
    max_vals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upper `percentile` bound per qparam (see the module's table).

    Args:
        counts: `(*Q, bins)` counts.
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width.
        percentile: in (0, 100].
        max_vals: `(*Q,)` largest observed values, to clamp to (optional).

    Returns:
        `(*Q,)` float64 bounds (`lo` where a qparam has no counts).
    """
    _check(percentile)
    cum, total = _cumulative(counts)
    need = total * (float(percentile) / 100.0)
    index = torch.searchsorted(cum.contiguous(), need.contiguous()).squeeze(-1)
    index = index.clamp(max=counts.shape[-1] - 1)
    edge = lo.to(torch.float64) + (index + 1).to(torch.float64) * width
    if max_vals is not None:
        edge = torch.minimum(edge, max_vals.to(torch.float64))
    return torch.where(total.squeeze(-1) > 0, edge, lo.to(torch.float64))


def percentile_lower(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    percentile: float,
    min_vals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lower `percentile` bound per qparam (see the module's table).

    Args:
        counts: `(*Q, bins)` counts.
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width.
        percentile: in (0, 100].
        min_vals: `(*Q,)` smallest observed values, to clamp to (optional).

    Returns:
        `(*Q,)` float64 bounds (`lo` where a qparam has no counts).
    """
    _check(percentile)
    cum, total = _cumulative(counts)
    before = torch.nn.functional.pad(cum[..., :-1], (1, 0))  # count below bin j
    allowed = total - total * (float(percentile) / 100.0)
    index = torch.searchsorted(before.contiguous(), allowed.contiguous(), right=True)
    index = (index.squeeze(-1) - 1).clamp(min=0)
    edge = lo.to(torch.float64) + index.to(torch.float64) * width
    if min_vals is not None:
        edge = torch.maximum(edge, min_vals.to(torch.float64))
    return torch.where(total.squeeze(-1) > 0, edge, lo.to(torch.float64))


def percentile_range(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    percentile: float,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    absolute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Percentile range: two-sided on `x`, or `[-a, a]` from a histogram of |x|.

    Args:
        counts: `(*Q, bins)` counts (of |x| when `absolute`).
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width.
        percentile: in (0, 100]; each tail keeps `percentile` percent.
        min_vals: `(*Q,)` smallest observed values of x.
        max_vals: `(*Q,)` largest observed values of x.
        absolute: the counts are of |x|: one-sided, symmetric result.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32.
    """
    if absolute:
        amax = torch.maximum(-min_vals, max_vals)
        upper = percentile_upper(counts, lo, width, percentile, amax)
        return (-upper).to(torch.float32), upper.to(torch.float32)
    upper = percentile_upper(counts, lo, width, percentile, max_vals)
    lower = percentile_lower(counts, lo, width, percentile, min_vals)
    return lower.to(torch.float32), upper.to(torch.float32)
