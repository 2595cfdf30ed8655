"""Tables, verdicts, JSON and CSV of a hand-built comparison."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re

import pytest
from rich.console import Console

from quantobs.report.render import (
    COLUMNS,
    CSV_COLUMNS,
    METRIC_DEFINITIONS,
    VERDICT_THRESHOLD,
    best_cells,
    format_number,
    render_table,
    to_csv,
    to_json,
    verdict,
)
from quantobs.report.results import Cell, Comparison, LayerHistogram, Skipped

LAYERS = (
    "encoder.layer.0.attention.self.query",
    "encoder.layer.0.output.dense",
    "encoder.layer.1.output.dense",
)


def make_cell(
    scheme: str,
    observer: str,
    *,
    cos: float,
    worst: float = 0.9,
    agree: float = 0.9,
    rho: float = 0.95,
    weight_db: tuple[float, ...] = (30.0, 31.0, 32.0),
    input_db: tuple[float, ...] = (),
    calib: float = 1.0,
    weight_observer: str | None = None,
    input_observer: str | None = None,
) -> Cell:
    """A cell whose per-layer SQNRs are given in `LAYERS` order."""
    return Cell(
        scheme=scheme,
        observer=observer,
        weight_observer=weight_observer or observer,
        input_observer=input_observer,
        cosine_mean=cos,
        cosine_worst=worst,
        neighbours=agree,
        spearman=rho,
        weight_sqnr=dict(zip(LAYERS, weight_db, strict=True)),
        input_sqnr=dict(zip(LAYERS, input_db, strict=True)) if input_db else {},
        input_ranges={},
        calibration_seconds=calib,
        evaluation_seconds=2.0,
    )


def make_comparison() -> Comparison:
    """W8A8 (3 observers, inputs, ties, an infinite SQNR), W4A16 (no input
    SQNR, a skipped row, a gain under the threshold), NVFP4 (all skipped)."""
    inf = math.inf
    cells = [
        make_cell(
            "W8A8", "minmax", cos=0.9950, worst=0.95, agree=0.90, rho=0.97,
            input_db=(20.0, 22.0, 24.0), calib=0.5, input_observer="minmax",
        ),
        make_cell(
            "W8A8", "mse", cos=0.9980, worst=0.96, agree=0.95, rho=0.98,
            weight_db=(30.0, inf, 32.0), input_db=(21.0, 23.0, 25.0), calib=1.3,
            input_observer="mse",
        ),
        make_cell(
            "W8A8", "static_mse", cos=0.9980, worst=0.955, agree=0.95, rho=0.975,
            weight_db=(30.0, inf, 32.0), input_db=(20.0, 21.0, 22.0), calib=2.0,
            weight_observer="mse", input_observer="static_mse",
        ),
        make_cell(
            "W4A16", "minmax", cos=0.9500, agree=0.90,
            weight_db=(18.0, 19.0, 20.0), calib=0.4,
        ),
        make_cell(
            "W4A16", "mse", cos=0.9504, agree=0.91,
            weight_db=(19.0, 20.0, 21.0), calib=0.9,
        ),
    ]  # fmt: skip
    nvfp4 = "NVFP4 needs compressed-tensors >= 0.19"
    skipped = [
        Skipped("W4A16", "static_mse", "same observers as mse here (no static inputs)"),
        *(Skipped("NVFP4", name, nvfp4) for name in ("minmax", "mse", "static_mse")),
    ]
    histogram = LayerHistogram(
        scheme="W8A8",
        layer=LAYERS[1],
        edges=[-4.0, -2.0, 0.0, 2.0, 4.0],
        counts=[3, 120, 110, 0],
        ranges={"minmax": (-3.9, 3.5), "mse": (-2.5, 2.5), "static_mse": (-2.0, 2.2)},
    )
    return Comparison(
        model="/models/all-MiniLM-L6-v2",
        schemes=["W8A8", "W4A16", "NVFP4"],
        observers=["minmax", "mse", "static_mse"],
        calibration_texts=200,
        heldout_texts=100,
        cells=cells,
        skipped=skipped,
        histogram=histogram,
        seconds=12.5,
    )


# ---------------------------------------------------------------- best cells


def test_best_cells_marks_ties_and_the_fastest() -> None:
    best = best_cells(make_comparison(), "W8A8")
    assert best == {
        "cosine_mean": {"mse", "static_mse"},  # tie: both marked
        "cosine_worst": {"mse"},
        "neighbours": {"mse", "static_mse"},
        "spearman": {"mse"},
        "mean_weight_sqnr": {"mse", "static_mse"},  # inf beats every finite
        "mean_input_sqnr": {"mse"},
        "calibration_seconds": {"minmax"},  # lowest
    }


def test_best_cells_ignores_none_and_nan() -> None:
    comparison = make_comparison()
    best = best_cells(comparison, "W4A16")
    assert best["mean_input_sqnr"] == set()  # every value is None
    assert best["cosine_mean"] == {"mse"}
    comparison.cells[4] = dataclasses.replace(comparison.cells[4], spearman=math.nan)
    assert best_cells(comparison, "W4A16")["spearman"] == {"minmax"}


def test_best_cells_of_a_scheme_without_cells_is_empty() -> None:
    best = best_cells(make_comparison(), "NVFP4")
    assert set(best) == {column.key for column in COLUMNS}
    assert all(observers == set() for observers in best.values())


# ---------------------------------------------------------------- verdict


def test_verdict_recommends_a_better_observer() -> None:
    assert verdict(make_comparison(), "W8A8") == (
        "W8A8: use mse — cos mean 0.9980 vs 0.9950 for minmax (+0.0030), "
        "top-1 agreement 0.95 vs 0.90, 0.8 s more calibration."
    )


def test_verdict_keeps_the_baseline_within_the_threshold() -> None:
    assert VERDICT_THRESHOLD == 0.001
    assert verdict(make_comparison(), "W4A16") == (
        "W4A16: keep minmax — no observer beats it by more than 0.001 in cos "
        "mean (best: mse, +0.0004)."
    )


def test_verdict_keeps_a_baseline_that_is_best() -> None:
    comparison = make_comparison()
    comparison.cells[3] = dataclasses.replace(comparison.cells[3], cosine_mean=0.96)
    assert verdict(comparison, "W4A16") == (
        "W4A16: keep minmax — no observer beats it by more than 0.001 in cos mean."
    )


def test_verdict_without_minmax_compares_with_the_first_row() -> None:
    comparison = make_comparison()
    comparison.cells = [cell for cell in comparison.cells if cell.observer != "minmax"]
    comparison.cells[1] = dataclasses.replace(
        comparison.cells[1], cosine_mean=0.9995, calibration_seconds=1.0
    )
    assert verdict(comparison, "W8A8") == (
        "W8A8: use static_mse — cos mean 0.9995 vs 0.9980 for mse (+0.0015), "
        "top-1 agreement 0.95 vs 0.95, 0.3 s less calibration."
    )


def test_verdict_of_a_single_cell() -> None:
    comparison = make_comparison()
    comparison.cells = comparison.cells[:1]
    assert verdict(comparison, "W8A8") == (
        "W8A8: only minmax ran — cos mean 0.9950, top-1 agreement 0.90; "
        "nothing to compare it with."
    )


def test_verdict_of_a_scheme_with_no_cells_gives_the_reason() -> None:
    comparison = make_comparison()
    assert verdict(comparison, "NVFP4") == (
        "NVFP4: no observer ran — every row was skipped "
        "(NVFP4 needs compressed-tensors >= 0.19)."
    )
    comparison.skipped[-1] = Skipped("NVFP4", "static_mse", "out of memory")
    assert verdict(comparison, "NVFP4").endswith(
        "minmax: NVFP4 needs compressed-tensors >= 0.19; "
        "mse: NVFP4 needs compressed-tensors >= 0.19; static_mse: out of memory."
    )
    assert verdict(comparison, "MXFP4") == (
        "MXFP4: no observer ran — no result was recorded for this scheme."
    )


# ---------------------------------------------------------------- table


@pytest.mark.parametrize(
    ("value", "decimals", "text"),
    [
        (0.99501, 4, "0.9950"),
        (0.905, 2, "0.91"),
        (31.04, 1, "31.0"),
        (None, 1, "—"),
        (math.inf, 1, "inf"),
        (-math.inf, 1, "-inf"),
        (math.nan, 4, "nan"),
    ],
    ids=["cos", "agreement", "dB", "none", "inf", "-inf", "nan"],
)
def test_format_number(value: float | None, decimals: int, text: str) -> None:
    assert format_number(value, decimals) == text


def _rendered(comparison: Comparison) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    render_table(comparison, console)
    return console.export_text()


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of every table in `text`, as stripped cell texts."""
    return [
        [part.strip() for part in line.split("│")[1:-1]]
        for line in text.splitlines()
        if line.startswith("│")
    ]


def test_render_table_rows_and_marks() -> None:
    rows = _table_rows(_rendered(make_comparison()))
    assert rows == [
        # observer, weights / inputs, cos mean, cos worst, top-1, spearman,
        # weight dB, input dB, calib s
        ["minmax", "minmax / minmax", "0.9950", "0.9500", "0.90", "0.9700",
         "31.0", "22.0", "0.50*"],
        ["mse", "mse / mse", "0.9980*", "0.9600*", "0.95*", "0.9800*",
         "inf*", "23.0*", "1.30"],
        ["static_mse", "mse / static_mse", "0.9980*", "0.9550", "0.95*", "0.9750",
         "inf*", "21.0", "2.00"],
        ["minmax", "minmax / —", "0.9500", "0.9000*", "0.90", "0.9500*",
         "19.0", "—", "0.40*"],
        ["mse", "mse / —", "0.9504*", "0.9000*", "0.91*", "0.9500*",
         "20.0*", "—", "0.90"],
    ]  # fmt: skip


def test_render_table_titles_verdicts_and_footnotes() -> None:
    comparison = make_comparison()
    text = _rendered(comparison)
    lines = [line.strip() for line in text.splitlines()]
    for title in ("observer", "weights / inputs", *(c.title for c in COLUMNS)):
        assert title in text
    for scheme in comparison.schemes:
        assert scheme in lines  # the table's title, or the scheme's heading
        assert verdict(comparison, scheme) in lines
    assert "skipped static_mse: same observers as mse here (no static inputs)" in lines
    assert "skipped mse: NVFP4 needs compressed-tensors >= 0.19" in lines
    # Each verdict follows its own table.
    assert text.index("W4A16: keep") < text.index("NVFP4: no observer")
    assert text.index("W8A8: use") < text.index("minmax / —")


def test_render_table_best_is_bold_green() -> None:
    console = Console(
        record=True, width=160, file=io.StringIO(), force_terminal=True,
        color_system="standard",
    )  # fmt: skip
    render_table(make_comparison(), console)
    styled = console.export_text(styles=True)
    bold_green = r"\x1b\[1;32m *{}\x1b\[0m"
    assert len(re.findall(bold_green.format(r"0\.9980\*"), styled)) == 2  # tie
    assert not re.search(bold_green.format(r"0\.9950"), styled)


def test_render_table_escapes_no_markup() -> None:
    comparison = make_comparison()
    comparison.cells[0] = dataclasses.replace(comparison.cells[0], observer="[bold]x")
    assert "[bold]x" in _rendered(comparison)


# ---------------------------------------------------------------- JSON / CSV


def _reject(constant: str) -> float:
    raise ValueError(f"non-standard JSON constant {constant}")


def test_json_is_strict_and_round_trips() -> None:
    comparison = make_comparison()
    comparison.cells[0] = dataclasses.replace(comparison.cells[0], spearman=math.nan)
    data = json.loads(to_json(comparison), parse_constant=_reject)
    assert data["model"] == comparison.model
    assert len(data["cells"]) == len(comparison.cells)
    for raw, cell in zip(data["cells"], comparison.cells, strict=True):
        assert raw["cosine_mean"] == cell.cosine_mean
        assert raw["calibration_seconds"] == cell.calibration_seconds
    assert data["cells"][0]["spearman"] == "nan"
    assert data["cells"][0]["mean_input_sqnr"] == 22.0
    assert data["cells"][1]["mean_weight_sqnr"] == "inf"
    assert data["cells"][1]["weight_sqnr"][LAYERS[1]] == "inf"
    assert data["cells"][3]["mean_input_sqnr"] is None
    assert data["cells"][3]["input_observer"] is None
    assert data["histogram"]["ranges"]["mse"] == [-2.5, 2.5]
    assert data["skipped"][0]["observer"] == "static_mse"


def test_json_rejects_nothing_strict_parsers_refuse() -> None:
    text = to_json(make_comparison())
    assert "NaN" not in text
    assert "Infinity" not in text
    assert text.endswith("\n")


def test_csv_columns_and_fields() -> None:
    comparison = make_comparison()
    text = to_csv(comparison)
    reader = csv.DictReader(io.StringIO(text))
    assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
    rows = list(reader)
    assert len(rows) == len(comparison.cells)
    for row, cell in zip(rows, comparison.cells, strict=True):
        assert (row["scheme"], row["observer"]) == (cell.scheme, cell.observer)
        assert float(row["cosine_mean"]) == cell.cosine_mean
        assert float(row["evaluation_seconds"]) == cell.evaluation_seconds
    assert rows[1]["mean_weight_sqnr"] == "inf"
    assert rows[2]["weight_observer"] == "mse"
    assert rows[2]["input_observer"] == "static_mse"
    assert rows[3]["input_observer"] == ""  # None: empty field
    assert rows[3]["mean_input_sqnr"] == ""
    assert float(rows[3]["mean_weight_sqnr"]) == 19.0


def test_csv_of_an_empty_comparison_is_its_header() -> None:
    comparison = Comparison("m", ["W8A8"], ["minmax"], 1, 1)
    assert to_csv(comparison) == ",".join(CSV_COLUMNS) + "\n"


def test_metric_definitions_cover_every_column() -> None:
    assert list(METRIC_DEFINITIONS) == [column.title for column in COLUMNS]
    assert all(len(text) > 40 for text in METRIC_DEFINITIONS.values())
