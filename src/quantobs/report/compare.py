"""`quantobs compare`: which scheme and which observer for a model.

For each scheme and each observer row, a fresh copy of the model is
calibrated on the calibration texts and evaluated on the held-out texts
against the unquantized model (`quantobs.report.evaluate`). A row names
what the user chooses; `resolve_row` turns it into the observers that run
on the weights and on the static inputs under one scheme:

==============  ====================  ======================================
row             weights               static inputs
==============  ====================  ======================================
minmax          memoryless_minmax     static_minmax
mse             memoryless_mse        mse (moving-average MSE)
static_mse      memoryless_mse        static_mse
histogram       histogram *           histogram
percentile      percentile *          percentile
entropy         entropy *             entropy
imatrix         imatrix_mse **        static_minmax
any other name  that observer *       that observer
==============  ====================  ======================================

\\* Histogram-family observers (histogram, histogram_mse, percentile,
entropy) run on weights quantized per tensor; per-channel and per-group
weights keep memoryless_minmax, since per-qparam histograms are not yet
fast enough for whole models.
\\** imatrix weighs the weight error by the inputs' importance per channel:
it needs per-channel or per-group weights, and the row is skipped for
per-tensor weights.

A row whose observers are those of an earlier row under the scheme (e.g.
`static_mse` and `mse` for W4A16, which quantizes no input) is not run
again: it is listed as skipped with the reason.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quantobs.calibration import Recipe, attach, calibrate, text_batches
from quantobs.core.args import QuantizationArgs
from quantobs.core.presets import preset_scheme
from quantobs.report.evaluate import HeldOut, embed, evaluate, input_ranges
from quantobs.report.results import Cell, Comparison, LayerHistogram, Skipped

__all__ = [
    "DEFAULT_OBSERVERS",
    "DEFAULT_SCHEMES",
    "HISTOGRAM_FAMILY",
    "QUICK_OBSERVERS",
    "QUICK_SCHEMES",
    "ROWS",
    "Resolved",
    "compare",
    "resolve_row",
]

DEFAULT_SCHEMES = ("W8A8", "W4A16", "FP8", "NVFP4", "MXFP4")
DEFAULT_OBSERVERS = (
    "minmax",
    "mse",
    "static_mse",
    "histogram",
    "percentile",
    "entropy",
    "imatrix",
)
QUICK_SCHEMES = ("W4A16", "FP8", "NVFP4")
QUICK_OBSERVERS = ("minmax", "mse", "percentile", "imatrix")

#: `{row: (weight observer, input observer)}` for the named rows.
ROWS: dict[str, tuple[str, str]] = {
    "minmax": ("memoryless_minmax", "static_minmax"),
    "mse": ("memoryless_mse", "mse"),
    "static_mse": ("memoryless_mse", "static_mse"),
    "histogram": ("histogram", "histogram"),
    "percentile": ("percentile", "percentile"),
    "entropy": ("entropy", "entropy"),
    "imatrix": ("imatrix_mse", "static_minmax"),
}
HISTOGRAM_FAMILY = frozenset({"histogram", "histogram_mse", "percentile", "entropy"})
_IMPORTANCE = frozenset({"imatrix_mse", "nvfp4_expanded_imatrix"})
#: the bins of the worst layer's histogram plot
_PLOT_BINS = 120


@dataclass(frozen=True)
class Resolved:
    """The observers a row runs under one scheme."""

    weight: str
    input: str | None  # None: the scheme quantizes no input statically


def _static_inputs(scheme: str) -> QuantizationArgs | None:
    args = preset_scheme(scheme).input_activations
    return None if args is None or args.dynamic is True else args


def resolve_row(row: str, scheme: str) -> Resolved | str:
    """The observers of `row` under `scheme`, or the reason it does not apply."""
    weight, inputs = ROWS.get(row, (row, row))
    weights = preset_scheme(scheme).weights
    if weights is None:
        return f"{scheme} quantizes no weights"
    if weight in HISTOGRAM_FAMILY and weights.strategy != "tensor":
        weight = ROWS["minmax"][0]
    if weight in _IMPORTANCE and weights.strategy == "tensor":
        return f"{weight} needs per-channel or per-group weights"
    static = _static_inputs(scheme)
    return Resolved(weight=weight, input=None if static is None else inputs)


@dataclass
class _Job:
    scheme: str
    row: str
    resolved: Resolved


def _plan(
    schemes: Sequence[str], rows: Sequence[str]
) -> tuple[list[_Job], list[Skipped]]:
    jobs: list[_Job] = []
    skipped: list[Skipped] = []
    for scheme in schemes:
        seen: dict[Resolved, str] = {}
        for row in rows:
            resolved = resolve_row(row, scheme)
            if isinstance(resolved, str):
                skipped.append(Skipped(scheme, row, resolved))
            elif resolved in seen:
                reason = f"same observers as {seen[resolved]} under {scheme}"
                if resolved.input is None:
                    reason += " (no static inputs)"
                skipped.append(Skipped(scheme, row, reason))
            else:
                seen[resolved] = row
                jobs.append(_Job(scheme, row, resolved))
    return jobs, skipped


def _progress(jobs: list[_Job], enabled: bool | None) -> Any:
    import sys

    from tqdm.auto import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(jobs, desc="compare", unit="cell", disable=not show, leave=False)


def _run_cell(
    model: torch.nn.Module,
    job: _Job,
    ignore: Sequence[str],
    calibration: Sequence[dict[str, Any]],
    held_out: HeldOut,
) -> Cell:
    copy_ = copy.deepcopy(model)
    start = time.perf_counter()
    recipe = Recipe.from_scheme(
        job.scheme,
        ignore=list(ignore),
        weight_observer=job.resolved.weight,
        input_observer=job.resolved.input,
    )
    attach(copy_, recipe)
    calibrate(copy_, calibration, progress=False)
    calibrated = time.perf_counter()
    evaluation = evaluate(copy_, held_out)
    ranges = input_ranges(copy_)
    return Cell(
        scheme=job.scheme,
        observer=job.row,
        weight_observer=job.resolved.weight,
        input_observer=job.resolved.input,
        cosine_mean=evaluation.cosine_mean,
        cosine_worst=evaluation.cosine_worst,
        neighbours=evaluation.neighbours,
        spearman=evaluation.spearman,
        weight_sqnr=evaluation.weight_sqnr,
        input_sqnr=evaluation.input_sqnr,
        input_ranges=ranges,
        calibration_seconds=calibrated - start,
        evaluation_seconds=time.perf_counter() - calibrated,
    )


def _worst_layer(cells: Sequence[Cell]) -> tuple[str, str] | None:
    """`(scheme, layer)`: among the schemes with static input ranges, the
    layer whose input SQNR is lowest under the scheme's first row."""
    for cell in cells:
        candidates = {
            k: v for k, v in cell.input_sqnr.items() if k in cell.input_ranges
        }
        if candidates:
            return cell.scheme, min(candidates, key=candidates.__getitem__)
    return None


def _layer_inputs(
    model: torch.nn.Module, layer: str, batches: Sequence[dict[str, Any]]
) -> torch.Tensor:
    """The unquantized model's inputs of `layer` on `batches`, flattened."""
    seen: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
        seen.append(inputs[0].detach().reshape(-1).float().cpu())

    handle = model.get_submodule(layer).register_forward_pre_hook(hook)
    try:
        embed(model, batches)
    finally:
        handle.remove()
    return torch.cat(seen)


def _histogram(
    model: torch.nn.Module, cells: Sequence[Cell], held_out: HeldOut
) -> LayerHistogram | None:
    found = _worst_layer(cells)
    if found is None:
        return None
    scheme, layer = found
    values = _layer_inputs(model, layer, held_out.batches)
    ranges = {
        cell.observer: cell.input_ranges[layer]
        for cell in cells
        if cell.scheme == scheme and layer in cell.input_ranges
    }
    low = min([float(values.min()), *(r[0] for r in ranges.values())])
    high = max([float(values.max()), *(r[1] for r in ranges.values())])
    counts = torch.histc(values.double(), bins=_PLOT_BINS, min=low, max=high)
    edges = torch.linspace(low, high, _PLOT_BINS + 1, dtype=torch.float64)
    return LayerHistogram(
        scheme=scheme,
        layer=layer,
        edges=edges.tolist(),
        counts=[int(c) for c in counts.tolist()],
        ranges=ranges,
    )


def compare(
    model: torch.nn.Module,
    tokenizer: Any,
    calibration_texts: Sequence[str],
    heldout_texts: Sequence[str],
    *,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    observers: Sequence[str] = DEFAULT_OBSERVERS,
    ignore: Sequence[str] = (),
    batch_size: int = 16,
    max_length: int = 128,
    model_name: str = "",
    progress: bool | None = None,
    on_cell: Callable[[Cell], None] | None = None,
) -> Comparison:
    """Calibrate and evaluate `model` under each scheme x observer row.

    The model itself is never modified: each cell calibrates a deep copy.

    Args:
        model: an unquantized transformers base model (`AutoModel`).
        tokenizer: its tokenizer.
        calibration_texts: the texts observed during calibration.
        heldout_texts: the texts the metrics are computed on (at least 3).
        schemes: preset scheme names.
        observers: row names (`ROWS`) or registered observer names.
        ignore: module names or `re:` expressions left unquantized.
        batch_size: texts per batch.
        max_length: tokens per text (truncated).
        model_name: the model's name or directory, for the report.
        progress: a progress bar over the cells (None: when stderr is a
            terminal).
        on_cell: called with each cell as soon as it is measured.

    Returns:
        The `Comparison`.

    Raises:
        ValueError: fewer than 3 held-out texts, no texts, or a scheme the
            model's layers cannot take (from `attach`, naming the layers).
    """
    start = time.perf_counter()
    calibration = text_batches(
        tokenizer, calibration_texts, batch_size=batch_size, max_length=max_length
    )
    held_out = HeldOut.of(
        model,
        text_batches(
            tokenizer, heldout_texts, batch_size=batch_size, max_length=max_length
        ),
    )
    jobs, skipped = _plan(schemes, observers)
    result = Comparison(
        model=model_name,
        schemes=list(schemes),
        observers=list(observers),
        calibration_texts=len(calibration_texts),
        heldout_texts=len(heldout_texts),
        skipped=skipped,
    )
    bar = _progress(jobs, progress)
    for job in bar:
        bar.set_postfix_str(f"{job.scheme} x {job.row}")
        cell = _run_cell(model, job, ignore, calibration, held_out)
        result.cells.append(cell)
        if on_cell is not None:
            on_cell(cell)
    result.histogram = _histogram(model, result.cells, held_out)
    result.seconds = time.perf_counter() - start
    return result
