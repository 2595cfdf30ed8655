"""The results of `quantobs compare` as text: tables, verdicts, JSON, CSV.

Pure functions of a `Comparison` (`report/results.py`). The table has one
row per observer and these columns (`COLUMNS`), higher is better except the
calibration time:

==============  ===========================  ==========  =========
title           `Cell` attribute             shown as    best
==============  ===========================  ==========  =========
cos mean        `cosine_mean`                0.0000      highest
cos worst       `cosine_worst`               0.0000      highest
top-1 agree     `neighbours`                 0.00        highest
spearman        `spearman`                   0.0000      highest
weight SQNR dB  `mean_weight_sqnr`           0.0, inf    highest
input SQNR dB   `mean_input_sqnr`            0.0, "—"    highest
calib s         `calibration_seconds`        0.00        lowest
==============  ===========================  ==========  =========

For a causal LM (`Comparison.task == "causal_lm"`) the four embedding
columns are replaced by the causal ones (`quantobs.report.tasks`):

==============  ===========================  ==========  =========
KL nats         `kl_divergence`              0.0000      lowest
top-1 token     `token_agreement`            0.000       highest
perplexity      `perplexity`                 0.00        lowest
==============  ===========================  ==========  =========

A value that is None ("—": the metric does not apply) or NaN takes no part in
the best; equal best values are all marked. The verdict recommends, per
scheme, the observer best in the task's main metric (highest cos mean;
lowest next-token KL for a causal LM) unless it beats the baseline
(`BASELINE_OBSERVER`, the cheapest) by less than the task's threshold
(`VERDICT_THRESHOLDS`: 0.001 in cos mean, 0.001 nats of KL).

(Over 500 lines: the encoder and causal-LM tables share every renderer.)
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from quantobs.report.results import QUALITY_METRICS, Cell, Comparison
from quantobs.report.tasks import (
    CAUSAL_LM,
    EMBEDDING,
    Metric,
    main_metric,
    quality_metrics,
)

__all__ = [
    "BASELINE_OBSERVER",
    "BEST_MARK",
    "CAUSAL_METRIC_DEFINITIONS",
    "COLUMNS",
    "CSV_COLUMNS",
    "METRIC_DEFINITIONS",
    "VERDICT_THRESHOLD",
    "VERDICT_THRESHOLDS",
    "Column",
    "best_cells",
    "columns",
    "csv_columns",
    "footnotes",
    "format_number",
    "metric_definitions",
    "note_marks",
    "observers_run",
    "reference_line",
    "render_table",
    "scheme_order",
    "to_csv",
    "to_json",
    "verdict",
]

#: The row a verdict compares against: min-max is the cheapest observer.
BASELINE_OBSERVER = "minmax"

#: A gain in cos mean over the baseline smaller than this (an absolute
#: difference of cosines) does not pay for a slower observer: the verdict
#: then keeps the baseline.
VERDICT_THRESHOLD = 0.001

#: The same per task: a gain in its main metric (cos mean; for a causal LM
#: the drop of the next-token KL divergence, in nats) below this keeps the
#: baseline.
VERDICT_THRESHOLDS = {EMBEDDING: VERDICT_THRESHOLD, CAUSAL_LM: 0.001}

#: The mark after a best value, so that it survives plain text.
BEST_MARK = "*"


@dataclass(frozen=True)
class Column:
    """One numeric column of the comparison table.

    Attributes:
        key: the `Cell` attribute (or property) shown.
        title: the column's heading.
        decimals: digits after the point.
        lower_is_better: the best value is the smallest (times).
    """

    key: str
    title: str
    decimals: int
    lower_is_better: bool = False

    def value(self, cell: Cell) -> float | None:
        """The cell's value in this column (None: does not apply)."""
        value: float | None = getattr(cell, self.key)
        return value

    def text(self, cell: Cell) -> str:
        """The cell's value as the table shows it (without the best mark)."""
        return format_number(self.value(cell), self.decimals)


def _column(metric: Metric) -> Column:
    return Column(metric.key, metric.title, metric.decimals, metric.lower_is_better)


def columns(task: str) -> tuple[Column, ...]:
    """The table's numeric columns for a model of `task`, in order: its
    quality metrics, then the SQNRs and the calibration time."""
    return (
        *(_column(metric) for metric in quality_metrics(task)),
        Column("mean_weight_sqnr", "weight SQNR dB", 1),
        Column("mean_input_sqnr", "input SQNR dB", 1),
        Column("calibration_seconds", "calib s", 2, lower_is_better=True),
    )


#: The table's numeric columns for an embedding model, in order.
COLUMNS: tuple[Column, ...] = columns(EMBEDDING)

#: Column title -> what it measures (the report's definitions, the CLI's help).
METRIC_DEFINITIONS: dict[str, str] = {
    "cos mean": (
        "Mean, over the held-out sentences, of the cosine similarity between "
        "the quantized model's sentence embedding and the unquantized "
        "model's; 1 means the same direction."
    ),
    "cos worst": (
        "The smallest of those per-sentence cosines: the held-out sentence "
        "that quantization distorts most."
    ),
    "top-1 agree": (
        "Fraction of held-out sentences whose nearest other sentence (highest "
        "cosine similarity) is the same under the quantized and the "
        "unquantized model; 1 means retrieval returns what the unquantized "
        "model returns."
    ),
    "spearman": (
        "Spearman rank correlation between the cosine similarities of every "
        "pair of held-out sentences under the quantized model and under the "
        "unquantized model; 1 means every pair is ranked the same."
    ),
    "weight SQNR dB": (
        "Signal-to-quantization-noise ratio of each quantized weight w and "
        "its quantized value q, 10*log10(sum w^2 / sum (w - q)^2) in dB, "
        "averaged over the quantized layers; about 6 dB per bit of precision. "
        "A layer represented exactly scores inf, and so then does the mean."
    ),
    "input SQNR dB": (
        "The same ratio for the input activations of each quantized layer, "
        "measured on the held-out sentences and averaged over layers; — when "
        "the scheme quantizes no input."
    ),
    "calib s": (
        "Wall-clock seconds spent observing the calibration texts and "
        "computing the qparams (the held-out evaluation is not included); "
        "lower is better."
    ),
}

#: Column title -> what it measures, for causal LMs' quality columns (the
#: SQNR and time columns are defined in `METRIC_DEFINITIONS`).
CAUSAL_METRIC_DEFINITIONS: dict[str, str] = {
    "KL nats": (
        "Mean, over the held-out positions whose next token is real (padding "
        "excluded), of the KL divergence of the quantized model's next-token "
        "distribution from the unquantized model's, sum p log(p / q) in nats; "
        "0 means the same predictions; lower is better."
    ),
    "top-1 token": (
        "Fraction of those positions where the quantized model's most likely "
        "next token is the unquantized model's."
    ),
    "perplexity": (
        "The quantized model's perplexity on the held-out texts, exp of the "
        "mean negative log-likelihood of each next token; lower is better. "
        "The unquantized model's is printed beside the tables."
    ),
}


def metric_definitions(task: str) -> dict[str, str]:
    """Column title -> definition for the columns of `task`'s table."""
    if task != CAUSAL_LM:
        return dict(METRIC_DEFINITIONS)
    kept = {
        title: text
        for title, text in METRIC_DEFINITIONS.items()
        if title not in dict(QUALITY_METRICS).values()
    }
    return {**CAUSAL_METRIC_DEFINITIONS, **kept}


def csv_columns(task: str) -> tuple[str, ...]:
    """The CSV's columns for a model of `task`: one row per cell."""
    return (
        "scheme",
        "observer",
        "weight_observer",
        "input_observer",
        *(metric.key for metric in quality_metrics(task)),
        "mean_weight_sqnr",
        "mean_input_sqnr",
        "calibration_seconds",
        "evaluation_seconds",
        "notes",
    )


#: The CSV's columns for an embedding model: one row per cell.
CSV_COLUMNS: tuple[str, ...] = csv_columns(EMBEDDING)


def format_number(value: float | None, decimals: int) -> str:
    """`value` with `decimals` digits; "—" for None, "inf" / "-inf" / "nan"
    for the non-finite."""
    if value is None:
        return "—"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{decimals}f}"


def observers_run(cell: Cell) -> str:
    """The observers that actually ran, `"weights / inputs"` ("—": no
    static input observer)."""
    return f"{cell.weight_observer} / {cell.input_observer or '—'}"


def footnotes(comparison: Comparison, scheme: str) -> list[str]:
    """The distinct notes of `scheme`'s cells, in row order; footnote `k`
    is `footnotes(...)[k - 1]`."""
    found = [note for cell in comparison.cells_of(scheme) for note in cell.notes]
    return list(dict.fromkeys(found))


def note_marks(cell: Cell, notes: list[str]) -> str:
    """The footnote marks after a cell's observer, e.g. `" [1]"` ("" if none)."""
    return "".join(f" [{notes.index(note) + 1}]" for note in cell.notes)


def scheme_order(comparison: Comparison) -> list[str]:
    """The schemes asked, then any other scheme a cell or skipped row
    names, each once."""
    names = [
        *comparison.schemes,
        *(cell.scheme for cell in comparison.cells),
        *(row.scheme for row in comparison.skipped),
    ]
    return list(dict.fromkeys(names))


def _best_of(cells: list[Cell], column: Column) -> set[str]:
    """The observers whose value in `column` is the best (None and NaN
    ignored; ties all kept)."""
    values = {}
    for cell in cells:
        value = column.value(cell)
        if value is not None and not math.isnan(value):
            values[cell.observer] = value
    if not values:
        return set()
    best = min(values.values()) if column.lower_is_better else max(values.values())
    return {observer for observer, value in values.items() if value == best}


def best_cells(comparison: Comparison, scheme: str) -> dict[str, set[str]]:
    """The best observer(s) of each column of `scheme`'s table.

    Args:
        comparison: the results.
        scheme: the scheme's name.

    Returns:
        `{column key: observers}` for every column of `columns(task)` (an
        embedding model's four `QUALITY_METRICS` attributes,
        `"mean_weight_sqnr"`, `"mean_input_sqnr"`: highest;
        `"calibration_seconds"`: lowest; a causal LM's `kl_divergence` and
        `perplexity`: lowest, `token_agreement`: highest). Equal best values
        are all included; a column with no value (no cell, or all None) maps
        to the empty set.
    """
    cells = comparison.cells_of(scheme)
    return {column.key: _best_of(cells, column) for column in columns(comparison.task)}


def _skipped_summary(comparison: Comparison, scheme: str) -> str:
    rows = [row for row in comparison.skipped if row.scheme == scheme]
    if not rows:
        return "no result was recorded for this scheme"
    reasons = {row.reason for row in rows}
    if len(reasons) == 1:
        return f"every row was skipped ({reasons.pop()})"
    return "; ".join(f"{row.observer}: {row.reason}" for row in rows)


def _gain_text(gain: float, metric: Metric) -> str:
    """A positive gain in `metric` to 4 decimals, signed as the metric moves
    (+ for cos mean, - for KL), never a misleading "+0.0000"."""
    sign = "-" if metric.lower_is_better else "+"
    return f"{sign}{gain:.4f}" if gain >= 0.00005 else f"{sign}<0.0001"


def _time_difference(seconds: float) -> str:
    if abs(seconds) < 0.05:
        return "about the same calibration time"
    more_or_less = "more" if seconds > 0 else "less"
    return f"{abs(seconds):.1f} s {more_or_less} calibration"


#: the metric a verdict quotes beside the main one (one per task)
_ALSO = ("neighbours", "token_agreement")

#: how a verdict names a metric (default: its column title)
_SAID = {
    "neighbours": "top-1 agreement",
    "kl_divergence": "KL",
    "token_agreement": "top-1 token agreement",
}


def _said(metric: Metric) -> str:
    return _SAID.get(metric.key, metric.title)


def _main_text(metric: Metric, value: float | None) -> str:
    text = format_number(value, metric.decimals)
    return f"{text} nats" if metric.key == "kl_divergence" else text


def _gain(cell: Cell, baseline: Cell, metric: Metric) -> float:
    """How much better `cell` is than `baseline` in `metric` (NaN: unknown)."""
    value, base = getattr(cell, metric.key), getattr(baseline, metric.key)
    if value is None or base is None:
        return math.nan
    return float(base - value) if metric.lower_is_better else float(value - base)


def _best_main(cells: list[Cell], metric: Metric) -> Cell:
    """The cell best in `metric` (the first in row order on a tie; None and
    NaN last)."""

    def badness(cell: Cell) -> float:
        value = getattr(cell, metric.key)
        if value is None or math.isnan(value):
            return math.inf
        return float(value) if metric.lower_is_better else -float(value)

    return min(cells, key=badness)


def verdict(comparison: Comparison, scheme: str) -> str:
    """One line recommending an observer for `scheme`.

    The best observer is the one best in the task's main metric
    (`quantobs.report.tasks.main_metric`: highest cos mean for an embedding
    model, lowest next-token KL for a causal LM; the first in row order on a
    tie). The baseline is the `BASELINE_OBSERVER` row when it ran, else the
    first row. If the best beats the baseline by less than the task's
    `VERDICT_THRESHOLDS`, the baseline (the cheaper) is kept.

    Args:
        comparison: the results.
        scheme: the scheme's name.

    Returns:
        The line, e.g. ``"W4A16: use mse — cos mean 0.9585 vs 0.9500 for
        minmax (+0.0085), top-1 agreement 0.93 vs 0.90, 0.3 s more
        calibration."``; a scheme with one cell or none says so (with the
        reasons its rows were skipped).
    """
    cells = comparison.cells_of(scheme)
    if not cells:
        return f"{scheme}: no observer ran — {_skipped_summary(comparison, scheme)}."
    metric = main_metric(comparison.task)
    second = next(m for m in quality_metrics(comparison.task) if m.key in _ALSO)
    if len(cells) == 1:
        (only,) = cells
        return (
            f"{scheme}: only {only.observer} ran — {_said(metric)} "
            f"{_main_text(metric, getattr(only, metric.key))}, {_said(second)} "
            f"{format_number(getattr(only, second.key), second.decimals)}; "
            "nothing to compare it with."
        )
    threshold = VERDICT_THRESHOLDS[comparison.task]
    baseline = next(
        (cell for cell in cells if cell.observer == BASELINE_OBSERVER), cells[0]
    )
    best = _best_main(cells, metric)
    gain = _gain(best, baseline, metric)
    if best is baseline or not gain >= threshold:
        unit = " nats" if metric.key == "kl_divergence" else ""
        line = (
            f"{scheme}: keep {baseline.observer} — no observer beats it by more "
            f"than {threshold:g}{unit} in {_said(metric)}"
        )
        if best is not baseline and gain > 0:
            line += f" (best: {best.observer}, {_gain_text(gain, metric)})"
        return line + "."
    seconds = best.calibration_seconds - baseline.calibration_seconds
    return (
        f"{scheme}: use {best.observer} — {_said(metric)} "
        f"{_main_text(metric, getattr(best, metric.key))} vs "
        f"{_main_text(metric, getattr(baseline, metric.key))} for "
        f"{baseline.observer} ({_gain_text(gain, metric)}), {_said(second)} "
        f"{format_number(getattr(best, second.key), second.decimals)} vs "
        f"{format_number(getattr(baseline, second.key), second.decimals)}, "
        f"{_time_difference(seconds)}."
    )


def _scheme_table(comparison: Comparison, scheme: str) -> Table:
    best = best_cells(comparison, scheme)
    notes = footnotes(comparison, scheme)
    table = Table(title=scheme, title_justify="left", caption_justify="left")
    table.add_column("observer", no_wrap=True)
    table.add_column("weights / inputs", style="dim", no_wrap=True)
    shown = columns(comparison.task)
    for column in shown:
        table.add_column(column.title, justify="right", no_wrap=True)
    for cell in comparison.cells_of(scheme):
        numbers = []
        for column in shown:
            if cell.observer in best[column.key]:
                numbers.append(Text(column.text(cell) + BEST_MARK, "bold green"))
            else:
                # A space where the mark would be keeps the digits aligned.
                numbers.append(Text(column.text(cell) + " "))
        label = cell.observer + note_marks(cell, notes)
        table.add_row(Text(label), Text(observers_run(cell)), *numbers)
    return table


def render_table(comparison: Comparison, console: Console) -> None:
    """Print one table per scheme, its verdict and its skipped rows.

    Observers are the rows; the best value of each column is bold green
    and followed by `*`; `[k]` after an observer points to its k-th
    footnote (a warning it gave, printed after the verdict). A scheme
    where no observer ran prints its title and the verdict saying why.

    Args:
        comparison: the results.
        console: where to print (`Console(record=True)` to export text).
    """
    for index, scheme in enumerate(scheme_order(comparison)):
        if index:
            console.print()
        if comparison.cells_of(scheme):
            console.print(_scheme_table(comparison, scheme))
        else:
            console.print(Text(scheme, style="italic"))
        console.print(Text(verdict(comparison, scheme)))
        for number, note in enumerate(footnotes(comparison, scheme), start=1):
            console.print(Text(f"  [{number}] {note}", style="dim"))
        for row in comparison.skipped:
            if row.scheme == scheme:
                console.print(
                    Text(f"  skipped {row.observer}: {row.reason}", style="dim")
                )
    if comparison.cells:
        console.print(Text(f"{BEST_MARK} best in its column", style="dim"))
    if (context := reference_line(comparison)) is not None:
        console.print(Text(context, style="dim"))


def reference_line(comparison: Comparison) -> str | None:
    """The unquantized causal LM's held-out perplexity, for context (None
    for other models)."""
    if comparison.reference_perplexity is None:
        return None
    return (
        "unquantized model: held-out perplexity "
        f"{format_number(comparison.reference_perplexity, 2)}"
    )


def to_json(comparison: Comparison) -> str:
    """The comparison as strict JSON (`Comparison.to_dict()`, indent 2):
    infinite SQNRs are the strings "inf" / "-inf", and no NaN or Infinity
    literal is ever written."""
    return json.dumps(comparison.to_dict(), indent=2, allow_nan=False) + "\n"


def _csv_field(value: str | float | tuple[str, ...] | None) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):  # notes
        return " | ".join(value)
    return repr(value)  # round-trips; "inf" for an exact tensor


def to_csv(comparison: Comparison) -> str:
    """One CSV row per cell (`csv_columns(comparison.task)`: `CSV_COLUMNS`
    for an embedding model); an empty field for None, floats written so that
    they read back exactly."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    keys = csv_columns(comparison.task)
    writer.writerow(keys)
    for cell in comparison.cells:
        writer.writerow(_csv_field(getattr(cell, key)) for key in keys)
    return buffer.getvalue()
