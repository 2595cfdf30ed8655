"""`quantobs compare` with compressed-tensors 0.20's MX presets: evaluated
end to end where compressed-tensors has FP6 (>= 0.20), refused with exit 2
and one line naming the version otherwise (before the model is loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantobs.cli import EXIT_OK, EXIT_USAGE, main
from quantobs.core.peer_versions import compressed_tensors_has_fp6
from tests.tiny_bert import HELDOUT, TEXTS, write_texts, write_tiny_bert

pytestmark = pytest.mark.peers
pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare-mx")
    return {
        "model": write_tiny_bert(root / "tiny-bert"),  # 128 features
        "data": write_texts(root / "data.txt", TEXTS),
        "heldout": write_texts(root / "heldout.txt", HELDOUT),
    }


def _compare(
    capsys: pytest.CaptureFixture[str], model: Path, files: dict[str, Path], *argv: str
) -> tuple[int, str, str]:
    code = main(
        [
            "compare",
            "--model",
            str(model),
            "--data",
            str(files["data"]),
            "--heldout",
            str(files["heldout"]),
            "--batch-size",
            "3",
            "--no-progress",
            "--observers",
            "minmax",
            "--format",
            "json",
            *argv,
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.skipif(
    not compressed_tensors_has_fp6(), reason="compressed-tensors < 0.20 has no FP6"
)
def test_compare_evaluates_the_new_mx_presets(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    schemes = ["mxfp6a16", "MXFP6A8", "MXFP4XFP8"]
    code, out, err = _compare(capsys, files["model"], files, "--schemes", *schemes)
    assert code == EXIT_OK, err
    cells = json.loads(out)["cells"]
    assert [c["scheme"] for c in cells] == ["MXFP6A16", "MXFP6A8", "MXFP4XFP8"]
    # the 6-bit weights lose less than the 4-bit ones, and every cell is a
    # real measurement
    sqnr = {c["scheme"]: min(c["weight_sqnr"].values()) for c in cells}
    assert sqnr["MXFP6A16"] > sqnr["MXFP4XFP8"] > 0


@pytest.mark.skipif(compressed_tensors_has_fp6(), reason="compressed-tensors has FP6")
def test_compare_refuses_fp6_before_compressed_tensors_0_20(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    missing = tmp_path / "not-a-model"  # refused before the model is read
    code, out, err = _compare(capsys, missing, files, "--schemes", "W4A16", "MXFP6A16")
    assert code == EXIT_USAGE and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "quantobs: error: scheme MXFP6A16 needs compressed-tensors >= 0.20"
    )
    assert "installed: 0.1" in lines[0]
