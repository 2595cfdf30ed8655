"""Host copies of small device histograms, read with the deferred checks.

The searches that decide as they go (the certified global L2 search, the
exhaustive entropy search, torch.ao's greedy walk) ask the host at every
step; on a GPU each question is a host-device synchronisation, and a
one-qparam histogram (2048 bins) is far too small to keep a GPU busy
anyway. So a histogram these searches solve is copied to the host once, in
the same read as the observer's deferred checks (`ObserverEngine._settle`'s
`_extra_pending` hook): qparams still cost at most two synchronisations,
and the search runs on the host copy (`quantobs.core.syncs.on_host`), with
the same code and arithmetic as on a CPU tensor (so the same numbers). The
range it finds goes back to the device.

`pack` flattens a histogram into one float64 tensor, exactly: counts are
integers below 2**53, exponents small, each int64 offset split in two
32-bit halves, the float32 ranges exact in float64. `unpack` rebuilds it on
the CPU. `HostCopy` keeps the last copy while the device histogram's
buffers are unchanged (identity and in-place version, as `SolveCache`).
"""

from __future__ import annotations

import weakref

import torch

from quantobs.observers.solve_cache import _version
from quantobs.stats.histogram import Histogram

__all__ = ["HostCopy", "pack", "unpack"]

_HALF = 1 << 32


def pack(hist: Histogram) -> torch.Tensor:
    """`hist` as one 1-D float64 tensor on its device (exact, see module)."""
    offset = hist.offset.reshape(-1)
    parts = [
        hist.counts.reshape(-1),
        hist.exponent.reshape(-1),
        torch.div(offset, _HALF, rounding_mode="floor"),
        torch.remainder(offset, _HALF),
        hist.min_vals.reshape(-1),
        hist.max_vals.reshape(-1),
    ]
    return torch.cat([p.to(torch.float64) for p in parts])


def unpack(values: list[float], like: Histogram) -> Histogram:
    """The CPU histogram `pack(like)` read as `values`."""
    shape, bins = like.qparam_shape, like.bins
    q = like.min_vals.numel()
    flat = torch.tensor(values, dtype=torch.float64)
    sizes = [q * bins, q, q, q, q, q]
    counts, exponent, high, low, min_vals, max_vals = torch.split(flat, sizes)
    offset = high.to(torch.int64) * _HALF + low.to(torch.int64)
    return Histogram(
        counts=counts.to(torch.int64).reshape(*shape, bins),
        exponent=exponent.to(torch.int64).reshape(shape),
        offset=offset.reshape(shape),
        min_vals=min_vals.to(torch.float32).reshape(shape),
        max_vals=max_vals.to(torch.float32).reshape(shape),
        absolute=like.absolute,
    )


class HostCopy:
    """The host copy of one device histogram, while its buffers are unchanged."""

    def __init__(self) -> None:
        self._refs: list[tuple[weakref.ref[torch.Tensor], int | None]] = []
        self._copy: Histogram | None = None
        self._asked: Histogram | None = None  # packed, waiting for its read

    @staticmethod
    def _key(hist: Histogram) -> list[torch.Tensor]:
        return list(hist.state().values())

    def _fresh(self, hist: Histogram) -> bool:
        tensors = self._key(hist)
        if self._copy is None or len(tensors) != len(self._refs):
            return False
        return all(
            ref() is tensor and _version(tensor) == version
            for tensor, (ref, version) in zip(tensors, self._refs, strict=True)
        )

    def get(self, hist: Histogram) -> Histogram | None:
        """The host copy of `hist`, if one was read since it last changed (a
        copy of untracked tensors, e.g. inference tensors, serves once)."""
        if not self._fresh(hist):
            return None
        copy = self._copy
        if any(version is None for _, version in self._refs):
            self.clear()
        return copy

    def ask(self, hist: Histogram) -> torch.Tensor | None:
        """`pack(hist)` to read with the deferred checks (None: already copied)."""
        if self._fresh(hist):
            return None
        self._asked = hist
        return pack(hist)

    def take(self, values: list[float]) -> None:
        """Keep the copy of the histogram last `ask`ed, read as `values`."""
        hist, self._asked = self._asked, None
        if hist is None:
            return
        self._copy = unpack(values, hist)
        self._refs = [(weakref.ref(t), _version(t)) for t in self._key(hist)]

    def clear(self) -> None:
        """Forget the copy."""
        self._refs, self._copy, self._asked = [], None, None

    def __getstate__(self) -> dict[str, object]:
        return {}  # weak references do not pickle; no copy does

    def __setstate__(self, state: dict[str, object]) -> None:
        self.clear()
