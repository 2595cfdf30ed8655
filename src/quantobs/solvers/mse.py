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
"""

from __future__ import annotations

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.qparams import generate_gparam
from quantobs.core.scoring import (
    DEFAULT_CHUNK_ELEMS,
    candidate_errors,
    search_args,
    shrink_factors,
)
from quantobs.stats.reduce import minmax

__all__ = ["mse_search"]


class _Patience:
    """llm-compressor's early stop, fed one candidate's errors at a time.

    The loop stops after `patience` consecutive candidates that improve no
    qparam (strictly lower error); `None` never stops.
    """

    def __init__(self, patience: int | None) -> None:
        self.patience = patience
        self.best: torch.Tensor | None = None
        self.stale = 0

    def stops_after(self, errors: torch.Tensor) -> bool:
        if self.patience is None:
            return False
        improved = self.best is None or bool((errors < self.best).any())
        self.best = errors if self.best is None else torch.minimum(self.best, errors)
        self.stale = 0 if improved else self.stale + 1
        return not improved and self.stale >= self.patience


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
    min_vals, max_vals = batch_range if batch_range is not None else minmax(x_flat)
    min_vals, max_vals = min_vals * expand, max_vals * expand
    factors = shrink_factors(maxshrink, grid).to(x_flat.device)
    scoring = search_args(args, round_scales)
    global_scale = None
    if round_scales and args.strategy == "tensor_group":
        global_scale = generate_gparam(min_vals.min(), max_vals.max())
    # Score candidates in blocks so an early stop skips the rest.
    block = factors.numel() if patience is None else max(1, patience)
    rule, scored = _Patience(patience), []
    for c0 in range(0, factors.numel(), block):
        errors = candidate_errors(
            x_flat,
            scoring,
            min_vals,
            max_vals,
            factors[c0 : c0 + block],
            norm,
            chunk_elems,
            global_scale,
        )
        stop = next(
            (i + 1 for i in range(errors.shape[0]) if rule.stops_after(errors[i])),
            None,
        )
        scored.append(errors if stop is None else errors[:stop])
        if stop is not None:
            break
    all_errors = torch.cat(scored)
    best = factors[torch.argmin(all_errors, dim=0)]  # first minimum wins
    return min_vals * best, max_vals * best
