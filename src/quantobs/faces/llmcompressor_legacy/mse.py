"""`MovingAverageMSEObserver` ("mse"): a moving average of MSE-searched ranges.

Each batch's range is the candidate `p * (min, max)`, `p = 1 - i / grid`,
minimizing `sum |fake_quant(x) - x| ** norm`; every candidate, row and group
is scored at once by `quantobs.core.scoring`, and the legacy loop's early
stop (`patience`) is applied afterwards: per call, or per group for the
`GROUPS_ID` range, where the legacy code ran one loop per group. The ranges
are averaged by `MovingAverage(form="step")`, also for a constant of 1.0
(`running + 1.0 * (new - running)`, as the legacy code computed it).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from functools import partial

import torch
from pydantic import Field, model_validator

from quantobs.core.args import QuantizationArgs
from quantobs.core.quantize import fake_quant_values
from quantobs.core.scoring import candidate_errors, search_args, shrink_factors
from quantobs.faces.llmcompressor_legacy.base import (
    GROUPS_ID,
    Observer,
    ObserverOptions,
)
from quantobs.faces.llmcompressor_legacy.minmax import AveragingConstant
from quantobs.faces.llmcompressor_legacy.ranges import RangeObserver, TensorRange
from quantobs.observers.observed_search import OBSERVED_DTYPES, candidate_qparams_in
from quantobs.stats.minmax import MovingAverage
from quantobs.stats.reduce import Range

__all__ = ["MSEOptions", "MovingAverageMSEObserver", "legacy_mse_range"]


class MSEOptions(ObserverOptions):
    """Options of `MovingAverageMSEObserver` (llm-compressor 0.7's defaults).

    Attributes:
        averaging_constant: weight of the newest batch's range, in `(0, 1]`.
        maxshrink: largest fraction the range shrinks by, in `(0, 1]`.
        patience: stop a search after this many candidates that improve no
            range of the call (of the group, for group strategies); None
            scores every candidate. 0 behaves as 1, as in the legacy loop.
        grid: candidates per unit of shrink; `int(maxshrink * grid)` in all.
        norm: exponent of the absolute error.
    """

    averaging_constant: AveragingConstant = 0.01
    maxshrink: float = Field(0.2, gt=0.0, le=1.0)
    patience: int | None = Field(5, ge=0)
    grid: float = Field(100.0, gt=0.0)
    norm: float = Field(2.4, gt=0.0)

    @model_validator(mode="after")
    def _at_least_one_candidate(self) -> MSEOptions:
        if int(self.maxshrink * self.grid) < 1:
            raise ValueError(
                f"maxshrink * grid = {self.maxshrink * self.grid} gives no "
                "candidate range; make it at least 1 (e.g. grid=100)"
            )
        return self


def _legacy_stop_mask(
    errors: torch.Tensor, patience: int | None, per_group: bool
) -> torch.Tensor:
    """Which candidates the legacy loop scores before its early stop.

    The loop runs once per call (once per group in the group path) and stops
    after `patience` consecutive candidates that improve no range of it.

    Args:
        errors: `(C, *Q)` errors; `(C, rows, *groups)` when `per_group`.
        patience: the early-stop patience, None for none.
        per_group: one loop per index of the dims after the rows.

    Returns:
        `(C, *Q)`-broadcastable bool mask of the scored candidates.
    """
    num_c = errors.shape[0]
    if patience is None:
        return torch.ones_like(errors, dtype=torch.bool)
    per_group = per_group and errors.ndim >= 3
    inf = torch.full_like(errors[:1], float("inf"))
    best_before = torch.cat([inf, errors.cummin(dim=0).values[:-1]])  # (C, *Q)
    improved = errors < best_before
    if per_group:
        improved = improved.any(dim=1).reshape(num_c, -1)  # (C, groups)
    else:
        improved = improved.reshape(num_c, -1).any(dim=1, keepdim=True)  # (C, 1)
    stale = (~improved).to(torch.int64).cumsum(dim=0)  # (C, U)
    streak = max(patience, 1)
    window = stale.clone()  # non-improving candidates among the last `streak`
    window[streak:] -= stale[:-streak]
    hit = window >= streak
    stop = torch.where(
        hit.any(dim=0), hit.to(torch.int64).argmax(dim=0) + 1, num_c
    )  # (U,)
    scored = torch.arange(num_c, device=errors.device)[:, None] < stop  # (C, U)
    if per_group:
        return scored.reshape(num_c, 1, *errors.shape[2:])  # (C, 1, *groups)
    return scored.reshape(num_c, *[1] * (errors.ndim - 1))  # (C, 1, ..., 1)


def legacy_mse_range(
    x_flat: torch.Tensor,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    *,
    args: QuantizationArgs,
    options: MSEOptions,
    per_group: bool,
) -> Range:
    """The legacy search's range of one batch (a `RangeSelector`).

    Args:
        x_flat: `(1, *Q, G)` finite values.
        min_vals: `(*Q,)` the batch's minima.
        max_vals: `(*Q,)` the batch's maxima.
        args: the quantization args (NVFP4 scores unrounded group scales and
            no global scale, as the legacy search: `search_args`).
        options: the search options.
        per_group: the early stop runs per group (the `GROUPS_ID` range).

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32 (float64 for float64
        ranges, whose ends may lie past float32's max); the first minimum wins.
    """
    if options.arithmetic == "observed" and x_flat.dtype in OBSERVED_DTYPES:
        return _observed_legacy_range(x_flat, args, options, per_group)
    factors = shrink_factors(options.maxshrink, options.grid, x_flat.device)
    min32, max32 = min_vals.float(), max_vals.float()
    errors = candidate_errors(
        x_flat, search_args(args), min32, max32, factors, options.norm
    )  # (C, *Q)
    scored = _legacy_stop_mask(errors, options.patience, per_group)
    masked = torch.where(scored, errors, torch.full_like(errors, float("inf")))
    index = torch.argmin(masked, dim=0)  # (*Q,)
    if min_vals.dtype == torch.float64:  # ends past float32's max stay finite
        best64 = 1 - index.double() / options.grid  # the legacy p, in float64
        return min_vals * best64, max_vals * best64
    best = factors[index]
    return min32 * best, max32 * best


def _observed_legacy_range(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    options: MSEOptions,
    per_group: bool,
) -> Range:
    """`legacy_mse_range` in the legacy loop's arithmetic on bfloat16 /
    float16 values: candidates, their qparams, the fake-quantized values and
    each error sum in `x_flat.dtype` (torch's operations, shapes and order),
    the first of tied rounded errors kept. One deliberate difference: where
    no candidate's error is below the dtype's maximum (errors that overflow
    it), the range is the observed one, where the legacy loop returned its
    placeholder `(1, 0)`.

    Args:
        x_flat: `(1, *Q, G)` finite bfloat16 / float16 values.
        args, options, per_group: as `legacy_mse_range`.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32.
    """
    dims = (0, x_flat.ndim - 1)
    scoring = search_args(args)
    top = torch.finfo(x_flat.dtype).max
    min_vals, max_vals = torch.amin(x_flat, dim=dims), torch.amax(x_flat, dim=dims)
    best_error = torch.full_like(min_vals, top)
    best_min, best_max = min_vals.clone(), max_vals.clone()
    per_group = per_group and min_vals.ndim >= 2
    # one loop per group (the dims after the rows) or one per call
    loops = min_vals.shape[1:] if per_group else ()
    stale = torch.zeros(loops, dtype=torch.int64, device=x_flat.device)
    # the legacy loop's early stop (patience 0 behaves as 1; None: never)
    limit = math.inf if options.patience is None else max(options.patience, 1)
    for i in range(int(options.maxshrink * options.grid)):
        active = stale < limit  # the loops still running
        if not bool(active.any()):
            break
        factor = 1 - i / options.grid
        low, high = factor * min_vals, factor * max_vals
        scale, zero_point = candidate_qparams_in(low, high, scoring)
        fake = fake_quant_values(x_flat, scale, zero_point, scoring.format)
        error = torch.sum((fake - x_flat).abs().pow(options.norm), dim=dims)
        improved = (error < best_error) & active
        best_error = torch.where(improved, error, best_error)
        best_min = torch.where(improved, low, best_min)
        best_max = torch.where(improved, high, best_max)
        any_improved = improved.any(dim=0) if per_group else improved.any()
        stale = torch.where(any_improved, 0, stale + 1)
    return best_min.float(), best_max.float()


@Observer.register("mse")
class MovingAverageMSEObserver(RangeObserver):
    """Moving average of the per-batch range minimizing `|fq(x) - x| ** norm`."""

    Options = MSEOptions
    options: MSEOptions

    def _new_range(self, tensor_id: Hashable) -> TensorRange:
        select = partial(
            legacy_mse_range,
            args=self.quantization_args,
            options=self.options,
            per_group=tensor_id == GROUPS_ID,
        )
        config = {"constant": self.options.averaging_constant, "form": "step"}
        return TensorRange(MovingAverage, config, self.name, tensor_id, select)
