"""Importance-weighted MSE range search (llm-compressor's `imatrix_mse`).

The range of each qparam is the shrunk candidate `(p * min, p * max)`,
`p = 1 - i / grid` for `i = 0 .. max(1, int(maxshrink * grid))` (both ends
included: one candidate more than `mse_search`), of `expand` times the
observed range, that minimizes

    sum_j w_j * |fake_quant(x_j) - x_j| ** norm

where `w_j` is the normalized importance of value `j`'s input channel
(`normalize_importance`: `E[x^2]` per channel divided by its mean). Without
weights it is the plain error (llm-compressor's fallback). The arithmetic is
llm-compressor's: float32 fake quantization, float32 products and float32
sums over each qparam's values; NVFP4 candidates are scored with unrounded
group scales and no global scale. Every candidate and qparam is scored
vectorized, in chunks of at most `chunk_elems` elements per temporary (or one
qparam's values, when those are more); the errors of at most as many
candidates as the input has values per qparam are held at once (one copy of
the input), then folded into a running best per qparam (the first candidate
of least error wins, as in llm-compressor's strict `<`). The early stop is
llm-compressor's: after `patience` consecutive candidates that improve no
qparam (0: never).
"""

from __future__ import annotations

import math

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.exact import divide
from quantobs.core.scoring import (
    DEFAULT_CHUNK_ELEMS,
    candidate_errors,
    candidate_qparams,
    error_power,
    search_args,
)
from quantobs.native.dispatch import kernel
from quantobs.solvers import mse_gpu
from quantobs.stats.reduce import minmax

__all__ = [
    "best_index",
    "imatrix_choice",
    "imatrix_factors",
    "imatrix_search",
    "normalize_importance",
    "weighted_errors",
]

_TINY = torch.finfo(torch.float32).tiny
_MAX = torch.finfo(torch.float32).max


def imatrix_factors(
    maxshrink: float, grid: float, device: torch.device | None = None
) -> torch.Tensor:
    """`(C,)` float32 factors `1 - i / grid`, `i = 0 .. max(1, int(maxshrink *
    grid))` inclusive (llm-compressor's `_grid_search` candidates), computed
    on `device` (as `shrink_factors`: no copy from the host)."""
    steps = max(1, int(maxshrink * grid))
    i = torch.arange(steps + 1, dtype=torch.float64, device=device)
    return (1 - i / grid).to(torch.float32)


def normalize_importance(importance: torch.Tensor) -> torch.Tensor:
    """`(K,)` float32 importance divided by its mean (llm-compressor's
    normalization: `imp / (imp.mean() + tiny)`), so uniform importance is 1."""
    imp = importance.to(torch.float32)
    return divide(imp, imp.mean() + _TINY)


def weighted_errors(
    x3: torch.Tensor,
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    norm: float,
    weights: torch.Tensor,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    qparams: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """`(C, Q)` float32 errors `sum w * |fake_quant(x) - x| ** norm` of every
    shrunk candidate range.

    Products and sums are float32, each qparam's values summed by one
    reduction, as llm-compressor sums them (so the errors are its bits).
    Candidate qparams are computed chunk by chunk (never `(C, Q)` at once).

    Args:
        x3: `(N, Q, G)` finite values.
        args: the args candidates are scored with (`search_args`).
        min_vals: `(Q,)` reference minima; candidates are `factor * min_vals`.
        max_vals: `(Q,)` reference maxima.
        factors: `(C,)` float32 shrink factors.
        norm: exponent of the absolute error.
        weights: `(N or 1, Q, G)` float32 weight of each value.
        chunk_elems: elements per temporary tensor (at least one qparam's
            values for one candidate).
        qparams: the candidates' `(C, Q)` scales and zero points (None:
            symmetric) when the caller has them (`candidate_qparams`' values,
            e.g. made by the GPU kernel); None: made here, chunk by chunk.

    Returns:
        `(C, Q)` float32 errors.
    """
    n, num_q, g = x3.shape
    num_c = factors.numel()
    fmt = args.format
    errors = torch.empty(num_c, num_q, dtype=torch.float32, device=x3.device)
    per_qparam = n * g
    c_step = max(1, min(num_c, chunk_elems // per_qparam))
    q_step = max(1, chunk_elems // (c_step * per_qparam))
    for q0 in range(0, num_q, q_step):
        rows = slice(q0, min(num_q, q0 + q_step))
        x = x3[None, :, rows].float()  # (1, N, q, G)
        w = weights[None, :, rows]  # (1, N | 1, q, G)
        for c0 in range(0, num_c, c_step):
            cols = slice(c0, min(num_c, c0 + c_step))
            if qparams is None:
                f = factors[cols, None]  # (c, 1)
                scale, zp = candidate_qparams(
                    min_vals[None, rows] * f, max_vals[None, rows] * f, args
                )  # (c, q)
            else:
                scale = qparams[0][cols, rows]
                zp = None if qparams[1] is None else qparams[1][cols, rows]
            zp4 = None if zp is None else zp[:, None, :, None]
            err = error_power(x, scale[:, None, :, None], zp4, fmt, norm)
            errors[cols, rows] = err.mul_(w).sum(dim=(1, 3))  # (c, N, q, G) -> (c, q)
    return errors


def best_index(errors: torch.Tensor, patience: int) -> torch.Tensor:
    """llm-compressor's choice among candidates with its early stop, decided
    on the device (no host read): `(C, Q)` float32 errors -> `(Q,)` int64.

    A candidate improves a qparam when its error is strictly below the best
    so far (float32, from `finfo.max`; NaN never improves); the search stops
    after `patience` consecutive candidates that improve none (0: never),
    counted from the first candidate. Each qparam gets its first candidate
    of least error among those scored (0 where none improved).
    """
    num_c = errors.shape[0]
    device = errors.device
    errors = errors.masked_fill(errors.isnan(), math.inf)
    least = torch.cummin(errors, dim=0).values.clamp(max=_MAX)  # (C, Q)
    start = torch.full_like(errors[:1], _MAX)
    before = torch.cat([start, least[:-1]])  # best before each candidate
    improved = (errors < before).any(dim=1)  # (C,)
    rows = torch.arange(num_c, device=device)
    scored = torch.full((), num_c, dtype=torch.int64, device=device)
    if patience:
        last = torch.cummax(torch.where(improved, rows, -1), dim=0).values
        stale = rows - last  # candidates since the last improving one
        scored = torch.where(stale >= patience, rows + 1, num_c).amin()
    kept = torch.where(rows[:, None] < scored, errors, math.inf)
    index = torch.argmin(kept, dim=0)  # first minimum wins
    found = kept.gather(0, index[None])[0]
    return torch.where(found < _MAX, index, 0)


def imatrix_search(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    weights: torch.Tensor | None = None,
    *,
    maxshrink: float = 0.95,
    grid: float = 20.0,
    norm: float = 3.0,
    patience: int = 5,
    expand: float = 1.0,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    batch_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-qparam range minimizing the (importance-weighted) error.

    Args:
        x_flat: `(N, *Q, G)` finite values.
        args: the quantization args.
        weights: optional weight of each value, broadcastable to `x_flat`
            (e.g. `(1, 1, *Q[1:], G)` normalized importance); None: unweighted.
        maxshrink: largest fraction the range shrinks by (`0 .. 1`).
        grid: candidates per unit of shrink.
        norm: exponent of the absolute error.
        patience: stop after this many candidates improving no qparam
            (0: score every candidate).
        expand: the search starts at `expand` times the observed range.
        chunk_elems: elements per temporary tensor.
        batch_range: `minmax(x_flat)` when the caller has it already.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32.
    """
    min_vals, max_vals = batch_range if batch_range is not None else minmax(x_flat)
    # Saturate where `expand` overflows (llm-compressor's ranges become inf).
    min_vals = (min_vals * expand).clamp(-_MAX, _MAX)
    max_vals = (max_vals * expand).clamp(-_MAX, _MAX)
    qshape = tuple(min_vals.shape)
    n, g = x_flat.shape[0], x_flat.shape[-1]
    x3 = x_flat.reshape(n, -1, g)  # (N, Q, G)
    mins, maxs = min_vals.reshape(-1), max_vals.reshape(-1)  # (Q,)
    w3 = None
    if weights is not None:  # (N | 1, Q, G); a copy only where it broadcasts
        shape = (weights.shape[0], *x_flat.shape[1:])
        w3 = weights.to(torch.float32).expand(shape).reshape(shape[0], -1, g)
    factors = imatrix_factors(maxshrink, grid, x_flat.device)
    scoring = search_args(args)
    if patience >= factors.numel():  # it cannot stop before the last candidate
        patience = 0
    index = imatrix_choice(
        x3, scoring, mins, maxs, factors, norm, patience, w3, chunk_elems
    )
    found = factors[index].reshape(qshape)
    return min_vals * found, max_vals * found


@kernel
def imatrix_choice(
    x3: torch.Tensor,
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    norm: float,
    patience: int,
    weights: torch.Tensor | None,
    chunk_elems: int,
) -> torch.Tensor:
    """`(Q,)` int64 index of llm-compressor's choice among the candidates
    (`best_index` of their float32 errors).

    A kernel: on CUDA one Triton pass scores every candidate
    (`quantobs.solvers.mse_gpu.imatrix_choice`, the same choice).

    Args:
        x3: `(N, Q, G)` finite values.
        args: the args candidates are scored with (`search_args`).
        min_vals: `(Q,)` reference minima; candidates are `factor * min_vals`.
        max_vals: `(Q,)` reference maxima.
        factors: `(C,)` float32 shrink factors, in the order of the search.
        norm: exponent of the absolute error.
        patience: early stop (0: never; less than `C`).
        weights: optional `(N | 1, Q, G)` float32 weight of each value.
        chunk_elems: elements per temporary tensor.
    """
    n, g = x3.shape[0], x3.shape[-1]
    num_c = factors.numel()
    # Blocks of candidates whose (c, Q) errors are at most one copy of the
    # input (and at most `patience`, the blocks llm-compressor's early stop
    # was checked after): all scored, the stop decided on the device.
    block = min(num_c, max(1, n * g), patience or num_c)
    found_errors = []
    for c0 in range(0, num_c, block):
        block_factors = factors[c0 : c0 + block]
        if weights is None:
            errors = candidate_errors(
                x3, args, min_vals, max_vals, block_factors, norm, chunk_elems
            ).to(torch.float32)
        else:
            errors = weighted_errors(
                x3, args, min_vals, max_vals, block_factors, norm, weights,
                chunk_elems,
            )  # fmt: skip
        found_errors.append(errors)
    return best_index(torch.cat(found_errors), patience)


imatrix_choice.register("cuda", mse_gpu.imatrix_choice)
