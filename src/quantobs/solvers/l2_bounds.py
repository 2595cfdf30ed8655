"""The global L2 search's certificate: lower bounds on the exact L2 error.

`quantobs.solvers.global_l2.l2_search` finds its range heuristically;
`certify` then proves it optimal over every bin-edge range, or improves it:
every pair `[a, b]` the bounds cannot rule out (its *survivors*) is scored
exactly (`quantobs.solvers.l2_error.row_errors`). Both steps are kernels:
`bound_survivors` lists the survivors in one native pass on CPU (or bounds
the whole rectangle with torch ops), `row_errors` scores them.

The bounds (`L2Bounds`): for `[a, b]` (bin units, `D = (b - a) / levels`)
the error is the clipping error (values below `a` go to the center
`a + D/2`, above `b` to `b - D/2`), computed exactly from prefix moments,
plus the error inside, which is at least the larger of

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

from __future__ import annotations

import torch

from quantobs import native
from quantobs.core.exact import divide
from quantobs.native.dispatch import kernel
from quantobs.solvers.l2_error import moments_at, region_error, row_errors

__all__ = [
    "JUMP_WEIGHT",
    "L2Bounds",
    "bound_survivors",
    "certify",
    "pair_bounds",
    "sawtooth_floor",
]

# Budgets of the certification below (per qparam): candidate pairs bounded,
# and candidates scored exactly, beyond which the search stays heuristic.
_PROOF_PAIRS = 1 << 22
_PROOF_EXACT = 1 << 14
_PROOF_EXACT_NATIVE = 1 << 17  # with the native exact scorer (~2 ns a level)
_PROOF_SLACK = 1e-9  # relative margin for float64 rounding in the bounds
# max over x of |int_{c - D/2}^{x} ((t - c)**2 - D**2 / 12) dt|, in units of
# D**3: 1 / (36 sqrt 3) = 0.0160375..., rounded up
JUMP_WEIGHT = 0.016038


def sawtooth_floor(width: torch.Tensor) -> torch.Tensor:
    """Least `int (x - nearest center)**2` over a unit interval, centers
    `width` apart: `(k * width**3 + r**3) / 12` with k whole periods and r the
    rest (each period gives `width**3 / 12`, the rest at least `r**3 / 12`)."""
    periods = torch.floor(1.0 / width)
    periods = torch.where(width >= 1, torch.zeros_like(width), periods)
    rest = torch.where(width >= 1, torch.ones_like(width), 1.0 - periods * width)
    return (periods * width**3 + rest**3) / 12


def pair_bounds(
    at: torch.Tensor,
    start: torch.Tensor,
    total: torch.Tensor,
    jumps: torch.Tensor,
    levels: int,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """Lower bounds of one histogram's error for starts `a` `(na, 1)` and ends
    `b` `(1, nb)` (bin edges): `(na, nb)` float64 (the module's bound).

    Args:
        at: `(3, bins + 1)` moments at each bin edge (`moments_at`).
        start: `(3,)` moments at 0; total: `(3,)` moments at `bins`.
        jumps: `(bins + 1,)` running sum of `|h[i + 1] - h[i]|`.
        levels: destination levels.
    """
    bins = at.shape[-1] - 1
    width = (b - a).to(torch.float64).clamp(min=1e-12) / levels
    first = a - bins / 2 + width / 2  # centered first / last centers
    last = b - bins / 2 - width / 2
    below = at[:, a] - start[:, None, None]  # (3, na, 1)
    above = total[:, None, None] - at[:, b]  # (3, 1, nb)
    clip = below[2] - 2 * first * below[1] + first * first * below[0]
    clip = clip + above[2] - 2 * last * above[1] + last * last * above[0]
    mass = at[0, b] - at[0, a]
    inside = (jumps[(b - 1).clamp(min=0)] - jumps[a]).clamp(min=0)
    floor = mass * sawtooth_floor(width)
    smooth = divide(mass * width**2, 12) - JUMP_WEIGHT * width**3 * inside
    return clip + torch.maximum(floor, smooth)


@kernel
def bound_survivors(
    at: torch.Tensor,
    start: torch.Tensor,
    total: torch.Tensor,
    jumps: torch.Tensor,
    levels: int,
    na: int,
    b0: int,
    limit: float,
    cap: int,
) -> tuple[torch.Tensor, bool]:
    """Bin-edge ranges of one histogram whose bound is below `limit`.

    Args: as `pair_bounds`' (one histogram), and the rectangle `a < na`,
    `b0 <= b <= bins`.

    Returns:
        `(pairs, complete)`: the `(K, 2)` int64 pairs `(a, b - b0)` with
        `b > a` and a bound below `limit`, in `(a, b)` order, and True; or
        an empty `(0, 2)` tensor and False when more than `cap` remain. The
        torch implementation bounds the whole rectangle at once; the native
        one (registered for "cpu") lists them in one pass.
    """
    bins = at.shape[-1] - 1
    a = torch.arange(na, device=at.device)[:, None]
    b = torch.arange(b0, bins + 1, device=at.device)[None, :]
    bounds = pair_bounds(at, start, total, jumps, levels, a, b)
    pairs = ((b > a) & (bounds < limit)).nonzero()
    return (pairs[:0], False) if pairs.shape[0] > cap else (pairs, True)


def _bound_survivors_native(
    at: torch.Tensor,
    start: torch.Tensor,
    total: torch.Tensor,
    jumps: torch.Tensor,
    levels: int,
    na: int,
    b0: int,
    limit: float,
    cap: int,
) -> tuple[torch.Tensor, bool] | None:
    # Dispatched only where the kernels run: None from them means "over cap".
    found = native.l2_survivors(
        at, start, total, jumps, JUMP_WEIGHT, levels, na, b0, limit, cap
    )
    if found is None:
        return torch.empty(0, 2, dtype=torch.int64), False
    return found, True


bound_survivors.register("cpu", _bound_survivors_native)


class L2Bounds:
    """Lower bounds on the exact L2 error of bin-edge ranges `[a, b]` of `Q`
    histograms (see the module docstring).

    Args:
        prefix: `(Q, bins, 4)` `prefix_moments` table.
        counts: `(Q, bins)` float64 counts.
        levels: destination levels.
    """

    def __init__(self, prefix: torch.Tensor, counts: torch.Tensor, levels: int):
        num_q, bins = counts.shape
        edges = torch.arange(bins + 1, dtype=torch.float64, device=counts.device)
        edges = edges.expand(num_q, -1)
        self.bins, self.levels = bins, levels
        self.at = moments_at(prefix, counts, edges)  # (3, Q, bins + 1)
        self.total = moments_at(prefix, counts, torch.full_like(edges, bins))
        self.start = moments_at(prefix, counts, torch.zeros_like(edges[:, :1]))
        self.low = region_error(self.at, self.start, edges - bins / 2)
        self.high = region_error(self.total, self.at, edges - bins / 2)
        steps = (counts[:, 1:] - counts[:, :-1]).abs()
        # jumps left of each bin j: sum of |h[i + 1] - h[i]| for i < j
        self.jumps = torch.nn.functional.pad(torch.cumsum(steps, dim=1), (1, 1))

    def reach(self, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(a_max, b_min)` per qparam: `a < a_max` and `b >= b_min` for any
        range whose error can be below `error` `(Q,)`."""
        a_max = (self.low < error[:, None]).sum(dim=1)
        b_min = self.bins + 1 - (self.high < error[:, None]).sum(dim=1)
        return a_max, b_min

    def _tables(
        self, q: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.at[:, q], self.start[:, q, 0], self.total[:, q, 0], self.jumps[q]

    def survivors(
        self, q: int, na: int, b0: int, limit: float, cap: int
    ) -> torch.Tensor | None:
        """`(K, 2)` pairs `(a, b - b0)`, `a < na`, `b0 <= b <= bins`, `b > a`,
        of qparam `q` whose bound is below `limit`, in `(a, b)` order; None
        if more than `cap` (`bound_survivors`)."""
        pairs, complete = bound_survivors(
            *self._tables(q), self.levels, na, b0, limit, cap
        )
        return pairs if complete else None

    def __call__(self, q: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Bounds of qparam `q` for starts `a` `(na, 1)` and ends `b` `(1, nb)`."""
        return pair_bounds(*self._tables(q), self.levels, a, b)


def certify(
    prefix: torch.Tensor,
    counts: torch.Tensor,
    best: torch.Tensor,
    best_error: torch.Tensor,
    levels: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prove the asymmetric search's result optimal, or improve it.

    Every bin-edge pair `[a, b]` in the rectangle that `L2Bounds.reach`
    leaves is bounded in one vectorized pass, and the few whose bound is
    below the incumbent are scored exactly. Qparams whose rectangle or
    survivors exceed the budgets keep the heuristic result.

    Args:
        prefix: `(Q, bins, 4)` `prefix_moments` table.
        counts: `(Q, bins)` float64 counts.
        best: `(Q, 2)` incumbent `[a, b]`.
        best_error: `(Q,)` its exact error.
        levels: destination levels.

    Returns:
        `(best, proven)`: the optimum `(Q, 2)` and a `(Q,)` bool, True where
        every candidate was bounded or scored.
    """
    num_q, bins = counts.shape
    bounds = L2Bounds(prefix, counts, levels)
    # The exact scorer's budget depends on which implementation will run.
    fast = counts.device.type == "cpu" and native.available()
    cap = _PROOF_EXACT_NATIVE if fast else _PROOF_EXACT
    limit = best_error * (1 + _PROOF_SLACK)
    a_max, b_min = bounds.reach(limit)
    proven = torch.zeros(num_q, dtype=torch.bool, device=counts.device)
    best, best_error = best.clone(), best_error.clone()
    for q in range(num_q):
        na, nb = int(a_max[q]), bins + 1 - int(b_min[q])
        if na * nb > _PROOF_PAIRS:
            continue
        pairs = bounds.survivors(q, na, int(b_min[q]), float(limit[q]), cap)
        if pairs is None:
            continue
        proven[q] = True
        if pairs.shape[0] == 0:
            continue
        lo_u = pairs[:, 0].to(torch.float64)
        hi_u = (pairs[:, 1] + int(b_min[q])).to(torch.float64)
        errors = row_errors(prefix[q], lo_u, hi_u, levels)
        k = int(errors.argmin())
        if float(errors[k]) < float(best_error[q]):
            best[q] = torch.stack([lo_u[k], hi_u[k]])
            best_error[q] = errors[k]
    return best, proven
