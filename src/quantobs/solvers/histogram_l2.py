"""L2 histogram search: torch.ao's greedy search, and its global minimum.

Final signatures::

    torch_l2_search(histogram: Tensor, min_val: Tensor, max_val: Tensor,
                    dst_nbins: int = 256) -> tuple[Tensor, Tensor]
    torch_l2_search_batched(histogram: Tensor (Q, bins), min_val: Tensor (Q,),
                            max_val: Tensor (Q,), dst_nbins: int = 256)
                            -> tuple[Tensor, Tensor]
    l2_search(counts: Tensor (*Q, bins), lo: Tensor (*Q,), width: Tensor (*Q,),
              levels: int, *, symmetric: tuple[float, float] | None = None)
              -> tuple[Tensor, Tensor]
    l2_errors(counts, lo, width, min_vals (*Q, C), max_vals (*Q, C),
              levels: int) -> Tensor (*Q, C)

`torch_l2_search` returns what torch 2.13's
`HistogramObserver._non_linear_param_search()` returns for an observer whose
`histogram`, `min_val`, `max_val` and `dst_nbins` are these (torch reads
`bins` as `histogram.numel()`; `upsample_rate` only matters to the histogram
update, not to the search). Call it as::

    new_min, new_max = torch_l2_search(
        obs.histogram, obs.min_val, obs.max_val, obs.dst_nbins
    )

The result is equal bit for bit, because the same greedy steps are taken with
the same float arithmetic; only the way they are found differs:

* torch walks `alpha`/`beta` in steps of 1e-5 of the mass (up to 10^5 Python
  iterations) and computes each L2 error in its own tensor call. Here the
  quantile bins of every step are one `searchsorted`, the steps that change
  neither end are skipped in one bisection, and the (at most `bins - 1`)
  proposed `(start_bin, end_bin)` pairs are scored a block at a time in one
  batched computation, with torch's float32 operations in torch's order (the
  sums reduce rows the way torch reduces a 1-D tensor).
* torch stops at the first proposal whose error exceeds the last accepted
  one; so does this, on the proposals in the same order.

`l2_search` minimizes the same closed-form error over every candidate range
instead of walking greedily (see its docstring), with as many destination
levels as the quantized range really has.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import functools
import itertools
import math
import operator
import struct
from collections.abc import Callable, Iterator, Sequence

import torch

from quantobs import native

__all__ = [
    "l2_errors",
    "l2_search",
    "torch_l2_search",
    "torch_l2_search_batched",
]

_STEP = 1e-5  # torch's `stepsize`: the mass trimmed per greedy step
# Proposals scored per batched error computation: bounds the (P, bins)
# temporaries to a few MiB.
_PROPOSAL_ELEMS = 1 << 19


@functools.cache
def _alpha_beta() -> tuple[list[float], list[float]]:
    """torch's `alpha` and `beta` after k steps, accumulated as torch does.

    `alpha` starts at 0.0 and `beta` at 1.0; each step adds (subtracts) 1e-5
    in double precision, so `alpha[k]` is not `k * 1e-5`. The loop runs while
    `alpha < beta`: about 10^5 steps in all.
    """
    size = int(1.0 / _STEP) + 3
    alpha = list(itertools.accumulate([_STEP] * (size - 1), initial=0.0))
    beta = list(itertools.accumulate([_STEP] * (size - 1), operator.sub, initial=1.0))
    return alpha, beta


def _f32(value: float) -> float:
    """A double rounded to the nearest float32, as torch casts a scalar."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_histogram(histogram: torch.Tensor, dst_nbins: int) -> None:
    if not isinstance(histogram, torch.Tensor):
        raise TypeError(
            f"histogram must be a torch.Tensor, got {type(histogram).__name__}"
        )
    if histogram.dtype != torch.float32:
        raise TypeError(
            f"histogram must be float32 as torch.ao's HistogramObserver keeps it, "
            f"got {histogram.dtype}; pass histogram.float()"
        )
    if histogram.ndim != 1 or histogram.numel() == 0:
        raise ValueError(
            f"histogram must be 1-D with at least one bin, got shape "
            f"{tuple(histogram.shape)}"
        )
    if isinstance(dst_nbins, bool) or not isinstance(dst_nbins, int) or dst_nbins < 1:
        raise ValueError(
            f"dst_nbins must be a positive int (2**bits of the quantized dtype), "
            f"got {dst_nbins!r}"
        )
    low, high = torch.aminmax(histogram)  # NaN propagates: fails both tests
    if not (float(low) >= 0.0 and float(high) < math.inf):
        raise ValueError(
            "histogram must hold finite, non-negative counts (torch.ao's search "
            "assumes a non-decreasing cumulative sum)"
        )


def _greedy_proposals(
    c_sum: Sequence[float], total: float
) -> Iterator[tuple[int, int]]:
    """The `(start_bin, end_bin)` pairs torch's loop scores, in order.

    Assumes every proposal is accepted; torch stops at the first rejected one,
    which the caller finds by scoring them. Up to that point the two walks
    are the same, because an accepted proposal is the only state change.

    torch's inner loops, for the quantile thresholds `t_a = f32(alpha * total)`
    and `t_b = f32(beta * total)` (the comparisons run in float32, the dtype
    of `cSum`), compute::

        l = first bin >= start_bin with cSum[l] >= t_a, at most end_bin
        r = last bin <= end_bin with cSum[r] <= t_b, at least start_bin

    `cSum` is non-decreasing, so both are bisections clamped to
    `[start_bin, end_bin]`; `c_sum` holds the float32 values as doubles, so
    comparing doubles compares the float32 values.
    """
    alpha, beta = _alpha_beta()
    a = b = 0  # steps taken by alpha and beta
    start, end = 0, len(c_sum) - 1
    while alpha[a] < beta[b] and start < end:  # start == end: nothing can move
        l_bin = bisect.bisect_left(c_sum, _f32(alpha[a + 1] * total))
        r_bin = bisect.bisect_right(c_sum, _f32(beta[b + 1] * total)) - 1
        l_bin, r_bin = min(max(l_bin, start), end), max(min(r_bin, end), start)
        if l_bin - start > end - r_bin:
            a, start = a + 1, l_bin
            yield start, end
        elif r_bin < end:
            b, end = b + 1, r_bin
            yield start, end
        else:
            # Neither end moves (l == start, r == end): torch steps beta alone
            # until r drops below end_bin, i.e. until t_b < cSum[end]. t_b
            # does not increase with b: skip to that step by bisection.
            b = (
                bisect.bisect_right(
                    beta,
                    -c_sum[end],
                    lo=b + 2,
                    key=lambda value: -_f32(value * total),
                )
                - 1
            )
            if b + 1 >= len(beta):  # beta ran out: the loop ends
                return


def _torch_errors(
    histogram: torch.Tensor,
    bin_width: torch.Tensor,
    dst_nbins: int,
    starts: torch.Tensor,
    ends: torch.Tensor,
) -> torch.Tensor:
    """torch's `_compute_quantization_error` for P proposals at once.

    Every operation is torch's, elementwise, in its dtype and order: Python
    doubles become float32 exactly where torch's scalar arguments do, and
    float64 tensor arithmetic stands in for torch's Python double arithmetic
    (both IEEE double).

    Args:
        histogram: `(P, bins)` float32, or `(1, bins)` shared by all proposals.
        bin_width: `(P,)` float64 `(max_val.item() - min_val.item()) / bins`.
        dst_nbins: destination bins.
        starts: `(P,)` int64 start bins.
        ends: `(P,)` int64 end bins.

    Returns:
        `(P,)` float32 errors (0 where the destination bin width is 0).
    """
    terms = native.torch_l2_terms(histogram, starts, ends, bin_width, dst_nbins)
    if terms is not None:  # the same terms, in one native pass
        return terms.sum(dim=1)
    bins = histogram.shape[-1]
    device = histogram.device
    f32 = torch.float32
    widths = (ends - starts + 1).to(torch.float64)
    dst_width = (bin_width * widths) / dst_nbins  # (P,) double
    bw = bin_width.to(f32)[:, None]  # (P, 1)
    dw = dst_width.to(f32)[:, None]
    half = (dst_width / 2).to(f32)[:, None]
    neg_half = (-dst_width / 2).to(f32)[:, None]

    src_bin = torch.arange(bins, device=device)
    src_begin = (src_bin[None, :] - starts[:, None]) * bw  # (P, bins)
    src_end = src_begin + bw
    dst_of_begin = torch.clamp(
        torch.div(src_begin, dw, rounding_mode="floor"), 0, dst_nbins - 1
    )
    dst_of_begin_center = (dst_of_begin + 0.5) * dw
    dst_of_end = torch.clamp(
        torch.div(src_end, dw, rounding_mode="floor"), 0, dst_nbins - 1
    )
    density = histogram / bw  # (P, bins)

    delta_begin = src_begin - dst_of_begin_center
    norm = density * (
        (half * half * half - delta_begin * delta_begin * delta_begin) / 3
    )
    inner = density * ((half * half * half - neg_half * neg_half * neg_half) / 3)
    norm += (dst_of_end - dst_of_begin - 1) * inner
    dst_of_end_center = dst_of_end * dw + half
    delta_end = src_end - dst_of_end_center
    norm += density * (
        (delta_end * delta_end * delta_end - neg_half * neg_half * neg_half) / 3
    )
    errors = norm.sum(dim=1)
    return torch.where(dst_width == 0.0, torch.zeros_like(errors), errors)


def torch_l2_search(
    histogram: torch.Tensor,
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    dst_nbins: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ao's `HistogramObserver._non_linear_param_search`, bit for bit.

    Greedy: from the full range, each step trims 1e-5 of the mass from the
    side whose quantile moves more bins, and the walk stops at the first step
    whose L2 error (torch's closed form, uniform density within bins) exceeds
    the last accepted one. See the module docstring for how it is vectorized.

    Args:
        histogram: `(bins,)` float32 counts, as `HistogramObserver.histogram`
            (finite, non-negative).
        min_val: 0-dim (or one-element) float32 left edge of bin 0, as
            `HistogramObserver.min_val`.
        max_val: right edge of the last bin, as `HistogramObserver.max_val`.
        dst_nbins: destination levels, torch's `dst_nbins` (`2 ** bits` of
            the quantized dtype: 256 for quint8/qint8, whatever the actual
            `quant_min`/`quant_max`).

    Returns:
        `(new_min, new_max)` with the dtype, shape and device torch's search
        gives: `min_val + bin_width * start_bin` and
        `min_val + bin_width * (end_bin + 1)`.

    Raises:
        TypeError: `histogram` is not a float32 tensor.
        ValueError: a histogram that is not 1-D, is empty, has negative or
            non-finite counts, or a `dst_nbins` below 1.
    """
    _check_histogram(histogram, dst_nbins)
    bins = histogram.numel()
    min_d, max_d = float(min_val.item()), float(max_val.item())
    width = torch.tensor(
        [(max_d - min_d) / bins], dtype=torch.float64, device=histogram.device
    )  # torch's Python double
    total = torch.sum(histogram).item()
    c_sum = _floats(torch.cumsum(histogram, dim=0))
    proposals = _greedy_proposals(c_sum, total)

    start_bin, end_bin = 0, bins - 1
    norm_min = float("inf")
    # torch usually stops within 3 to 40 proposals: score blocks of growing size.
    size, most = 8, max(8, _PROPOSAL_ELEMS // bins)
    while block := list(itertools.islice(proposals, size)):
        pairs = torch.tensor(block, dtype=torch.int64, device=histogram.device)
        errors = _torch_errors(
            histogram[None], width.expand(len(block)), dst_nbins, *pairs.unbind(1)
        )
        for (start, end), norm in zip(block, errors.tolist(), strict=True):
            if norm > norm_min:
                return _edges(min_val, max_val, bins, start_bin, end_bin)
            norm_min, start_bin, end_bin = norm, start, end
        size = min(size * 4, most)
    return _edges(min_val, max_val, bins, start_bin, end_bin)


def _floats(values: torch.Tensor) -> array.array[float]:
    """A float32 tensor's values as a Python sequence (its bytes copied once,
    items read lazily: bisecting 2048 values reads ~11 of them)."""
    values = values.detach().to("cpu", torch.float32).contiguous()
    found = array.array("f")
    found.frombytes(ctypes.string_at(values.data_ptr(), values.numel() * 4))
    return found


def _edges(
    min_val: torch.Tensor, max_val: torch.Tensor, bins: int, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # torch's last two lines, with its tensor arithmetic.
    bin_width = (max_val - min_val) / bins
    return min_val + bin_width * start, min_val + bin_width * (end + 1)


def _first_beta_below(
    betas: torch.Tensor, total: torch.Tensor, bound: torch.Tensor, lo: torch.Tensor
) -> torch.Tensor:
    """Per row, the first `j >= lo` with `f32(betas[j] * total) < bound`.

    `f32(beta * total)` does not increase with j, so this is a bisection (run
    on every row at once). Rows where no such j exists get `len(betas)`.
    """
    hi = torch.full_like(lo, betas.numel())
    for _ in range(int(betas.numel()).bit_length() + 1):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        below = (betas[mid.clamp(max=betas.numel() - 1)] * total).to(torch.float32)
        below = (below < bound) & (mid < hi)
        hi = torch.where(below, mid, hi)
        lo = torch.where(below | (mid >= hi), lo, mid + 1)
    return hi


def torch_l2_search_batched(
    histogram: torch.Tensor,
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    dst_nbins: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_l2_search` on many histograms at once (one result per row).

    The rows walk in lockstep: each iteration takes every unfinished row one
    greedy step (a proposal, scored in one batched error computation, or a
    bisection over the steps that change nothing), so the Python loop runs
    over steps, never over rows. Each row's result equals `torch_l2_search`
    of that row.

    Args:
        histogram: `(Q, bins)` float32 finite, non-negative counts.
        min_val: `(Q,)` float32 left edges of bin 0.
        max_val: `(Q,)` float32 right edges of the last bin.
        dst_nbins: destination bins (torch: `2 ** bits`).

    Returns:
        `(new_min, new_max)`, each `(Q,)` float32.
    """
    if histogram.ndim != 2:
        raise ValueError(
            f"histogram must be 2-D (qparams, bins), got shape {tuple(histogram.shape)}"
        )
    _check_histogram(histogram.reshape(-1), dst_nbins)
    num_q, bins = histogram.shape
    device = histogram.device
    alpha, beta = _alpha_beta()
    alphas = torch.tensor(alpha, dtype=torch.float64, device=device)
    betas = torch.tensor(beta, dtype=torch.float64, device=device)
    width = (max_val.to(torch.float64) - min_val.to(torch.float64)) / bins
    total = histogram.sum(dim=1).to(torch.float64)
    c_sum = torch.cumsum(histogram, dim=1)

    a = torch.zeros(num_q, dtype=torch.int64, device=device)
    b = torch.zeros_like(a)
    start = torch.zeros_like(a)
    end = torch.full_like(a, bins - 1)
    norm_min = torch.full((num_q,), math.inf, dtype=torch.float64, device=device)
    live = torch.ones(num_q, dtype=torch.bool, device=device)
    while True:
        live &= (alphas[a] < betas[b]) & (start < end)
        rows = live.nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        ra, rb, rs, re = a[rows], b[rows], start[rows], end[rows]
        rt, rc = total[rows], c_sum[rows]
        thr_a = (alphas[ra + 1] * rt).to(torch.float32)[:, None]
        thr_b = (betas[rb + 1] * rt).to(torch.float32)[:, None]
        l_bin = torch.searchsorted(rc, thr_a).squeeze(1)
        r_bin = torch.searchsorted(rc, thr_b, right=True).squeeze(1) - 1
        l_bin = torch.minimum(torch.maximum(l_bin, rs), re)
        r_bin = torch.maximum(torch.minimum(r_bin, re), rs)
        move_start = (l_bin - rs) > (re - r_bin)
        move_end = ~move_start & (r_bin < re)
        spin = ~move_start & ~move_end
        if bool(spin.any()):
            # Only beta moves until r < end_bin: jump there (see _greedy_proposals).
            sr = rows[spin]
            bound = c_sum[sr, end[sr]]
            j = _first_beta_below(betas, total[sr], bound, b[sr] + 2)
            b[sr] = j - 1
            live[sr[j >= betas.numel()]] = False
        moving = move_start | move_end
        if not bool(moving.any()):
            continue
        mr = rows[moving]
        new_start = torch.where(move_start, l_bin, rs)[moving]
        new_end = torch.where(move_end, r_bin, re)[moving]
        errors = _torch_errors(
            histogram[mr], width[mr], dst_nbins, new_start, new_end
        ).to(torch.float64)
        accept = errors <= norm_min[mr]
        live[mr[~accept]] = False
        ar = mr[accept]
        norm_min[ar] = errors[accept]
        start[ar] = new_start[accept]
        end[ar] = new_end[accept]
        a[ar] += move_start[moving][accept].to(torch.int64)
        b[ar] += move_end[moving][accept].to(torch.int64)
    bin_width = (max_val - min_val) / bins
    return min_val + bin_width * start, min_val + bin_width * (end + 1)


# ------------------------------------------------------------------ global mode
#
# The L2 error of torch's closed form, for any range: the histogram is a
# piecewise-uniform density (bin j holds counts[j] spread evenly over it); the
# candidate range [lo, hi] is cut into `levels` equal destination bins of
# width D = (hi - lo) / levels whose centers are the quantized values; values
# below lo (above hi) go to the first (last) center. torch's
# `_compute_quantization_error` is this integral for bin-edge ranges and
# `dst_nbins` levels. Below, positions are in bin units, u = (x - lo_edge) /
# width, and moments are taken about the histogram's middle (fewer digits
# lost in float64).

_TOP = 4  # candidates kept per refinement level
_EXACT = 4  # best screened candidates: starts of the exact descent
_GRID = 64  # first-level grid: _GRID + 1 positions per side
_SPLIT = 8  # each refinement level divides the step by this
_DESCENT_STEPS = 64  # exact +-1 bin moves after the approximate search
_EXACT_ELEMS = 1 << 21  # float64 elements per exact-error temporary
_EXACT_SCREEN_LEVELS = 32  # up to this many levels, screen with exact errors
_EXHAUSTIVE_EVALS = 1 << 22  # edge evaluations below which every candidate is scored


def _prefix_moments(counts: torch.Tensor) -> torch.Tensor:
    """`(Q, bins, 4)` table: moments at position u in bin j are affine in u.

    With `P_p[j]` the prefix sums of `counts[i] * int_i^{i+1} x^p dx` (x
    centered on the histogram's middle) and `h = counts[j]`::

        int_0^u x^p rho = P_p[j] + h * (u^(p+1) - j^(p+1)) / (p + 1)
                        = A_p[j] + h * u^(p+1) / (p + 1)

    The table holds `A_0, A_1, A_2, h` per bin: one gather per position.
    """
    num_q, bins = counts.shape
    left = torch.arange(bins + 1, dtype=torch.float64, device=counts.device)
    left = left - bins / 2  # centered bin edges
    table = torch.empty(num_q, bins, 4, dtype=torch.float64, device=counts.device)
    for p in range(3):
        power = left ** (p + 1) / (p + 1)
        prefix = torch.cumsum(counts * (power[1:] - power[:-1]), dim=1)
        prefix = torch.nn.functional.pad(prefix[:, :-1], (1, 0))  # P_p[j]
        table[..., p] = prefix - counts * power[:-1]
    table[..., 3] = counts
    return table


def _moments_at(
    prefix: torch.Tensor, counts: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """`(3, Q, K)` moments `int_0^u x^p rho(x) dx` at positions `u` `(Q, K)`."""
    bins = counts.shape[1]
    u = u.clamp(0, bins)
    j = u.to(torch.int64).clamp(max=bins - 1)  # floor: u >= 0
    found = torch.gather(prefix, 1, j[..., None].expand(*j.shape, 4))
    a0, a1, a2, h = found.unbind(-1)
    uc = u - bins / 2
    hu = h * uc
    out = torch.empty(3, *u.shape, dtype=torch.float64, device=u.device)
    out[0] = a0 + hu
    hu = hu * uc
    out[1] = a1 + hu / 2
    out[2] = a2 + hu * uc / 3
    return out


def _region_error(
    moments_hi: torch.Tensor, moments_lo: torch.Tensor, center: torch.Tensor
) -> torch.Tensor:
    """`int (x - center)^2 rho` over a region, from its end moments."""
    d0, d1, d2 = (moments_hi - moments_lo).unbind(0)
    return d2 - 2 * center * d1 + center * center * d0


def _exact_units(
    prefix: torch.Tensor,
    counts: torch.Tensor,
    lo_u: torch.Tensor,
    hi_u: torch.Tensor,
    levels: int,
) -> torch.Tensor:
    """Exact L2 errors `(Q, C)` of ranges `[lo_u, hi_u]` (bin units)."""
    num_q, num_c = lo_u.shape
    bins = counts.shape[1]
    out = torch.empty(num_q, num_c, dtype=torch.float64, device=lo_u.device)
    k = torch.arange(levels + 1, dtype=torch.float64, device=lo_u.device)
    step = max(1, _EXACT_ELEMS // max(1, num_q * (levels + 1)))
    for c0 in range(0, num_c, step):
        lo, hi = lo_u[:, c0 : c0 + step, None], hi_u[:, c0 : c0 + step, None]
        width = (hi - lo) / levels
        edges = lo + k * width  # (Q, Cc, levels + 1)
        edges[..., 0], edges[..., -1] = 0.0, float(bins)  # tails clip to the ends
        moments = _moments_at(prefix, counts, edges.reshape(num_q, -1)).reshape(
            3, *edges.shape
        )
        centers = lo + (k[:-1] + 0.5) * width - bins / 2
        errors = _region_error(moments[..., 1:], moments[..., :-1], centers)
        out[:, c0 : c0 + step] = errors.sum(dim=-1)
    return out


def _approx_units(
    prefix: torch.Tensor,
    counts: torch.Tensor,
    lo_u: torch.Tensor,
    hi_u: torch.Tensor,
    levels: int,
) -> torch.Tensor:
    """O(1) errors `(Q, C)`: exact clipping, `D**2 / 12` per unit mass inside.

    The inside term is exact when the density is uniform within each
    destination bin, and close when it is smooth on that scale.
    """
    bins = counts.shape[1]
    width = (hi_u - lo_u) / levels
    zero = torch.zeros_like(lo_u)
    ends = torch.stack([zero, lo_u, hi_u, torch.full_like(lo_u, float(bins))], 1)
    m = _moments_at(prefix, counts, ends.reshape(lo_u.shape[0], -1)).reshape(
        3, *ends.shape
    )  # (3, Q, 4, C)
    first = lo_u + width / 2 - bins / 2
    last = hi_u - width / 2 - bins / 2
    left = _region_error(m[:, :, 1], m[:, :, 0], first)
    right = _region_error(m[:, :, 3], m[:, :, 2], last)
    inside = (m[0, :, 2] - m[0, :, 1]) * width * width / 12
    return left + right + inside


def _as_rows(
    counts: torch.Tensor, lo: torch.Tensor, width: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bins = counts.shape[-1]
    return (
        counts.reshape(-1, bins).to(torch.float64),
        lo.reshape(-1).to(torch.float64),
        width.reshape(-1).to(torch.float64),
    )


def l2_errors(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    levels: int,
) -> torch.Tensor:
    """torch's closed-form L2 error of candidate ranges, in float64.

    Args:
        counts: `(*Q, bins)` counts.
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width.
        min_vals: `(*Q, C)` candidate lower ends (any real value).
        max_vals: `(*Q, C)` candidate upper ends, `> min_vals`.
        levels: destination bins (torch's `dst_nbins`).

    Returns:
        `(*Q, C)` errors `int (x - Q(x))**2 rho(x) dx` in squared input units;
        for bin-edge ranges and `levels = dst_nbins` this is what
        `HistogramObserver._compute_quantization_error` computes in float32.
    """
    rows, lo64, width64 = _as_rows(counts, lo, width)
    point = width64 <= 0  # one value (torch: min_val == max_val): no error
    width64 = torch.where(point, 1.0, width64)
    num_q = rows.shape[0]
    lo_u = (min_vals.reshape(num_q, -1).to(torch.float64) - lo64[:, None]) / width64[
        :, None
    ]
    hi_u = (max_vals.reshape(num_q, -1).to(torch.float64) - lo64[:, None]) / width64[
        :, None
    ]
    errors = _exact_units(_prefix_moments(rows), rows, lo_u, hi_u, levels)
    errors = torch.where(point[:, None], 0.0, errors * width64[:, None] ** 2)
    return errors.reshape(min_vals.shape)


def _top(errors: torch.Tensor, params: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` lowest-error rows of `params` `(Q, C, d)` -> `(Q, k, d)`."""
    index = torch.topk(errors, min(k, errors.shape[1]), dim=1, largest=False).indices
    return torch.gather(params, 1, index[..., None].expand(-1, -1, params.shape[2]))


def _refine(
    score: Callable[[torch.Tensor], torch.Tensor],
    params: torch.Tensor,
    step: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
) -> torch.Tensor:
    """Coarse-to-fine around the best candidates, down to a step of one bin.

    Args:
        score: `(Q, C, d)` parameters -> `(Q, C)` errors.
        params: `(Q, K, d)` best candidates on a grid of `step` bins.
        step: `(Q,)` current grid step in bins.
        low: `(Q, d)` smallest parameter values.
        high: `(Q, d)` largest parameter values.

    Returns:
        `(Q, _TOP, d)` best candidates of the finest level.
    """
    num_q, _, dims = params.shape
    offsets = torch.arange(
        -_SPLIT, _SPLIT + 1, device=params.device, dtype=torch.float64
    )
    moves = torch.cartesian_prod(*[offsets] * dims).reshape(-1, dims)  # (M, d)
    while bool((step > 1).any()):
        fine = torch.clamp(torch.ceil(step / _SPLIT), min=1)
        grid = params[:, :, None, :] + moves * fine[:, None, None, None]
        grid = grid.reshape(num_q, -1, dims)
        grid = torch.minimum(torch.maximum(grid, low[:, None]), high[:, None])
        params = _top(score(grid), grid, _TOP)
        step = fine
    return params


def _descend(
    score: Callable[[torch.Tensor], torch.Tensor],
    params: torch.Tensor,
    best: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact local descent from several starts, while any start improves.

    Each step tries, from every start, the one-bin moves of every end (and
    their combinations) and moves of 2 to 32 bins along each axis.

    Args:
        score: exact `(Q, C, d)` -> `(Q, C)` errors.
        params: `(Q, S, d)` start points.
        best: `(Q, S)` their errors.
        low: `(Q, d)` bounds.
        high: `(Q, d)` bounds.

    Returns:
        `(params, errors)`: `(Q, S, d)` local minima (or the points after
        `_DESCENT_STEPS` steps) and their `(Q, S)` errors.
    """
    num_q, starts, dims = params.shape
    unit = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64, device=params.device)
    moves = torch.cartesian_prod(*[unit] * dims).reshape(-1, dims)
    moves = moves[moves.abs().sum(dim=1) > 0]
    # Longer moves along each axis let a long slope be walked in few steps.
    reach = 2.0 ** torch.arange(1, 6, dtype=torch.float64, device=params.device)
    axis = torch.eye(dims, dtype=torch.float64, device=params.device)
    far = (reach[:, None, None] * axis).reshape(-1, dims)
    moves = torch.cat([moves, far, -far])  # (M, d)
    for _ in range(_DESCENT_STEPS):
        grid = params[:, :, None, :] + moves  # (Q, S, M, d)
        grid = torch.minimum(
            torch.maximum(grid, low[:, None, None]), high[:, None, None]
        )
        errors = score(grid.reshape(num_q, -1, dims)).reshape(num_q, starts, -1)
        value, index = errors.min(dim=2)
        better = value < best
        if not bool(better.any()):
            break
        chosen = torch.gather(
            grid, 2, index[:, :, None, None].expand(-1, -1, 1, dims)
        ).squeeze(2)
        params = torch.where(better[..., None], chosen, params)
        best = torch.where(better, value, best)
    return params, best


# Budgets of the certification below (per qparam): candidate pairs bounded,
# and candidates scored exactly, beyond which the search stays heuristic.
_PROOF_PAIRS = 1 << 22
_PROOF_EXACT = 1 << 14
_PROOF_EXACT_NATIVE = 1 << 17  # with the native exact scorer (~2 ns a level)
_PROOF_SLACK = 1e-9  # relative margin for float64 rounding in the bounds
_PROOF_QPARAMS = 64  # certified one qparam at a time: per-tensor-like searches
# max over x of |int_{c - D/2}^{x} ((t - c)**2 - D**2 / 12) dt|, in units of
# D**3: 1 / (36 sqrt 3) = 0.0160375..., rounded up
_JUMP_WEIGHT = 0.016038


def _sawtooth_floor(width: torch.Tensor) -> torch.Tensor:
    """Least `int (x - nearest center)**2` over a unit interval, centers
    `width` apart: `(k * width**3 + r**3) / 12` with k whole periods and r the
    rest (each period gives `width**3 / 12`, the rest at least `r**3 / 12`)."""
    periods = torch.floor(1.0 / width)
    periods = torch.where(width >= 1, torch.zeros_like(width), periods)
    rest = torch.where(width >= 1, torch.ones_like(width), 1.0 - periods * width)
    return (periods * width**3 + rest**3) / 12


class _Bounds:
    """Lower bounds on the exact L2 error of bin-edge ranges `[a, b]`.

    For `[a, b]` (bin units, `D = (b - a) / levels`) the error is the clipping
    error (values below `a` go to the center `a + D/2`, above `b` to
    `b - D/2`), computed exactly from prefix moments, plus the error inside,
    which is at least the larger of

    * `mass(a, b) * sawtooth_floor(D)` (any density), and
    * `mass(a, b) * D**2 / 12 - 0.016038 * D**3 * jumps(a, b)`: the first
      term is exact for a density flat within each destination bin. With
      `g(x) = (x - c)**2 - D**2 / 12` (zero integral over the destination bin
      of center `c`) and `S` its running integral from the bin's left edge
      (zero at both edges), a piecewise-constant density that jumps by
      `d_p` at points `p` inside the bin adds `int g rho = -sum_p d_p S(p)`,
      at most `max |S| = D**3 / (36 sqrt 3)` times the jumps' total
      `jumps(a, b)` (the sum of `|h[i + 1] - h[i]|` inside) in magnitude.

    The clipping error is also at least `low(a) = int_{x<a} (x - a)**2` and
    `high(b)` likewise, which grow as the range shrinks: `a_max` / `b_min`
    bound the starts and ends that can beat a given error at all.
    """

    def __init__(self, prefix: torch.Tensor, counts: torch.Tensor, levels: int):
        num_q, bins = counts.shape
        edges = torch.arange(bins + 1, dtype=torch.float64, device=counts.device)
        edges = edges.expand(num_q, -1)
        self.bins, self.levels = bins, levels
        self.at = _moments_at(prefix, counts, edges)  # (3, Q, bins + 1)
        self.total = _moments_at(prefix, counts, torch.full_like(edges, bins))
        self.start = _moments_at(prefix, counts, torch.zeros_like(edges[:, :1]))
        self.low = _region_error(self.at, self.start, edges - bins / 2)
        self.high = _region_error(self.total, self.at, edges - bins / 2)
        steps = (counts[:, 1:] - counts[:, :-1]).abs()
        # jumps left of each bin j: sum of |h[i + 1] - h[i]| for i < j
        self.jumps = torch.nn.functional.pad(torch.cumsum(steps, dim=1), (1, 1))

    def reach(self, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(a_max, b_min)` per qparam: `a < a_max` and `b >= b_min` for any
        range whose error can be below `error` `(Q,)`."""
        a_max = (self.low < error[:, None]).sum(dim=1)
        b_min = self.bins + 1 - (self.high < error[:, None]).sum(dim=1)
        return a_max, b_min

    def survivors(
        self, q: int, na: int, b0: int, limit: float, cap: int
    ) -> torch.Tensor | None:
        """`(K, 2)` pairs `(a, b - b0)`, `a < na`, `b0 <= b <= bins`, `b > a`,
        of qparam `q` whose bound is below `limit`, in `(a, b)` order; None
        if more than `cap` (natively in one pass, else on the rectangle)."""
        if self.at.device.type == "cpu" and native.available():
            return native.l2_survivors(
                self.at[:, q],
                self.start[:, q, 0],
                self.total[:, q, 0],
                self.jumps[q],
                _JUMP_WEIGHT,
                self.levels,
                na,
                b0,
                limit,
                cap,
            )
        a = torch.arange(na, device=self.at.device)[:, None]
        b = torch.arange(b0, self.bins + 1, device=self.at.device)[None, :]
        pairs = ((b > a) & (self(q, a, b) < limit)).nonzero()
        return None if pairs.shape[0] > cap else pairs

    def __call__(self, q: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Bounds of qparam `q` for starts `a` `(na, 1)` and ends `b` `(1, nb)`."""
        bins, at = self.bins, self.at
        width = (b - a).to(torch.float64).clamp(min=1e-12) / self.levels
        first = a - bins / 2 + width / 2  # centered first / last centers
        last = b - bins / 2 - width / 2
        below = at[:, q, a] - self.start[:, q, :, None]  # (3, na, 1)
        above = self.total[:, q, :1, None] - at[:, q, b]  # (3, 1, nb)
        clip = below[2] - 2 * first * below[1] + first * first * below[0]
        clip = clip + above[2] - 2 * last * above[1] + last * last * above[0]
        mass = at[0, q, b] - at[0, q, a]
        jumps = (self.jumps[q, (b - 1).clamp(min=0)] - self.jumps[q, a]).clamp(min=0)
        floor = mass * _sawtooth_floor(width)
        smooth = mass * width**2 / 12 - _JUMP_WEIGHT * width**3 * jumps
        return clip + torch.maximum(floor, smooth)


def _certify(
    prefix: torch.Tensor,
    counts: torch.Tensor,
    best: torch.Tensor,
    best_error: torch.Tensor,
    levels: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prove the asymmetric search's result optimal, or improve it.

    Every bin-edge pair `[a, b]` in the rectangle that `_Bounds.reach` leaves
    is bounded in one vectorized pass (`_Bounds`), and the few whose bound is
    below the incumbent are scored exactly. Qparams whose rectangle or
    survivors exceed the budgets keep the heuristic result.

    Args:
        prefix, counts: `_prefix_moments` table and `(Q, bins)` counts.
        best: `(Q, 2)` incumbent `[a, b]`; best_error: `(Q,)` its exact error.
        levels: destination levels.

    Returns:
        `(best, proven)`: the optimum `(Q, 2)` and a `(Q,)` bool, True where
        every candidate was bounded or scored.
    """
    num_q, bins = counts.shape
    bounds = _Bounds(prefix, counts, levels)
    fast = counts.device.type == "cpu" and native.available()
    limit = best_error * (1 + _PROOF_SLACK)
    a_max, b_min = bounds.reach(limit)
    proven = torch.zeros(num_q, dtype=torch.bool, device=counts.device)
    best, best_error = best.clone(), best_error.clone()
    for q in range(num_q):
        na, nb = int(a_max[q]), bins + 1 - int(b_min[q])
        if na * nb > _PROOF_PAIRS:
            continue
        cap = _PROOF_EXACT_NATIVE if fast else _PROOF_EXACT
        pairs = bounds.survivors(q, na, int(b_min[q]), float(limit[q]), cap)
        if pairs is None:
            continue
        proven[q] = True
        if pairs.shape[0] == 0:
            continue
        lo_u = pairs[:, 0].to(torch.float64)
        hi_u = (pairs[:, 1] + int(b_min[q])).to(torch.float64)
        errors = native.l2_errors(prefix[q], lo_u, hi_u, levels) if fast else None
        if errors is None:
            errors = _exact_units(
                prefix[q : q + 1], counts[q : q + 1], lo_u[None], hi_u[None], levels
            )[0]
        k = int(errors.argmin())
        if float(errors[k]) < float(best_error[q]):
            best[q] = torch.stack([lo_u[k], hi_u[k]])
            best_error[q] = errors[k]
    return best, proven


def l2_search(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    levels: int,
    *,
    symmetric: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The range of least L2 error over all candidate ranges (not greedy).

    Asymmetric (`symmetric=None`): the candidates are torch's, every pair of
    bin edges `[lo + s * width, lo + (e + 1) * width]`, scored with torch's
    closed form (`l2_errors`) with `levels` destination bins. Symmetric
    (`symmetric=(qmin, qmax)`): the candidates are `[-amax, amax]` for amax on
    a one-bin grid, scored with the symmetric quantizer that `(qmin, qmax)`
    really has: levels `k * scale`, `scale = amax / ((qmax - qmin) / 2)`,
    i.e. destination bins `[(qmin - 0.5) * scale, (qmax + 0.5) * scale]`.

    Search (vectorized over qparams and candidates; no greedy path):

    1. When every candidate fits the budget (`num_qparams * candidates *
       (levels + 1) <= 2**22`, e.g. up to ~128 bins per tensor) all of them
       are scored exactly: the exact minimum.
    2. Otherwise every pair of a grid of 65 edges over the data (every amax
       of a 256-point grid when symmetric) is scored, the best 4 are refined
       coarse-to-fine (step / 8 per level) down to single bins, and the best
       4 of the last level start an exact descent (moves of 1 to 32 bins of
       either end) that stops at a local minimum of the exact error. The
       screening uses the exact error up to 32 levels and an O(1) form
       above (clipping exact, `D**2 / 12` per unit mass inside: exact for a
       density uniform within each destination bin).

    3. Asymmetric, up to 64 qparams: the result is certified (`_certify`):
       every other bin-edge pair gets a lower bound on its error (`_Bounds`:
       exact clipping plus a floor on the error inside), and the pairs whose
       bound is below the result are scored exactly; a better one replaces
       it. So the result is the exhaustive minimum whenever at most 2**17
       pairs (2**14 without the native kernels) survive the bounds: every
       256- and 512-bin case of the tests, and 2048-bin histograms of smooth
       data; sparse heavy tails (t(2), 2048 bins) can leave more and keep
       the heuristic result.

    Step 2 finds the exhaustive minimum on dense histograms (tested against
    brute force); on sparse ones, whose error is jagged in the range, it can
    end in a local minimum, which step 3 then catches where its budget
    allows. It cannot stop at the first uphill step as torch's walk does, so
    single outliers and heavy tails do not give collapsed or lopsided ranges.

    Args:
        counts: `(*Q, bins)` counts.
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width (> 0).
        levels: destination levels: `qmax - qmin + 1` of the format (16 for
            int4; torch always uses 256).
        symmetric: `(qmin, qmax)` for symmetric ranges, else None.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32. Qparams with no counts
        get `(0, 0)`.
    """
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 2:
        raise ValueError(f"levels must be an int >= 2, got {levels!r}")
    qshape = tuple(counts.shape[:-1])
    rows, lo64, width64 = _as_rows(counts, lo, width)
    point = width64 <= 0  # all values equal (torch's min_val == max_val)
    width64 = torch.where(point, 1.0, width64)
    num_q, bins = rows.shape
    device = rows.device
    prefix = _prefix_moments(rows)
    nonzero = rows > 0
    has_data = nonzero.any(dim=1)
    index = torch.arange(bins, device=device, dtype=torch.float64)
    first = torch.where(nonzero, index, float(bins)).amin(dim=1)
    last = torch.where(nonzero, index + 1, 0.0).amax(dim=1)
    first = torch.where(has_data, first, torch.zeros_like(first))
    last = torch.where(has_data, last, torch.ones_like(last))

    if symmetric is None:
        # torch's candidates: every pair of bin edges of the histogram.
        low = torch.zeros(num_q, 2, dtype=torch.float64, device=device)
        high = torch.full_like(low, float(bins))

        def to_range(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return params[..., 0], params[..., 1]

        ticks = torch.linspace(0, 1, _GRID + 1, dtype=torch.float64, device=device)
        points = torch.round(first[:, None] + ticks * (last - first)[:, None])
        pairs = torch.triu_indices(_GRID + 1, _GRID + 1, offset=1, device=device)
        params = torch.stack([points[:, pairs[0]], points[:, pairs[1]]], dim=2)
        step = torch.ceil((last - first) / _GRID)
        levels_model = levels
    else:
        qmin, qmax = symmetric
        half = (qmax - qmin) / 2
        # amax in bins of the data's largest magnitude
        amax = torch.maximum(
            (lo64 / width64 + first).abs(), (lo64 / width64 + last).abs()
        )
        amax = torch.clamp(amax, min=1.0)
        low, high = torch.ones_like(amax)[:, None], amax[:, None]
        origin = lo64 / width64  # unit position of 0 is -origin

        def to_range(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            scale = params[..., 0] / half
            return (qmin - 0.5) * scale - origin[:, None], (
                qmax + 0.5
            ) * scale - origin[:, None]

        grid_size = 4 * _GRID
        ticks = torch.arange(1, grid_size + 1, dtype=torch.float64, device=device)
        params = (ticks * amax[:, None] / grid_size)[..., None]
        step = torch.ceil(amax / grid_size)
        levels_model = int(qmax - qmin + 1)

    def approx(params: torch.Tensor) -> torch.Tensor:
        lo_u, hi_u = to_range(params)
        errors = _approx_units(prefix, rows, lo_u, hi_u, levels_model)
        return torch.where(hi_u > lo_u, errors, math.inf)

    def exact(params: torch.Tensor) -> torch.Tensor:
        lo_u, hi_u = to_range(params)
        errors = _exact_units(prefix, rows, lo_u, hi_u, levels_model)
        return torch.where(hi_u > lo_u, errors, math.inf)

    # Few levels: the exact error costs about what the O(1) form does, and
    # the O(1) form misleads on sparse histograms; screen with it only when
    # levels are many.
    screen = exact if levels_model <= _EXACT_SCREEN_LEVELS else approx
    if (
        symmetric is None
        and num_q * bins * (bins + 1) // 2 * (levels_model + 1) <= _EXHAUSTIVE_EVALS
    ):
        ticks = torch.arange(bins + 1, dtype=torch.float64, device=device)
        pairs = torch.triu_indices(bins + 1, bins + 1, offset=1, device=device)
        params = ticks[pairs.T].expand(num_q, -1, -1)
        step = torch.ones_like(step)
        screen = exact
    elif (
        symmetric is not None
        and num_q * int(high.max()) * (levels_model + 1) <= _EXHAUSTIVE_EVALS
    ):
        ticks = torch.arange(1, int(high.max()) + 1, dtype=torch.float64, device=device)
        params = torch.minimum(ticks, high)[..., None].expand(num_q, -1, -1)
        step = torch.ones_like(step)
        screen = exact
    params = _top(screen(params), params, _TOP)
    params = _refine(screen, params, step, low, high)
    # The finest level's best candidates, re-scored exactly, then descended.
    offsets = torch.arange(-2.0, 3.0, dtype=torch.float64, device=device)
    moves = torch.cartesian_prod(*[offsets] * params.shape[2]).reshape(
        -1, params.shape[2]
    )
    near = (params[:, :, None, :] + moves).reshape(num_q, -1, params.shape[2])
    near = torch.minimum(torch.maximum(near, low[:, None]), high[:, None])
    near = _top(screen(near), near, _EXACT)
    near, errors = _descend(exact, near, exact(near), low, high)
    pick = errors.argmin(dim=1)
    best = near[torch.arange(num_q, device=device), pick]
    if symmetric is None and num_q <= _PROOF_QPARAMS:
        # integer bin edges: certify against every pair, or improve
        best_error = errors[torch.arange(num_q, device=device), pick]
        best, _ = _certify(prefix, rows, best, best_error, levels_model)
    lo_u, hi_u = to_range(best[:, None, :])
    if symmetric is None:
        min_vals = lo64 + lo_u[:, 0] * width64
        max_vals = lo64 + hi_u[:, 0] * width64
    else:
        max_vals = best[:, 0] * width64
        min_vals = -max_vals
    min_vals = torch.where(point, lo64, min_vals)
    max_vals = torch.where(point, lo64, max_vals)
    zero = torch.zeros_like(min_vals)
    min_vals = torch.where(has_data, min_vals, zero).to(torch.float32)
    max_vals = torch.where(has_data, max_vals, zero).to(torch.float32)
    return min_vals.reshape(qshape), max_vals.reshape(qshape)
