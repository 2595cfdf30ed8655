"""A process that takes a destination's lock, for the lock tests: run as a
script (`python lock_worker.py MODE ...`), it imports
`quantobs.calibration.locking` without the package's `__init__` (which
imports torch), so that many start quickly.

Modes:
    race TARGET GO RELEASE RESULT [fallback]: wait until the file GO exists,
        try the lock of TARGET; write `busy` to RESULT, or `won`, write
        this process's id to TARGET, wait until RELEASE exists and write
        `won ok` (TARGET still holds this id) or `won corrupted` to RESULT.
    hold TARGET [fallback]: take the lock, print `held`, keep it until
        stdin closes (or the process is killed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_SRC = Path(__file__).resolve().parents[2] / "src"


def _locking() -> types.ModuleType:
    """`quantobs.calibration.locking`, its parent packages left empty."""
    for name, folder in (
        ("quantobs", _SRC / "quantobs"),
        ("quantobs.calibration", _SRC / "quantobs" / "calibration"),
    ):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    import quantobs.calibration.locking as locking

    return locking


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.001)


def _report(result: Path, text: str) -> None:
    """Write `result` whole (renamed into place: never read half-written)."""
    temp = result.with_name(result.name + ".tmp")
    temp.write_text(text, encoding="ascii")
    os.replace(temp, result)


def race(
    locking: types.ModuleType, target: Path, go: Path, release: Path, result: Path
) -> str:
    """This process's part in a race for `target`'s lock (module docstring)."""
    _wait_for(go)
    try:
        with locking.exclusive(target):
            me = str(os.getpid())
            target.write_text(me, encoding="ascii")
            _report(result, "won")
            _wait_for(release)
            kept = target.read_text(encoding="ascii") == me
            return "won ok" if kept else "won corrupted"
    except locking.DestinationBusy:
        return "busy"


@contextmanager
def holding(target: Path, mode: str = "flock") -> Iterator[subprocess.Popen[str]]:
    """A live process holding `target`'s lock while the block runs (killed
    after it unless the block ended it)."""
    process = subprocess.Popen(
        [sys.executable, __file__, "hold", str(target), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "held\n"
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


if __name__ == "__main__":
    mode, target = sys.argv[1], Path(sys.argv[2])
    module = _locking()
    if sys.argv[-1] == "fallback":
        module.USE_FLOCK = False
    if mode == "race":
        go, release, result = (Path(arg) for arg in sys.argv[3:6])
        _report(result, race(module, target, go, release, result))
    else:
        with module.exclusive(target):
            print("held", flush=True)
            sys.stdin.read()
