"""The lock a writer holds on a destination while it checks it and renames
its output into place, so that two writers of one destination (two runs
with the same `--out` or `--save-state`) never both succeed.

`exclusive(dir/NAME)` holds the lock file `dir/.NAME.lock`:

- Where the kernel has `flock` (Linux, macOS, the BSDs; on NFS Linux
  emulates it with a POSIX lock), the lock is an advisory `flock` on that
  file, which the kernel releases when its holder exits, however it exits
  (SIGKILL included). A lock file a killed holder left is simply not held:
  the next writer locks the same file and takes it over, nothing is ever
  removed to break it, so no two writers can both "break a stale lock". The
  holder releases by unlinking the file while still locking it; a writer
  that locked a file just unlinked (it opened it before) sees that it is no
  longer the file at the path and tries again.
- Fallback (no `fcntl`, e.g. Windows, or a filesystem that refuses `flock`
  with ENOLCK / EOPNOTSUPP / ENOSYS): the lock file is created with
  `O_CREAT | O_EXCL`; it is stale when its process is dead, or its pid now
  names another process (a different start time, read from `/proc` where
  there is one). Only the holder of a second lock, `.NAME.lock.break`
  (created with `O_EXCL`, held for a few system calls), may remove a stale
  lock file, after reading it again: a fresh lock is never removed, and
  at most one contender creates the next. Residual risk: a contender killed
  while holding `.lock.break` leaves it to be removed as stale in turn, and
  two contenders removing that one at once could both break the main lock
  (a SIGKILL inside a window of a few system calls, on such filesystems
  only).

The holder's id (`pid start-time`) is written inside, for the message of
`DestinationBusy`, which a writer gets while another live process holds the
lock. `DestinationChanged` is what a writer raises when, holding the lock,
it finds a destination another process wrote since it started.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantobs.calibration.tempfiles import pid_alive, start_time

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: the O_EXCL fallback
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "USE_FLOCK",
    "DestinationBusy",
    "DestinationChanged",
    "exclusive",
    "lock_path",
]

#: Whether `exclusive` tries `flock` first (False: always the fallback).
USE_FLOCK = fcntl is not None
# errnos of a filesystem without flock: use the O_EXCL fallback there
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# tries before giving up on a lock file that keeps changing under us
_TRIES = 32


class DestinationBusy(FileExistsError):
    """Another live process holds the lock of the destination."""


class DestinationChanged(FileExistsError):
    """The destination was written by another process since the writer
    started (so it is kept, not replaced)."""


def lock_path(target: Path) -> Path:
    """The lock file of `target`: `.NAME.lock` beside it."""
    return target.parent / f".{target.name}.lock"


@contextmanager
def exclusive(target: Path) -> Iterator[Path]:
    """Hold the lock of `target` while the block runs (module docstring).

    Yields:
        The lock file.

    Raises:
        DestinationBusy: a live process holds it (or, on the fallback, a
            lock file that cannot be read: one being written).
    """
    lock = lock_path(target)
    handle = _acquire(lock, target)
    try:
        yield lock
    finally:
        _release(lock, handle)


def _token() -> str:
    """This process's id in a lock file: `pid start-time` (or `pid`)."""
    started = start_time(os.getpid())
    return str(os.getpid()) if started is None else f"{os.getpid()} {started}"


def _holder_alive(token: str) -> bool:
    """Whether the process a lock file's token names still runs."""
    parts = token.split()
    if not parts or not parts[0].isdigit():
        return True  # unreadable: being written, count it as held
    pid = int(parts[0])
    if not pid_alive(pid):
        return False
    if len(parts) > 1:
        now = start_time(pid)
        return now is None or now == parts[1]
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _busy(lock: Path, target: Path, token: str) -> DestinationBusy:
    pid = token.split()[0] if token.split() else ""
    who = f"process {pid}" if pid.isdigit() else "an unknown process"
    unknown = "" if pid.isdigit() else ", or remove the lock if no process writes"
    return DestinationBusy(
        errno.EEXIST,
        f"{target} is being written by {who} (lock {lock}); wait for it to "
        f"finish or choose another destination{unknown}",
        str(lock),
    )


def _open(lock: Path) -> tuple[int, bool] | None:
    """`(descriptor, created)` of the lock file, or None: it vanished."""
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    try:
        return os.open(lock, flags), False
    except FileNotFoundError:
        return None


def _flock(handle: int) -> bool | None:
    """Lock `handle` without waiting: True locked, False held by another
    process, None no flock here (use the fallback)."""
    if not USE_FLOCK or fcntl is None:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in _NO_FLOCK:
            return None
        raise
    return True


def _is_at(lock: Path, handle: int) -> bool:
    """Whether the open file `handle` is still the file at `lock`."""
    try:
        return os.path.samestat(os.fstat(handle), os.stat(lock))
    except FileNotFoundError:
        return False


def _write_token(handle: int) -> None:
    os.ftruncate(handle, 0)
    os.write(handle, _token().encode("ascii"))
    os.fsync(handle)


def _acquire(lock: Path, target: Path) -> int:
    """The descriptor of the lock file, locked by this process."""
    token = ""
    for _ in range(_TRIES):
        opened = _open(lock)
        if opened is None:
            continue
        handle, created = opened
        try:
            locked = _flock(handle)
            if locked is None and created:
                locked = True  # fallback: created with O_EXCL, ours
            if locked and _is_at(lock, handle):
                _write_token(handle)
                return handle
            if locked is False:
                raise _busy(lock, target, _read(lock))
        except BaseException:
            os.close(handle)
            raise
        os.close(handle)
        if locked is None:  # fallback, another process's file
            token = _read(lock)
            if _holder_alive(token):
                raise _busy(lock, target, token)
            _break_stale(lock, token)
    raise _busy(lock, target, "")  # it kept changing: whose is unknown


def _break_stale(lock: Path, token: str) -> None:
    """Fallback: remove the lock file of a dead holder (`token`) holding
    `.lock.break`, unless another contender did first (then try again)."""
    breaker = lock.with_name(lock.name + ".break")
    try:
        handle = os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if _holder_alive(_read(breaker)):
            time.sleep(0.001)  # another contender is at it: a few syscalls
        else:  # a breaker was killed
            breaker.unlink(missing_ok=True)
        return
    try:
        os.write(handle, _token().encode("ascii"))
        # only breakers remove another's lock file: still the dead one's?
        if _read(lock) == token:
            lock.unlink(missing_ok=True)
    finally:
        os.close(handle)
        breaker.unlink(missing_ok=True)


def _release(lock: Path, handle: int) -> None:
    """Unlink the lock file while still holding it, then close it (which
    releases the flock)."""
    try:
        if _is_at(lock, handle):
            lock.unlink(missing_ok=True)
    finally:
        os.close(handle)
