"""`benchmarks/bench_gpu.py` runs end to end with tiny sizes on the CPU (its
timings are never asserted; its checks' results are)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # about 10 s of CPU: transformers and a tiny Llama
@pytest.mark.filterwarnings("ignore")
def test_bench_gpu_small_cpu_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench = _load()
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--small", "--no-peers", "--json", str(out)]
    bench.main([*argv, "--observers", "static_minmax"])
    printed = capsys.readouterr().out
    assert "torch.aminmax floor" in printed and "calibrate:" in printed
    found = json.loads(out.read_text())
    assert found["environment"]["device"] == "cpu"
    weights = {row["format"]: row for row in found["weights"]}
    assert set(weights) == set(bench.WEIGHT_FORMATS)
    for row in [*found["weights"], *found["activations"]]:
        assert row["observer"] == "static_minmax" and row["ms"] > 0, row
        assert row["syncs_update"] == 0 and row["syncs_qparams"] <= 2, row
        assert row["cpu_differs"] == 0.0, row  # native == torch path
    assert {row["class"] for row in found["torch_ao"]} == {
        name for name, _ in bench.TORCH_AO_CLASSES
    }
    assert all(row["speed"] > 0 for row in found["torch_ao"])
    calibration = found["calibrate"]
    assert calibration["plain_forward_ms"] > 0
    assert set(calibration["observers"]) == set(bench.CALIBRATION_OBSERVERS)
    assert all("s" in row for row in calibration["observers"].values())
