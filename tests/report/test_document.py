"""Figures and report directories of a hand-built comparison."""

from __future__ import annotations

import base64
import dataclasses
import html
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from quantobs.report import plots
from quantobs.report.document import REPORT_NAMES, _md, write_report
from quantobs.report.render import METRIC_DEFINITIONS, verdict
from quantobs.report.results import Comparison, LayerHistogram
from tests.report.test_render import make_comparison

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("layer_sqnr.png", "quality_vs_time.png", "worst_layer.png")


def _empty(comparison: Comparison) -> Comparison:
    return dataclasses.replace(comparison, cells=[], skipped=[], histogram=None)


# ---------------------------------------------------------------- plots


@pytest.mark.parametrize(
    "plot",
    [plots.plot_layer_sqnr, plots.plot_quality_vs_time, plots.plot_worst_layer],
    ids=["layer_sqnr", "quality_vs_time", "worst_layer"],
)
def test_plots_write_png_or_nothing(
    plot: Callable[[Comparison, Path], Path | None], tmp_path: Path
) -> None:
    path = tmp_path / "figure.png"
    assert plot(make_comparison(), path) == path
    assert path.read_bytes().startswith(PNG_MAGIC)
    empty = tmp_path / "empty.png"
    assert plot(_empty(make_comparison()), empty) is None
    assert not empty.exists()


def test_plot_layer_sqnr_without_inputs_or_finite_values(tmp_path: Path) -> None:
    comparison = make_comparison()
    comparison.cells = [cell for cell in comparison.cells if cell.scheme == "W4A16"]
    comparison.cells[0] = dataclasses.replace(
        comparison.cells[0],
        weight_sqnr=dict.fromkeys(comparison.cells[0].weight_sqnr, math.inf),
    )
    path = plots.plot_layer_sqnr(comparison, tmp_path / "sqnr.png")
    assert path is not None
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_plot_worst_layer_refuses_mismatched_edges(tmp_path: Path) -> None:
    comparison = make_comparison()
    comparison.histogram = LayerHistogram("W8A8", "l", [0.0, 1.0], [1, 2], {})
    with pytest.raises(ValueError, match="2 edges for 2 counts"):
        plots.plot_worst_layer(comparison, tmp_path / "worst.png")


def test_plot_worst_layer_with_an_unbounded_range(tmp_path: Path) -> None:
    comparison = make_comparison()
    assert comparison.histogram is not None
    ranges = {**comparison.histogram.ranges, "odd": (-math.inf, math.inf)}
    comparison.histogram = dataclasses.replace(comparison.histogram, ranges=ranges)
    path = plots.plot_worst_layer(comparison, tmp_path / "worst.png")
    assert path is not None
    assert path.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    ("names", "short"),
    [
        (
            ["encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense"],
            ["0.attention.self.query", "1.output.dense"],
        ),
        (["model.fc1", "model.fc2"], ["fc1", "fc2"]),
        (["a.b.query"], ["query"]),
        (["fc"], ["fc"]),
        ([], []),
        (["x." + "y" * 40], ["…" + "y" * 27]),
    ],
    ids=["minilm", "flat", "one", "no-dot", "none", "long"],
)
def test_short_layer_names(names: list[str], short: list[str]) -> None:
    assert plots.short_layer_names(names) == short


# ---------------------------------------------------------------- reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`make_comparison()`'s report in each format, written once: {format:
    the document's path}."""
    root = tmp_path_factory.mktemp("reports")
    return {
        report_format: write_report(
            make_comparison(), root / report_format, format=report_format
        )
        for report_format in ("html", "markdown")
    }


@pytest.mark.parametrize("report_format", ["html", "markdown"])
def test_report_writes_every_figure_as_png(
    report_format: Literal["html", "markdown"], reports: dict[str, Path]
) -> None:
    path = reports[report_format]
    out_dir = path.parent
    assert path == out_dir / REPORT_NAMES[report_format]
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([*FIGURES, path.name])
    for name in FIGURES:
        assert (out_dir / name).read_bytes().startswith(PNG_MAGIC)
    # No temporary directory left beside the reports.
    assert sorted(p.name for p in out_dir.parent.iterdir()) == ["html", "markdown"]


def test_html_report_is_self_contained(reports: dict[str, Path]) -> None:
    comparison = make_comparison()
    text = reports["html"].read_text(encoding="utf-8")
    sources = re.findall(r'src="([^"]*)"', text)
    assert len(sources) == len(FIGURES)
    for source in sources:
        prefix = "data:image/png;base64,"
        assert source.startswith(prefix)
        assert base64.b64decode(source[len(prefix) :]).startswith(PNG_MAGIC)
    for external in ("href=", "<link", "<script", "http://", "https://", "url("):
        assert external not in text
    for scheme in comparison.schemes:
        assert html.escape(verdict(comparison, scheme)) in text
    for title, definition in METRIC_DEFINITIONS.items():
        assert f"<dt>{title}</dt>" in text
        assert html.escape(definition) in text
    assert '<td class="num best">0.9980*</td>' in text
    assert '<td class="num">0.9950</td>' in text
    assert "same observers as mse here (no static inputs)" in text
    assert "/models/all-MiniLM-L6-v2" in text
    assert "<th>held-out texts</th><td>100</td>" in text


def test_html_report_escapes_names(tmp_path: Path) -> None:
    comparison = make_comparison()
    comparison.cells[1] = dataclasses.replace(comparison.cells[1], observer="<b>mse")
    assert comparison.histogram is not None
    comparison.histogram = dataclasses.replace(
        comparison.histogram, layer="encoder.<script>.dense"
    )
    comparison.model = 'models/"a&b"'
    text = write_report(comparison, tmp_path / "out").read_text(encoding="utf-8")
    assert "<b>mse" not in text
    assert "&lt;b&gt;mse" in text
    assert "<script>" not in text
    assert "encoder.&lt;script&gt;.dense" in text
    assert "models/&quot;a&amp;b&quot;" in text


def test_markdown_report_references_figures(reports: dict[str, Path]) -> None:
    out_dir = reports["markdown"].parent
    text = reports["markdown"].read_text(encoding="utf-8")
    images = re.findall(r"!\[[^\]]*\]\(([^)]*)\)", text)
    assert sorted(images) == sorted(FIGURES)
    assert all((out_dir / image).is_file() for image in images)
    assert "| static\\_mse | mse / static\\_mse | **0.9980\\*** |" in text
    assert "## Metrics" in text
    for title in METRIC_DEFINITIONS:
        assert f"**{title}**" in text
    assert "data:" not in text


def test_report_of_an_empty_comparison(tmp_path: Path) -> None:
    comparison = _empty(make_comparison())
    path = write_report(comparison, tmp_path / "out")
    assert [p.name for p in path.parent.iterdir()] == ["report.html"]
    assert "no result was recorded" in path.read_text(encoding="utf-8")


def test_report_without_histogram_has_no_worst_layer(tmp_path: Path) -> None:
    comparison = dataclasses.replace(make_comparison(), histogram=None)
    path = write_report(comparison, tmp_path / "out", format="markdown")
    assert not (path.parent / "worst_layer.png").exists()
    assert "worst_layer.png" not in path.read_text(encoding="utf-8")


# ---------------------------------------------------------------- errors


def test_report_into_an_empty_existing_directory(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    path = write_report(make_comparison(), out_dir)
    assert path.is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_report_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"not empty.*overwrite"):
        write_report(make_comparison(), out_dir)
    assert [p.name for p in out_dir.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_report_overwrite_replaces_its_files_and_keeps_others(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("keep me")
    (out_dir / "report.html").write_text("old")
    path = write_report(make_comparison(), out_dir, overwrite=True)
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert (out_dir / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        [*FIGURES, "notes.txt", "report.html"]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_report_refuses_a_file(tmp_path: Path) -> None:
    out_file = tmp_path / "out"
    out_file.write_text("a file")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="not a directory"):
            write_report(make_comparison(), out_file, overwrite=overwrite)
    assert out_file.read_text() == "a file"


def test_report_refuses_an_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown report format 'pdf'"):
        pdf: Any = "pdf"
        write_report(make_comparison(), tmp_path / "out", format=pdf)
    assert list(tmp_path.iterdir()) == []


def test_report_under_a_file_raises_oserror(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        write_report(make_comparison(), tmp_path / "file" / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_a_failing_plot_leaves_nothing_behind(
    existing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "out"
    if existing:
        out_dir.mkdir()
        (out_dir / "report.html").write_text("old")

    def broken(comparison: Comparison, path: Path) -> Path:
        path.write_bytes(b"half a figure")
        raise RuntimeError("plot failed")

    monkeypatch.setattr(plots, "plot_quality_vs_time", broken)
    with pytest.raises(RuntimeError, match="plot failed"):
        write_report(make_comparison(), out_dir, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if existing else [])
    if existing:
        assert [p.name for p in out_dir.iterdir()] == ["report.html"]
        assert (out_dir / "report.html").read_text() == "old"


def test_a_failing_write_raises_oserror_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(self: Path, *args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_report(make_comparison(), tmp_path / "reports" / "out", format="markdown")
    assert [p.name for p in tmp_path.iterdir()] == ["reports"]  # the parent made
    assert list((tmp_path / "reports").iterdir()) == []


@pytest.mark.parametrize("report_format", ["html", "markdown"])
def test_report_shows_notes_as_footnotes(
    report_format: Literal["html", "markdown"], tmp_path: Path
) -> None:
    comparison = make_comparison()
    note = "observer 'entropy' does not fit float8_e4m3fn: <reason> & more"
    cell = comparison.cells[1]
    comparison.cells[1] = dataclasses.replace(cell, notes=(note,))
    text = write_report(comparison, tmp_path / "out", format=report_format)
    document = text.read_text(encoding="utf-8")
    if report_format == "html":
        assert f"<td>{cell.observer} [1]</td>" in document
        assert f'<p class="skipped">[1] {html.escape(note)}</p>' in document
    else:
        assert f"\\[1\\] {_md(note)}" in document
        assert f"| {_md(cell.observer)} \\[1\\] |" in document


def test_observer_styles_stay_distinct_past_the_palette() -> None:
    # tab10 repeats every 10 colours: the marker changes with each round, so
    # an 11th observer row is not drawn like the first.
    comparison = make_comparison()
    comparison.observers = [f"row{i}" for i in range(25)]
    styles = plots._observer_styles(comparison)
    rows = [styles[f"row{i}"] for i in range(25)]
    assert len(set(rows)) == 25
