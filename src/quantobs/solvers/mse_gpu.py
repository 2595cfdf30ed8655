"""The MSE searches on CUDA: one Triton pass scores every candidate, torch
decides the near ties, nothing is read on the host.

`best_shrink` (`memoryless_mse`, `mse`, `nvfp4_expanded_mse`) and
`imatrix_choice` (`imatrix_mse`, `nvfp4_expanded_imatrix`) are the `"cuda"`
implementations of the kernels of the same names in `quantobs.solvers.mse`
and `quantobs.solvers.imatrix`: same arguments, same result as their torch
references. Each runs, in a handful of launches and no `(C, Q)` torch
work (`quantobs.native.triton_shrink`): one pass that makes every
candidate's qparams on chip (`candidate_qparams`' float32 operations: its
bits), scores them (`quantobs.native.triton_mse`'s arithmetic) and flags
the qparams with a near comparison; the near ones scored again with torch
(`rescore_near`: a stable sort puts them first, their candidates' qparams
from the same kernel); llm-compressor's early stop and first minimum in two
more launches (`triton_shrink.choose`: `first_best`, `best_index`). Where
the kernel does not make the candidates (a `scale_dtype` other than
float32 / FP8 e4m3, an asymmetric global scale, float64 ranges), they are
made with torch as `(C, Q)` tensors and the same steps run in torch ops
(`settle_near_ties`, `first_best`, `best_index`).

Why the choice is the torch reference's: the kernel's errors are torch's to
about 1e-6 relative (its sums and `pow` differ from torch's float32 sums and
`pow` by float32 roundings, `quantobs.native.triton_mse`), so every
comparison the search makes (a candidate's error against the least before
it) whose two sides differ by more than `mse_ties`' tolerance (2**-16
relative) comes out as torch's. Qparams with a closer comparison are scored
again with torch, for every candidate, and keep those errors; candidates
whose qparams repeat their predecessor's have the same error in every
arithmetic and never count as near. To stay free of host reads the
re-scored qparams are a fixed number, `tie_columns(Q, values)`: every qparam
up to 256, then one in 256 more, within 1/256 of the data beyond 2**16
values (none for a single large qparam: a tensor's near ties keep the
kernel's order). Where more are near, the first ones in qparam order are
re-scored and the rest keep the kernel's order (measured on MiniLM's
weights, about 0.5% of W4A16 groups have a near comparison; on 8192x8192
bf16 H200 weights every MSE observer's qparams equalled the torch path's).

Measured on an H200 (bf16 8192x8192, `update` + `get_qparams` of the
observer, triton 3.6): memoryless_mse int4 g128 5-7 ms (torch path 135-150
ms; llm-compressor 0.14: 6.6 ms), NVFP4 12.7 ms, MXFP4 8.8 ms, int8
channel 4.6 ms, FP8 tensor 3.5 ms, imatrix_mse int4 g128 6.4 ms,
nvfp4_expanded_mse 53.5 ms (llm-compressor: 37.6 ms). The Triton pass is
1.0 ms of about 2.5 ms of GPU time for int4 g128: the rest was the `(C, Q)`
torch work (candidate qparams, near ties, the early stop) and the host's
launches of it, before the candidates were made on chip. Counted on the CPU
(`benchmarks/gpu_ops.py`, the same path under Triton's interpreter), one
`update` of memoryless_mse int4 g128 dispatches 83 aten ops and 5 Triton
launches (189 and 2 before), NVFP4 104 (210), imatrix_mse 125 (262); not
yet timed on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.scoring import candidate_qparams, score_with_torch
from quantobs.solvers.mse_ties import first_best

if TYPE_CHECKING:  # imports Triton: at run time only where it runs
    from quantobs.native import triton_shrink

__all__ = [
    "best_shrink",
    "imatrix_choice",
    "rescore_near",
    "settle_near_ties",
    "tie_columns",
]

_TOLERANCE = 2.0**-16  # mse_ties' tolerance
_ALL_TIES = 256  # qparams re-scored whatever the share of near ones
_TIE_SHARE = 256  # and one in this many beyond
_TIE_VALUES = 1 << 16  # values re-scored whatever the share


def tie_columns(num_q: int, values: int = 1) -> int:
    """How many qparams of `values` values each `settle_near_ties` may score
    again with torch: every qparam up to 256, then one in 256 more, and at
    most `1 / 256` of the data beyond `2**16` values (0 for one large
    qparam: a tensor's near ties keep the kernel's order)."""
    columns = min(num_q, _ALL_TIES + num_q // _TIE_SHARE)
    budget = max(_TIE_VALUES, num_q * values // _TIE_SHARE)
    return min(columns, budget // max(1, values))


def _tolerance(x3: torch.Tensor) -> float:
    values = x3.shape[0] * x3.shape[-1]
    return _TOLERANCE * max(1.0, math.log2(max(values, 2)) / 8)


def _near(
    errors: torch.Tensor, repeats: torch.Tensor, tolerance: float
) -> torch.Tensor:
    """`(Q,)` whether some candidate's error is within `tolerance` of the
    least error before it (`errors` `(C, Q)`; `repeats` `(C - 1, Q)`)."""
    if errors.shape[0] < 2:
        return torch.zeros(errors.shape[1], dtype=torch.bool, device=errors.device)
    best = torch.cummin(errors, dim=0).values[:-1]  # least before each row
    rows = errors[1:]
    bound = torch.maximum(rows, best).mul_(tolerance)
    near = ((rows - best).abs_() <= bound) & ~repeats
    return near.any(dim=0)


def settle_near_ties(
    errors: torch.Tensor,
    repeats: torch.Tensor,
    tolerance: float,
    rescore: Callable[[torch.Tensor], torch.Tensor],
    values: int = 1,
) -> torch.Tensor:
    """`errors` with the qparams of near comparisons scored by `rescore`.

    Args:
        errors: `(C, Q)` the kernel's errors of every candidate.
        repeats: `(C - 1, Q)` whether candidate `i + 1`'s qparams equal
            candidate `i`'s.
        tolerance: relative distance of a near comparison.
        rescore: `(K,)` int64 qparam indices -> their `(C, K)` errors (torch).
        values: values per qparam (`tie_columns`).

    Returns:
        `(C, Q)` errors in `errors`' dtype, torch's for up to
        `tie_columns(Q, values)` qparams with a near comparison (module
        docstring). Nothing is read on the host.
    """
    num_c, num_q = errors.shape
    k = tie_columns(num_q, values)
    if num_c < 2 or k == 0:
        return errors
    near = _near(errors, repeats, tolerance)  # (Q,)
    if near.numel() > 0:
        return rescore_near(errors.clone(), near, rescore, values)
    device = errors.device
    order = torch.cumsum(near, dim=0) - 1  # rank of each near qparam
    # near qparam j goes to slot order[j] < k, every other to its own spare
    # slot k + j: one write per slot (no two writes to one place)
    qparams = torch.arange(num_q, device=device)
    slot = torch.where(near & (order < k), order, k + qparams)
    index = torch.zeros(k + num_q, dtype=torch.int64, device=device)
    index.scatter_(0, slot, qparams)
    index = index[:k]  # (k,): the qparam of each used slot
    used = torch.arange(k, device=device) < near.sum()
    if k >= 2:  # one column of several rows would be summed in another order
        index = torch.where(used, index, (index[0] + 1) % num_q)
    found = rescore(index).to(errors.dtype)  # (C, k)
    # Write back the used slots; the unused ones go to a spare column.
    target = torch.where(used, index, num_q)
    padded = torch.cat([errors, errors[:, :1]], dim=1)
    padded.index_copy_(1, target, torch.where(used, found, padded[:, target]))
    return padded[:, :num_q]


def rescore_near(
    errors: torch.Tensor,
    near: torch.Tensor,
    rescore: Callable[[torch.Tensor], torch.Tensor],
    values: int = 1,
) -> torch.Tensor:
    """`errors`, in place, with the first `tie_columns(Q, values)` qparams
    flagged `near` (in qparam order) scored by `rescore`.

    Args:
        errors: `(C, Q)` the kernel's errors of every candidate (written).
        near: `(Q,)` int8 or bool: whether a comparison of the qparam is near.
        rescore: `(K,)` int64 distinct qparam indices -> their `(C, K)`
            errors (torch).
        values: values per qparam (`tie_columns`).

    Returns:
        `errors`. Nothing is read on the host: a stable sort puts the near
        qparams first (the rest follow in order, scored but not written).
    """
    num_c, num_q = errors.shape
    k = tie_columns(num_q, values)
    if num_c < 2 or k == 0:
        return errors
    if num_q > 1:  # one column of several rows would be summed in another order
        k = max(k, 2)
    flags, order = torch.sort(near.to(torch.int8), descending=True, stable=True)
    index = order[:k]  # (k,) distinct: the near qparams first
    found = rescore(index).to(errors.dtype)  # (C, k)
    kept = torch.where(flags[:k] > 0, found, errors[:, index])
    return errors.index_copy_(1, index, kept)


def _candidates(
    x3: torch.Tensor,
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    global_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`(C, Q)` candidate scales, zero points, and `(C - 1, Q)` repeats."""
    f = factors.to(device=x3.device, dtype=torch.float32)[:, None]
    scale, zero_point = candidate_qparams(
        min_vals[None] * f, max_vals[None] * f, args, global_scale
    )
    repeats = scale[1:] == scale[:-1]
    if zero_point is not None:
        repeats &= zero_point[1:] == zero_point[:-1]
    return scale, zero_point, repeats


def _rule(
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    global_scale: torch.Tensor | None,
) -> triton_shrink.Rule | None:
    """The kernel's candidate rule for `args`, or None where the candidates
    are made with torch (float64 ranges, scale dtypes it does not round)."""
    from quantobs.native import triton_shrink  # imports Triton

    if min_vals.dtype != torch.float32 or max_vals.dtype != torch.float32:
        return None
    return triton_shrink.Rule.of(args, global_scale)


def best_shrink(
    x3: torch.Tensor,
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    *,
    norm: float = 2.4,
    patience: int | None = 5,
    chunk_elems: int = 1 << 20,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`quantobs.solvers.mse.best_shrink` on the GPU (same arguments and
    result), or None where the kernel does not apply."""
    from quantobs.native import triton_mse, triton_shrink  # imports Triton

    if not triton_mse.supported(args.format) or x3.dtype == torch.float64:
        return None
    fmt = args.format
    factors = factors.to(device=x3.device, dtype=torch.float32)
    # torch's errors are float32 sums (float64 sums of float32 chunk sums
    # for qparams beyond a chunk, where the kernel's stay float64)
    values = x3.shape[0] * x3.shape[-1]
    wide = factors.numel() * values > chunk_elems
    rule = _rule(args, min_vals, max_vals, global_scale)
    found = None
    if rule is not None:
        found = triton_shrink.shrink_errors(
            x3, rule, min_vals, max_vals, factors, norm, _tolerance(x3),
            global_scale=global_scale,
            dtype=torch.float64 if wide else torch.float32,
        )  # fmt: skip
    if rule is not None and found is not None:

        def rescore_rule(index: torch.Tensor) -> torch.Tensor:
            scale, zp = triton_shrink.candidate_qparams(
                rule, min_vals, max_vals, factors, index, global_scale
            )  # (C, k) each
            return score_with_torch(
                x3[:, index], scale, zp, fmt, norm, chunk_elems=chunk_elems
            )

        settled = rescore_near(found[0], found[1], rescore_rule, values)
        return triton_shrink.choose(
            settled, patience, triton_shrink.FIRST_BEST, factors
        )
    # candidates the kernel does not make: with torch, `(C, Q)`
    scale, zero_point, repeats = _candidates(
        x3, args, min_vals, max_vals, factors, global_scale
    )
    errors = triton_mse.candidate_errors(
        x3, scale, zero_point, fmt, norm,
        dtype=torch.float64 if wide else torch.float32, exact=False,
    )  # fmt: skip
    if errors is None:
        return None

    def rescore(index: torch.Tensor) -> torch.Tensor:
        zp = None if zero_point is None else zero_point[:, index]
        return score_with_torch(
            x3[:, index], scale[:, index], zp, fmt, norm, chunk_elems=chunk_elems
        )

    errors = settle_near_ties(errors, repeats, _tolerance(x3), rescore, values)
    return factors[first_best(errors, patience)]


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
) -> torch.Tensor | None:
    """`quantobs.solvers.imatrix.imatrix_choice` on the GPU (same arguments
    and result), or None where the kernel does not apply."""
    from quantobs.native import triton_mse, triton_shrink  # imports Triton
    from quantobs.solvers.imatrix import best_index, weighted_errors

    if not triton_mse.supported(args.format) or x3.dtype == torch.float64:
        return None
    fmt = args.format
    factors = factors.to(device=x3.device, dtype=torch.float32)
    values = x3.shape[0] * x3.shape[-1]
    rule = _rule(args, min_vals, max_vals, None)
    found = None
    if rule is not None:
        # float32 errors: the reference compares float32 sums
        found = triton_shrink.shrink_errors(
            x3, rule, min_vals, max_vals, factors, norm, _tolerance(x3),
            weights=weights, dtype=torch.float32,
        )  # fmt: skip
    if rule is not None and found is not None:

        def rescore_rule(index: torch.Tensor) -> torch.Tensor:
            scale, zp = triton_shrink.candidate_qparams(
                rule, min_vals, max_vals, factors, index
            )  # (C, k) each
            if weights is not None:
                return weighted_errors(
                    x3[:, index], args, min_vals[index], max_vals[index],
                    factors, norm, weights[:, index], chunk_elems, (scale, zp),
                )  # fmt: skip
            return score_with_torch(
                x3[:, index], scale, zp, fmt, norm, chunk_elems=chunk_elems
            ).to(torch.float32)

        settled = rescore_near(found[0], found[1], rescore_rule, values)
        return triton_shrink.choose(settled, patience, triton_shrink.BEST_INDEX)
    scale, zero_point, repeats = _candidates(
        x3, args, min_vals, max_vals, factors, None
    )
    errors = triton_mse.candidate_errors(
        x3, scale, zero_point, fmt, norm, weights, dtype=torch.float32, exact=False
    )  # the reference compares float32 sums
    if errors is None:
        return None

    def rescore(index: torch.Tensor) -> torch.Tensor:
        if weights is None:
            zp = None if zero_point is None else zero_point[:, index]
            torch_errors = score_with_torch(
                x3[:, index], scale[:, index], zp, fmt, norm, chunk_elems=chunk_elems
            )
            return torch_errors.to(torch.float32)
        return weighted_errors(
            x3[:, index], args, min_vals[index], max_vals[index], factors, norm,
            weights[:, index], chunk_elems,
        )  # fmt: skip

    errors = settle_near_ties(errors, repeats, _tolerance(x3), rescore, values)
    return best_index(errors, patience)
