"""The lock of a destination (`quantobs.calibration.locking`), held and
raced for by real processes (`lock_worker.py`): flock, and the O_EXCL
fallback for filesystems without it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quantobs.calibration import locking
from quantobs.calibration.locking import DestinationBusy, exclusive
from quantobs.calibration.tempfiles import pid_alive, start_time
from tests.calibration.lock_worker import holding

WORKER = str(Path(__file__).with_name("lock_worker.py"))
MODES = ["flock", "fallback"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test in both modes (this process and the workers alike)."""
    monkeypatch.setattr(locking, "USE_FLOCK", request.param == "flock")
    return str(request.param)


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert not pid_alive(done.pid)
    return done.pid


@pytest.fixture
def holder(tmp_path: Path, mode: str) -> Iterator[subprocess.Popen[str]]:
    """A live process holding the lock of `tmp_path / "out"`."""
    with holding(tmp_path / "out", mode) as process:
        yield process


def test_the_lock_holds_the_id_and_goes_away(tmp_path: Path, mode: str) -> None:
    with exclusive(tmp_path / "out") as lock:
        assert lock == tmp_path / ".out.lock"
        assert lock.read_text(encoding="ascii").split() == [
            str(os.getpid()),
            str(start_time(os.getpid())),
        ]
    assert list(tmp_path.iterdir()) == []


def test_a_live_holder_refuses_another(
    tmp_path: Path, mode: str, holder: subprocess.Popen[str]
) -> None:
    with (
        pytest.raises(DestinationBusy, match=f"by process {holder.pid} "),
        exclusive(tmp_path / "out"),
    ):
        pytest.fail("the lock was taken twice")
    holder.communicate()  # the holder lets go: the lock is free again
    assert holder.returncode == 0
    assert list(tmp_path.iterdir()) == []
    with exclusive(tmp_path / "out"):
        pass


def test_a_sigkilled_holders_lock_is_taken_over(
    tmp_path: Path, mode: str, holder: subprocess.Popen[str]
) -> None:
    lock = tmp_path / ".out.lock"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock.read_text(encoding="ascii").split()[0] == str(holder.pid)
    with exclusive(tmp_path / "out"):
        assert lock.read_text(encoding="ascii").split()[0] == str(os.getpid())
    assert not lock.exists()


def test_a_dead_holders_lock_is_taken_over(
    tmp_path: Path, mode: str, dead_pid: int
) -> None:
    lock = tmp_path / ".out.lock"
    lock.write_text(str(dead_pid), encoding="ascii")
    with exclusive(tmp_path / "out"):
        assert lock.read_text(encoding="ascii").split()[0] == str(os.getpid())
    assert list(tmp_path.iterdir()) == []


def test_a_reused_pid_does_not_hold_the_lock(tmp_path: Path, mode: str) -> None:
    """A lock file naming a live process with another start time was left by
    an earlier process of that pid."""
    lock = tmp_path / ".out.lock"
    lock.write_text(f"{os.getppid()} 1", encoding="ascii")
    with exclusive(tmp_path / "out"):
        pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", ["", "garbage"])
def test_an_unreadable_lock_file(tmp_path: Path, mode: str, content: str) -> None:
    """flock: an unlocked file is not held, whatever it says; fallback: one
    being written (no id yet) counts as held, and the message says to
    remove it if no process writes."""
    lock = tmp_path / ".out.lock"
    lock.write_text(content, encoding="ascii")
    if mode == "flock":
        with exclusive(tmp_path / "out"):
            pass
        assert not lock.exists()
        return
    with (
        pytest.raises(DestinationBusy, match=r"an unknown process.*remove the lock"),
        exclusive(tmp_path / "out"),
    ):
        pytest.fail("an unreadable lock was taken")
    assert lock.read_text(encoding="ascii") == content


def test_a_lock_file_swapped_after_opening_is_not_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock: a writer that locks a file its holder unlinked meanwhile (it
    opened it before) sees that and locks the new one."""
    lock = tmp_path / ".out.lock"
    opened: list[int] = []
    real_open = locking._open

    def open_then_swap(path: Path) -> tuple[int, bool] | None:
        found = real_open(path)
        if not opened:  # the first file is unlinked and replaced
            assert found is not None
            opened.append(found[0])
            path.unlink()
            path.write_text("", encoding="ascii")
        return found

    monkeypatch.setattr(locking, "_open", open_then_swap)
    with exclusive(tmp_path / "out"):
        assert lock.read_text(encoding="ascii").split()[0] == str(os.getpid())
    assert opened and list(tmp_path.iterdir()) == []


def _race(tmp_path: Path, mode: str, count: int) -> list[str]:
    """`count` processes race for the lock of a destination whose lock file
    a dead process left; the winner keeps it until all have tried."""
    target, go, release = tmp_path / "out", tmp_path / "go", tmp_path / "release"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".out.lock").write_text(str(dead.pid), encoding="ascii")
    results = [tmp_path / f"result-{i}" for i in range(count)]
    racers = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "race",
                str(target),
                str(go),
                str(release),
                str(result),
                mode,
            ]
        )
        for result in results
    ]
    try:
        time.sleep(0.5)  # let them start and wait for the signal
        go.touch()
        while not all(result.exists() for result in results):
            assert all(racer.poll() in (None, 0) for racer in racers)
            time.sleep(0.01)
        release.touch()
        assert [racer.wait(timeout=60) for racer in racers] == [0] * count
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
    return sorted(result.read_text(encoding="ascii") for result in results)


@pytest.mark.parametrize("mode", MODES)
def test_racers_for_a_stale_lock_exactly_one_wins(tmp_path: Path, mode: str) -> None:
    count = 12
    outcomes = _race(tmp_path, mode, count)
    assert outcomes == ["busy"] * (count - 1) + ["won ok"]
    winner = (tmp_path / "out").read_text(encoding="ascii")
    assert not pid_alive(int(winner))  # the winner's id, written under the lock
    assert not (tmp_path / ".out.lock").exists()


def test_a_killed_breakers_file_does_not_block_the_fallback(
    tmp_path: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fallback: a contender killed while removing a stale lock left
    `.lock.break`; it is stale in turn, and the next writer gets the lock."""
    monkeypatch.setattr(locking, "USE_FLOCK", False)
    (tmp_path / ".out.lock").write_text(str(dead_pid), encoding="ascii")
    (tmp_path / ".out.lock.break").write_text(str(dead_pid), encoding="ascii")
    with exclusive(tmp_path / "out") as lock:
        assert lock.read_text(encoding="ascii").split()[0] == str(os.getpid())
    assert list(tmp_path.iterdir()) == []


def test_a_live_breaker_keeps_the_stale_lock_until_it_is_done(
    tmp_path: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fallback: while another live process holds `.lock.break`, the stale
    lock is left to it: this writer is refused, nothing removed."""
    monkeypatch.setattr(locking, "USE_FLOCK", False)
    lock, breaker = tmp_path / ".out.lock", tmp_path / ".out.lock.break"
    lock.write_text(str(dead_pid), encoding="ascii")
    breaker.write_text(str(os.getppid()), encoding="ascii")
    with (
        pytest.raises(DestinationBusy, match="unknown process"),
        exclusive(tmp_path / "out"),
    ):
        pytest.fail("the lock was taken while another process breaks it")
    assert lock.read_text(encoding="ascii") == str(dead_pid)
    assert breaker.exists()
