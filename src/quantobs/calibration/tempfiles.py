"""Hidden temporary files and directories beside a destination, named with
the writer's process id so that the next writer can remove those a killed
process left behind.

A writer of `dir/NAME` works in `dir/.NAME.<kind>-<pid>-<hex>` (plus a
suffix, e.g. `.tmp`) and renames it into place. A SIGKILL leaves it there;
`remove_stale(dir/NAME, kind)` removes every such entry whose pid is not a
live process, and keeps those of live processes (a concurrent writer);
`remove_leftovers(dir/NAME)` does so for every kind a writer leaves
(`LEFTOVER_KINDS`). `stamp(path)` identifies the file at a path, so that a
writer can tell whether another process replaced it meanwhile. The lock
around a writer's final check-and-rename is `quantobs.calibration.locking`.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LEFTOVER_KINDS",
    "FileStamp",
    "pid_alive",
    "remove_leftovers",
    "remove_stale",
    "stamp",
    "start_time",
    "temp_path",
]

#: `(kind, suffix)` of every temporary entry a writer makes beside its
#: destination: a state file being written, a checkpoint being written, the
#: checkpoint it replaces while it renames.
LEFTOVER_KINDS: tuple[tuple[str, str], ...] = (
    ("state", ".tmp"),
    ("partial", ""),
    ("old", ""),
)


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


def start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from
    `/proc/PID/stat`), or None where unknown (no such process, no `/proc`):
    tells a process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses;
    # the start time is field 22, the 20th after the comm
    fields = text[text.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


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


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the temporary entries of every kind (`LEFTOVER_KINDS`) that
    dead processes left beside `target` (`remove_stale`).

    Returns:
        The entries removed.
    """
    removed: list[Path] = []
    for kind, suffix in LEFTOVER_KINDS:
        removed += remove_stale(target, kind, suffix)
    return removed


@dataclass(frozen=True)
class FileStamp:
    """What identifies the file at a path: its device, inode, size and
    modification time (a replaced or rewritten file differs)."""

    device: int
    inode: int
    size: int
    mtime_ns: int


def stamp(path: Path) -> FileStamp | None:
    """The stamp of the file at `path`, or None when there is none."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return FileStamp(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
