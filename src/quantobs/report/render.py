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

A value that is None ("—": the metric does not apply) or NaN takes no part in
the best; equal best values are all marked. The verdict recommends, per
scheme, the observer of highest cos mean unless it beats the baseline
(`BASELINE_OBSERVER`, the cheapest) by less than `VERDICT_THRESHOLD`.
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

__all__ = [
    "BASELINE_OBSERVER",
    "BEST_MARK",
    "COLUMNS",
    "CSV_COLUMNS",
    "METRIC_DEFINITIONS",
    "VERDICT_THRESHOLD",
    "Column",
    "best_cells",
    "footnotes",
    "format_number",
    "note_marks",
    "observers_run",
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


_DECIMALS = {"cosine_mean": 4, "cosine_worst": 4, "neighbours": 2, "spearman": 4}

#: The table's numeric columns, in order.
COLUMNS: tuple[Column, ...] = (
    *(Column(key, title, _DECIMALS[key]) for key, title in QUALITY_METRICS),
    Column("mean_weight_sqnr", "weight SQNR dB", 1),
    Column("mean_input_sqnr", "input SQNR dB", 1),
    Column("calibration_seconds", "calib s", 2, lower_is_better=True),
)

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

#: The CSV's columns: one row per cell.
CSV_COLUMNS: tuple[str, ...] = (
    "scheme",
    "observer",
    "weight_observer",
    "input_observer",
    *(key for key, _ in QUALITY_METRICS),
    "mean_weight_sqnr",
    "mean_input_sqnr",
    "calibration_seconds",
    "evaluation_seconds",
    "notes",
)


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
        `{column key: observers}` for every column of `COLUMNS` (the four
        `QUALITY_METRICS` attributes, `"mean_weight_sqnr"`,
        `"mean_input_sqnr"`: highest; `"calibration_seconds"`: lowest).
        Equal best values are all included; a column with no value (no
        cell, or all None) maps to the empty set.
    """
    cells = comparison.cells_of(scheme)
    return {column.key: _best_of(cells, column) for column in COLUMNS}


def _skipped_summary(comparison: Comparison, scheme: str) -> str:
    rows = [row for row in comparison.skipped if row.scheme == scheme]
    if not rows:
        return "no result was recorded for this scheme"
    reasons = {row.reason for row in rows}
    if len(reasons) == 1:
        return f"every row was skipped ({reasons.pop()})"
    return "; ".join(f"{row.observer}: {row.reason}" for row in rows)


def _gain_text(gain: float) -> str:
    """A positive cos-mean gain to 4 decimals, never a misleading "+0.0000"."""
    return f"+{gain:.4f}" if gain >= 0.00005 else "+<0.0001"


def _time_difference(seconds: float) -> str:
    if abs(seconds) < 0.05:
        return "about the same calibration time"
    more_or_less = "more" if seconds > 0 else "less"
    return f"{abs(seconds):.1f} s {more_or_less} calibration"


def verdict(comparison: Comparison, scheme: str) -> str:
    """One line recommending an observer for `scheme`.

    The best observer is the one of highest cos mean (the first in row
    order on a tie). The baseline is the `BASELINE_OBSERVER` row when it
    ran, else the first row. If the best beats the baseline's cos mean by
    less than `VERDICT_THRESHOLD`, the baseline (the cheaper) is kept.

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
    if len(cells) == 1:
        (only,) = cells
        return (
            f"{scheme}: only {only.observer} ran — cos mean "
            f"{only.cosine_mean:.4f}, top-1 agreement {only.neighbours:.2f}; "
            "nothing to compare it with."
        )
    baseline = next(
        (cell for cell in cells if cell.observer == BASELINE_OBSERVER), cells[0]
    )
    best = max(cells, key=lambda cell: cell.cosine_mean)
    gain = best.cosine_mean - baseline.cosine_mean
    if best is baseline or gain < VERDICT_THRESHOLD:
        line = (
            f"{scheme}: keep {baseline.observer} — no observer beats it by more "
            f"than {VERDICT_THRESHOLD:g} in cos mean"
        )
        if best is not baseline and gain > 0:
            line += f" (best: {best.observer}, {_gain_text(gain)})"
        return line + "."
    return (
        f"{scheme}: use {best.observer} — cos mean {best.cosine_mean:.4f} vs "
        f"{baseline.cosine_mean:.4f} for {baseline.observer} ({_gain_text(gain)}), "
        f"top-1 agreement {best.neighbours:.2f} vs {baseline.neighbours:.2f}, "
        f"{_time_difference(best.calibration_seconds - baseline.calibration_seconds)}."
    )


def _scheme_table(comparison: Comparison, scheme: str) -> Table:
    best = best_cells(comparison, scheme)
    notes = footnotes(comparison, scheme)
    table = Table(title=scheme, title_justify="left", caption_justify="left")
    table.add_column("observer", no_wrap=True)
    table.add_column("weights / inputs", style="dim", no_wrap=True)
    for column in COLUMNS:
        table.add_column(column.title, justify="right", no_wrap=True)
    for cell in comparison.cells_of(scheme):
        numbers = []
        for column in COLUMNS:
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
    """One CSV row per cell (`CSV_COLUMNS`); an empty field for None,
    floats written so that they read back exactly."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for cell in comparison.cells:
        writer.writerow(_csv_field(getattr(cell, key)) for key in CSV_COLUMNS)
    return buffer.getvalue()
