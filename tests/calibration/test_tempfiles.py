"""Temporary files a killed writer left beside a state file or checkpoint
are removed by the next save; those of live processes stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from quantobs.calibration import Recipe, attach, calibrate, save_compressed
from quantobs.calibration.locking import DestinationBusy, DestinationChanged
from quantobs.calibration.state import save_state
from quantobs.calibration.tempfiles import (
    pid_alive,
    remove_leftovers,
    remove_stale,
    stamp,
    temp_path,
)
from tests.calibration.conftest import tiny_llama, token_batches
from tests.calibration.lock_worker import holding


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert not pid_alive(done.pid)
    return done.pid


def _calibrated() -> object:
    model = tiny_llama()
    attach(model, Recipe.from_scheme("W8A8", ignore=["lm_head"]))
    calibrate(model, token_batches(1), progress=False)
    return model


def test_temp_names_carry_the_pid(tmp_path: Path) -> None:
    name = temp_path(tmp_path / "s.safetensors", "state", ".tmp").name
    assert name.startswith(f".s.safetensors.state-{os.getpid()}-")
    assert name.endswith(".tmp")


def test_only_dead_writers_entries_are_removed(tmp_path: Path, dead_pid: int) -> None:
    target = tmp_path / "out"
    dead = tmp_path / f".out.partial-{dead_pid}-0123456789ab"
    live = tmp_path / f".out.partial-{os.getppid()}-0123456789ab"
    other = tmp_path / f".other.partial-{dead_pid}-0123456789ab"
    unrelated = tmp_path / ".out.partial-notapid"
    for entry in (dead, live, other, unrelated):
        entry.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    assert remove_stale(target, "partial") == [dead]
    assert sorted(tmp_path.iterdir()) == sorted([live, other, unrelated])


def test_save_state_removes_stale_temp_files(tmp_path: Path, dead_pid: int) -> None:
    target = tmp_path / "s.safetensors"
    dead = tmp_path / f".s.safetensors.state-{dead_pid}-0123456789ab.tmp"
    live = tmp_path / f".s.safetensors.state-{os.getppid()}-0123456789ab.tmp"
    dead.write_bytes(b"half a state")
    live.write_bytes(b"being written")
    save_state(_calibrated(), target)  # type: ignore[arg-type]
    assert sorted(tmp_path.iterdir()) == sorted([live, target])


def test_save_compressed_removes_stale_partial_directories(
    tmp_path: Path, dead_pid: int
) -> None:
    out = tmp_path / "ckpt"
    dead = tmp_path / f".ckpt.partial-{dead_pid}-0123456789ab"
    live = tmp_path / f".ckpt.partial-{os.getppid()}-0123456789ab"
    for entry in (dead, live):
        entry.mkdir()
        (entry / "model.safetensors").write_bytes(b"half")
    save_compressed(_calibrated(), out)  # type: ignore[arg-type]
    assert sorted(tmp_path.iterdir()) == sorted([live, out])
    assert (out / "model.safetensors").is_file()


# ------------------------------------------------------- leftovers and locks


def test_every_leftover_kind_of_a_dead_writer_is_removed(
    tmp_path: Path, dead_pid: int
) -> None:
    target = tmp_path / "out"
    dead = [
        tmp_path / f".out.state-{dead_pid}-0123456789ab.tmp",
        tmp_path / f".out.partial-{dead_pid}-0123456789ab",
        tmp_path / f".out.old-{dead_pid}-0123456789ab",
    ]
    live = [p.with_name(p.name.replace(str(dead_pid), str(os.getppid()))) for p in dead]
    for entry in dead + live:
        if entry.suffix == ".tmp":
            entry.write_bytes(b"half")
        else:
            entry.mkdir()
            (entry / "model.safetensors").write_bytes(b"half")
    assert sorted(remove_leftovers(target)) == sorted(dead)
    assert sorted(tmp_path.iterdir()) == sorted(live)


def test_stamp_tells_a_replaced_file(tmp_path: Path) -> None:
    path = tmp_path / "s"
    assert stamp(path) is None
    path.write_bytes(b"one")
    first = stamp(path)
    assert first is not None and stamp(path) == first
    replacement = tmp_path / "t"
    replacement.write_bytes(b"one")
    os.replace(replacement, path)
    assert stamp(path) != first


def test_a_live_holder_refuses_the_checkpoint(tmp_path: Path) -> None:
    with holding(tmp_path / "ckpt") as holder:
        with pytest.raises(DestinationBusy, match=f"process {holder.pid} "):
            save_compressed(_calibrated(), tmp_path / "ckpt")  # type: ignore[arg-type]
        assert [p.name for p in tmp_path.iterdir()] == [".ckpt.lock"]


def test_a_live_holder_refuses_the_state(tmp_path: Path) -> None:
    target = tmp_path / "s.safetensors"
    with holding(target) as holder:
        with pytest.raises(DestinationBusy, match=f"process {holder.pid} "):
            save_state(_calibrated(), target)  # type: ignore[arg-type]
        assert [p.name for p in tmp_path.iterdir()] == [".s.safetensors.lock"]


def test_a_state_written_meanwhile_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "s.safetensors"
    seen = stamp(target)  # none yet
    target.write_bytes(b"another process's state")
    with pytest.raises(DestinationChanged, match="written by another process"):
        save_state(_calibrated(), target, expected=seen)  # type: ignore[arg-type]
    assert target.read_bytes() == b"another process's state"
    assert list(tmp_path.iterdir()) == [target]
    save_state(_calibrated(), target, expected=stamp(target))  # type: ignore[arg-type]
    assert target.read_bytes() != b"another process's state"


def test_a_dead_holders_lock_is_taken_over(tmp_path: Path, dead_pid: int) -> None:
    (tmp_path / ".ckpt.lock").write_text(str(dead_pid), encoding="ascii")
    out = save_compressed(_calibrated(), tmp_path / "ckpt")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [out]


# A process that overwrites a checkpoint and is SIGKILLed in its last step:
# the old checkpoint moved aside, the new one not yet renamed into place.
_KILLED_AT_RENAME = """
import os, signal, sys
from quantobs.calibration import Recipe, attach, calibrate, save_compressed
from tests.calibration.conftest import tiny_llama, token_batches

def calibrated():
    model = tiny_llama()
    attach(model, Recipe.from_scheme("W8A8", ignore=["lm_head"]))
    calibrate(model, token_batches(1), progress=False)
    return model

out = sys.argv[1]
real_rename = os.rename

def rename_then_die(source, target):
    real_rename(source, target)
    if ".old-" in str(target):
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = rename_then_die
save_compressed(calibrated(), out, overwrite=True)
"""


@pytest.mark.slow
def test_the_leftovers_of_a_run_killed_at_the_rename_are_removed(
    tmp_path: Path,
) -> None:
    out = save_compressed(_calibrated(), tmp_path / "ckpt")  # type: ignore[arg-type]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    killed = subprocess.Popen(
        [sys.executable, "-c", _KILLED_AT_RENAME, str(out)],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    pid = killed.pid
    left = {p.name.rsplit("-", 1)[0]: p for p in tmp_path.iterdir()}
    assert sorted(left) == [".ckpt.lock", f".ckpt.old-{pid}", f".ckpt.partial-{pid}"]
    assert (left[f".ckpt.old-{pid}"] / "model.safetensors").is_file()
    again = save_compressed(_calibrated(), out)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [again]
    assert (again / "model.safetensors").is_file()
