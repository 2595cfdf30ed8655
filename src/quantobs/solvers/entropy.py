"""Entropy (KL-divergence) calibration as in TensorRT and NVIDIA ModelOpt.

On a histogram of |x| whose bin 0 starts at 0, each candidate `i` (from
`start_bin` up to the bin holding the largest value, every `stride` bins)
clips at the edge `i * width` and is scored by `KL(P || Q)`:

* P: bins `0 .. i-1`, with the mass of every bin from `i` on added to bin
  `i - 1` (the clipped values);
* Q: bins `0 .. i-1` merged into `num_quantized_bins` levels (bin j goes to
  level `floor(j * num_quantized_bins / i)`), each level's mass spread evenly
  over its non-empty bins (empty bins stay empty);
* both normalized; `KL = sum p log(p / q)`.

The last minimum wins (ties go to the wider range) and the result is the edge
`i * width`, at most the largest |x| observed. As in ModelOpt (and
pytorch-quantization), bin 0 first takes bin 1's count, so a pile of exact
zeros (ReLU, padding) does not decide the range. Deliberate differences from
ModelOpt: a candidate whose P has mass where Q has none, or whose first `i`
bins are all empty, scores `+inf` (ModelOpt gets `inf` or NaN, and its
`argmin` picks a NaN); with no candidate at all (fewer than `start_bin`
bins hold data) the result is the largest value.

Vectorized: with prefix sums of the counts, of the non-empty bins and of
`c log c`, each candidate costs one gather per level, and all candidates of
all qparams are scored at once, in chunks of bounded memory (natively, one
loop over levels per candidate, where `quantobs.native` is built)::

    KL(i) = (sum_j p_j log p_j) / T - log T
            - (sum_k L_k log(L_k / n_k) + tail_i log q_{i-1}) / T + log S_i

with T the total, S_i the mass of bins `< i`, L_k / n_k the mass / non-empty
bins of level k.
"""

from __future__ import annotations

import math

import torch

from quantobs import native
from quantobs.native.dispatch import kernel

__all__ = ["entropy_search"]

_CHUNK_ELEMS = 1 << 20  # float64 elements per (qparams, candidates, levels) temporary
_TINY = 1e-300
_CHUNK_QPARAMS = 256  # qparams scored together (the gathered rows' length)


def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.xlogy(x, x)  # 0 log 0 = 0


Prefixes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _prefixes(h: torch.Tensor) -> Prefixes:
    """`(csum, nz, plogp)` of `h` `(Q, B)`, each `(Q, B + 1)`: the mass, the
    non-empty bins and the `c log c` below each bin edge."""
    zero = torch.zeros(h.shape[0], 1, dtype=torch.float64, device=h.device)
    csum = torch.cat([zero, torch.cumsum(h, dim=1)], dim=1)
    nz = torch.nn.functional.pad(torch.cumsum(h > 0, dim=1), (1, 0))  # int64
    plogp = torch.cat([zero, torch.cumsum(_xlogx(h), dim=1)], dim=1)
    return csum, nz, plogp


def _divergences(
    h: torch.Tensor, prefixes: Prefixes, cands: torch.Tensor, levels: int
) -> torch.Tensor:
    """KL of each candidate `(C,)` for each row of `h` `(Q, B)` -> `(Q, C)`.

    The level boundaries depend only on the candidate and the level count, so
    they are computed once and every row gathers the same columns.
    """
    num_q, bins = h.shape
    device = h.device
    csum, nz, plogp = prefixes
    total = csum[:, -1:]  # (Q, 1)
    i = cands.to(torch.int64)  # (C,)
    num_c = i.numel()

    mass_below = csum[:, i]  # S_i (Q, C)
    tail = total - mass_below
    last = h[:, i - 1]  # h_{i-1}
    p_term = plogp[:, i - 1] + _xlogx(last + tail)

    # Level k holds bins [ceil(k i / nb), ceil((k + 1) i / nb)): exact integers.
    k = torch.arange(levels + 1, device=device)
    bounds = (k[None, :] * i[:, None] + levels - 1) // levels  # (C, nb + 1)
    upper, lower = bounds[:, 1:].reshape(-1), bounds[:, :-1].reshape(-1)
    # Gather whole rows of the transposed prefix sums: (C * nb, Q) copies of
    # Q contiguous values, much faster than gathering columns.
    csum_t, nz_t = csum.T.contiguous(), nz.T.contiguous()
    shape = (num_c, levels, num_q)
    level_mass = (csum_t.index_select(0, upper) - csum_t.index_select(0, lower)).view(
        shape
    )
    level_bins = (nz_t.index_select(0, upper) - nz_t.index_select(0, lower)).view(shape)
    # sum_k L_k log(L_k / n_k); a level with no non-empty bin has no mass, and
    # then contributes 0 * (log(tiny) - log 1) = 0.
    log_bins = torch.log(
        torch.arange(bins + 1, dtype=torch.float64, device=device).clamp(min=1)
    )
    log_ratio = torch.log(level_mass.clamp(min=_TINY)).sub_(log_bins[level_bins])
    q_term = log_ratio.mul_(level_mass).sum(dim=1).T  # (Q, C)
    # q of bin i-1: its level's mass per non-empty bin.
    top = (i - 1) * levels // i  # (C,)
    columns = torch.arange(num_c, device=device)
    top_mass = level_mass[columns, top].T
    top_bins = level_bins[columns, top].T.to(torch.float64)
    q_last = torch.log(torch.where(top_bins > 0, top_mass / top_bins, 1.0))
    q_term = q_term + torch.where(tail > 0, tail * q_last, 0.0)

    safe_total = torch.where(total > 0, total, 1.0)
    safe_below = torch.where(mass_below > 0, mass_below, 1.0)
    kl = (p_term - q_term) / safe_total - torch.log(safe_total) + torch.log(safe_below)
    impossible = (mass_below <= 0) | ((tail > 0) & (last <= 0))
    return torch.where(impossible, math.inf, kl)


@kernel
def _candidate_divergences(
    h: torch.Tensor, cands: torch.Tensor, levels: int, c_step: int
) -> torch.Tensor:
    """`(Q, C)` KL divergences of clip bins `cands` for histograms `h`
    `(Q, B)`: in torch, candidates in chunks of `c_step`; natively (CPU) all
    at once."""
    prefixes = _prefixes(h)
    return torch.cat(
        [
            _divergences(h, prefixes, cands[c0 : c0 + c_step], levels)
            for c0 in range(0, cands.numel(), c_step)
        ],
        dim=1,
    )


def _candidate_divergences_native(
    h: torch.Tensor, cands: torch.Tensor, levels: int, c_step: int
) -> torch.Tensor | None:
    return native.entropy(h, cands, levels)


_candidate_divergences.register("cpu", _candidate_divergences_native)


def entropy_search(
    counts: torch.Tensor,
    width: torch.Tensor,
    num_quantized_bins: int | torch.Tensor = 128,
    *,
    start_bin: int = 128,
    stride: int = 1,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The clipping threshold of least KL divergence, per qparam.

    Args:
        counts: `(*Q, bins)` counts of |x|, bin 0 starting at 0.
        width: `(*Q,)` bin width.
        num_quantized_bins: levels of the quantized |x| (128 for int8 as in
            TensorRT; one int or a `(*Q,)` tensor).
        start_bin: the smallest candidate (in bins).
        stride: candidate spacing (in bins).
        amax: `(*Q,)` largest |x| observed; results are clamped to it (and it
            is the result where no candidate exists). Default: the right edge
            of the last non-empty bin.

    Returns:
        `(*Q,)` float64 thresholds (0 where a qparam has no counts).

    Raises:
        ValueError: `start_bin < 1`, `stride < 1` or fewer than 1 level.
    """
    for name, value in (("start_bin", start_bin), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    qshape = tuple(counts.shape[:-1])
    bins = counts.shape[-1]
    h = counts.reshape(-1, bins).to(torch.float64, copy=True)  # modified below
    num_q = h.shape[0]
    device = h.device
    levels = torch.as_tensor(num_quantized_bins, device=device).reshape(-1)
    levels = levels.expand(num_q) if levels.numel() == 1 else levels
    if bool((levels < 1).any()):
        raise ValueError(f"num_quantized_bins must be >= 1, got {num_quantized_bins}")
    width64 = width.reshape(-1).to(torch.float64)

    # bins up to the largest value: one past the last non-empty bin (0: none)
    nonzero = (h > 0).to(torch.uint8)
    has_data = nonzero.amax(dim=1) > 0
    stop = torch.where(has_data, bins - nonzero.flip(1).argmax(dim=1), 0)
    if amax is None:
        amax64 = stop.to(torch.float64) * width64
    else:
        amax64 = amax.reshape(-1).to(torch.float64)
    if bins > 1:
        h[:, 0] = h[:, 1]  # ModelOpt: exact zeros do not decide the range
    cands = torch.arange(min(start_bin, bins + 1), bins + 1, stride, device=device)
    best = torch.zeros(num_q, dtype=torch.float64, device=device)
    found = torch.zeros(num_q, dtype=torch.bool, device=device)
    for count in torch.unique(levels).tolist() if cands.numel() else []:
        # One or two distinct level counts (asymmetric args: per qparam sign).
        group = (levels == count).nonzero().squeeze(1)
        # Chunks of qparams with similar data extents: candidates past the
        # largest value of a whole chunk are not scored at all.
        group = group[torch.argsort(stop[group])]
        q_step = min(group.numel(), _CHUNK_QPARAMS)
        c_step = max(1, _CHUNK_ELEMS // (q_step * (count + 1)))
        for q0 in range(0, group.numel(), q_step):
            rows = group[q0 : q0 + q_step]
            mine = cands[cands <= stop[rows].max()]
            if mine.numel() == 0:
                continue
            kl = _candidate_divergences(h[rows], mine, int(count), c_step)
            kl = torch.where(mine[None, :] <= stop[rows, None], kl, math.inf)
            # Last minimum: search the reversed candidates for the first one.
            least, rev = kl.flip(1).min(dim=1)
            pick = mine.numel() - 1 - rev
            found[rows] = torch.isfinite(least)
            best[rows] = mine[pick].to(torch.float64) * width64[rows]
    result = torch.where(found, torch.minimum(best, amax64), amax64)
    result = torch.where(has_data, result, torch.zeros_like(result))
    return result.reshape(qshape)
