"""Wrappers of `qo_search.c`: the histogram searches' error terms (torch's L2
terms, the exact L2 errors and the certificate's survivors, the L2 errors of
candidate ranges of many small histograms) and the entropy search's
divergences.
"""

from __future__ import annotations

import math

import torch

from quantobs.native.runtime import available, loaded, threads, usable

__all__ = [
    "entropy",
    "entropy_search_rows",
    "l2_candidates",
    "l2_errors",
    "l2_survivors",
    "l2_symmetric",
    "torch_l2_terms",
]

_LOG_TABLE = 1 << 20  # entropy: level masses below this get their log from a table
_EXACT_QUOTIENT = 1 << 28  # torch_l2_terms: bins * dst_nbins below this
_SERIAL_ELEMS = 1 << 13  # torch_l2_terms runs this much work on one thread


def torch_l2_terms(
    histogram: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    bin_width: torch.Tensor,
    dst_nbins: int,
) -> torch.Tensor | None:
    """The `(P, bins)` float32 terms of torch.ao's histogram L2 error, or None.

    `solvers.torch_l2.torch_l2_errors`' arithmetic (torch's
    `_compute_quantization_error` before its sum) for P proposals: `(P,)`
    start and end bins and float64 source bin widths; `histogram` is
    `(P, bins)` or `(1, bins)` float32. None also where a destination width
    rounds to a float32 zero (torch divides by it; the eager twin follows).
    """
    if not usable(histogram) or histogram.ndim != 2:
        return None
    count, bins = starts.numel(), histogram.shape[1]
    if bins * dst_nbins >= _EXACT_QUOTIENT:  # the kernel's fmod needs q < 2**29
        return None
    if histogram.shape[0] not in (1, count) or {ends.numel(), bin_width.numel()} != {
        count
    }:
        raise ValueError(
            "histogram must be (1 or P, bins) and starts, ends, widths (P,)"
        )
    starts = starts.to(torch.int64).contiguous()
    ends = ends.to(torch.int64).contiguous()
    bin_width = bin_width.to(torch.float64).contiguous()
    out = torch.empty(count, bins, dtype=torch.float32)
    bad = loaded().qo_torch_l2_terms(
        histogram.data_ptr(),
        bins,
        int(histogram.shape[0] == 1),
        count,
        starts.data_ptr(),
        ends.data_ptr(),
        bin_width.data_ptr(),
        dst_nbins,
        out.data_ptr(),
        # small blocks: waking a second thread costs more than it saves
        1 if count * bins <= _SERIAL_ELEMS else torch.get_num_threads(),
    )
    return None if bad else out


def l2_errors(
    table: torch.Tensor, lo_u: torch.Tensor, hi_u: torch.Tensor, levels: int
) -> torch.Tensor | None:
    """Exact L2 errors of ranges `[lo_u, hi_u]` `(K,)` over one histogram.

    `table`: its `(bins, 4)` float64 `_prefix_moments` rows. The same
    arithmetic as `solvers.l2_error.exact_errors` (the level sums in order);
    None where the kernels are not available.
    """
    if table.device.type != "cpu" or not available():
        return None
    if table.ndim != 2 or table.shape[1] != 4 or lo_u.numel() != hi_u.numel():
        raise ValueError("table must be (bins, 4) and lo_u, hi_u of one length")
    table = table.to(torch.float64).contiguous()
    lo_u = lo_u.to(torch.float64).contiguous()
    hi_u = hi_u.to(torch.float64).contiguous()
    out = torch.empty(lo_u.numel(), dtype=torch.float64)
    loaded().qo_l2_errors(
        table.data_ptr(),
        table.shape[0],
        lo_u.data_ptr(),
        hi_u.data_ptr(),
        lo_u.numel(),
        levels,
        out.data_ptr(),
        threads(lo_u.numel() * levels),
    )
    return out


def l2_candidates(
    counts: torch.Tensor,
    lo_u: torch.Tensor,
    hi_u: torch.Tensor,
    levels: int,
    exact: bool,
) -> torch.Tensor | None:
    """L2 errors `(Q, C)` of candidate ranges of the histograms `counts` `(Q, B)`.

    `lo_u`, `hi_u`: `(Q, C)` ranges in bin units. The arithmetic of
    `solvers.l2_error.approx_errors` (`exact=False`) or `exact_errors`
    (`exact=True`, levels summed in order) over each row's
    `prefix_moments`, which the kernel builds; `+inf` where `hi <= lo`.
    None where the kernels are not available.
    """
    if counts.device.type != "cpu" or not available():
        return None
    if counts.ndim != 2 or lo_u.shape != hi_u.shape or lo_u.shape[0] != counts.shape[0]:
        raise ValueError("counts must be (Q, B) and lo_u, hi_u (Q, C)")
    num_q, bins = counts.shape
    counts = counts.to(torch.float64).contiguous()
    lo_u = lo_u.to(torch.float64).contiguous()
    hi_u = hi_u.to(torch.float64).contiguous()
    out = torch.empty(lo_u.shape, dtype=torch.float64)
    failed = loaded().qo_l2_candidates(
        counts.data_ptr(),
        num_q,
        bins,
        lo_u.data_ptr(),
        hi_u.data_ptr(),
        lo_u.shape[1],
        levels,
        int(exact),
        out.data_ptr(),
        threads(lo_u.numel() * (levels if exact else 4) + counts.numel()),
    )
    return None if failed else out  # failed: out of memory


def l2_symmetric(
    counts: torch.Tensor,
    origin: torch.Tensor,
    amax: torch.Tensor,
    qmin: float,
    qmax: float,
    exact: bool,
) -> torch.Tensor | None:
    """`(Q,)` float64 best amax (bin units) of the batched symmetric L2 search.

    `counts` `(Q, B)` int64; `origin`, `amax` `(Q,)` float64 (bin units):
    `solvers.l2_batched`'s symmetric block, every amax of a row scored in the
    kernel (`l2_candidates`' arithmetic). None where the kernels are not
    available (or out of memory).
    """
    if counts.device.type != "cpu" or not available() or counts.dtype != torch.int64:
        return None
    if (
        counts.ndim != 2
        or origin.shape != amax.shape
        or amax.numel() != counts.shape[0]
    ):
        raise ValueError("counts must be (Q, B) and origin, amax (Q,)")
    num_q, bins = counts.shape
    counts = counts.contiguous()
    origin = origin.to(torch.float64).contiguous()
    amax = amax.to(torch.float64).contiguous()
    out = torch.empty(num_q, dtype=torch.float64)
    levels = int(qmax - qmin + 1)
    failed = loaded().qo_l2_symmetric(
        counts.data_ptr(),
        num_q,
        bins,
        origin.data_ptr(),
        amax.data_ptr(),
        float(qmin),
        float(qmax),
        int(exact),
        out.data_ptr(),
        threads(counts.numel() * (levels if exact else 4)),
    )
    return None if failed else out


def l2_survivors(
    at: torch.Tensor,
    start: torch.Tensor,
    total: torch.Tensor,
    jumps: torch.Tensor,
    jump_weight: float,
    levels: int,
    na: int,
    b0: int,
    limit: float,
    cap: int,
) -> torch.Tensor | None:
    """Bin-edge ranges left in the running by `solvers.l2_bounds.L2Bounds`.

    For one histogram of `bins` bins: `at` `(3, bins + 1)` moments at each
    edge, `start` and `total` `(3,)` the moments at 0 and at `bins`, `jumps`
    `(bins + 1,)` and their weight in the bound. Returns the `(K, 2)` int64
    pairs `(a, b - b0)`, `a < na`, `b0 <= b <= bins`, `b > a`, whose bound
    is below `limit`, in `(a, b)` order (as `nonzero` lists them); an empty
    `(0, 2)` tensor for none; None where the kernels are not available or
    more than `cap` pairs remain.
    """
    if at.device.type != "cpu" or not available():
        return None
    bins = at.shape[-1] - 1
    if at.shape != (3, bins + 1) or jumps.numel() != bins + 1 or start.numel() != 3:
        raise ValueError("at must be (3, bins + 1), jumps (bins + 1,), start (3,)")
    tables = [t.to(torch.float64).contiguous() for t in (at, start, total, jumps)]
    out = torch.empty(cap, 2, dtype=torch.int64)
    found = loaded().qo_l2_survivors(
        *(t.data_ptr() for t in tables),
        jump_weight,
        bins,
        levels,
        na,
        b0,
        limit,
        out.data_ptr(),
        cap,
        torch.get_num_threads(),
    )
    return None if found > cap else out[:found].clone()


def entropy(h: torch.Tensor, cands: torch.Tensor, levels: int) -> torch.Tensor | None:
    """KL divergence `(Q, C)` of clip bins `cands` for histograms `h` `(Q, B)`:
    `cands` `(C,)` for every row, or `(Q, C)`, one list per row.

    `solvers.entropy._divergences` over its `_prefixes`, in float64 (each
    row's prefix sums made in the kernel); None where the kernels are not
    available.
    """
    if h.device.type != "cpu" or not available():
        return None
    if h.ndim != 2:
        raise ValueError(f"h must be (Q, B), got shape {tuple(h.shape)}")
    num_q, bins = h.shape
    per_row = cands.ndim == 2
    if per_row and cands.shape[0] != num_q:
        raise ValueError(f"per-row candidates must be ({num_q}, C), got {cands.shape}")
    h = h.to(torch.float64).contiguous()
    cands = cands.to(torch.int64).contiguous()
    if cands.numel() and not (int(cands.min()) >= 1 and int(cands.max()) <= bins):
        raise ValueError(f"candidate bins must lie in [1, {bins}]")
    count = cands.shape[-1]
    out = torch.full((num_q, count), math.nan, dtype=torch.float64)
    # integer counts: the logs of level masses come from a table, when the
    # table is smaller than the work it saves (the same values as log())
    total = float(h.sum(dim=1).max()) if num_q else 0.0
    worth = total < min(_LOG_TABLE, num_q * count * levels)
    integral = worth and bool((h == h.floor()).all())
    loaded().qo_entropy(
        h.data_ptr(),
        num_q,
        bins,
        cands.data_ptr(),
        count if per_row else 0,
        count,
        levels,
        int(total) + 1 if integral else 0,
        out.data_ptr(),
        threads(num_q * count * levels),
    )
    return None if bool(torch.isnan(out).any()) else out  # NaN: out of memory


def entropy_search_rows(
    counts: torch.Tensor,
    levels: torch.Tensor,
    start_bin: int,
    stride: int,
    coarse: int,
    keep: int,
    reach: int,
) -> torch.Tensor | None:
    """`(Q,)` int64 clip bins of `solvers.entropy`'s coarse-to-fine search
    (0: no possible candidate) for int64 counts `(Q, B)` of |x| and `(Q,)`
    levels, one row at a time in the kernel. None where the kernels are not
    available (or out of memory, or the search's sizes exceed the kernel's).
    """
    if counts.device.type != "cpu" or not available() or counts.dtype != torch.int64:
        return None
    if counts.ndim != 2 or levels.numel() != counts.shape[0]:
        raise ValueError("counts must be (Q, B) and levels (Q,)")
    num_q, bins = counts.shape
    counts = counts.contiguous()
    levels = levels.to(torch.int64).contiguous()
    total = int(counts.sum(dim=1).max()) if num_q else 0
    # a log table when it is smaller than the work it saves (same values)
    masses = total + 1 if total < min(_LOG_TABLE, counts.numel() * 16) else 0
    out = torch.empty(num_q, dtype=torch.int64)
    failed = loaded().qo_entropy_search(
        counts.data_ptr(),
        num_q,
        bins,
        levels.data_ptr(),
        start_bin,
        stride,
        coarse,
        keep,
        reach,
        masses,
        out.data_ptr(),
        threads(counts.numel() * 16),
    )
    return None if failed else out
