"""Temporary files a killed writer left beside a state file or checkpoint
are removed by the next save; those of live processes stay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantobs.calibration import Recipe, attach, calibrate, save_compressed
from quantobs.calibration.state import save_state
from quantobs.calibration.tempfiles import (
    DestinationBusy,
    exclusive,
    pid_alive,
    remove_stale,
    temp_path,
)
from tests.calibration.conftest import tiny_llama, token_batches


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


# ------------------------------------------------------------------ the lock


def test_the_lock_holds_the_pid_and_goes_away(tmp_path: Path) -> None:
    with exclusive(tmp_path / "out") as lock:
        assert lock == tmp_path / ".out.lock"
        assert lock.read_text(encoding="ascii") == str(os.getpid())
    assert list(tmp_path.iterdir()) == []


def test_a_live_holder_refuses_the_checkpoint(tmp_path: Path) -> None:
    lock = tmp_path / ".ckpt.lock"
    lock.write_text(str(os.getppid()), encoding="ascii")
    with pytest.raises(DestinationBusy, match=f"process {os.getppid()}"):
        save_compressed(_calibrated(), tmp_path / "ckpt")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [lock]


@pytest.mark.parametrize("content", ["", "garbage"])
def test_an_unreadable_lock_counts_as_held(tmp_path: Path, content: str) -> None:
    lock = tmp_path / ".out.lock"
    lock.write_text(content, encoding="ascii")
    with (
        pytest.raises(DestinationBusy, match="an unknown process"),
        exclusive(tmp_path / "out"),
    ):
        pass  # pragma: no cover - not reached
    assert lock.exists()


def test_a_dead_holders_lock_is_removed(tmp_path: Path, dead_pid: int) -> None:
    (tmp_path / ".ckpt.lock").write_text(str(dead_pid), encoding="ascii")
    out = save_compressed(_calibrated(), tmp_path / "ckpt")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [out]
