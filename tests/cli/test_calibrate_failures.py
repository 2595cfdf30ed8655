"""`quantobs calibrate`'s failures on a bad `--resume` state or a failing
write: exit 2, one line naming the file, nothing written. On a tiny Llama."""

from __future__ import annotations

import errno
import functools
import os
import resource
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantobs.cli import EXIT_OK, EXIT_USAGE, calibrate_cmd, main
from tests.calibration.lock_worker import holding
from tests.decoders import save_decoder

TEXTS = [
    "The cat slept on the warm windowsill all afternoon.",
    "Interest rates rose by half a point in March.",
    "Whisk two eggs with a pinch of salt.",
    "Is it going to rain in Oslo on Saturday?",
    "The river froze early that winter.",
]
WEIGHT = "model.layers.0.mlp.down_proj.weight"


@dataclass
class Setup:
    model: Path
    data: Path
    state: Path

    def argv(self, out: Path, *extra: str) -> list[str]:
        """The arguments of a small FP8 run writing `out`."""
        return [
            "calibrate", "--model", str(self.model), "--scheme", "FP8",
            "--data", str(self.data), "--heldout", str(self.data),
            "--batch-size", "4", "--max-length", "32", "--no-progress",
            "--out", str(out), *extra,
        ]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("failures")
    model = save_decoder("llama", root / "llama")
    data = root / "data.txt"
    data.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    made = Setup(model, data, root / "state.safetensors")
    code = main(made.argv(root / "first", "--save-state", str(made.state)))
    assert code == EXIT_OK
    return made


def _rewrite(source: Path, target: Path, **changes: torch.Tensor) -> Path:
    """`source`'s state with some tensors replaced, written to `target`."""
    with safe_open(str(source), framework="pt") as handle:
        header = handle.metadata()
    tensors = {**load_file(source), **changes}
    save_file(tensors, str(target), metadata=header)
    return target


def _one_line_error(
    capsys: pytest.CaptureFixture[str], *names: object, bars: bool = False
) -> None:
    """stderr is one error line naming `names` (after compressed-tensors'
    progress bars where `bars`)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    if bars:
        assert all("Traceback" not in line for line in lines), err
        lines = lines[-1:]
    assert len(lines) == 1, err
    assert lines[0].startswith("quantobs: error: "), err
    for name in names:
        assert str(name) in lines[0], (name, err)


# ------------------------------------------------------------------ --resume


def test_a_nan_range_is_refused_before_the_model_loads(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = f"{WEIGHT}/max_vals"
    value = load_file(setup.state)[key].clone()
    value.view(-1)[0] = float("nan")
    bad = _rewrite(setup.state, tmp_path / "nan.safetensors", **{key: value})

    def no_load(directory: Path) -> None:
        raise AssertionError("the model was loaded before the state was checked")

    monkeypatch.setattr("quantobs.cli.calibrate_cmd.load_model", no_load)
    capsys.readouterr()
    assert main(setup.argv(tmp_path / "out", "--resume", str(bad))) == EXIT_USAGE
    _one_line_error(capsys, bad, "NaN", "without --resume")
    assert not (tmp_path / "out").exists()


def test_a_corrupt_file_is_refused_before_the_model_loads(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(setup.state.read_bytes()[:200])

    def no_load(directory: Path) -> None:
        raise AssertionError("the model was loaded before the state was checked")

    monkeypatch.setattr("quantobs.cli.calibrate_cmd.load_model", no_load)
    capsys.readouterr()
    assert main(setup.argv(tmp_path / "out", "--resume", str(bad))) == EXIT_USAGE
    _one_line_error(capsys, bad, "--save-state")
    assert not (tmp_path / "out").exists()


def test_a_wrong_shape_is_refused_before_the_held_out_set_runs(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    changes = {f"{WEIGHT}/{n}": torch.zeros(7, 1) for n in ("min_vals", "max_vals")}
    bad = _rewrite(setup.state, tmp_path / "shape.safetensors", **changes)

    def no_held_out(*args: object) -> None:
        raise AssertionError("the held-out set ran before the state was checked")

    monkeypatch.setattr("quantobs.report.evaluate.HeldOut.of", no_held_out)
    capsys.readouterr()
    code = main(
        setup.argv(tmp_path / "out", "--resume", str(bad), "--save-state",
                   str(tmp_path / "new.safetensors"))
    )  # fmt: skip
    assert code == EXIT_USAGE
    _one_line_error(capsys, bad, WEIGHT, "(7, 1)")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == [bad]


def test_a_good_state_still_resumes(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(setup.argv(tmp_path / "out", "--resume", str(setup.state)))
    assert code == EXIT_OK, capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ------------------------------------------------------------------ writes

FULL = [
    safetensors.SafetensorError("No space left on device"),
    OSError(errno.ENOSPC, "No space left on device"),
]


@pytest.mark.parametrize("failure", FULL, ids=["SafetensorError", "ENOSPC"])
def test_a_failed_state_write_is_one_line_naming_the_file(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    failure: Exception,
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr("safetensors.torch.save_file", full)
    state = tmp_path / "state.safetensors"
    capsys.readouterr()
    code = main(setup.argv(tmp_path / "out", "--save-state", str(state)))
    assert code == EXIT_USAGE
    _one_line_error(capsys, f"--save-state {state}", "No space left on device")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", FULL, ids=["SafetensorError", "ENOSPC"])
def test_a_failed_checkpoint_write_is_one_line_naming_the_directory(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    failure: Exception,
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr("quantobs.calibration.export._write", full)
    out = tmp_path / "nested" / "out"
    capsys.readouterr()
    assert main(setup.argv(out)) == EXIT_USAGE
    _one_line_error(capsys, f"--out {out}", "No space left on device")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------- --distributed


class _Group:
    """A stand-in for the torchrun process group: rank 0 of `world`."""

    def __init__(self, world: int) -> None:
        self.rank, self.world, self.device, self.started = 0, world, None, False

    def close(self) -> None:
        """Nothing to close."""


def test_fewer_texts_than_processes_is_refused_before_the_model_loads(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        "quantobs.cli.calibrate_cmd.TorchrunGroup", lambda: _Group(len(TEXTS) + 1)
    )

    def no_load(directory: Path) -> None:
        raise AssertionError("the model was loaded before the texts were counted")

    monkeypatch.setattr("quantobs.cli.calibrate_cmd.load_model", no_load)
    capsys.readouterr()
    assert main([*setup.argv(tmp_path / "out"), "--distributed"]) == EXIT_USAGE
    _one_line_error(capsys, f"{len(TEXTS)} calibration text(s) for 6 processes")
    assert not (tmp_path / "out").exists()


def test_an_out_locked_by_a_live_process_is_refused(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with holding(out) as holder:
        capsys.readouterr()
        assert main(setup.argv(out)) == EXIT_USAGE
        _one_line_error(capsys, f"--out {out} is being", holder.pid, bars=True)
        assert [p.name for p in tmp_path.iterdir()] == [".out.lock"]


def test_an_out_written_meanwhile_is_refused_and_kept(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"

    def another_writer(*args: object, **kwargs: object) -> None:
        out.mkdir()
        (out / "theirs.txt").write_text("x", encoding="utf-8")

    monkeypatch.setattr("quantobs.calibration.export._write", another_writer)
    capsys.readouterr()
    assert main(setup.argv(out)) == EXIT_USAGE
    _one_line_error(capsys, f"--out {out} was written meanwhile")
    assert list(tmp_path.iterdir()) == [out]
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]


# ------------------------------------------------------------- --save-state


def test_a_state_locked_by_a_live_process_is_refused(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.safetensors"
    with holding(state) as holder:
        capsys.readouterr()
        code = main(setup.argv(tmp_path / "out", "--save-state", str(state)))
        assert code == EXIT_USAGE
        _one_line_error(capsys, f"--save-state {state} is being", holder.pid)
        assert [p.name for p in tmp_path.iterdir()] == [".state.safetensors.lock"]


@pytest.mark.slow
def test_a_state_another_run_wrote_meanwhile_is_kept(
    setup: Setup,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs with the same --save-state: the other one (a real process)
    runs whole while this one loads its model; this one then refuses to
    replace the state the other wrote, and writes nothing."""
    state = tmp_path / "state.safetensors"
    real_load = calibrate_cmd.load_model
    theirs: list[bytes] = []

    def another_run_first(*args: Any, **kwargs: Any) -> Any:
        argv = setup.argv(tmp_path / "theirs", "--save-state", str(state))
        done = subprocess.run(
            [sys.executable, "-m", "quantobs", *argv],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == EXIT_OK, done.stderr[-3000:]
        theirs.append(state.read_bytes())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(calibrate_cmd, "load_model", another_run_first)
    capsys.readouterr()
    code = main(setup.argv(tmp_path / "mine", "--save-state", str(state)))
    assert code == EXIT_USAGE
    _one_line_error(capsys, f"--save-state {state} was written by another process")
    assert state.read_bytes() == theirs[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.safetensors", "theirs"]


# ----------------------------------------------------- --distributed, recipes


@pytest.mark.slow
def test_processes_given_different_recipes_exit_2(setup: Setup, tmp_path: Path) -> None:
    """Two real processes of one gloo group (the environment torchrun sets),
    given different schemes: both refuse with one line, before calibrating."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank, scheme in enumerate(["FP8", "W8A8"]):
        argv = setup.argv(tmp_path / "out", "--distributed")
        argv[argv.index("--scheme") + 1] = scheme
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": "",
        }  # fmt: skip
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-m", "quantobs", *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        results = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    for rank, (_, err) in zip(ranks, results, strict=True):
        assert rank.returncode == EXIT_USAGE, err[-3000:]
        # one error line, last (torchao's and torch's import-time warnings
        # before it)
        lines = err.strip().splitlines()
        assert "Traceback" not in err, err
        assert [line for line in lines if "quantobs:" in line] == lines[-1:], err
        last = lines[-1]
        assert last.startswith("quantobs: error: --distributed: process(es) [1]")
        assert "same options" in last
    assert not (tmp_path / "out").exists()


def test_resuming_and_saving_the_same_state_replaces_it(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.safetensors"
    state.write_bytes(setup.state.read_bytes())
    argv = setup.argv(tmp_path / "out", "--resume", str(state), "--save-state")
    code = main([*argv, str(state)])
    assert code == EXIT_OK, capsys.readouterr().err
    assert state.read_bytes() != setup.state.read_bytes()  # twice the tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "state.safetensors"]


def test_the_leftovers_of_killed_runs_are_removed_by_the_next(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What killed runs leave beside --out and --save-state (temporary
    entries named with their pid, lock files) goes; a live run's stays."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    dead, live = done.pid, os.getppid()
    hex_ = "0123456789ab"
    stale = [
        f".out.partial-{dead}-{hex_}", f".out.old-{dead}-{hex_}",
        f".state.safetensors.state-{dead}-{hex_}.tmp",
    ]  # fmt: skip
    kept = [name.replace(str(dead), str(live)) for name in stale]
    for name in stale + kept:
        if name.endswith(".tmp"):
            (tmp_path / name).write_bytes(b"half a state")
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors").write_bytes(b"half")
    for lock in (".out.lock", ".state.safetensors.lock"):
        (tmp_path / lock).write_text(str(dead), encoding="ascii")
    state = tmp_path / "state.safetensors"
    code = main(setup.argv(tmp_path / "out", "--save-state", str(state)))
    assert code == EXIT_OK, capsys.readouterr().err
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["out", "state.safetensors", *kept])


# ------------------------------------------------------ a real failing write


def _file_size_limit(limit: int) -> None:
    """In the child: files may not grow past `limit` bytes (the kernel's
    EFBIG, as a full disk's ENOSPC: a write that fails midway)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow
@pytest.mark.parametrize("fails", ["--save-state", "--out"])
def test_a_write_the_kernel_refuses_is_one_line(
    setup: Setup, tmp_path: Path, fails: str
) -> None:
    """A real process whose writes past a size fail (RLIMIT_FSIZE): the state
    file (small) or the checkpoint (larger) cannot be written. Exit 2, one
    line naming the option and the reason, nothing half-written left."""
    state_size = setup.state.stat().st_size
    checkpoint_size = (
        (setup.model.parent / "first" / "model.safetensors").stat().st_size
    )
    assert state_size < checkpoint_size
    limit = state_size // 2 if fails == "--save-state" else state_size * 2
    state, out = tmp_path / "state.safetensors", tmp_path / "out"
    argv = setup.argv(out, "--save-state", str(state))
    done = subprocess.run(
        [sys.executable, "-m", "quantobs", *argv],
        capture_output=True, text=True, timeout=300, check=False,
        preexec_fn=functools.partial(_file_size_limit, limit),
    )  # fmt: skip
    assert done.returncode == EXIT_USAGE, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "quantobs:" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    what = "the checkpoint --out" if fails == "--out" else "--save-state"
    assert lines[0].startswith(f"quantobs: error: cannot write {what} "), lines[0]
    assert "File too large" in lines[0], lines[0]
    kept = ["state.safetensors"] if fails == "--out" else []
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
