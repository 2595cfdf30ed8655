"""Shared timing helper of the benchmark scripts (run them from the repo root)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["best_ms"]


def best_ms(fns: list[Callable[[], object]], repeat: int, warmup: int) -> list[float]:
    """Best wall time of each `fn()` in milliseconds over `repeat` rounds.

    The functions run interleaved, one call each per round, so that a load
    change on the machine hits all of them alike.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [seconds * 1e3 for seconds in best]
