"""The global L2 histogram search: the range of least L2 error over all
candidate ranges, not torch's greedy walk.

    l2_search(counts: Tensor (*Q, bins), lo: Tensor (*Q,), width: Tensor (*Q,),
              levels: int, *, symmetric: tuple[float, float] | None = None)
              -> tuple[Tensor, Tensor]

It minimizes torch's closed-form error (`quantobs.solvers.l2_error`) with as
many destination levels as the quantized range really has: a coarse grid,
coarse-to-fine refinement and an exact descent (vectorized over qparams and
candidates), then, per tensor, a certificate (`quantobs.solvers.l2_bounds`)
that proves the result optimal over every bin-edge range or improves it.
torch's own greedy search is `quantobs.solvers.torch_l2`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from quantobs.core.exact import divide
from quantobs.solvers.l2_bounds import certify
from quantobs.solvers.l2_error import (
    approx_errors,
    as_rows,
    exact_errors,
    prefix_moments,
)

__all__ = ["l2_search"]

_TOP = 4  # candidates kept per refinement level
_EXACT = 4  # best screened candidates: starts of the exact descent
_GRID = 64  # first-level grid: _GRID + 1 positions per side
_SPLIT = 8  # each refinement level divides the step by this
_DESCENT_STEPS = 64  # exact +-1 bin moves after the approximate search
_EXACT_SCREEN_LEVELS = 32  # up to this many levels, screen with exact errors
_EXHAUSTIVE_EVALS = 1 << 22  # edge evaluations below which every candidate is scored
_PROOF_QPARAMS = 64  # certified one qparam at a time: per-tensor-like searches


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

    3. Asymmetric, up to 64 qparams: the result is certified (`certify`):
       every other bin-edge pair gets a lower bound on its error (`L2Bounds`:
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
    rows, lo64, width64 = as_rows(counts, lo, width)
    point = width64 <= 0  # all values equal (torch's min_val == max_val)
    width64 = torch.where(point, 1.0, width64)
    num_q, bins = rows.shape
    device = rows.device
    prefix = prefix_moments(rows)
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
            scale = divide(params[..., 0], half)
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
        errors = approx_errors(prefix, rows, lo_u, hi_u, levels_model)
        return torch.where(hi_u > lo_u, errors, math.inf)

    def exact(params: torch.Tensor) -> torch.Tensor:
        lo_u, hi_u = to_range(params)
        errors = exact_errors(prefix, rows, lo_u, hi_u, levels_model)
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
        best, _ = certify(prefix, rows, best, best_error, levels_model)
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
