"""The results of `quantobs compare`: plain data, JSON-ready.

A `Comparison` holds one `Cell` per (scheme, observer) that was calibrated
and evaluated, the rows that were not run with the reason (`Skipped`), and
for the plots the activation histogram of the worst layer with each
observer's chosen range (`LayerHistogram`). Every number is a Python float
or int; `Comparison.to_dict()` is what `--format json` prints. The
quality metrics of a cell are those of the model's task
(`quantobs.report.tasks`): the embedding ones (cos mean, ...) or the causal
LM ones (next-token KL, ...); the other task's are None.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from quantobs.report.tasks import EMBEDDING, EMBEDDING_METRICS

__all__ = [
    "QUALITY_METRICS",
    "Cell",
    "Comparison",
    "LayerHistogram",
    "Skipped",
]

#: The end-to-end metrics of an embedding model's cell, higher is better, in
#: table order: (attribute, column title). Every task's metrics, with their
#: direction: `quantobs.report.tasks.quality_metrics`.
QUALITY_METRICS = tuple((metric.key, metric.title) for metric in EMBEDDING_METRICS)


@dataclass(frozen=True)
class Cell:
    """One calibrated and evaluated (scheme, observer).

    Attributes:
        scheme: the preset scheme's name (`"W4A16"`).
        observer: the row's name as the user chose it (`"mse"`).
        weight_observer: the observer that ran on the weights.
        input_observer: the observer of the static input activations, or
            None when the scheme quantizes no input statically.
        cosine_mean: mean cosine similarity of the held-out sentence
            embeddings to the unquantized model's (None for a causal LM).
        cosine_worst: the smallest of those cosines.
        neighbours: fraction of held-out sentences whose nearest other
            sentence is the unquantized model's.
        spearman: Spearman correlation of all pairwise similarities.
        weight_sqnr: `{layer: dB}`, each quantized weight.
        input_sqnr: `{layer: dB}`, each quantized input on held-out data.
        input_ranges: `{layer: (low, high)}`, the range each static
            per-tensor input can represent under the calibrated qparams.
        calibration_seconds: observing the calibration set and computing
            the qparams.
        evaluation_seconds: the held-out forward passes and metrics.
        notes: the warnings the observers gave while calibrating (e.g.
            `quantobs.ObjectiveFitWarning`), each message once.
        kl_divergence: causal LMs: the mean next-token KL divergence of the
            quantized model from the unquantized one, in nats (lower is
            better); None for other models.
        token_agreement: causal LMs: the fraction of held-out positions
            whose most likely next token is the unquantized model's.
        perplexity: causal LMs: the quantized model's held-out perplexity.
    """

    scheme: str
    observer: str
    weight_observer: str
    input_observer: str | None
    cosine_mean: float | None
    cosine_worst: float | None
    neighbours: float | None
    spearman: float | None
    weight_sqnr: dict[str, float]
    input_sqnr: dict[str, float]
    input_ranges: dict[str, tuple[float, float]]
    calibration_seconds: float
    evaluation_seconds: float
    notes: tuple[str, ...] = ()
    kl_divergence: float | None = None
    token_agreement: float | None = None
    perplexity: float | None = None

    @property
    def mean_weight_sqnr(self) -> float | None:
        """The mean of the per-layer weight SQNRs (dB); None if no layer."""
        return _mean(self.weight_sqnr.values())

    @property
    def mean_input_sqnr(self) -> float | None:
        """The mean of the per-layer input SQNRs (dB); None when the scheme
        quantizes no input."""
        return _mean(self.input_sqnr.values())


@dataclass(frozen=True)
class Skipped:
    """A (scheme, observer) that was not run, and why (e.g. it would run
    exactly the observers of another row)."""

    scheme: str
    observer: str
    reason: str


@dataclass(frozen=True)
class LayerHistogram:
    """The held-out input values of one layer, binned, and the range each
    observer chose for it (the plot of the worst layer).

    Attributes:
        scheme: the scheme whose calibrations chose the ranges.
        layer: the module name.
        edges: `bins + 1` increasing bin edges.
        counts: `bins` counts of the unquantized model's input values.
        ranges: `{observer: (low, high)}`.
    """

    scheme: str
    layer: str
    edges: list[float]
    counts: list[int]
    ranges: dict[str, tuple[float, float]]


@dataclass
class Comparison:
    """Everything `quantobs compare` measured.

    Attributes:
        model: the model directory.
        schemes: the schemes in the order asked.
        observers: the observer rows in the order asked.
        calibration_texts: the number of calibration texts.
        heldout_texts: the number of held-out texts.
        cells: the (scheme, observer) results.
        skipped: the rows not run, with the reason.
        histogram: the worst layer's histogram, when a scheme has static
            per-tensor inputs.
        seconds: the whole comparison's wall time.
        task: the model's task, which names the quality metrics
            (`quantobs.report.tasks`: "embedding" or "causal_lm").
        reference_perplexity: causal LMs: the unquantized model's held-out
            perplexity, for context; None for other models.
    """

    model: str
    schemes: list[str]
    observers: list[str]
    calibration_texts: int
    heldout_texts: int
    cells: list[Cell] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    histogram: LayerHistogram | None = None
    seconds: float = 0.0
    task: str = EMBEDDING
    reference_perplexity: float | None = None

    def cells_of(self, scheme: str) -> list[Cell]:
        """The cells of `scheme`, in observer order."""
        return [cell for cell in self.cells if cell.scheme == scheme]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: infinite SQNRs (an exactly representable
        tensor) become the strings "inf" / "-inf"; a metric that does not
        apply is None."""
        data = dataclasses.asdict(self)
        for cell, raw in zip(self.cells, data["cells"], strict=True):
            raw["mean_weight_sqnr"] = cell.mean_weight_sqnr
            raw["mean_input_sqnr"] = cell.mean_input_sqnr
        result: dict[str, Any] = _json_floats(data)
        return result


def _mean(values: Any) -> float | None:
    numbers = [float(v) for v in values]
    return math.fsum(numbers) / len(numbers) if numbers else None


def _json_floats(value: Any) -> Any:
    """`value` with non-finite floats as strings (JSON has no inf or NaN);
    tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _json_floats(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_floats(item) for item in value]
    return value
