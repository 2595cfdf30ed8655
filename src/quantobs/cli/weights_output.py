"""`quantobs weights`' report as text: an aligned table, JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import math

from quantobs.cli.weights_report import WeightsReport

__all__ = [
    "CSV_COLUMNS",
    "TABLE_COLUMNS",
    "format_csv",
    "format_json",
    "format_table",
    "summary_line",
    "table_rows",
]


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "x".join(str(size) for size in shape)


def _float_text(value: float | None, digits: int) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}f}" if digits >= 0 else f"{value:.3e}"


def summary_line(report: WeightsReport) -> str:
    """One line: layers, skipped, params, mean and min SQNR, elapsed seconds."""
    summary = report.summary()
    skipped = f", {summary['skipped']} skipped" if summary["skipped"] else ""
    return (
        f"{summary['layers']} layers{skipped}, {summary['params']:,} params, "
        f"SQNR mean {_float_text(summary['mean_sqnr_db'], 2)} dB, "
        f"min {_float_text(summary['min_sqnr_db'], 2)} dB, "
        f"{summary['elapsed_s']:.2f} s"
    )


TABLE_COLUMNS: tuple[str, ...] = ("layer", "shape", "scale", "SQNR dB", "max |err|")


def table_rows(report: WeightsReport) -> list[tuple[str, ...]]:
    """The table's cells, one tuple per layer (`TABLE_COLUMNS`)."""
    rows: list[tuple[str, ...]] = []
    for layer in report.layers:
        if layer.skipped is not None:
            rows.append(
                (layer.name, _shape_text(layer.shape), "-", "skipped", layer.skipped)
            )
        else:
            rows.append(
                (
                    layer.name,
                    _shape_text(layer.shape),
                    _shape_text(layer.scale_shape),
                    _float_text(layer.sqnr_db, 2),
                    _float_text(layer.max_abs_error, -1),
                )
            )
    return rows


def format_table(report: WeightsReport) -> str:
    """Plain aligned text: a header, one row per layer, a summary line."""
    rows = [TABLE_COLUMNS, *table_rows(report)]
    # Left-align text columns, right-align numbers; the skip reason (last
    # cell of a skipped row) is free text and is not padded.
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS) - 1)]
    lines = [f"model  {report.model}", f"scheme {report.scheme} (weights)", ""]
    for row in rows:
        cells = [
            row[0].ljust(widths[0]),
            row[1].rjust(widths[1]),
            row[2].rjust(widths[2]),
            row[3].rjust(widths[3]),
            row[4],
        ]
        lines.append("  ".join(cells).rstrip())
    lines += ["", summary_line(report)]
    return "\n".join(lines) + "\n"


def _json_float(value: float | int | None) -> float | int | str | None:
    # JSON has no inf/nan: written as the strings "inf", "-inf", "nan".
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def format_json(report: WeightsReport) -> str:
    """The report as a JSON document (non-finite numbers as strings)."""
    document = {
        "model": report.model,
        "scheme": report.scheme,
        "weight_args": report.args,
        "layers": [
            {
                "name": layer.name,
                "shape": list(layer.shape),
                "dtype": layer.dtype,
                "scale_shape": None
                if layer.scale_shape is None
                else list(layer.scale_shape),
                "sqnr_db": _json_float(layer.sqnr_db),
                "max_abs_error": _json_float(layer.max_abs_error),
                "skipped": layer.skipped,
            }
            for layer in report.layers
        ],
        "summary": {key: _json_float(value) for key, value in report.summary().items()},
    }
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


CSV_COLUMNS: tuple[str, ...] = (
    "name",
    "shape",
    "dtype",
    "scale_shape",
    "sqnr_db",
    "max_abs_error",
    "skipped",
)


def format_csv(report: WeightsReport) -> str:
    """One CSV row per layer (`CSV_COLUMNS`); shapes as `rowsxcols`."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for layer in report.layers:
        writer.writerow(
            (
                layer.name,
                _shape_text(layer.shape),
                layer.dtype,
                "" if layer.scale_shape is None else _shape_text(layer.scale_shape),
                "" if layer.sqnr_db is None else repr(layer.sqnr_db),
                "" if layer.max_abs_error is None else repr(layer.max_abs_error),
                layer.skipped or "",
            )
        )
    return buffer.getvalue()
