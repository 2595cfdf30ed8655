"""Hidden temporary files and directories beside a destination, named with
the writer's process id so that the next writer can remove those a killed
process left behind.

A writer of `dir/NAME` works in `dir/.NAME.<kind>-<pid>-<hex>` (plus a
suffix, e.g. `.tmp`) and renames it into place. A SIGKILL leaves it there;
`remove_stale(dir/NAME, kind)` removes every such entry whose pid is not a
live process, and keeps those of live processes (a concurrent writer).
`exclusive(dir/NAME)` holds the lock file `dir/.NAME.lock` (its holder's
pid inside) around a writer's final check-and-rename, so two writers of one
destination never silently replace each other.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "DestinationBusy",
    "exclusive",
    "pid_alive",
    "remove_stale",
    "temp_path",
]


def temp_path(target: Path, kind: str, suffix: str = "") -> Path:
    """A new hidden name beside `target` carrying this process's id."""
    name = f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}"
    return target.parent / name


def pid_alive(pid: int) -> bool:
    """Whether a process with id `pid` exists (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_pattern(target: Path, kind: str, suffix: str) -> re.Pattern[str]:
    return re.compile(
        rf"\.{re.escape(target.name)}\.{re.escape(kind)}-(\d+)-[0-9a-f]+"
        + re.escape(suffix)
    )


def remove_stale(target: Path, kind: str, suffix: str = "") -> list[Path]:
    """Remove the temporary entries of `kind` beside `target` that processes
    no longer alive left (best effort: what cannot be removed stays).

    Returns:
        The entries removed.
    """
    pattern = _stale_pattern(target, kind, suffix)
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or pid_alive(int(found.group(1))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry)
    return removed


class DestinationBusy(FileExistsError):
    """Another live process holds the lock of the destination."""


@contextmanager
def exclusive(target: Path) -> Iterator[Path]:
    """Hold `.NAME.lock` beside `target` (created with `O_EXCL`, this
    process's id inside) while the block runs; a lock whose process is dead
    is removed first.

    Yields:
        The lock file.

    Raises:
        DestinationBusy: a live process (or one whose lock cannot be read)
            holds it.
    """
    lock = target.parent / f".{target.name}.lock"
    _acquire(lock, target)
    try:
        yield lock
    finally:
        lock.unlink(missing_ok=True)


def _holder(lock: Path) -> int | None:
    """The process id in a lock file, or None where it cannot be read."""
    try:
        return int(lock.read_text(encoding="ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _acquire(lock: Path, target: Path) -> None:
    holder: int | None = None
    for _ in range(2):
        try:
            handle = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if holder is not None and not pid_alive(holder):
                lock.unlink(missing_ok=True)  # left by a dead process
                continue
            break
        with os.fdopen(handle, "w", encoding="ascii") as file:
            file.write(str(os.getpid()))
        return
    who = "an unknown process" if holder is None else f"process {holder}"
    raise DestinationBusy(
        errno.EEXIST,
        f"{target} is being written by {who} (lock {lock}); wait for it to "
        "finish or choose another destination (remove the lock only if no "
        "such process runs)",
        str(lock),
    )
