"""`quantobs compare`: its options end to end on a two-layer BERT, and each
bad input as exit code 2 with one clear line and nothing written."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from quantobs.cli import EXIT_OK, EXIT_USAGE, main
from tests.tiny_bert import HELDOUT, TEXTS, write_texts, write_tiny_bert


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    return {
        "model": write_tiny_bert(root / "tiny-bert"),
        "narrow": write_tiny_bert(root / "narrow-bert", hidden=64),
        "data": write_texts(root / "data.txt", TEXTS),
        "heldout": write_texts(root / "heldout.txt", HELDOUT),
    }


def _compare(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], *argv: str
) -> tuple[int, str, str]:
    base = [
        "compare",
        "--model",
        str(files["model"]),
        "--data",
        str(files["data"]),
        "--heldout",
        str(files["heldout"]),
        "--batch-size",
        "3",
        "--no-progress",
    ]
    code = main([*base, *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------ outputs


def test_table_and_html_report(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    report = tmp_path / "report"
    code, out, err = _compare(
        capsys,
        files,
        "--schemes",
        "fp8",
        "W4A16",
        "--observers",
        "minmax",
        "MSE",
        "static-mse",
        "--report",
        str(report),
    )
    assert code == EXIT_OK, err
    for text in ("FP8", "W4A16", "minmax", "mse", "static_mse", f"report: {report}"):
        assert text in out
    assert "same observers as mse under W4A16" in out  # the skipped row
    html = (report / "report.html").read_text(encoding="utf-8")
    assert "data:image/png;base64," in html
    assert sorted(p.suffix for p in report.iterdir()).count(".png") >= 2


def test_json_csv_and_markdown(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    argv = ("--schemes", "W8A8", "--observers", "minmax", "imatrix")
    code, out, err = _compare(capsys, files, *argv, "--format", "json")
    assert code == EXIT_OK, err
    data = json.loads(out)
    assert [c["observer"] for c in data["cells"]] == ["minmax", "imatrix"]
    assert data["cells"][1]["weight_observer"] == "imatrix_mse"

    report = tmp_path / "md"
    code, out, err = _compare(
        capsys,
        files,
        *argv,
        "--format",
        "csv",
        "--report",
        str(report),
        "--report-format",
        "markdown",
    )
    assert code == EXIT_OK, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["observer"] for r in rows] == ["minmax", "imatrix"]
    assert rows[0]["input_observer"] == ""  # W8A8: dynamic inputs
    assert f"report: {report}" in err  # stdout stays CSV
    assert (report / "report.md").is_file()


def test_overwrite_replaces_a_report(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    report = tmp_path / "again"
    report.mkdir()
    (report / "old.txt").write_text("old")
    argv = ("--schemes", "W8A8", "--observers", "minmax", "--report", str(report))
    code, _, err = _compare(capsys, files, *argv)
    assert code == EXIT_USAGE and "--overwrite" in err
    code, _, err = _compare(capsys, files, *argv, "--overwrite")
    assert code == EXIT_OK, err
    assert (report / "report.html").is_file()
    # only the report's own files are replaced; others are left alone
    assert (report / "old.txt").read_text() == "old"


def test_help_defines_every_metric(capsys: pytest.CaptureFixture[str]) -> None:
    from quantobs.report.render import METRIC_DEFINITIONS

    assert main(["compare", "--help"]) == EXIT_OK
    out = capsys.readouterr().out
    for name in METRIC_DEFINITIONS:
        assert name in out
    assert "--quick" in out and "imatrix" in out


# ------------------------------------------------------------ bad input


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("quantobs: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schemes", "W9A9"], "unknown scheme 'W9A9'; available presets: FP8"),
        (["--observers", "maxmin"], "unknown observer 'maxmin'; valid names:"),
        (["--observers", "minmax", "bogus"], "imatrix"),  # the list names the rows
    ],
)
def test_unknown_names(
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    argv: list[str],
    message: str,
) -> None:
    code, out, err = _compare(capsys, files, *argv)
    assert code == EXIT_USAGE and out == ""
    assert message in _one_error_line(err)


def test_bad_model_directories(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    (no_weights / "pytorch_model.bin").write_bytes(b"\0")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-model"}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    cases = [
        (missing, "does not exist or is not a directory"),
        (tmp_path, "has no config.json"),
        (no_weights, "holds no .safetensors weights"),
        (broken, "transformers cannot load the model"),
    ]
    for directory, message in cases:
        code = main(["compare", "--model", str(directory), "--no-progress"])
        err = capsys.readouterr().err
        assert code == EXIT_USAGE
        assert message in _one_error_line(err), directory


def test_bad_data(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    empty = write_texts(tmp_path / "empty.txt", [])
    two = write_texts(tmp_path / "two.txt", HELDOUT[:2])
    cases = [
        (["--data", str(empty)], "cannot read the calibration data"),
        (["--data", str(tmp_path / "none.txt")], "cannot read the calibration data"),
        (["--heldout", str(two)], "--heldout has 2 text(s); the metrics need 3"),
    ]
    for argv, message in cases:
        code, out, err = _compare(capsys, files, *argv)
        assert code == EXIT_USAGE and out == ""
        assert message in _one_error_line(err)


def test_a_scheme_the_layers_cannot_take(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    # 64 input features do not divide into W4A16's groups of 128
    narrow = ["--model", str(files["narrow"]), "--data", str(files["data"])]
    code = main(["compare", *narrow, "--schemes", "W4A16", "--no-progress"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_USAGE
    assert "scheme W4A16" in line and "encoder.layer.0" in line and "ignore" in line


def test_unwritable_or_taken_report_directory(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("keep")
    cases = [
        (a_file, "exists and is not a directory"),
        (a_file / "report", "cannot write in"),
        (taken, "exists and is not empty"),
    ]
    for report, message in cases:
        code, out, err = _compare(capsys, files, "--report", str(report))
        assert code == EXIT_USAGE and out == ""
        assert message in _one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "taken"]
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]


def test_ignore_skips_the_layers_a_scheme_cannot_take(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    # only output.dense (128 input features) can take groups of 128
    narrow = ["--model", str(files["narrow"]), "--data", str(files["data"])]
    ignore = ["re:.*attention.*", "re:.*intermediate.*", "re:.*pooler.*"]
    matrix = ["--schemes", "W4A16", "--observers", "minmax"]
    output = ["--heldout", str(files["heldout"]), "--format", "json", "--no-progress"]
    code = main(["compare", *narrow, *matrix, "--ignore", *ignore, *output])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    (cell,) = json.loads(captured.out)["cells"]
    assert sorted(cell["weight_sqnr"]) == [
        "encoder.layer.0.output.dense",
        "encoder.layer.1.output.dense",
    ]


def test_quick_and_explicit_matrices() -> None:
    from quantobs.cli import build_parser
    from quantobs.cli.compare_cmd import _matrix
    from quantobs.report.compare import (
        DEFAULT_OBSERVERS,
        DEFAULT_SCHEMES,
        QUICK_OBSERVERS,
        QUICK_SCHEMES,
    )

    def matrix(*argv: str) -> tuple[list[str], list[str]]:
        return _matrix(build_parser().parse_args(["compare", *argv]))

    assert matrix() == (list(DEFAULT_SCHEMES), list(DEFAULT_OBSERVERS))
    assert matrix("--quick") == (list(QUICK_SCHEMES), list(QUICK_OBSERVERS))
    # explicit lists win over --quick; names are normalized and deduplicated
    assert matrix("--quick", "--schemes", "nvfp4", "NVFP4", "--observers", "MSE") == (
        ["NVFP4"],
        ["mse"],
    )
    assert matrix("--observers", "Histogram-MSE") == (
        list(DEFAULT_SCHEMES),
        ["histogram_mse"],
    )
