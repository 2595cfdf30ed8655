"""torch.ao's greedy L2 histogram search, bit for bit and vectorized.

Signatures::

    torch_l2_search(histogram: Tensor, min_val: Tensor, max_val: Tensor,
                    dst_nbins: int = 256) -> tuple[Tensor, Tensor]
    torch_l2_search_batched(histogram: Tensor (Q, bins), min_val: Tensor (Q,),
                            max_val: Tensor (Q,), dst_nbins: int = 256)
                            -> tuple[Tensor, Tensor]

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
  batched computation (`torch_l2_terms`, a kernel: torch's float32
  operations in torch's order, or the native pass with the same arithmetic;
  the sums reduce rows the way torch reduces a 1-D tensor).
* torch stops at the first proposal whose error exceeds the last accepted
  one; so does this, on the proposals in the same order.

The global search over the same error is `quantobs.solvers.global_l2`.
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
from collections.abc import Iterator, Sequence

import torch

from quantobs import native
from quantobs.core.exact import divide
from quantobs.native.dispatch import kernel

__all__ = [
    "torch_l2_errors",
    "torch_l2_search",
    "torch_l2_search_batched",
    "torch_l2_terms",
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


@functools.lru_cache(maxsize=8)
def _alpha_beta_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`_alpha_beta()` as float64 tensors on `device` (made once: 10^5 values
    each; callers only read them)."""
    alpha, beta = _alpha_beta()
    return (
        torch.tensor(alpha, dtype=torch.float64, device=device),
        torch.tensor(beta, dtype=torch.float64, device=device),
    )


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


@kernel
def torch_l2_terms(
    histogram: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    bin_width: torch.Tensor,
    dst_nbins: int,
) -> torch.Tensor:
    """The terms of torch's `_compute_quantization_error` for P proposals.

    Every operation is torch's, elementwise, in its dtype and order: Python
    doubles become float32 exactly where torch's scalar arguments do, and
    float64 tensor arithmetic stands in for torch's Python double arithmetic
    (both IEEE double). A kernel: the native pass (registered for "cpu")
    computes the same terms, and declines where a destination width rounds
    to a float32 zero.

    Args:
        histogram: `(P, bins)` float32, or `(1, bins)` shared by all proposals.
        bin_width: `(P,)` float64 `(max_val.item() - min_val.item()) / bins`.
        dst_nbins: destination bins.
        starts: `(P,)` int64 start bins.
        ends: `(P,)` int64 end bins.

    Returns:
        `(P, bins)` float32 terms; a row sums to the proposal's error (rows
        whose destination bin width is 0 are all 0: torch's error 0).
    """
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
        divide(half * half * half - delta_begin * delta_begin * delta_begin, 3)
    )
    inner = density * divide(half * half * half - neg_half * neg_half * neg_half, 3)
    norm += (dst_of_end - dst_of_begin - 1) * inner
    dst_of_end_center = dst_of_end * dw + half
    delta_end = src_end - dst_of_end_center
    norm += density * (
        divide(delta_end * delta_end * delta_end - neg_half * neg_half * neg_half, 3)
    )
    # torch returns 0 for a zero destination width (a row of zeros sums to 0)
    return torch.where((dst_width == 0.0)[:, None], torch.zeros_like(norm), norm)


torch_l2_terms.register("cpu", native.torch_l2_terms)


def torch_l2_errors(
    histogram: torch.Tensor,
    bin_width: torch.Tensor,
    dst_nbins: int,
    starts: torch.Tensor,
    ends: torch.Tensor,
) -> torch.Tensor:
    """torch's `_compute_quantization_error` for P proposals at once.

    Args: as `torch_l2_terms`' (`histogram` `(P, bins)` or `(1, bins)`,
    `bin_width` `(P,)` float64, `starts` / `ends` `(P,)` int64).

    Returns:
        `(P,)` float32 errors (0 where the destination bin width is 0).
    """
    return torch_l2_terms(histogram, starts, ends, bin_width, dst_nbins).sum(dim=1)


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
        errors = torch_l2_errors(
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
    alphas, betas = _alpha_beta_tensors(device)
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
        errors = torch_l2_errors(
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
