"""MSE range search: the shrink factor of the range that minimizes the error.

The objective and defaults are llm-compressor's: candidate ranges
`(p * min, p * max)` for `p = 1 - i / grid`, `i < int(maxshrink * grid)`, each
scored by `sum |fake_quant(x) - x| ** norm` with the format's real rounding;
for `tensor_group` (NVFP4) the search uses unrounded group scales and no
global scale, as llm-compressor does. All candidates and all qparams are
scored at once, in chunks of at most `chunk_elems` elements per temporary, so
memory is bounded whatever the input size and no Python loop runs over groups.

Candidates are scored by `quantobs.core.scoring`. `patience` reproduces
llm-compressor's early stop: the search ends after
`patience` consecutive candidates that improve no qparam (`None`: never).
Where the native kernel scores, `quantobs.solvers.mse_ties` makes its
comparisons of near-tied candidates torch's, so the ranges are
llm-compressor's bit for bit on float32 inputs.

`quantobs.solvers.mse_refine` and `quantobs.solvers.mse_discrete` search
further (opt-in options of the MSE observers).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.checks import Checks
from quantobs.core.qparams import generate_gparam
from quantobs.core.scoring import DEFAULT_CHUNK_ELEMS, search_args, shrink_factors
from quantobs.native.dispatch import kernel
from quantobs.solvers import mse_gpu
from quantobs.solvers.mse_ties import LlmCompressorErrors, first_best
from quantobs.stats.reduce import minmax

__all__ = ["GridSearch", "best_shrink", "grid_search", "mse_search"]


def mse_search(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    *,
    maxshrink: float = 0.2,
    grid: float = 100.0,
    norm: float = 2.4,
    patience: int | None = 5,
    expand: float = 1.0,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    batch_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    round_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-qparam range minimizing the quantization error of `x_flat`.

    Args:
        x_flat: `(N, *Q, G)` finite values.
        args: the quantization args.
        maxshrink: largest fraction the range shrinks by.
        grid: candidates per unit of shrink.
        norm: exponent of the absolute error.
        patience: early stop after this many non-improving candidates.
        expand: the search starts at `expand` times the observed range.
        chunk_elems: elements per temporary tensor.
        batch_range: `minmax(x_flat)` when the caller has it already.
        round_scales: score NVFP4 candidates with FP8-rounded group scales
            under the global scale of the observed range (llm-compressor
            ignores both while searching).

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32.
    """
    found = grid_search(
        x_flat, args, maxshrink=maxshrink, grid=grid, norm=norm,
        patience=patience, expand=expand, chunk_elems=chunk_elems,
        batch_range=batch_range, round_scales=round_scales,
    )  # fmt: skip
    best = found.best.reshape(found.min_vals.shape)
    return found.min_vals * best, found.max_vals * best


class GridSearch(NamedTuple):
    """`grid_search`'s choice and the set-up the searches beyond it reuse:
    `x3` the `(N, Q, G)` values, `scoring` the args (`search_args`),
    `min_vals` / `max_vals` the `(*Q,)` observed range times `expand`,
    `global_scale` NVFP4's (`round_scales`) or None, `best` the `(Q,)`
    float32 factors (`best_shrink`)."""

    x3: torch.Tensor
    scoring: QuantizationArgs
    min_vals: torch.Tensor
    max_vals: torch.Tensor
    global_scale: torch.Tensor | None
    best: torch.Tensor


def grid_search(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    *,
    maxshrink: float,
    grid: float,
    norm: float,
    patience: int | None,
    expand: float,
    chunk_elems: int,
    batch_range: tuple[torch.Tensor, torch.Tensor] | None,
    round_scales: bool,
) -> GridSearch:
    """`mse_search`'s set-up and its choice on the shrink grid.

    Shared by `mse_search` and the searches that start from its choice
    (`quantobs.solvers.mse_refine`); the arguments are `mse_search`'s.
    """
    min_vals, max_vals = batch_range if batch_range is not None else minmax(x_flat)
    top = torch.finfo(torch.float32).max  # `expand` past it saturates
    if expand != 1.0:  # (times 1 is exact: one op less on a GPU)
        min_vals, max_vals = min_vals * expand, max_vals * expand
    min_vals, max_vals = min_vals.clamp(-top, top), max_vals.clamp(-top, top)
    scoring = search_args(args, round_scales)
    global_scale = None
    if round_scales and args.strategy == "tensor_group":
        # the data's checks are its observer's: not read here (no host wait)
        global_scale = generate_gparam(min_vals.min(), max_vals.max(), checks=Checks())
    n, g = x_flat.shape[0], x_flat.shape[-1]
    x3 = x_flat.reshape(n, -1, g)  # (N, Q, G)
    best = best_shrink(
        x3,
        scoring,
        min_vals.reshape(-1),
        max_vals.reshape(-1),
        shrink_factors(maxshrink, grid, x_flat.device),
        norm=norm,
        patience=patience,
        chunk_elems=chunk_elems,
        global_scale=global_scale,
    )
    return GridSearch(x3, scoring, min_vals, max_vals, global_scale, best)


@kernel
def best_shrink(
    x3: torch.Tensor,
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    *,
    norm: float = 2.4,
    patience: int | None = 5,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """llm-compressor's choice among shrink factors, per qparam.

    A kernel: on CUDA one Triton pass scores every candidate
    (`quantobs.solvers.mse_gpu.best_shrink`, the same choice).

    Args:
        x3: `(N, Q, G)` finite values.
        args: the args candidates are scored with (`search_args`).
        min_vals: `(Q,)` minima the factors shrink.
        max_vals: `(Q,)` maxima.
        factors: `(C,)` float32 factors in the order of the search.
        norm: exponent of the absolute error.
        patience: early stop after this many non-improving candidates.
        chunk_elems: elements per temporary tensor.
        global_scale: optional `(1,)` NVFP4 global scale of the candidates.

    Returns:
        `(Q,)` float32: the first factor of least error among those scored.
    """
    factors = factors.to(x3.device)
    table = LlmCompressorErrors(
        x3, args, min_vals, max_vals, factors, norm, chunk_elems, global_scale
    )
    block = factors.numel() if patience is None else max(1, patience)
    if not table.settles:
        # torch's errors (any device): every block scored, the early stop
        # decided on the device, so the host waits for nothing (issue 24).
        for _ in range(0, factors.numel(), block):
            errors = table.extend(block)
        return factors[first_best(errors, patience)]
    # The native kernel's (CPU): score candidates in blocks so an early stop
    # skips the rest; where its errors say the search ends, settle its near
    # ties and decide (the first minimum before the stop wins).
    for c0 in range(0, factors.numel(), block):
        table.extend(block)
        last = c0 + block >= factors.numel()
        if table.stop(patience) is None and not last:
            continue
        table.settle(patience)
        if table.stopped is not None:
            break
    if table.chosen is None:  # not reached: the last block settles
        raise RuntimeError("best_shrink: the search ended undecided")
    return factors[table.chosen]


best_shrink.register("cuda", mse_gpu.best_shrink)
