"""MSE grid searches in the observed dtype: llm-compressor 0.14's arithmetic
on bfloat16 / float16 values (its eager path, the one it runs on the CPU).

llm-compressor keeps a bfloat16 / float16 value in its dtype through the
whole search: the candidate ranges (`min * p`), their scales and zero points
(compressed-tensors' rule in that dtype), the fake-quantized values, and,
for `memoryless_mse` / `mse`, the error `sum |q - x| ** norm` itself (one
sum per qparam, rounded to the dtype), compared with a strict `<` so that
the first of several candidates whose rounded errors tie wins. `imatrix_mse`
computes its candidates the same way but sums the (importance-weighted)
error in float32. The float32 searches (`quantobs.solvers.mse`,
`quantobs.solvers.imatrix`) score the same candidates without those
roundings; an observer's `arithmetic="float32"` option keeps them (see
`docs/dtypes.md` for the measured effect on the quantization error).

The functions here run torch's own operations on the same shapes and in the
same order as llm-compressor, so their roundings, including the order of
the reduced sum, are the peer's on any device that runs its eager path.
(On CUDA llm-compressor 0.14 runs the MSE search in Triton instead, whose
arithmetic differs from its own eager path; this module does not follow
it.)
"""

from __future__ import annotations

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.checks import Checks
from quantobs.core.qparams import calculate_qparams
from quantobs.core.quantize import fake_quant_values
from quantobs.core.scoring import search_args

__all__ = ["OBSERVED_DTYPES", "candidate_qparams_in", "observed_grid_search"]

#: dtypes whose arithmetic the search keeps (others: the float32 searches)
OBSERVED_DTYPES = (torch.bfloat16, torch.float16)


def candidate_qparams_in(
    low: torch.Tensor, high: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(*Q, 1)` scale and zero point (None: symmetric) of one candidate
    range of `low.dtype`, in compressed-tensors' arithmetic on that dtype."""
    dtype = low.dtype
    # the data's checks are its observer's (its NaN policy): not read here,
    # so that nothing waits on the host
    scale, zero_point = calculate_qparams(
        low.float(), high.float(), args, observed_dtype=dtype, checks=Checks()
    )
    zp = None if args.symmetric else zero_point.unsqueeze(-1)
    return scale.to(dtype).unsqueeze(-1), zp


@torch.no_grad()
def observed_grid_search(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    *,
    maxshrink: float = 0.2,
    grid: float = 100.0,
    norm: float = 2.4,
    patience: int | None = 5,
    expand: float = 1.0,
    imatrix: bool = False,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shrink-grid range minimizing `sum |fake_quant(x) - x| ** norm`,
    computed as llm-compressor 0.14 computes it on `x_flat.dtype`.

    `memoryless_mse`'s search (`int(maxshrink * grid)` candidates, errors
    summed in the observed dtype), or with `imatrix=True` `imatrix_mse`'s
    (`max(1, int(maxshrink * grid)) + 1` candidates, errors weighted by
    `importance` where given and summed in float32; patience 0 never stops
    early).

    Args:
        x_flat: `(N, *Q, G)` finite bfloat16 / float16 values.
        args: the quantization args.
        maxshrink: largest fraction the range shrinks by.
        grid: candidates per unit of shrink.
        norm: exponent of the absolute error.
        patience: stop after this many candidates that improve no qparam
            (None: score every candidate).
        expand: the search starts at `expand` times the observed range.
        imatrix: `imatrix_mse`'s search (above).
        importance: with `imatrix`, optional float32 weights of the errors
            broadcasting against `x_flat` (the normalized importance, e.g.
            `(1, 1, *Q[1:], G)`); None: unweighted.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32 (values of the
        observed dtype).

    Raises:
        ValueError: `x_flat` is not bfloat16 / float16.
    """
    dtype = x_flat.dtype
    if dtype not in OBSERVED_DTYPES:
        raise ValueError(
            f"observed_grid_search computes in bfloat16 / float16, got {dtype}; "
            "use quantobs.solvers.mse.mse_search for other dtypes"
        )
    scoring = search_args(args)  # NVFP4: unrounded group scales
    dims = (0, x_flat.ndim - 1)
    # (*Q,) observed range in the observed dtype (times expand, rounded);
    # an `expand` past the dtype's max saturates (llm-compressor's becomes
    # inf and its scales inf / NaN)
    top = torch.finfo(dtype).max
    min_vals = (torch.amin(x_flat, dim=dims) * expand).clamp_(-top, top)
    max_vals = (torch.amax(x_flat, dim=dims) * expand).clamp_(-top, top)
    error_dtype = torch.float32 if imatrix else dtype
    best_error = torch.full(
        min_vals.shape, torch.finfo(error_dtype).max, dtype=error_dtype,
        device=x_flat.device,
    )  # fmt: skip
    best_min, best_max = min_vals.clone(), max_vals.clone()
    steps = int(maxshrink * grid)
    if imatrix:
        steps = max(1, steps) + 1
        patience = patience or None  # 0: every candidate
    reference = x_flat.float() if imatrix else x_flat
    # llm-compressor stops after `patience` candidates that improve no
    # qparam; here every candidate is scored and those after the stop are
    # masked out, so the choice is the same and nothing is read on the host
    stale = torch.zeros((), dtype=torch.int64, device=x_flat.device)
    stopped = torch.zeros((), dtype=torch.bool, device=x_flat.device)
    for i in range(steps):
        factor = 1 - i / grid
        low, high = min_vals * factor, max_vals * factor
        scale, zero_point = candidate_qparams_in(low, high, scoring)
        # (N, *Q, G) in the observed dtype
        fake = fake_quant_values(x_flat, scale, zero_point, scoring.format)
        if imatrix:
            diff = fake.float().sub_(reference).abs_().pow_(norm)
            if importance is not None:
                diff.mul_(importance)
            error = diff.sum(dim=dims)
        else:
            error = torch.sum((fake - reference).abs().pow(norm), dim=dims)
        improved = (error < best_error) & ~stopped  # (*Q,)
        best_error = torch.where(improved, error, best_error)
        best_min = torch.where(improved, low, best_min)
        best_max = torch.where(improved, high, best_max)
        if patience is not None:
            stale = torch.where(improved.any(), 0, stale + 1)
            stopped = stopped | (stale >= patience)
    return best_min.float(), best_max.float()
