"""`quantobs weights`: min-max weight quantization error of a checkpoint.

For every linear weight of a `.safetensors` checkpoint
(`quantobs.cli.checkpoint_files`): min-max qparams under a preset scheme's
weight args, fake quantization, and the error it makes (SQNR in dB, max abs
error). Pure functions; the CLI only parses arguments and prints
(`quantobs.cli.weights_output`).

The math is done in float32 whatever the stored dtype. The next tensor is
read on a second thread while the current one is quantized, and the fake
quantization and its error run over row chunks of `_CHUNK_ELEMS` elements,
so a report costs about reading the file plus the fake quantization itself
(`benchmarks/bench_weights_report.py`).

A checkpoint the report cannot measure is refused with a `ValueError` that
names the reason, before any math: a file safetensors cannot read, a
checkpoint that is already quantized (`quantized_evidence`: compressed-
tensors / GPTQ / AWQ / FP8 companion tensors, or `.weight` tensors stored as
integers or 8-bit-or-narrower floats), one with no linear weight, and one
whose linear weights the scheme can take none of.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

import quantobs
from quantobs.cli.checkpoint_files import (
    find_safetensors,
    iter_linear_weights,
    quantized_evidence,
)
from quantobs.core.args import QuantizationArgs

__all__ = [
    "LayerReport",
    "WeightsReport",
    "layer_error",
    "max_abs_error",
    "minmax_fake_quantize",
    "minmax_qparams",
    "report_layer",
    "sqnr_db",
    "weights_report",
]


@dataclass(frozen=True)
class LayerReport:
    """One weight: its quantization error, or why it was skipped.

    Attributes:
        name: tensor name in the checkpoint.
        shape: weight shape `(rows, cols)`.
        dtype: stored dtype, e.g. `torch.float32`.
        scale_shape: shape of the scale (the qparam shape); None if skipped.
        sqnr_db: `10 log10(sum w^2 / sum (w - w_q)^2)`; `inf` when exact.
        max_abs_error: `max |w - w_q|`.
        skipped: the reason the scheme could not quantize it, else None.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    scale_shape: tuple[int, ...] | None = None
    sqnr_db: float | None = None
    max_abs_error: float | None = None
    skipped: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WeightsReport:
    """All linear weights of a checkpoint under one scheme.

    Attributes:
        model: the checkpoint path(s) read.
        scheme: the preset name.
        args: the weight args, as a JSON-able dict.
        layers: one report per linear weight, in checkpoint order.
        elapsed_s: wall time of loading and quantizing, in seconds.
    """

    model: str
    scheme: str
    args: dict[str, object]
    layers: list[LayerReport] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def quantized(self) -> list[LayerReport]:
        return [layer for layer in self.layers if layer.skipped is None]

    @property
    def skipped(self) -> list[LayerReport]:
        return [layer for layer in self.layers if layer.skipped is not None]

    def summary(self) -> dict[str, float | int]:
        """Counts and SQNR statistics over the quantized layers.

        `mean_sqnr_db` averages the layers whose SQNR is finite (an exact
        layer would make any mean `inf`); it is `inf` when all are exact and
        `nan` when no layer was quantized.
        """
        sqnrs = [layer.sqnr_db for layer in self.quantized if layer.sqnr_db is not None]
        finite = [value for value in sqnrs if math.isfinite(value)]
        if finite:
            mean_sqnr = sum(finite) / len(finite)
        else:
            mean_sqnr = math.inf if sqnrs else math.nan
        return {
            "layers": len(self.quantized),
            "skipped": len(self.skipped),
            "params": sum(layer.numel for layer in self.quantized),
            "mean_sqnr_db": mean_sqnr,
            "min_sqnr_db": min(sqnrs) if sqnrs else math.nan,
            "elapsed_s": self.elapsed_s,
        }


# ---------------------------------------------------------------- math


def minmax_qparams(
    w: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Min-max qparams of a weight under `args`.

    Args:
        w: `(rows, cols)` float32 weight.
        args: weight quantization args.

    Returns:
        `(scale, zero_point, global_scale)`: `(*qparam_shape,)` scales and
        zero points, and the `(1,)` global scale of `tensor_group` args
        (else None).

    Raises:
        ValueError: the weight's shape does not fit `args` (e.g. a group size
            that does not divide the columns).
    """
    x_flat = quantobs.flatten_for_calibration(w, "weight", args)
    # x_flat: (1, *qparam_shape, group_size) -> ranges (*qparam_shape,)
    min_vals = x_flat.amin(dim=(0, -1))
    max_vals = x_flat.amax(dim=(0, -1))
    global_scale = None
    if args.strategy == "tensor_group":
        global_scale = quantobs.generate_gparam(
            min_vals.min().reshape(1), max_vals.max().reshape(1)
        )
    scale, zero_point = quantobs.calculate_qparams(
        min_vals, max_vals, args, global_scale=global_scale
    )
    return scale, zero_point, global_scale


def minmax_fake_quantize(
    w: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max qparams of a weight under `args`, and its fake quantization.

    Args:
        w: `(rows, cols)` weight, any floating dtype; computed in float32.
        args: weight quantization args.

    Returns:
        `(w_q, scale)`: the float32 fake-quantized weight `(rows, cols)` and
        the scale `(*qparam_shape,)`.

    Raises:
        ValueError: the weight's shape does not fit `args` (e.g. a group size
            that does not divide the columns).
    """
    w = w.to(torch.float32)
    scale, zero_point, global_scale = minmax_qparams(w, args)
    w_q = quantobs.fake_quantize(w, scale, zero_point, args, global_scale=global_scale)
    return w_q, scale


def sqnr_db(x: torch.Tensor, x_q: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio `10 log10(sum x^2 / sum (x - x_q)^2)`.

    Sums in float64. `inf` when `x_q == x` exactly (including all zeros);
    `-inf` when `x` is all zeros but `x_q` is not.
    """
    x = x.to(torch.float32)
    signal = torch.sum(x.square(), dtype=torch.float64).item()
    noise = torch.sum((x - x_q.to(torch.float32)).square(), dtype=torch.float64).item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def max_abs_error(x: torch.Tensor, x_q: torch.Tensor) -> float:
    """`max |x - x_q|` in float32 (0.0 for empty tensors)."""
    if x.numel() == 0:
        return 0.0
    return (x.to(torch.float32) - x_q.to(torch.float32)).abs().max().item()


def _sum_of_squares(x: torch.Tensor) -> float:
    # x: (rows, cols) float32. Per-row dot products (BLAS, float32 over one
    # row), summed over rows in float64: within ~1e-7 relative of a float64
    # sum, at a fraction of its cost (no float64 copy of the tensor).
    rows = torch.einsum("ij,ij->i", x, x)  # (rows,)
    return torch.sum(rows, dtype=torch.float64).item()


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def layer_error(w: torch.Tensor, w_q: torch.Tensor) -> tuple[float, float]:
    """`(sqnr_db, max_abs_error)` of a fake-quantized 2-D weight, fused.

    The same quantities as `sqnr_db` and `max_abs_error`, from two passes
    over `w - w_q` (computed in place in `w_q`, which is consumed) and one
    over `w`.

    Args:
        w: `(rows, cols)` float32 weight.
        w_q: `(rows, cols)` float32 fake-quantized weight; overwritten.
    """
    if w.numel() == 0:
        return math.inf, 0.0
    error = w_q.sub_(w)  # (rows, cols)
    low, high = torch.aminmax(error)
    return _sqnr(_sum_of_squares(w), _sum_of_squares(error)), max(
        -low.item(), high.item()
    )


# Elements of one row chunk (8 MB of float32): the temporaries of the fake
# quantization stay small enough for the allocator to reuse them, instead of
# fresh pages of a multi-hundred-MB tensor per step.
_CHUNK_ELEMS = 1 << 21


def _row_chunks(args: QuantizationArgs, rows: int, cols: int) -> Iterator[slice]:
    """Row slices of about `_CHUNK_ELEMS` elements, whole blocks each."""
    unit = args.block_structure[0] if args.block_structure else 1
    step = max(1, _CHUNK_ELEMS // max(cols, 1) // unit) * unit
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def _qparam_rows(
    t: torch.Tensor | None, args: QuantizationArgs, rows: slice, weight_rows: int
) -> torch.Tensor | None:
    """The qparams of the weight rows `rows` (`(*qparam_shape,)` sliced)."""
    if t is None or args.strategy == "tensor":
        return t
    if args.strategy == "block" and args.block_structure:
        unit = args.block_structure[0]
        return t[rows.start // unit : -(-rows.stop // unit)]
    assert t.shape[0] == weight_rows
    return t[rows]


def report_layer(name: str, w: torch.Tensor, args: QuantizationArgs) -> LayerReport:
    """Quantize one weight; a shape the scheme cannot take is reported skipped.

    The qparams come from the whole weight; the fake quantization and its
    error run over row chunks (`_row_chunks`), the same numbers as
    `minmax_fake_quantize` + `layer_error` with less memory traffic.
    """
    shape, dtype = tuple(w.shape), str(w.dtype)
    w = w.to(torch.float32)
    try:
        scale, zero_point, global_scale = minmax_qparams(w, args)
    except ValueError as error:
        return LayerReport(name=name, shape=shape, dtype=dtype, skipped=str(error))
    signal = noise = worst = 0.0
    for rows in _row_chunks(args, *w.shape):
        part = w[rows]
        diff = quantobs.fake_quantize(
            part,
            _qparam_rows(scale, args, rows, w.shape[0]),  # type: ignore[arg-type]
            _qparam_rows(zero_point, args, rows, w.shape[0]),
            args,
            global_scale=global_scale,
        ).sub_(part)
        low, high = torch.aminmax(diff)
        worst = max(worst, -low.item(), high.item())
        noise += _sum_of_squares(diff)
        signal += _sum_of_squares(part)
    return LayerReport(
        name=name,
        shape=shape,
        dtype=dtype,
        scale_shape=tuple(scale.shape),
        sqnr_db=math.inf if w.numel() == 0 else _sqnr(signal, noise),
        max_abs_error=worst,
    )


def _report_layers(
    weights: Iterator[tuple[str, torch.Tensor]], args: QuantizationArgs
) -> list[LayerReport]:
    # Reads the next tensor on a second thread while this one is quantized
    # (torch and safetensors release the GIL for the heavy work).
    layers: list[LayerReport] = []
    with ThreadPoolExecutor(max_workers=1) as reader:
        pending = reader.submit(next, weights, None)
        while (item := pending.result()) is not None:
            pending = reader.submit(next, weights, None)
            layers.append(report_layer(*item, args))
    return layers


def weights_report(
    model: str | Path | Sequence[Path], scheme: str = "W4A16", limit: int | None = None
) -> WeightsReport:
    """Min-max fake-quantization error of every linear weight of a checkpoint.

    Args:
        model: a `.safetensors` file, a directory holding some, or a list of
            files.
        scheme: preset name (`quantobs.PRESET_SCHEMES`); its weight args are
            used.
        limit: only the first `limit` linear weights (None: all).

    Raises:
        KeyError: unknown scheme (the message lists the presets).
        ValueError: a scheme that does not quantize weights, a bad limit, a
            path that is not a readable `.safetensors` file, a checkpoint
            that is already quantized, one with no linear weight, or one
            whose linear weights the scheme can take none of (module
            docstring).
        FileNotFoundError: the model path does not exist or holds no file.
    """
    start = time.perf_counter()
    weight_args = quantobs.preset_scheme(scheme).weights
    if weight_args is None:
        choices = [name for name in quantobs.PRESET_SCHEMES if name != "UNQUANTIZED"]
        raise ValueError(
            f"scheme {scheme!r} does not quantize weights; pick one of "
            f"{', '.join(choices)}"
        )
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of layers, got {limit}")
    if isinstance(model, (str, Path)):
        files = find_safetensors(Path(model))
    else:
        files = [Path(path) for path in model]
    where = ", ".join(repr(str(path)) for path in files)
    evidence = quantized_evidence(files)
    if evidence is not None:
        raise ValueError(
            f"{where} is already quantized: {evidence}; `quantobs weights` "
            f"measures the quantization error of unquantized floating-point "
            f"weights, so pass the original checkpoint"
        )
    layers = _report_layers(iter_linear_weights(files, limit), weight_args)
    if not layers:
        raise ValueError(
            f"no linear weight in {where}: no 2-D floating-point '.weight' "
            f"tensor outside embeddings and norms"
        )
    if all(layer.skipped is not None for layer in layers):
        raise ValueError(
            f"scheme {scheme.strip().upper()} can quantize none of the "
            f"{len(layers)} linear weight(s) of {where}; the first: "
            f"{layers[0].name}: {layers[0].skipped}"
        )
    return WeightsReport(
        model=", ".join(str(path) for path in files),
        scheme=scheme.strip().upper(),
        args=weight_args.model_dump(mode="json", exclude_none=True),
        layers=layers,
        elapsed_s=time.perf_counter() - start,
    )
