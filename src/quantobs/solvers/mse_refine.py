"""MSE searches beyond llm-compressor's shrink grid (opt-in).

The objective is `mse_search`'s, `sum |fake_quant(x) - x| ** norm` per
qparam with the same scoring args; only the candidate ranges differ. A range
is `(a * min, b * max)` of the observed range (times `expand`), with factors
in `[1 - maxshrink, 1]`:

==========  ================================================================
search      candidates of the shared factor `p = a = b`
==========  ================================================================
``grid``    llm-compressor's: `1 - i / grid`, `i < int(maxshrink * grid)`,
            with its early stop (`mse_search`)
``fine``    the grid's range of factors `FINE_STEPS` (10) times as dense,
            every one scored (7-12 times the grid's cost)
``refine``  the grid, then `REFINE_ROUNDS` (3) rounds around each qparam's
            best factor: round `r` scores `p +- j / (grid * 4**r)`,
            `j = 1, 2, 3` (1-3 times the grid's cost; steps of 1/6400)
==========  ================================================================

`independent_bounds=True` (asymmetric args) then searches `a` and `b` apart:
`BOUND_ROUNDS` (2) rounds of a search of `a` with `b` fixed, then of `b`
with `a` fixed, each over the factors of `search` (all of the grid for
``grid``). Data on one side of 0 has its range extended to 0 by the qparams
rule, so the factor of that side changes nothing and keeps its value (its
end moves to the other one where the two would cross: `ranges`).

Every stage starts from llm-compressor's range and keeps a qparam's range
unless a candidate's error is strictly lower (the incumbent is scored in the
same call, first): no search does worse than the default grid in the error
it minimizes, on the same data.
"""

from __future__ import annotations

from typing import Literal

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.scoring import (
    DEFAULT_CHUNK_ELEMS,
    candidate_qparams,
    score,
    shrink_factors,
)
from quantobs.solvers.mse import grid_search

__all__ = [
    "BOUND_ROUNDS",
    "FINE_STEPS",
    "REFINE_ROUNDS",
    "Search",
    "check_independent_bounds",
    "ranges",
    "refined_mse_search",
]

Search = Literal["grid", "fine", "refine"]

FINE_STEPS = 10  # candidates of `fine` per candidate of the grid
REFINE_ROUNDS = 3  # rounds of `refine` after the grid
_REFINE_SPLIT = 4  # each round divides the step by this
BOUND_ROUNDS = 2  # rounds of (min, max) searches of independent_bounds


def ranges(
    min_vals: torch.Tensor, max_vals: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranges `(a * min_vals, b * max_vals)` (broadcast), kept ordered.

    Data on one side of 0 crosses when its near end shrinks less than its
    far end (`0 < a * min_vals`, `b * max_vals < a * min_vals`); the qparams
    rule extends a range to 0, so the near end is moved to the far one,
    which changes no scale or zero point."""
    low, high = min_vals * a, max_vals * b
    zero = torch.zeros((), dtype=low.dtype, device=low.device)
    return torch.minimum(low, torch.maximum(high, zero)), torch.maximum(
        high, torch.minimum(low, zero)
    )


class _Scorer:
    """Errors of candidate ranges `(a * min_vals, b * max_vals)` per qparam.

    Args:
        x3: `(N, Q, G)` values.
        args: the scoring args (`search_args`).
        min_vals, max_vals: `(Q,)` the range the factors apply to.
        norm: exponent of the absolute error.
        chunk_elems: elements per temporary tensor.
        global_scale: optional `(1,)` NVFP4 global scale of the candidates.
    """

    def __init__(
        self,
        x3: torch.Tensor,
        args: QuantizationArgs,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        norm: float,
        chunk_elems: int,
        global_scale: torch.Tensor | None,
    ) -> None:
        self.x3, self.args = x3, args
        self.min_vals, self.max_vals = min_vals, max_vals
        self.norm, self.chunk_elems = norm, chunk_elems
        self.global_scale = global_scale

    def best(
        self, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors `(a, b)`, each `(Q,)`, of least error among the
        candidate rows `(C, Q)`; the first of equal errors wins."""
        low, high = ranges(self.min_vals, self.max_vals, a, b)
        scale, zero_point = candidate_qparams(low, high, self.args, self.global_scale)
        errors = score(
            self.x3, scale, zero_point, self.args.format, self.norm,
            chunk_elems=self.chunk_elems,
        )  # (C, Q)  # fmt: skip
        pick = torch.argmin(errors, dim=0)[None]  # (1, Q)
        return a.gather(0, pick)[0], b.gather(0, pick)[0]


class _Search:
    """One-dimensional searches of a factor, from an incumbent `(a, b)`."""

    def __init__(
        self, scorer: _Scorer, search: Search, maxshrink: float, grid: float
    ) -> None:
        self.scorer, self.search = scorer, search
        self.low = 1.0 - maxshrink
        self.grid = grid
        device = scorer.x3.device
        self.grid_factors = shrink_factors(maxshrink, grid).to(device)
        self.fine_factors = shrink_factors(maxshrink, grid * FINE_STEPS).to(device)
        steps = torch.arange(1, _REFINE_SPLIT, dtype=torch.float64, device=device)
        self.offsets = torch.cat([steps, -steps])  # (2 * (split - 1),)

    def _stage(
        self, a: torch.Tensor, b: torch.Tensor, values: torch.Tensor, side: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score `values` `(C, Q)` for side `joint`, `min` or `max`, the
        incumbent `(a, b)` first; keep the best."""
        cand_a = values if side in ("joint", "min") else a[None].expand_as(values)
        cand_b = values if side in ("joint", "max") else b[None].expand_as(values)
        return self.scorer.best(
            torch.cat([a[None], cand_a]), torch.cat([b[None], cand_b])
        )

    def _refine(
        self, a: torch.Tensor, b: torch.Tensor, side: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for r in range(1, REFINE_ROUNDS + 1):
            center = b if side == "max" else a  # (Q,)
            step = 1.0 / (self.grid * _REFINE_SPLIT**r)
            values = center.double()[None] + self.offsets[:, None] * step
            values = values.clamp(self.low, 1.0).float()  # (2 * (split - 1), Q)
            a, b = self._stage(a, b, values, side)
        return a, b

    def run(
        self, a: torch.Tensor, b: torch.Tensor, side: str, after_grid: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Search one side's factor (`side`: `joint`, `min` or `max`) from
        the incumbent `(a, b)`; `after_grid`: the grid was searched already."""
        num_q = a.numel()
        if self.search == "fine":
            values = self.fine_factors[:, None].expand(-1, num_q)
            return self._stage(a, b, values, side)
        if not after_grid:
            values = self.grid_factors[:, None].expand(-1, num_q)
            a, b = self._stage(a, b, values, side)
        if self.search == "refine":
            a, b = self._refine(a, b, side)
        return a, b


def check_independent_bounds(args: QuantizationArgs) -> None:
    """Raise `ValueError` for symmetric args (one bound: `max(|min|, |max|)`)."""
    if args.symmetric:
        raise ValueError(
            "independent_bounds=True needs asymmetric args (symmetric scales "
            "depend on max(|min|, |max|) only); set symmetric=False or drop it"
        )


def refined_mse_search(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    *,
    search: Search = "refine",
    independent_bounds: bool = False,
    maxshrink: float = 0.2,
    grid: float = 100.0,
    norm: float = 2.4,
    patience: int | None = 5,
    expand: float = 1.0,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    batch_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    round_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-qparam range of least error under a search beyond the grid.

    Args:
        x_flat: `(N, *Q, G)` finite values.
        args: the quantization args.
        search: `grid`, `fine` or `refine` (module docstring).
        independent_bounds: search the min and max factors apart
            (asymmetric args only).
        maxshrink, grid, norm, patience, expand, chunk_elems, batch_range,
            round_scales: as `mse_search` (`patience` is the incumbent's).

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32, of error at most that
        of `mse_search`'s range.

    Raises:
        ValueError: `independent_bounds` with symmetric args.
    """
    if independent_bounds:
        check_independent_bounds(args)
    # The incumbent: llm-compressor's choice on the grid.
    found = grid_search(
        x_flat, args, maxshrink=maxshrink, grid=grid, norm=norm,
        patience=patience, expand=expand, chunk_elems=chunk_elems,
        batch_range=batch_range, round_scales=round_scales,
    )  # fmt: skip
    min_vals, max_vals, p = found.min_vals, found.max_vals, found.best  # p: (Q,)
    mins, maxs = min_vals.reshape(-1), max_vals.reshape(-1)
    scorer = _Scorer(
        found.x3, found.scoring, mins, maxs, norm, chunk_elems, found.global_scale
    )
    stages = _Search(scorer, search, maxshrink, grid)
    a, b = p, p.clone()
    if search != "grid":
        a, b = stages.run(a, b, "joint", after_grid=True)
    if independent_bounds:
        for _ in range(BOUND_ROUNDS):
            a, b = stages.run(a, b, "min")
            a, b = stages.run(a, b, "max")
    shape = min_vals.shape
    return ranges(min_vals, max_vals, a.reshape(shape), b.reshape(shape))
