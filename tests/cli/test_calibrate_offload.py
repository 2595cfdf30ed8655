"""`quantobs calibrate --offload-folder DIR --max-memory cpu=SIZE`: a model
that does not fit the memory limit is loaded with accelerate's offloading
(transformers' `device_map="auto"`, the rest on disk), calibrated, evaluated
and exported in place; its checkpoint, in files of at most
`--max-shard-size`, is the one of the model loaded whole, bit for bit."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from quantobs.cli import EXIT_OK, EXIT_USAGE, main
from tests.calibration.conftest import SENTENCES
from tests.decoders import save_decoder

pytestmark = pytest.mark.peers
pytest.importorskip("accelerate")
pytest.importorskip("compressed_tensors")


def _files(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.suffix in (".safetensors", ".json")
    }


@pytest.fixture(scope="module")
def common(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("offload-cli")
    source = save_decoder("llama", root / "source")
    data, heldout = root / "data.txt", root / "heldout.txt"
    data.write_text("\n".join(SENTENCES[:8]) + "\n", encoding="utf-8")
    heldout.write_text("\n".join(SENTENCES[8:]) + "\n", encoding="utf-8")
    return [
        "calibrate",
        "--model",
        str(source),
        "--scheme",
        "FP8",  # static input scales: observed through accelerate's hooks
        "--data",
        str(data),
        "--heldout",
        str(heldout),
        "--batch-size",
        "4",
        "--max-length",
        "32",
        "--no-progress",
        "--max-shard-size",
        "100KB",
    ]


@pytest.mark.slow  # two CLI runs with their evaluation: ~10-20 s
def test_an_offloaded_model_writes_the_in_memory_checkpoint(
    common: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*common, "--out", str(tmp_path / "memory")]) == EXIT_OK
    in_memory = capsys.readouterr().out
    folder = tmp_path / "offload"
    args = ["--offload-folder", str(folder), "--max-memory", "cpu=200KB"]
    assert main([*common, *args, "--out", str(tmp_path / "offloaded")]) == EXIT_OK
    offloaded = capsys.readouterr().out
    assert not (folder / "quantobs").exists()  # no file of ours left
    files = _files(tmp_path / "offloaded")
    assert "model.safetensors.index.json" in files
    assert len([f for f in files if f.startswith("model-")]) > 2
    assert files == _files(tmp_path / "memory")

    def metrics(out: str) -> str:
        return next(line for line in out.splitlines() if line.startswith("held-out"))

    assert metrics(offloaded) == metrics(in_memory)  # its forward was right


@pytest.mark.slow  # one CLI run with its evaluation: ~10 s
def test_a_failed_offloaded_run_leaves_no_file_of_ours(
    common: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint cannot be written (its parent is a file) once the
    offloaded modules' qparams are written under the offload folder: the
    command fails in one line and removes them."""
    folder = tmp_path / "offload"
    blocked = tmp_path / "file"
    blocked.write_text("not a directory", encoding="utf-8")
    args = ["--offload-folder", str(folder), "--max-memory", "cpu=200KB"]
    assert main([*common, *args, "--out", str(blocked / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot write the checkpoint" in err, err
    assert folder.is_dir()  # it was offloaded
    assert not (folder / "quantobs").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-memory", "cpu=1GiB"], "needs --offload-folder"),
        (["--max-shard-size", "lots"], "--max-shard-size"),
        (["--offload-folder", "OFF", "--max-memory", "cpu"], "DEVICE=SIZE"),
        (["--offload-folder", "OFF", "--max-memory", "cpu=big"], "not a size"),
    ],
)
def test_bad_offload_options_are_one_line(
    extra: list[str],
    message: str,
    common: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = [str(tmp_path / "off") if a == "OFF" else a for a in extra]
    out = tmp_path / "out"
    assert main([*common, *extra, "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("quantobs:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not out.exists()


@pytest.mark.slow  # torchrun with two processes, then one CLI run: ~30-60 s
def test_two_offloaded_processes_write_the_one_process_checkpoint(
    common: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--distributed --offload-folder`: each gloo process offloads under its
    own `rank-N` folder, and process 0 writes the in-memory checkpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = tmp_path / "offload"
    offload = ["--offload-folder", str(folder), "--max-memory", "cpu=200KB"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         f"--master-port={port}", "-m", "quantobs", *common, *offload,
         "--out", str(tmp_path / "two"), "--distributed"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(p.name for p in folder.iterdir()) == ["rank-0", "rank-1"]
    assert not list(folder.glob("*/quantobs/*"))  # no file of ours left
    assert main([*common, "--out", str(tmp_path / "one")]) == EXIT_OK
    capsys.readouterr()
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
