"""Tables, verdicts, CSV, JSON and documents of a causal LM's comparison
(next-token KL, top-1 token agreement, perplexity), hand-built."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from rich.console import Console

from quantobs.report.document import write_report
from quantobs.report.render import (
    best_cells,
    columns,
    csv_columns,
    metric_definitions,
    render_table,
    to_csv,
    to_json,
    verdict,
)
from quantobs.report.results import Cell, Comparison
from quantobs.report.tasks import CAUSAL_LM


def make_cell(
    scheme: str, observer: str, *, kl: float, agree: float, ppl: float, calib: float
) -> Cell:
    return Cell(
        scheme=scheme,
        observer=observer,
        weight_observer=observer,
        input_observer=None,
        cosine_mean=None,
        cosine_worst=None,
        neighbours=None,
        spearman=None,
        weight_sqnr={"model.layers.0.mlp.down_proj": 30.0},
        input_sqnr={},
        input_ranges={},
        calibration_seconds=calib,
        evaluation_seconds=1.0,
        kl_divergence=kl,
        token_agreement=agree,
        perplexity=ppl,
    )


def make_comparison() -> Comparison:
    cells = [
        make_cell("W4A16", "minmax", kl=0.0200, agree=0.900, ppl=12.5, calib=0.5),
        make_cell("W4A16", "mse", kl=0.0100, agree=0.950, ppl=12.6, calib=1.3),
        make_cell("W4A16", "histogram", kl=0.0150, agree=0.960, ppl=12.4, calib=2.0),
        make_cell("W8A8", "minmax", kl=0.0010, agree=0.990, ppl=12.1, calib=0.2),
        make_cell("W8A8", "mse", kl=0.0004, agree=0.995, ppl=12.0, calib=0.6),
    ]
    return Comparison(
        model="/models/tiny-llama",
        schemes=["W4A16", "W8A8"],
        observers=["minmax", "mse", "histogram"],
        calibration_texts=8,
        heldout_texts=6,
        cells=cells,
        task=CAUSAL_LM,
        reference_perplexity=11.9,
    )


def test_columns_and_best_marks_follow_each_direction() -> None:
    titles = [column.title for column in columns(CAUSAL_LM)]
    assert titles[:3] == ["KL nats", "top-1 token", "perplexity"]
    best = best_cells(make_comparison(), "W4A16")
    assert best["kl_divergence"] == {"mse"}  # lowest
    assert best["token_agreement"] == {"histogram"}  # highest
    assert best["perplexity"] == {"histogram"}  # lowest
    assert best["calibration_seconds"] == {"minmax"}


def test_verdict_picks_the_lowest_kl() -> None:
    assert verdict(make_comparison(), "W4A16") == (
        "W4A16: use mse — KL 0.0100 nats vs 0.0200 nats for minmax (-0.0100), "
        "top-1 token agreement 0.950 vs 0.900, 0.8 s more calibration."
    )


def test_verdict_keeps_minmax_within_a_thousandth_of_a_nat() -> None:
    assert verdict(make_comparison(), "W8A8") == (
        "W8A8: keep minmax — no observer beats it by more than 0.001 nats in KL "
        "(best: mse, -0.0006)."
    )


def test_table_shows_the_causal_metrics_and_the_reference() -> None:
    console = Console(record=True, width=200)
    render_table(make_comparison(), console)
    text = console.export_text()
    assert "KL nats" in text and "top-1 token" in text and "perplexity" in text
    assert "cos mean" not in text
    assert "0.0100*" in text  # mse's KL, the best of W4A16
    assert "unquantized model: held-out perplexity 11.90" in text


def test_csv_and_json_carry_the_causal_metrics() -> None:
    comparison = make_comparison()
    rows = list(csv.DictReader(io.StringIO(to_csv(comparison))))
    assert tuple(rows[0]) == csv_columns(CAUSAL_LM)
    assert float(rows[1]["kl_divergence"]) == 0.01
    assert float(rows[1]["perplexity"]) == 12.6
    data = json.loads(to_json(comparison))
    assert data["task"] == CAUSAL_LM
    assert data["reference_perplexity"] == 11.9
    assert data["cells"][2]["token_agreement"] == 0.96
    assert data["cells"][0]["cosine_mean"] is None


def test_html_report_shows_the_causal_columns(tmp_path: Path) -> None:
    path = write_report(make_comparison(), tmp_path / "report", format="html")
    text = path.read_text(encoding="utf-8")
    assert "<th>KL nats</th>" in text and "<dt>perplexity</dt>" in text
    assert "cos mean" not in text
    assert "W4A16: use mse" in text


def test_markdown_report_defines_the_causal_metrics(tmp_path: Path) -> None:
    path = write_report(make_comparison(), tmp_path / "report", format="markdown")
    text = path.read_text(encoding="utf-8")
    assert "| KL nats | top-1 token | perplexity |" in text
    for title in metric_definitions(CAUSAL_LM):
        assert f"**{title}**" in text
    assert "cos mean" not in text
    assert "unquantized perplexity: 11.90" in text
    assert (tmp_path / "report" / "quality_vs_time.png").is_file()
