"""Hidden temporary files and directories beside a destination, named with
the writer's process id so that the next writer can remove those a killed
process left behind.

A writer of `dir/NAME` works in `dir/.NAME.<kind>-<pid>-<hex>` (plus a
suffix, e.g. `.tmp`) and renames it into place. A SIGKILL leaves it there;
`remove_stale(dir/NAME, kind)` removes every such entry whose pid is not a
live process, and keeps those of live processes (a concurrent writer).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

__all__ = ["pid_alive", "remove_stale", "temp_path"]


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
