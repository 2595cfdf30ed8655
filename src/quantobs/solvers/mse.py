"""MSE range search: the shrink factor of the range that minimizes the error.

The objective and defaults are llm-compressor's: candidate ranges
`(p * min, p * max)` for `p = 1 - i / grid`, `i < int(maxshrink * grid)`, each
scored by `sum |fake_quant(x) - x| ** norm` with the format's real rounding;
for `tensor_group` (NVFP4) the search uses unrounded group scales and no
global scale, as llm-compressor does. All candidates and all qparams are
scored at once, in chunks of at most `chunk_elems` elements per temporary, so
memory is bounded whatever the input size and no Python loop runs over groups.

`patience` reproduces llm-compressor's early stop: the search ends after
`patience` consecutive candidates that improve no qparam (`None`: never).
"""

from __future__ import annotations

import torch

from quantobs import native
from quantobs.core.args import QuantizationArgs
from quantobs.core.qparams import calculate_qparams, generate_gparam
from quantobs.stats.reduce import minmax

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "candidate_errors",
    "error_power",
    "mse_search",
    "search_args",
    "shrink_factors",
]

# Elements per temporary tensor (4 MiB of float32): bounds peak memory; larger
# chunks spend their time in page faults of fresh allocations.
DEFAULT_CHUNK_ELEMS = 1 << 20


def shrink_factors(maxshrink: float, grid: float) -> torch.Tensor:
    """`(C,)` float32 factors `1 - i / grid` for `i < int(maxshrink * grid)`."""
    steps = max(1, int(maxshrink * grid))
    return torch.tensor([1 - i / grid for i in range(steps)], dtype=torch.float32)


def search_args(args: QuantizationArgs, round_scales: bool = False) -> QuantizationArgs:
    """The args candidates are scored with.

    llm-compressor scores NVFP4 candidates with unrounded group scales and no
    global scale; `round_scales=True` keeps `scale_dtype`, so candidates are
    scored with the FP8 group scales they will be stored with (pass the
    global scale to `candidate_errors` then).
    """
    tensor_group = args.strategy == "tensor_group"
    if tensor_group and args.scale_dtype is not None and not round_scales:
        return args.model_copy(update={"scale_dtype": None})
    return args


def _candidate_qparams(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(C, Q)` effective scales (divided by any global scale, as fake_quantize
    applies them) and zero points of the candidates `factors * range`."""
    scale, zero_point = calculate_qparams(
        min_vals[None, :] * factors[:, None],
        max_vals[None, :] * factors[:, None],
        args,
        global_scale,
    )
    if global_scale is not None:
        scale = scale / global_scale
    return scale, zero_point


def _errors_of_chunk(
    x: torch.Tensor,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    args: QuantizationArgs,
    norm: float,
    global_scale: torch.Tensor | None,
) -> torch.Tensor:
    # x: (N, Qc, G); min_vals, max_vals: (Qc,); factors: (C,) -> errors (C, Qc)
    scale, zero_point = _candidate_qparams(
        min_vals, max_vals, factors, args, global_scale
    )
    x_c = x.to(torch.float32)[None]  # (1, N, Qc, G)
    zp = None if args.symmetric else zero_point[:, None, :, None]
    err = error_power(x_c, scale[:, None, :, None], zp, args, norm)  # (C, N, Qc, G)
    return err.sum(dim=(1, 3), dtype=torch.float32).to(torch.float64)


def error_power(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    norm: float,
) -> torch.Tensor:
    """`|fake_quant(x) - x| ** norm` with fake_quantize's float32 arithmetic,
    in place on one temporary of the broadcast shape of `x` and `scale`.

    Args:
        x: float32 values; scale, zero_point: broadcast against `x`
            (zero_point None for symmetric args).
        args: the quantization args (the format's rounding and bounds).
        norm: error exponent.
    """
    fmt = args.format
    values = x / scale
    zp = None if zero_point is None else zero_point.to(torch.float32)
    if zp is not None:
        values.add_(zp)
    values.clamp_(fmt.min, fmt.max)
    values = values.round_() if not fmt.is_float else fmt.round(values)
    if zp is not None:
        values.sub_(zp)
    return values.mul_(scale).sub_(x).abs_().pow_(norm)


def _native_errors(
    x3: torch.Tensor,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    args: QuantizationArgs,
    norm: float,
    global_scale: torch.Tensor | None,
) -> torch.Tensor | None:
    """`(C, Qn)` errors from the native kernel, or None where it does not run."""
    if x3.device.type != "cpu" or not native.mse_supported(args.format, norm):
        return None
    if not native.available():
        return None
    # x3: (N, Qn, G); scales and zero points of every candidate: (C, Qn)
    scale, zero_point = _candidate_qparams(
        min_vals, max_vals, factors, args, global_scale
    )
    values = x3 if x3.dtype == torch.float32 else x3.to(torch.float32)
    return native.mse_errors(
        values.contiguous(),
        scale,
        None if args.symmetric else zero_point,
        args.format,
        norm,
    )


def candidate_errors(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    factors: torch.Tensor,
    norm: float = 2.4,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Error of every candidate range for every qparam.

    Args:
        x_flat: `(N, *Q, G)` values (finite).
        args: the quantization args (see `search_args`).
        min_vals: `(*Q,)` reference minima; candidates are `factor * min_vals`.
        max_vals: `(*Q,)` reference maxima.
        factors: `(C,)` float32 shrink factors.
        norm: exponent of the absolute error.
        chunk_elems: elements per temporary tensor.
        global_scale: optional `(1,)` NVFP4 global scale the candidates'
            scales are computed and applied with.

    Returns:
        `(C, *Q)` float64 errors `sum |fake_quant(x) - x| ** norm` over N, G.
    """
    qshape = tuple(min_vals.shape)
    n, g = x_flat.shape[0], x_flat.shape[-1]
    x3 = x_flat.reshape(n, -1, g)  # (N, Qn, G)
    mins, maxs = min_vals.reshape(-1), max_vals.reshape(-1)
    factors = factors.to(x_flat.device)
    found = _native_errors(x3, mins, maxs, factors, args, norm, global_scale)
    if found is not None:
        return found.reshape(-1, *qshape)
    num_c, num_q = factors.numel(), x3.shape[1]
    errors = torch.zeros(num_c, num_q, dtype=torch.float64, device=x_flat.device)
    per_qparam = num_c * n * g
    q_step = max(1, chunk_elems // per_qparam)
    for q0 in range(0, num_q, q_step):
        q1 = min(num_q, q0 + q_step)
        if per_qparam <= chunk_elems:
            errors[:, q0:q1] = _errors_of_chunk(
                x3[:, q0:q1],
                mins[q0:q1],
                maxs[q0:q1],
                factors,
                args,
                norm,
                global_scale,
            )
            continue
        # One qparam is too large for a chunk: score its values piece by piece.
        values = x3[:, q0, :].reshape(1, 1, -1)
        step = max(1, chunk_elems // num_c)
        for v0 in range(0, values.shape[-1], step):
            errors[:, q0 : q0 + 1] += _errors_of_chunk(
                values[..., v0 : v0 + step],
                mins[q0 : q0 + 1],
                maxs[q0 : q0 + 1],
                factors,
                args,
                norm,
                global_scale,
            )
    return errors.reshape(num_c, *qshape)


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
        return self.stale >= self.patience


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
