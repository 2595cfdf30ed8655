"""Wrappers of `qo_histogram.c`: exact counting on power-of-two grids, the
one-pass per-tensor scan, and `torch.histc`'s twin.
"""

from __future__ import annotations

import torch

from quantobs.native.runtime import available, loaded, threads, usable

__all__ = [
    "add_counts",
    "histc",
    "histogram_pass",
]


def add_counts(
    x3: torch.Tensor,
    inv: torch.Tensor,
    offset: torch.Tensor,
    counts: torch.Tensor,
    absolute: bool,
) -> bool:
    """Add the histogram counts of `x3` into `counts`; False if not run.

    Args:
        x3: `(N, Q, G)` float32 values; NaN entries are skipped.
        inv: `(Q,)` float32 inverse bin widths (powers of two).
        offset: `(Q,)` float32 integer offsets of each grid's bin 0.
        counts: `(Q, bins)` contiguous int64 counts, updated in place.
        absolute: count `abs(x)`.

    Bin of x: `floor(x * inv) - offset`, clamped to `[0, bins)` (see
    `quantobs.stats.histogram`, whose torch path computes the same).
    """
    if x3.ndim != 3 or not usable(x3):
        return False
    if counts.dtype != torch.int64 or not counts.is_contiguous():
        return False
    n, q, g = x3.shape
    if (
        counts.ndim != 2
        or counts.shape[0] != q
        or inv.numel() != q
        or offset.numel() != q
    ):
        raise ValueError(
            f"counts must be ({q}, bins) and inv, offset ({q},) for {q} qparams"
        )
    inv = inv.to(torch.float32).contiguous()
    offset = offset.to(torch.float32).contiguous()
    loaded().qo_histogram(
        x3.data_ptr(),
        n,
        q,
        g,
        inv.data_ptr(),
        offset.data_ptr(),
        counts.shape[-1],
        int(absolute),
        counts.data_ptr(),
        threads(x3.numel()),
    )
    return True


def histogram_pass(
    x: torch.Tensor, inv: float, offset: float, bins: int, absolute: bool, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Min/max and counts on a known grid in one pass over float32 `x`.

    Args:
        x: the values (any shape, contiguous float32).
        inv, offset: the grid, as in `add_counts` (one qparam).
        bins: number of bins.
        absolute: count `abs(x)`.
        cap: most values each thread may set aside.

    Returns:
        None where the kernels do not apply, else `(ends, counts, side)`:
        `(2,)` min and max of the non-NaN values, `(bins,)` int64 counts of
        the values whose bin lies in `[0, bins)`, and the other values
        (outside the window, NaN, or negative and below 2**-100 in
        magnitude: a NaN input shows up here), or None if a thread found more
        than `cap` of them.
    """
    if not usable(x):
        return None
    threads = torch.get_num_threads()
    ends = torch.empty(2, dtype=torch.float32)
    counts = torch.zeros(bins, dtype=torch.int64)
    side = torch.empty(threads * cap, dtype=torch.float32)
    side_count = torch.zeros(threads, dtype=torch.int64)
    overflow = loaded().qo_histogram_pass(
        x.data_ptr(),
        x.numel(),
        inv,
        offset,
        bins,
        int(absolute),
        counts.data_ptr(),
        ends.data_ptr(),
        side.data_ptr(),
        cap,
        side_count.data_ptr(),
        threads,
    )
    if overflow:
        return ends, counts, None
    pieces = [side[t * cap : t * cap + k] for t, k in enumerate(side_count.tolist())]
    return ends, counts, torch.cat(pieces)


# float32 counts are exact integers up to here; past it torch.histc rounds
_EXACT_FLOAT_COUNT = 1 << 24


def histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor | None:
    """`torch.histc(x, bins, min=lo, max=hi)` bit for bit, or None.

    Same float32 bin selection as torch (`int(((v - lo) * bins) / (hi - lo))`,
    the last bin closed, values outside `[lo, hi]` and NaN skipped), counted
    exactly; returns None (use torch.histc) for non-float32 input, `lo >= hi`,
    `(hi - lo) * bins` beyond float32 (torch's own binning overflows there),
    or a bin reaching 2**24, where torch's float32 counts stop being exact.
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or not available():
        return None
    lo32, hi32 = torch.tensor([lo, hi], dtype=torch.float32).tolist()
    # (v - lo) * bins must not overflow float32 (torch then bins by UB casts)
    if not (lo32 < hi32 and (hi32 - lo32) * bins < 1e38):
        return None
    if x.numel() == 0 or bins < 1 or bins >= 1 << 30:
        return None
    values = x.reshape(-1).contiguous()
    counts = torch.zeros(bins, dtype=torch.int64)
    loaded().qo_histc(
        values.data_ptr(),
        values.numel(),
        lo32,
        hi32,
        bins,
        counts.data_ptr(),
        threads(values.numel()),
    )
    if int(counts.max()) >= _EXACT_FLOAT_COUNT:
        return None
    return counts.to(torch.float32)
