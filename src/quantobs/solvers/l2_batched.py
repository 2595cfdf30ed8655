"""The L2 histogram search batched over many small histograms (per channel,
per group): the same objective as `quantobs.solvers.global_l2`, a cheaper
search.

    l2_search_batched(counts: Tensor (*Q, bins), lo: Tensor (*Q,),
                      width: Tensor (*Q,), levels: int, *,
                      symmetric: tuple[float, float] | None = None)
                      -> tuple[Tensor, Tensor]

`l2_search` spends milliseconds per histogram (a descent of exact errors and
a certificate, built for one 2048-bin per-tensor histogram); a weight
calibrated per channel or per group has thousands of histograms of a few
hundred bins. This search scores every qparam's candidates in the same
tensor operations, a bounded block of qparams at a time, with torch's closed
form (`quantobs.solvers.l2_error`):

* symmetric: every `amax` on the one-bin grid (`max(1, floor(A) - bins) ..
  A` bins, A the data's largest magnitude in bins: every amax from the
  data's least magnitude up, and `A` itself): exhaustive;
* asymmetric: every pair of a grid of 17 bin edges over the data, then the
  best 4 refined coarse-to-fine (a quarter of the step per level, moves of
  -4 .. 4 steps of either end) down to one bin; when scoring exactly, the
  best 4 of the last level and their one-bin neighbours are scored again.

Every candidate is scored with the exact closed form when the format has at
most 32 levels (`EXACT_LEVELS`; int4 and narrower: every symmetric amax; the
asymmetric grid and its refinements), and with the O(1) form otherwise
(`approx_errors`: clipping exact, `D**2 / 12` per unit mass inside): one form
per search, no screening; the least error wins. With more levels (int8) the
result is the least O(1) error: within a few histogram bins of the exact
optimum's range, because auto-sized per-qparam histograms have no more bins
than levels, so the density is uniform within all but the destination bins a
bin edge crosses.
"""

from __future__ import annotations

import torch

from quantobs import native
from quantobs.core.exact import divide
from quantobs.native.dispatch import kernel
from quantobs.solvers.l2_error import EXACT_LEVELS, l2_candidate_errors

__all__ = ["l2_search_batched", "symmetric_search"]

_TOP = 4  # asymmetric: candidates kept per refinement level
_GRID = 16  # asymmetric: first-level grid of _GRID + 1 edges
_REACH = 4  # asymmetric refinement: moves of -_REACH .. _REACH steps per end
_ELEMS = 1 << 18  # qparams per block: _ELEMS // (4 * bins) of them


def _score(
    rows: torch.Tensor, lo_u: torch.Tensor, hi_u: torch.Tensor, levels: int
) -> torch.Tensor:
    """`(Q, C)` errors of the ranges (exact up to `EXACT_LEVELS` levels)."""
    return l2_candidate_errors(rows, lo_u, hi_u, levels, levels <= EXACT_LEVELS)


def _extent(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(first, last, has_data)`: `(Q,)` float64 bin edges around the data."""
    bins = rows.shape[1]
    nonzero = rows > 0  # counts of any dtype
    has_data = nonzero.any(dim=1)
    index = torch.arange(bins, device=rows.device, dtype=torch.float64)
    first = torch.where(nonzero, index, float(bins)).amin(dim=1)
    last = torch.where(nonzero, index + 1, 0.0).amax(dim=1)
    first = torch.where(has_data, first, torch.zeros_like(first))
    last = torch.where(has_data, last, torch.ones_like(last))
    return first, last, has_data


@kernel
def symmetric_search(
    counts: torch.Tensor,
    origin: torch.Tensor,
    amax: torch.Tensor,
    qmin: float,
    qmax: float,
) -> torch.Tensor:
    """Best amax (bin units) of each histogram `(Q,)`: every amax on the
    one-bin grid below the data's magnitude `amax` (within `bins` bins of
    it: the data's own extent, as the histogram spans at most `bins` bins;
    smaller amax would clip all of it), and `amax` itself,
    scored over `[(qmin - 1/2) s, (qmax + 1/2) s]` (`s = amax / ((qmax -
    qmin) / 2)`) shifted by `origin` (the bin position of 0 is `-origin`);
    the first minimum wins (the tightest of tied ranges).

    A kernel: the native pass (registered for "cpu") scores each row's
    candidates in one loop with the same arithmetic; here, blocks of rows.
    """
    num_q, bins = counts.shape
    levels = int(qmax - qmin + 1)
    half = (qmax - qmin) / 2
    best = torch.zeros(num_q, dtype=torch.float64, device=counts.device)
    block = max(1, _ELEMS // max(1, bins * 4))
    for q0 in range(0, num_q, block):
        part = slice(q0, q0 + block)
        rows = counts[part].to(torch.float64)
        # k = first .. ceil(amax): at most bins + 2 whole-bin amax values, so
        # bins + 2 ticks, no host read; ticks past ceil(amax) repeat amax,
        # which the first minimum never picks over amax itself
        first = torch.clamp(torch.floor(amax[part]) - bins, min=1.0)  # (q,)
        ticks = torch.arange(bins + 2, dtype=torch.float64, device=counts.device)
        params = torch.minimum(first[:, None] + ticks, amax[part, None])  # (q, K)
        scale = divide(params, half)
        lo_u = (qmin - 0.5) * scale - origin[part, None]
        hi_u = (qmax + 0.5) * scale - origin[part, None]
        errors = _score(rows, lo_u, hi_u, levels)
        best[part] = params.gather(1, errors.argmin(dim=1, keepdim=True)).squeeze(1)
    return best


def _symmetric_native(
    counts: torch.Tensor,
    origin: torch.Tensor,
    amax: torch.Tensor,
    qmin: float,
    qmax: float,
) -> torch.Tensor | None:
    exact = int(qmax - qmin + 1) <= EXACT_LEVELS
    return native.l2_symmetric(counts, origin, amax, qmin, qmax, exact)


symmetric_search.register("cpu", _symmetric_native)


def _top(errors: torch.Tensor, params: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` lowest-error rows of `params` `(Q, C, 2)` -> `(Q, k, 2)`."""
    index = torch.topk(errors, min(k, errors.shape[1]), dim=1, largest=False).indices
    return torch.gather(params, 1, index[..., None].expand(-1, -1, params.shape[2]))


def _levels_needed(bins: int) -> int:
    """Refinement levels of the widest data (`bins` bins): the first runs
    always, the next while the step `ceil(bins / _GRID)` stays above 1."""
    step, levels = -(-bins // _GRID), 0
    while True:
        step = max(1, -(-step // _REACH))
        levels += 1
        if step <= 1:
            return levels


def _asymmetric_block(
    rows: torch.Tensor, first: torch.Tensor, last: torch.Tensor, levels: int
) -> torch.Tensor:
    """Best `[a, b]` (bin edges) of each row, `(Q, 2)`, of one block."""
    num_q, bins = rows.shape
    device = rows.device
    exact = levels <= EXACT_LEVELS

    def score(params: torch.Tensor) -> torch.Tensor:
        return _score(rows, params[..., 0], params[..., 1], levels)

    # G = _GRID + 1 edges, P = G (G - 1) / 2 pairs of them, T = _TOP kept
    ticks = torch.linspace(0, 1, _GRID + 1, dtype=torch.float64, device=device)
    points = torch.round(first[:, None] + ticks * (last - first)[:, None])  # (Q, G)
    pairs = torch.triu_indices(_GRID + 1, _GRID + 1, offset=1, device=device)  # (2, P)
    params = torch.stack([points[:, pairs[0]], points[:, pairs[1]]], dim=2)  # (Q, P, 2)
    params = _top(score(params), params, _TOP)  # (Q, T, 2)
    step = torch.ceil((last - first) / _GRID)  # (Q,)
    offsets = torch.arange(-_REACH, _REACH + 1, dtype=torch.float64, device=device)
    moves = torch.cartesian_prod(offsets, offsets)  # (M, 2)
    # Levels run while any row of the block still has a step > 1 (each row
    # refines at every level); on the device: as many levels as the widest
    # data can need, each after the last kept only where `going` (no host
    # read, the same result).
    going = torch.ones((), dtype=torch.bool, device=device)
    for _ in range(_levels_needed(bins)):
        fine = torch.clamp(torch.ceil(step / _REACH), min=1)  # (Q,)
        grid = params[:, :, None, :] + moves * fine[:, None, None, None]  # (Q, T, M, 2)
        grid = grid.reshape(num_q, -1, 2).clamp(0, bins)  # (Q, T * M, 2)
        params = torch.where(going, _top(score(grid), grid, _TOP), params)  # (Q, T, 2)
        step = torch.where(going, fine, step)
        going = going & (step > 1).any()
    if exact:
        unit = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64, device=device)
        near = params[:, :, None, :] + torch.cartesian_prod(unit, unit)  # (Q, T, 9, 2)
        params = near.reshape(num_q, -1, 2).clamp(0, bins)  # (Q, T * 9, 2)
    best = score(params).argmin(dim=1)  # (Q,)
    return params[torch.arange(num_q, device=device), best]  # (Q, 2)


def l2_search_batched(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    levels: int,
    *,
    symmetric: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The range of least L2 error of each histogram, searched in batches.

    The objective and the candidates are `l2_search`'s (bin-edge ranges
    scored by torch's closed form with `levels` destination bins; symmetric:
    `[-amax, amax]`, amax on the one-bin grid, scored with the levels of
    `(qmin, qmax)`); the search is the module docstring's.

    Args:
        counts: `(*Q, bins)` counts.
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width (> 0).
        levels: destination levels, `qmax - qmin + 1` (asymmetric; with
            `symmetric` the levels come from `(qmin, qmax)` and this is only
            validated).
        symmetric: `(qmin, qmax)` for symmetric ranges, else None.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32: asymmetric, the
        candidate's ends (bin edges); symmetric, `(-amax, amax)`. Qparams
        with no counts get `(0, 0)`; a histogram of equal values (`width
        <= 0`) gets that value as both ends.
    """
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 2:
        raise ValueError(f"levels must be an int >= 2, got {levels!r}")
    qshape = tuple(counts.shape[:-1])
    bins = counts.shape[-1]
    counts2d = counts.reshape(-1, bins)
    lo64 = lo.reshape(-1).to(torch.float64)
    width64 = width.reshape(-1).to(torch.float64)
    point = width64 <= 0  # all values equal
    width64 = torch.where(point, 1.0, width64)
    num_q = counts2d.shape[0]
    first, last, has_data = _extent(counts2d)
    origin = lo64 / width64  # the unit position of 0 is -origin
    if symmetric is None:
        min_vals = torch.zeros(num_q, dtype=torch.float64, device=counts.device)
        max_vals = torch.zeros_like(min_vals)
        block = max(1, _ELEMS // max(1, bins * 4))
        for q0 in range(0, num_q, block):
            part = slice(q0, q0 + block)
            rows = counts2d[part].to(torch.float64)
            best = _asymmetric_block(rows, first[part], last[part], levels)
            min_vals[part] = lo64[part] + best[:, 0] * width64[part]
            max_vals[part] = lo64[part] + best[:, 1] * width64[part]
    else:
        qmin, qmax = symmetric
        amax = torch.maximum((origin + first).abs(), (origin + last).abs())
        best_amax = symmetric_search(counts2d, origin, amax.clamp(min=1.0), qmin, qmax)
        max_vals = best_amax * width64
        min_vals = -max_vals
    min_vals = torch.where(point, lo64, min_vals)
    max_vals = torch.where(point, lo64, max_vals)
    zero = torch.zeros_like(min_vals)
    min_vals = torch.where(has_data, min_vals, zero).to(torch.float32)
    max_vals = torch.where(has_data, max_vals, zero).to(torch.float32)
    return min_vals.reshape(qshape), max_vals.reshape(qshape)
