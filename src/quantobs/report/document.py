"""The results of `quantobs compare` as a report directory.

`write_report` writes the figures of `report/plots.py` as PNG files and one
document beside them: `report.html`, self-contained (the figures embedded as
base64 data URIs, inline CSS, no external reference), or `report.md` (the
figures referenced by relative path). Both hold the run's settings, the
verdicts, one table per scheme with the best values marked, the figures,
the metric definitions of the model's task (`render.metric_definitions`) and
the skipped rows.

Nothing is half-written: the files are written into a hidden directory
beside `out_dir`, which then takes its place by one rename. The outcomes:

=====================================  =======================================
`out_dir`                              result
=====================================  =======================================
missing                                created, whole, by one rename
an empty directory                     the report's files moved into it
not empty, `overwrite=False`           `FileExistsError`; nothing written
not empty, `overwrite=True`            the report's files replace those of
                                       the same name; other files are kept
a file (or a broken link)              `FileExistsError`; nothing written
any failure while writing              the error propagates; the hidden
                                       directory is removed; `out_dir`
                                       untouched
=====================================  =======================================
"""

from __future__ import annotations

import base64
import html
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import quantobs
from quantobs.report import plots
from quantobs.report.render import (
    BEST_MARK,
    best_cells,
    columns,
    footnotes,
    metric_definitions,
    note_marks,
    observers_run,
    scheme_order,
    verdict,
)
from quantobs.report.results import Comparison
from quantobs.report.tasks import main_metric

__all__ = ["REPORT_NAMES", "write_report"]

#: The document written for each format.
REPORT_NAMES = {"html": "report.html", "markdown": "report.md"}


@dataclass(frozen=True)
class _Figure:
    path: Path
    caption: str


def _write_figures(comparison: Comparison, directory: Path) -> list[_Figure]:
    """The figures that have something to show, written into `directory`.

    Looked up on the module at call time (`plots.plot_...`), so that a test
    can make one fail."""
    worst = comparison.histogram
    figures = [
        (
            plots.plot_layer_sqnr(comparison, directory / "layer_sqnr.png"),
            "Per-layer SQNR of each observer (weights; inputs where quantized).",
        ),
        (
            plots.plot_quality_vs_time(comparison, directory / "quality_vs_time.png"),
            f"{main_metric(comparison.task).title.capitalize()} against "
            "calibration time, one point per scheme and observer.",
        ),
        (
            plots.plot_worst_layer(comparison, directory / "worst_layer.png"),
            f"The worst layer ({worst.scheme}: {worst.layer}): its held-out "
            "inputs and the range each observer chose."
            if worst
            else "",
        ),
    ]
    return [_Figure(path, caption) for path, caption in figures if path is not None]


def _settings(comparison: Comparison) -> list[tuple[str, str]]:
    return [
        ("model", comparison.model),
        ("schemes", ", ".join(comparison.schemes)),
        ("observers", ", ".join(comparison.observers)),
        ("calibration texts", str(comparison.calibration_texts)),
        ("held-out texts", str(comparison.heldout_texts)),
        ("task", comparison.task),
        *(
            [("unquantized perplexity", f"{comparison.reference_perplexity:.2f}")]
            if comparison.reference_perplexity is not None
            else []
        ),
        ("total time", f"{comparison.seconds:.1f} s"),
        ("quantobs", quantobs.__version__),
    ]


def _table_rows(comparison: Comparison, scheme: str) -> list[list[tuple[str, bool]]]:
    """`scheme`'s table as text: per cell, (text, is best) for the observer,
    the observers run and each of `columns(comparison.task)`."""
    best = best_cells(comparison, scheme)
    notes = footnotes(comparison, scheme)
    rows = []
    for cell in comparison.cells_of(scheme):
        label = cell.observer + note_marks(cell, notes)
        row = [(label, False), (observers_run(cell), False)]
        row += [
            (column.text(cell), cell.observer in best[column.key])
            for column in columns(comparison.task)
        ]
        rows.append(row)
    return rows


def _headings(comparison: Comparison) -> list[str]:
    shown = columns(comparison.task)
    return ["observer", "weights / inputs", *(column.title for column in shown)]


# ---------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em;
       padding: 0 1em; color: #1f2328; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
th, td { border-bottom: 1px solid #d0d7de; padding: 0.25em 0.7em; }
th { text-align: left; background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.best { font-weight: bold; color: #1a7f37; }
td.dim, .skipped { color: #656d76; }
.verdict { font-weight: 600; }
figure { margin: 1.5em 0; }
img { max-width: 100%; height: auto; }
dt { font-weight: 600; }
dd { margin: 0 0 0.6em 1.5em; }
"""


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _html_table(comparison: Comparison, scheme: str) -> list[str]:
    lines = [
        "<table>",
        "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in _headings(comparison)) + "</tr>",
    ]
    for row in _table_rows(comparison, scheme):
        cells = [f"<td>{_e(row[0][0])}</td>", f'<td class="dim">{_e(row[1][0])}</td>']
        for text, is_best in row[2:]:
            if is_best:
                cells.append(f'<td class="num best">{_e(text + BEST_MARK)}</td>')
            else:
                cells.append(f'<td class="num">{_e(text)}</td>')
        lines.append("<tr>" + "".join(cells) + "</tr>")
    lines.append("</table>")
    return lines


def _html_scheme(comparison: Comparison, scheme: str) -> list[str]:
    lines = [f"<h3>{_e(scheme)}</h3>"]
    if comparison.cells_of(scheme):
        lines += _html_table(comparison, scheme)
    lines.append(f'<p class="verdict">{_e(verdict(comparison, scheme))}</p>')
    for number, note in enumerate(footnotes(comparison, scheme), start=1):
        lines.append(f'<p class="skipped">[{number}] {_e(note)}</p>')
    for row in comparison.skipped:
        if row.scheme == scheme:
            lines.append(
                f'<p class="skipped">skipped {_e(row.observer)}: {_e(row.reason)}</p>'
            )
    return lines


def _html_figure(figure: _Figure) -> list[str]:
    data = base64.b64encode(figure.path.read_bytes()).decode("ascii")
    return [
        "<figure>",
        f'<img src="data:image/png;base64,{data}" alt="{_e(figure.caption)}">',
        f"<figcaption>{_e(figure.caption)}</figcaption>",
        "</figure>",
    ]


def _html(comparison: Comparison, figures: list[_Figure]) -> str:
    schemes = scheme_order(comparison)
    lines = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>quantobs compare: {_e(comparison.model)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<h1>Observer comparison</h1>",
        "<h2>Settings</h2>",
        "<table>",
        *(
            f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>"
            for k, v in _settings(comparison)
        ),
        "</table>",
        "<h2>Verdicts</h2>",
        "<ul>",
        *(f"<li>{_e(verdict(comparison, scheme))}</li>" for scheme in schemes),
        "</ul>",
        "<h2>Results by scheme</h2>",
        f"<p>{_e(BEST_MARK)} and bold: the best value of its column.</p>",
    ]
    for scheme in schemes:
        lines += _html_scheme(comparison, scheme)
    if figures:
        lines.append("<h2>Figures</h2>")
        for figure in figures:
            lines += _html_figure(figure)
    lines += ["<h2>Metrics</h2>", "<dl>"]
    for title, definition in metric_definitions(comparison.task).items():
        lines += [f"<dt>{_e(title)}</dt>", f"<dd>{_e(definition)}</dd>"]
    lines += ["</dl>", "<h2>Skipped</h2>"]
    if comparison.skipped:
        lines.append("<ul>")
        lines += [
            f"<li>{_e(row.scheme)} / {_e(row.observer)}: {_e(row.reason)}</li>"
            for row in comparison.skipped
        ]
        lines.append("</ul>")
    else:
        lines.append("<p>Every (scheme, observer) ran.</p>")
    lines += ["</body>", "</html>", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- Markdown

_MARKDOWN_SPECIAL = "\\`*_[]<>|&#"


def _md(text: str) -> str:
    """`text` shown literally by Markdown (its special characters escaped)."""
    return "".join("\\" + char if char in _MARKDOWN_SPECIAL else char for char in text)


def _md_table(comparison: Comparison, scheme: str) -> list[str]:
    lines = [
        "| " + " | ".join(_md(h) for h in _headings(comparison)) + " |",
        "| --- | --- |" + " ---: |" * len(columns(comparison.task)),
    ]
    for row in _table_rows(comparison, scheme):
        texts = [_md(row[0][0]), _md(row[1][0])]
        texts += [
            f"**{_md(text + BEST_MARK)}**" if is_best else _md(text)
            for text, is_best in row[2:]
        ]
        lines.append("| " + " | ".join(texts) + " |")
    return lines


def _md_scheme(comparison: Comparison, scheme: str) -> list[str]:
    lines = [f"### {_md(scheme)}", ""]
    if comparison.cells_of(scheme):
        lines += [*_md_table(comparison, scheme), ""]
    lines += [f"**{_md(verdict(comparison, scheme))}**", ""]
    notes = footnotes(comparison, scheme)
    lines += [f"{_md(f'[{k}]')} {_md(note)}" for k, note in enumerate(notes, 1)]
    lines += [""] if notes else []
    skipped = [row for row in comparison.skipped if row.scheme == scheme]
    for row in skipped:
        lines.append(f"- skipped {_md(row.observer)}: {_md(row.reason)}")
    return [*lines, ""] if skipped else lines


def _markdown(comparison: Comparison, figures: list[_Figure]) -> str:
    schemes = scheme_order(comparison)
    lines = ["# Observer comparison", "", "## Settings", ""]
    lines += [f"- {_md(k)}: {_md(v)}" for k, v in _settings(comparison)]
    lines += ["", "## Verdicts", ""]
    lines += [f"- {_md(verdict(comparison, scheme))}" for scheme in schemes]
    lines += [
        "",
        "## Results by scheme",
        "",
        f"{_md(BEST_MARK)} and bold: the best value of its column.",
        "",
    ]
    for scheme in schemes:
        lines += _md_scheme(comparison, scheme)
    if figures:
        lines += ["## Figures", ""]
        for figure in figures:
            lines += [f"![{_md(figure.caption)}]({figure.path.name})", ""]
            lines += [f"*{_md(figure.caption)}*", ""]
    lines += ["## Metrics", ""]
    definitions = metric_definitions(comparison.task).items()
    lines += [f"- **{_md(t)}**: {_md(d)}" for t, d in definitions]
    lines += ["", "## Skipped", ""]
    lines += [
        f"- {_md(row.scheme)} / {_md(row.observer)}: {_md(row.reason)}"
        for row in comparison.skipped
    ] or ["Every (scheme, observer) ran."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- writing

_RENDERERS: dict[str, Callable[[Comparison, list[_Figure]], str]] = {
    "html": _html,
    "markdown": _markdown,
}


def _check_target(target: Path, overwrite: bool) -> None:
    """Refuse an `out_dir` that is a file, or a directory holding something
    without `overwrite`."""
    if not (target.exists() or target.is_symlink()):
        return
    if not target.is_dir():
        raise FileExistsError(
            f"{target} exists and is not a directory; choose another output "
            "directory for the report"
        )
    if not overwrite and any(target.iterdir()):
        raise FileExistsError(
            f"{target} exists and is not empty; choose another output directory, "
            "or overwrite to replace the report's files in it"
        )


def _make_staging(target: Path) -> Path:
    """A new hidden directory beside `target`, on its file system (so that a
    rename moves it), with the permissions the umask gives a new directory
    (`tempfile.mkdtemp`'s would be 0o700)."""
    for _ in range(100):
        staging = target.parent / f".{target.name}.{secrets.token_hex(4)}.partial"
        try:
            staging.mkdir()
        except FileExistsError:
            continue
        return staging
    raise FileExistsError(f"no free name for a temporary directory in {target.parent}")


def _move_into_place(staging: Path, target: Path, document: str) -> None:
    """`staging`'s files into `target`: one rename when `target` is new;
    else file by file, the document last, so that it never names a figure
    that is not there."""
    if not (target.exists() or target.is_symlink()):
        staging.rename(target)
        return
    names = sorted(item.name for item in staging.iterdir() if item.name != document)
    for name in [*names, document]:
        os.replace(staging / name, target / name)


def write_report(
    comparison: Comparison,
    out_dir: str | os.PathLike[str],
    format: Literal["html", "markdown"] = "html",
    overwrite: bool = False,
) -> Path:
    """Write the comparison's figures and report document into `out_dir`.

    Args:
        comparison: the results.
        out_dir: the directory to create (or an empty one to fill).
        format: `"html"` (`report.html`, self-contained) or `"markdown"`
            (`report.md`, the PNGs beside it).
        overwrite: replace the report's files in a non-empty `out_dir`
            (other files in it are kept).

    Returns:
        The report document's path.

    Raises:
        ValueError: on an unknown `format`.
        FileExistsError: `out_dir` is a file, or a non-empty directory
            without `overwrite`.
        OSError: when the directory cannot be created or written. The
            report is staged beside `out_dir` and removed on failure, so a
            new `out_dir` is never half-written; parent directories it had
            to create stay, and when replacing an existing report file by
            file, the document moves last, after its figures.
    """
    if format not in _RENDERERS:
        raise ValueError(
            f"unknown report format {format!r}; choose one of {sorted(_RENDERERS)}"
        )
    target = Path(os.path.abspath(out_dir))
    _check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _make_staging(target)
    document = REPORT_NAMES[format]
    try:
        figures = _write_figures(comparison, staging)
        text = _RENDERERS[format](comparison, figures)
        (staging / document).write_text(text, encoding="utf-8")
        _move_into_place(staging, target, document)
    finally:
        # After a rename it is gone; after moving file by file, empty.
        shutil.rmtree(staging, ignore_errors=True)
    return target / document
