"""`quantobs calibrate`, end to end on the embedded MiniLM."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from quantobs.cli import EXIT_OK, EXIT_USAGE, main
from quantobs.cli.calibrate_cmd import shard
from quantobs.cli.default_model import default_model_path

#: transformers warns that the checkpoint's own quantization_config wins over
#: the one passed to from_pretrained (only `dequantize` is taken from ours):
#: expected whenever a compressed-tensors checkpoint is loaded dequantized.
MERGE_WARNING = "ignore:You passed `quantization_config`:UserWarning"

TEXTS = [
    "The cat slept on the warm windowsill all afternoon.",
    "Interest rates rose by half a point in March.",
    "Whisk two eggs with a pinch of salt.",
    "Is it going to rain in Oslo on Saturday?",
]


@dataclass
class Run:
    code: int
    out: Path
    state: Path


def _write_data(path: Path, texts: list[str]) -> Path:
    path.write_text("\n".join(texts) + "\n\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_data(tmp_path_factory.mktemp("data") / "tiny.txt", TEXTS)


@pytest.fixture(scope="module", params=["W8A8", "FP8"])
def run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    data_file: Path,
) -> Run:
    scheme: str = request.param
    root = tmp_path_factory.mktemp(scheme)
    out, state = root / "checkpoint", root / "state.safetensors"
    code = main(
        [
            "calibrate",
            "--scheme",
            scheme.lower(),
            "--data",
            str(data_file),
            "--batch-size",
            "2",
            "--out",
            str(out),
            "--save-state",
            str(state),
            "--no-progress",
        ]
    )
    return Run(code, out, state)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["calibrate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------ checkpoints


@pytest.mark.filterwarnings(MERGE_WARNING)
def test_the_checkpoint_loads_in_transformers(run: Run) -> None:
    assert run.code == EXIT_OK
    config = json.loads((run.out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    assert quant["ignore"] == ["pooler.dense"]  # the default, resolved
    assert (run.out / "tokenizer.json").is_file()  # copied from the source
    assert run.state.is_file()
    loaded = transformers.AutoModel.from_pretrained(
        run.out,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(run.out)
    reference = transformers.AutoModel.from_pretrained(
        default_model_path().parent
    ).eval()
    name = "encoder.layer.0.attention.self.query"
    found = loaded.get_submodule(name).weight.float()
    expected = reference.get_submodule(name).weight
    assert not torch.equal(found, expected)  # quantized ...
    error = (found - expected).norm() / expected.norm()
    assert error < 0.05  # ... closely (8-bit: a few percent at most)
    with torch.no_grad():
        hidden = loaded(**tokenizer(TEXTS[:2], padding=True, return_tensors="pt"))
    assert torch.isfinite(hidden.last_hidden_state).all()


def test_the_report_and_path_are_printed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, data_file: Path
) -> None:
    out = tmp_path / "ckpt"
    code, stdout, err = _cli(
        capsys,
        "--scheme",
        "W8A8",
        "--data",
        str(data_file),
        "--out",
        str(out),
        "--ignore",
        "re:.*pooler.*",
        "re:.*layer\\.5\\..*",
        "--no-progress",
    )
    assert code == EXIT_OK, err
    # W8A8: min-max weights and dynamic inputs need no batch; none is run
    assert "calibrated 30 modules from their weights alone" in stdout
    # the held-out metrics of the result (W8A8 on MiniLM: close to the original)
    metrics = re.search(r"held-out: cos mean (\d\.\d{4}), worst (\d\.\d{4})", stdout)
    assert metrics is not None, stdout
    assert 0.99 < float(metrics[2]) <= float(metrics[1]) <= 1
    assert stdout.rstrip().splitlines()[-1] == f"checkpoint  {out.absolute()}"
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "pooler.dense" in quant["ignore"]
    assert "encoder.layer.5.output.dense" in quant["ignore"]
    assert len(quant["ignore"]) == 7


def test_resume_gives_the_scales_of_one_run_over_all_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FP8's static input scales: calibrating on A, saving, resuming on B is
    calibrating on A + B (batches of one text: no padding differs)."""
    first = _write_data(tmp_path / "a.txt", TEXTS[:2])
    second = _write_data(tmp_path / "b.txt", TEXTS[2:])
    both = _write_data(tmp_path / "ab.txt", TEXTS)
    state = tmp_path / "a.safetensors"
    common = ["--scheme", "FP8", "--batch-size", "1", "--no-progress"]
    runs = [
        [*common, "--data", str(first), "--out", str(tmp_path / "a"),
         "--save-state", str(state)],
        [*common, "--data", str(second), "--out", str(tmp_path / "resumed"),
         "--resume", str(state)],
        [*common, "--data", str(both), "--out", str(tmp_path / "whole")],
    ]  # fmt: skip
    for argv in runs:
        code, _, err = _cli(capsys, *argv)
        assert code == EXIT_OK, err
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    alone = load_file(tmp_path / "a" / "model.safetensors")
    scales = [name for name in whole if name.endswith("input_scale")]
    assert len(scales) == 36
    for name in scales:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0)
    assert any(not torch.equal(alone[name], whole[name]) for name in scales)


def test_distributed_in_a_process_group_of_one(
    tmp_path: Path,
    data_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a one-process NCCL group is not worth a GPU here")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "ckpt"
    code, _, err = _cli(
        capsys, "--scheme", "FP8", "--data", str(data_file), "--out", str(out),
        "--distributed", "--no-progress",
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert (out / "config.json").is_file()
    assert not torch.distributed.is_initialized()  # the command closed its group


@pytest.mark.parametrize(
    ("count", "world", "expected"),
    [
        (7, 3, [range(3), range(3, 5), range(5, 7)]),
        (6, 3, [range(2), range(2, 4), range(4, 6)]),
        (2, 2, [range(1), range(1, 2)]),
    ],
)
def test_shards_are_contiguous_and_cover_everything(
    count: int, world: int, expected: list[range]
) -> None:
    assert [shard(count, rank, world) for rank in range(world)] == expected


# ------------------------------------------------------------------ errors


def test_errors_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, data_file: Path
) -> None:
    out = str(tmp_path / "out")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{"txt": "oops"}\n', encoding="utf-8")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x", encoding="utf-8")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    data = ["--data", str(data_file)]
    cases = [
        (["--scheme", "W9A9", "--out", out],
         "unknown scheme 'W9A9'; available presets: FP8, "),
        (["--scheme", "W8A8", "--model", str(tmp_path / "nope"), "--out", out],
         "does not exist"),
        (["--scheme", "W8A8", "--model", str(no_config), "--out", out],
         "has no config.json"),
        (["--scheme", "W8A8", "--data", str(tmp_path / "missing.txt"), "--out", out],
         "cannot read the calibration data: no such file"),
        (["--scheme", "W8A8", "--data", str(bad_jsonl), "--out", out],
         'bad.jsonl:2: expected a JSON object with a "text" field'),
        (["--scheme", "MXFP8", *data, "--out", out],
         "scheme MXFP8 cannot be written as a checkpoint"),
        (["--scheme", "W8A8", *data, "--out", str(full)], "exists and is not empty"),
        (["--scheme", "W8A8", *data, "--out", out, "--distributed"],
         "--distributed needs the environment torchrun sets"),
        (["--scheme", "W8A8", *data, "--out", out, "--observer", "minmax",
          "--input-observer", "minmax"], "--observer sets both observers"),
        (["--scheme", "W8A8", *data, "--out", out, "--weight-observer", "nope"],
         "cannot attach the observers: unknown observer 'nope'"),
        (["--scheme", "FP8", *data, "--out", out, "--resume",
          str(tmp_path / "none.safetensors")], "cannot resume from"),
    ]  # fmt: skip
    for argv, message in cases:
        code, _, err = _cli(capsys, *argv)
        assert code == EXIT_USAGE, (argv, err)
        last = err.rstrip().splitlines()[-1]  # after any loading progress bar
        assert last.startswith("quantobs: error: "), err
        assert message in last, (message, err)
        assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert (full / "keep.txt").read_text(encoding="utf-8") == "x"


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--out", "x"]) == EXIT_USAGE  # no --scheme
    assert "--scheme" in capsys.readouterr().err
    code = main(["calibrate", "--scheme", "W8A8", "--out", "x", "--batch-size", "0"])
    assert code == EXIT_USAGE
    assert "expected a positive integer" in capsys.readouterr().err


def test_torchrun_with_two_processes_writes_the_one_process_checkpoint(
    tmp_path: Path, data_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two gloo processes, each batching half the texts (4 texts, one batch
    of 4: fewer batches than processes is fine), then process 0 alone
    writes: the checkpoint equals a single process's, tensor for tensor."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["--scheme", "FP8", "--data", str(data_file), "--batch-size", "4"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         f"--master-port={port}", "-m", "quantobs", "calibrate", *common,
         "--out", str(tmp_path / "two"), "--distributed", "--no-progress"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "checkpoint" in done.stdout
    code, _, err = _cli(capsys, *common, "--out", str(tmp_path / "one"))
    assert code == EXIT_OK, err
    two = load_file(tmp_path / "two" / "model.safetensors")
    one = load_file(tmp_path / "one" / "model.safetensors")
    assert two.keys() == one.keys()
    for name, value in one.items():
        assert torch.equal(two[name], value), name
