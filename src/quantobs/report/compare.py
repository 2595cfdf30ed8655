"""`quantobs compare`: which scheme and which observer for a model.

For each scheme and each observer row, a fresh copy of the model is
calibrated on the calibration texts and evaluated on the held-out texts
against the unquantized model (`quantobs.report.evaluate`). A row names
what the user chooses; `resolve_row` turns it into the observers that run
on the weights and on the static inputs under one scheme:

==================  ==========================  ==========================
row                 weights                     static inputs
==================  ==========================  ==========================
minmax              memoryless_minmax           static_minmax
mse                 memoryless_mse              mse (moving-average MSE)
mse_refine          memoryless_mse, search=     mse
                    "refine"
mse_fine            memoryless_mse, search=     mse
                    "fine"
mse_independent     memoryless_mse,             mse
                    independent_bounds=True
mse_discrete        memoryless_mse,             mse
                    scale_search="discrete"
static_mse          memoryless_mse              static_mse
histogram           histogram *                 histogram
percentile          percentile *                percentile
entropy             entropy *                   entropy
imatrix             imatrix_mse **              static_minmax
any other name      that observer *             that observer
==================  ==========================  ==========================

The `mse_*` rows are llm-compressor's MSE search with one of quantobs'
options turned on for the weights (`quantobs.observers.mse.MSEOptions`); the
inputs keep the `mse` row's observer, so each differs from `mse` by the
weight search alone. A row whose options the scheme's args cannot take
(`independent_bounds` needs asymmetric weights, `scale_search="discrete"`
NVFP4 or MX ones) is skipped with the reason the observer gives.
\\* Histogram-family observers (histogram, histogram_mse, percentile,
entropy) run on weights per tensor, per channel and per group, with
`"auto"` bins and batched searches, when each qparam holds at least
`MIN_HISTOGRAM_VALUES` (64) weights. Smaller groups (NVFP4's 16, MX's 32)
have no distribution to search, and tens of thousands of them cost seconds
per cell for a range that is the group's min-max anyway: those weights keep
memoryless_minmax (the inputs still run the row's observer).
\\** imatrix weighs the weight error by the inputs' importance per channel:
it needs per-channel or per-group weights, and the row is skipped for
per-tensor weights.

A row whose observers are those of an earlier row under the scheme (e.g.
`static_mse` and `mse` for W4A16, which quantizes no input) is not run
again: it is listed as skipped with the reason.

Warnings an observer gives while a cell calibrates (e.g.
`quantobs.ObjectiveFitWarning`: entropy or percentile on a float format)
are kept in the cell's `notes`, once each, and shown as footnotes.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from quantobs.calibration import Recipe, attach, calibrate, text_batches
from quantobs.calibration.transposed import linear_targets
from quantobs.core.args import QuantizationArgs
from quantobs.core.peer_versions import COMPARE_TASK, check_fp6_schemes
from quantobs.core.presets import preset_scheme
from quantobs.observers.base import Observer
from quantobs.observers.fit import ObjectiveFitWarning
from quantobs.report.causal import perplexity
from quantobs.report.evaluate import HeldOut, embed, evaluate, input_ranges
from quantobs.report.results import Cell, Comparison, LayerHistogram, Skipped
from quantobs.report.tasks import CAUSAL_LM

__all__ = [
    "DEFAULT_OBSERVERS",
    "DEFAULT_SCHEMES",
    "QUICK_OBSERVERS",
    "QUICK_SCHEMES",
    "ROWS",
    "ObserverSpec",
    "Resolved",
    "compare",
    "resolve_row",
    "spec_text",
]

DEFAULT_SCHEMES = ("W8A8", "W4A16", "FP8", "NVFP4", "MXFP4")
DEFAULT_OBSERVERS = (
    "minmax",
    "mse",
    "mse_refine",
    "mse_discrete",
    "static_mse",
    "histogram",
    "percentile",
    "entropy",
    "imatrix",
)
QUICK_SCHEMES = ("W4A16", "FP8", "NVFP4")
QUICK_OBSERVERS = ("minmax", "mse", "percentile", "imatrix")

#: An observer of a row: its registered name, or `(name, options)`.
ObserverSpec = str | tuple[str, dict[str, Any]]

#: `{row: (weight observer, input observer)}` for the named rows.
ROWS: dict[str, tuple[ObserverSpec, str]] = {
    "minmax": ("memoryless_minmax", "static_minmax"),
    "mse": ("memoryless_mse", "mse"),
    "mse_refine": (("memoryless_mse", {"search": "refine"}), "mse"),
    "mse_fine": (("memoryless_mse", {"search": "fine"}), "mse"),
    "mse_independent": (("memoryless_mse", {"independent_bounds": True}), "mse"),
    "mse_discrete": (("memoryless_mse", {"scale_search": "discrete"}), "mse"),
    "static_mse": ("memoryless_mse", "static_mse"),
    "histogram": ("histogram", "histogram"),
    "percentile": ("percentile", "percentile"),
    "entropy": ("entropy", "entropy"),
    "imatrix": ("imatrix_mse", "static_minmax"),
}
HISTOGRAM_FAMILY = frozenset({"histogram", "histogram_mse", "percentile", "entropy"})
#: the fewest weights per qparam a histogram-family weight observer runs on
MIN_HISTOGRAM_VALUES = 64
_IMPORTANCE = frozenset({"imatrix_mse", "nvfp4_expanded_imatrix"})
#: the bins of the worst layer's histogram plot
_PLOT_BINS = 120


def spec_text(spec: ObserverSpec) -> str:
    """An observer as the report shows it: `"memoryless_mse"`, or with its
    options, `"memoryless_mse(search=refine)"`."""
    if isinstance(spec, str):
        return spec
    name, options = spec
    shown = ", ".join(f"{key}={value}" for key, value in options.items())
    return f"{name}({shown})"


@dataclass(frozen=True)
class Resolved:
    """The observers a row runs under one scheme.

    Attributes:
        weight: the weight observer's registered name.
        input: the static input observer's name; None when the scheme
            quantizes no input statically.
        weight_options: the weight observer's options, as sorted
            `(key, value)` pairs (hashable: rows with equal observers and
            options are the same).
    """

    weight: str
    input: str | None
    weight_options: tuple[tuple[str, Any], ...] = ()

    @property
    def weight_spec(self) -> ObserverSpec:
        """The weight observer for a `Recipe`: a name or `(name, options)`."""
        if not self.weight_options:
            return self.weight
        return self.weight, dict(self.weight_options)


def _static_inputs(scheme: str) -> QuantizationArgs | None:
    args = preset_scheme(scheme).input_activations
    return None if args is None or args.dynamic is True else args


def _refusal(name: str, options: dict[str, Any], args: QuantizationArgs) -> str | None:
    """Why observer `name` with `options` cannot calibrate weights under
    `args` (the observer's own `ValueError`), or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fit warnings come with the cell
        try:
            Observer.get_class(name)("weight", args, **options)
        except ValueError as error:
            return str(error).splitlines()[0]
    return None


def resolve_row(row: str, scheme: str) -> Resolved | str:
    """The observers of `row` under `scheme`, or the reason it does not apply."""
    weight_spec, inputs = ROWS.get(row, (row, row))
    name, options = (weight_spec, {}) if isinstance(weight_spec, str) else weight_spec
    weights = preset_scheme(scheme).weights
    if weights is None:
        return f"{scheme} quantizes no weights"
    if name in _IMPORTANCE and weights.strategy == "tensor":
        return f"{name} needs per-channel or per-group weights"
    small_groups = weights.strategy in ("group", "tensor_group") and (
        (weights.group_size or 0) < MIN_HISTOGRAM_VALUES
    )
    if name in HISTOGRAM_FAMILY and small_groups:
        name, options = "memoryless_minmax", {}
    if options and (refused := _refusal(name, options, weights)) is not None:
        return f"{spec_text(weight_spec)}: {refused}"
    static = _static_inputs(scheme)
    return Resolved(
        weight=name,
        input=None if static is None else inputs,
        weight_options=tuple(sorted(options.items())),
    )


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


#: the registry of the warnings `_observer_notes` gives on (shown once each)
_GIVEN_ON: dict[Any, Any] = {}


@contextmanager
def _observer_notes() -> Iterator[list[str]]:
    """Collect the `ObjectiveFitWarning`s given inside, each message once,
    in order; any other warning is given on, once per message and place, also
    when the body raises."""
    notes: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield notes
    finally:
        for record in caught:
            message = str(record.message)
            if not issubclass(record.category, ObjectiveFitWarning):
                warnings.warn_explicit(
                    record.message,
                    record.category,
                    record.filename,
                    record.lineno,
                    registry=_GIVEN_ON,
                )
            elif message not in notes:
                notes.append(message)


def _run_cell(
    model: torch.nn.Module,
    job: _Job,
    ignore: Sequence[str],
    calibration: Sequence[dict[str, Any]],
    held_out: HeldOut,
    kv_cache_scheme: QuantizationArgs | None = None,
) -> Cell:
    cell_model = copy.deepcopy(model)
    start = time.perf_counter()
    recipe = Recipe.from_scheme(
        job.scheme,
        targets=linear_targets(model),  # GPT-2's Conv1D layers too
        ignore=list(ignore),
        weight_observer=job.resolved.weight_spec,
        input_observer=job.resolved.input,
        kv_cache_scheme=kv_cache_scheme,
    )
    with _observer_notes() as notes:
        attach(cell_model, recipe)
        calibrate(cell_model, calibration, progress=False)
    calibrated = time.perf_counter()
    evaluation = evaluate(cell_model, held_out)
    ranges = input_ranges(cell_model)
    return Cell(
        scheme=job.scheme,
        observer=job.row,
        weight_observer=spec_text(job.resolved.weight_spec),
        input_observer=job.resolved.input,
        cosine_mean=evaluation.cosine_mean,
        cosine_worst=evaluation.cosine_worst,
        neighbours=evaluation.neighbours,
        spearman=evaluation.spearman,
        kl_divergence=evaluation.kl_divergence,
        token_agreement=evaluation.token_agreement,
        perplexity=evaluation.perplexity,
        weight_sqnr=evaluation.weight_sqnr,
        input_sqnr=evaluation.input_sqnr,
        input_ranges=ranges,
        calibration_seconds=calibrated - start,
        evaluation_seconds=time.perf_counter() - calibrated,
        notes=tuple(notes),
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
    kv_cache_scheme: QuantizationArgs | None = None,
) -> Comparison:
    """Calibrate and evaluate `model` under each scheme x observer row.

    The model itself is never modified: each cell calibrates a deep copy.
    Everything runs in eval mode (no dropout in the reference or the
    cells); a model given in train mode is put back in it at the end.

    Args:
        model: an unquantized transformers model: a causal LM (scored by
            its next-token predictions) or any other (scored by its
            mean-pooled hidden states); see `quantobs.report.tasks`.
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
        kv_cache_scheme: args of the attention's k / v states, the same in
            every cell (their observer: the args', by default static_minmax).

    Returns:
        The `Comparison`.

    Raises:
        ValueError: fewer than 3 held-out texts, no texts, a scheme the
            model's layers cannot take (from `attach`, naming the layers), or
            an FP6 one without compressed-tensors >= 0.20 (`check_fp6`).
    """
    check_fp6_schemes(schemes, kv_cache_scheme, COMPARE_TASK)
    training = model.training
    model.eval()
    try:
        return _compare(
            model,
            tokenizer,
            calibration_texts,
            heldout_texts,
            schemes=schemes,
            observers=observers,
            ignore=ignore,
            batch_size=batch_size,
            max_length=max_length,
            model_name=model_name,
            progress=progress,
            on_cell=on_cell,
            kv_cache_scheme=kv_cache_scheme,
        )
    finally:
        model.train(training)


def _compare(
    model: torch.nn.Module,
    tokenizer: Any,
    calibration_texts: Sequence[str],
    heldout_texts: Sequence[str],
    *,
    schemes: Sequence[str],
    observers: Sequence[str],
    ignore: Sequence[str],
    batch_size: int,
    max_length: int,
    model_name: str,
    progress: bool | None,
    on_cell: Callable[[Cell], None] | None,
    kv_cache_scheme: QuantizationArgs | None,
) -> Comparison:
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
        task=held_out.task,
    )
    bar = _progress(jobs, progress)
    for job in bar:
        bar.set_postfix_str(f"{job.scheme} x {job.row}")
        cell = _run_cell(model, job, ignore, calibration, held_out, kv_cache_scheme)
        result.cells.append(cell)
        if on_cell is not None:
            on_cell(cell)
    result.histogram = _histogram(model, result.cells, held_out)
    if held_out.task == CAUSAL_LM and held_out.targets is not None:
        result.reference_perplexity = perplexity(held_out.reference, held_out.targets)
    result.seconds = time.perf_counter() - start
    return result
