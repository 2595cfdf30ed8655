"""The one candidate-error scorer: `sum w * |fake_quant(x) - x| ** norm`.

Every range search of quantobs scores candidate qparams with `score`: the
raw-data MSE search and `static_mse` (values of the canonical layout), the
histogram MSE searches (bin centers weighted by their counts). The
arithmetic is `fake_quantize`'s, in float32 (`quantize.fake_quant_values`),
so a search scores exactly what the stored qparams will do. All candidates
and qparams are scored at once, in chunks of at most `chunk_elems` elements
per temporary, so memory is bounded whatever the input size; the native
kernel (`quantobs.native.mse_errors`) runs the unweighted case on CPU.

Candidates of llm-compressor's family shrink a reference range,
`(p * min, p * max)` for `p = 1 - i / grid`, `i < int(maxshrink * grid)`
(`shrink_factors`); NVFP4 candidates are scored with unrounded group scales
and no global scale, as llm-compressor does (`search_args`).
"""

from __future__ import annotations

import torch

from quantobs import native
from quantobs.core.args import QuantizationArgs
from quantobs.core.checks import Checks
from quantobs.core.formats import NumberFormat
from quantobs.core.qparams import calculate_qparams
from quantobs.core.quantize import fake_quant_values
from quantobs.native.dispatch import kernel

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "candidate_errors",
    "candidate_qparams",
    "error_power",
    "score",
    "score_with_torch",
    "search_args",
    "shrink_factors",
]

# Elements per temporary tensor (4 MiB of float32): bounds peak memory; larger
# chunks spend their time in page faults of fresh allocations.
DEFAULT_CHUNK_ELEMS = 1 << 20


def shrink_factors(
    maxshrink: float, grid: float, device: torch.device | None = None
) -> torch.Tensor:
    """`(C,)` float32 factors `1 - i / grid` for `i < int(maxshrink * grid)`.

    Computed on `device` (default the CPU), with no copy from the host: the
    float64 `1 - i / grid` of torch is Python's (correctly rounded division
    and subtraction), rounded once to float32.
    """
    steps = max(1, int(maxshrink * grid))
    i = torch.arange(steps, dtype=torch.float64, device=device)
    return (1 - i / grid).to(torch.float32)


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


def candidate_qparams(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Effective scales (divided by any global scale, as fake_quantize applies
    them) and zero points (None when symmetric) of candidate ranges, any
    shape (`(C, Q)` typically).

    Candidate ends past the dtype's finite range (a range scaled by an
    `expand` beyond float32's max: llm-compressor's become inf and its
    scales inf or NaN) saturate to `+-max`. Nothing is read on the host:
    the rule's checks are not raised here (candidates shrink ranges of data
    their observer checks itself; NaN data gives NaN candidates, reported
    when its qparams are computed).
    """
    top = torch.finfo(min_vals.dtype).max  # finite ends keep their bits
    min_vals, max_vals = min_vals.clamp(-top, top), max_vals.clamp(-top, top)
    scale, zero_point = calculate_qparams(
        min_vals, max_vals, args, global_scale, checks=Checks()
    )  # the checks are dropped unread
    if global_scale is not None:
        scale = scale / global_scale
    return scale, None if args.symmetric else zero_point


def error_power(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
) -> torch.Tensor:
    """`|fake_quant(x) - x| ** norm` in float32, in place on one temporary of
    the broadcast shape of `x` and `scale` (`x` float32)."""
    values = fake_quant_values(x, scale, zero_point, fmt)
    return values.sub_(x).abs_().pow_(norm)


@kernel
def _score_chunked(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> torch.Tensor:
    """`(C, Q)` float64 errors of `(N, Q, G)` values, summed in float32 per
    chunk (torch ops, any device)."""
    n, num_q, g = x3.shape
    num_c = scale.shape[0]
    per_qparam = num_c * n * g
    q_step = max(1, chunk_elems // per_qparam)
    if q_step >= num_q and per_qparam <= chunk_elems:  # one chunk: fewer ops
        zp = None if zero_point is None else zero_point[:, None, :, None]
        err = error_power(x3[None].float(), scale[:, None, :, None], zp, fmt, norm)
        return err.sum(dim=(1, 3), dtype=torch.float32).double()
    errors = torch.zeros(num_c, num_q, dtype=torch.float64, device=x3.device)
    for q0 in range(0, num_q, q_step):
        rows = slice(q0, min(num_q, q0 + q_step))
        sc = scale[:, None, rows, None]  # (C, 1, Qc, 1)
        zp = None if zero_point is None else zero_point[:, None, rows, None]
        if per_qparam <= chunk_elems:
            err = error_power(x3[None, :, rows].float(), sc, zp, fmt, norm)
            errors[:, rows] = err.sum(dim=(1, 3), dtype=torch.float32).double()
            continue
        # One qparam is too large for a chunk: score its values piece by piece.
        values = x3[:, q0, :].reshape(1, 1, 1, -1)
        step = max(1, chunk_elems // num_c)
        for v0 in range(0, values.shape[-1], step):
            piece = values[..., v0 : v0 + step].float()
            err = error_power(piece, sc, zp, fmt, norm)
            errors[:, rows] += err.sum(dim=(1, 3), dtype=torch.float32).double()
    return errors


def _score_native(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> torch.Tensor | None:
    values = x3 if x3.dtype == torch.float32 else x3.to(torch.float32)
    return native.mse_errors(values.contiguous(), scale, zero_point, fmt, norm)


_score_chunked.register("cpu", _score_native)


def score_with_torch(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> torch.Tensor:
    """`score` (unweighted) with torch ops whatever the device and the native
    kernels' switch: llm-compressor's float32 arithmetic, which decides near
    ties (`quantobs.solvers.mse_ties`). Same arguments and result."""
    return _score_chunked.torch(x3, scale, zero_point, fmt, norm, chunk_elems)


def score(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
    *,
    weights: torch.Tensor | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> torch.Tensor:
    """Error of every candidate qparam for every qparam.

    Args:
        x3: `(N, Q, G)` finite values (histograms: `(1, Q, bins)` centers).
        scale: `(C, Q)` effective candidate scales (divided by any global scale).
        zero_point: `(C, Q)` candidate zero points, or None (symmetric).
        fmt: the quantized format (its rounding and bounds).
        norm: exponent of the absolute error.
        weights: optional `(Q, G)` weight of each value (histogram counts);
            weighted errors are summed in float64, unweighted ones in float32
            per chunk.
        chunk_elems: elements per temporary tensor.

    Returns:
        `(C, Q)` float64 errors.
    """
    if weights is None:
        return _score_chunked(x3, scale, zero_point, fmt, norm, chunk_elems)
    _, num_q, g = x3.shape
    num_c = scale.shape[0]
    weights = weights.to(torch.float64)[:, :, None]  # (Q, G, 1)
    errors = torch.empty(num_c, num_q, dtype=torch.float64, device=x3.device)
    # Chunks of qparams x candidates, each at most ~chunk_elems values.
    q_step = max(1, chunk_elems // max(1, num_c * g))
    c_step = max(1, min(num_c, chunk_elems // max(1, g)))
    for q0 in range(0, num_q, q_step):
        rows = slice(q0, q0 + q_step)
        values = x3[0, rows].float()[:, None]  # (q, 1, G)
        for c0 in range(0, num_c, c_step):
            cols = slice(c0, c0 + c_step)
            zp = None if zero_point is None else zero_point[cols, rows].T[..., None]
            err = error_power(values, scale[cols, rows].T[..., None], zp, fmt, norm)
            # (q, c, G) @ (q, G, 1): the count-weighted sum of each row
            weighted = torch.bmm(err.to(torch.float64), weights[rows])
            errors[cols, rows] = weighted.squeeze(-1).T
    return errors


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
    """Error of every shrunk candidate range for every qparam.

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
    mins, maxs = min_vals.reshape(1, -1), max_vals.reshape(1, -1)
    factors = factors.to(x_flat.device)[:, None]
    scale, zero_point = candidate_qparams(
        mins * factors, maxs * factors, args, global_scale
    )  # (C, Q)
    errors = score(
        x_flat.reshape(n, -1, g), scale, zero_point, args.format, norm,
        chunk_elems=chunk_elems,
    )  # fmt: skip
    return errors.reshape(-1, *qshape)
