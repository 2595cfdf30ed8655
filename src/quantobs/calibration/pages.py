"""Give the kernel back the file pages of the weights the export freed.

transformers loads a safetensors checkpoint without copying it: safetensors
maps each file once (`safe_open(..., backend="mmap")`: a private mapping of
the whole file) and every tensor is a storage over its own bytes of that
mapping. A page the process has read (calibration reads every weight it
observes, the export every tensor it writes) stays resident, counted in the
process's RSS (`RssFile`), for as long as the file stays mapped, i.e. while
any tensor of the file lives, not only the one that read it. The in-place
export replaces each quantized module's weight by its compressed tensors:
without this module the original weights' pages stay resident beside the
compressed ones to the end (measured with `benchmarks/bench_scale.py`: the
export's peak was the whole model's file plus the compressed weights).

`FilePages(model)` records, before the export changes anything, the
storages of the model's tensors that lie in a private file mapping (one
read of `/proc/self/maps`); `release()`, after each module's originals are
dropped, calls `madvise(MADV_DONTNEED)` on the pages of each recorded
storage that is now freed. Why that is safe:

* only a storage that no tensor holds any more (a weak reference to it
  has expired): nothing reads these bytes again;
* only inside a private (copy-on-write) mapping of a file: DONTNEED there
  drops this process's pages, and a later access would read the file again
  (the same bytes, for a page never written to: the file itself is never
  written); never anonymous memory, where the allocator may already have
  given the freed bytes to a live tensor;
* only the pages wholly inside the storage's bytes (a page it shares with
  a neighbouring tensor stays), and none that a tensor of the model still
  uses (a loader may make several storages over one file tensor);
* only while a recorded storage of the same mapping is alive and held
  during the call (a tensor of the model): it has kept the mapping mapped
  since it was read (a storage over a mapped file keeps its mapping, as
  safetensors' do), so the address range cannot have been unmapped and
  given to another mapping. Pages of a mapping with no such storage left
  are not dropped (the mapping went with its last tensor, or something
  else holds it).

Linux only (the mappings are read from `/proc/self/maps`); elsewhere,
where torch has no storage weak references, or where a tensor of the model
shows no storage, `release` does nothing.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FilePages", "file_mappings"]

_MADV_DONTNEED = 4  # Linux


@dataclass(frozen=True)
class MappedRange:
    """One line of `/proc/self/maps`: `[start, end)` and whether it maps a
    file privately (`p` in its permissions, a non-zero inode)."""

    start: int
    end: int
    private_file: bool


#: a line of /proc/self/maps: start-end perms offset dev inode [path]
_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S{3}(\S) \S+ \S+ (\d+) *(.*)$", re.M)


def file_mappings() -> list[MappedRange]:
    """The process's mappings sorted by address (empty where there is no
    `/proc/self/maps`)."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            text = maps.read()
    except OSError:
        return []
    found = [
        MappedRange(
            int(start, 16),
            int(end, 16),
            share == "p"
            and inode != "0"
            and path.startswith("/")
            and not path.startswith("/memfd:"),
        )
        for start, end, share, inode, path in _LINE.findall(text)
    ]
    return sorted(found, key=lambda m: m.start)


def _containing(maps: list[MappedRange], start: int, end: int) -> MappedRange | None:
    """The mapping that holds all of `[start, end)`, or None."""
    index = bisect.bisect_right([m.start for m in maps], start) - 1
    if index < 0 or maps[index].end < end:
        return None
    return maps[index]


@functools.cache
def _madvise() -> Any:
    """libc's `madvise`, or None (no C library found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _weak_ref_type() -> Any:
    """torch's weak reference to a storage (`expired()`), or None."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef
    except ImportError:  # pragma: no cover - depends on torch's version
        return None
    return StorageWeakRef


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """`[start, end)` of the bytes of `tensor`'s whole storage."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


@dataclass
class _Recorded:
    ref: Any  # StorageWeakRef (its cdata: the storage's identity)
    start: int  # the storage's bytes
    end: int
    mapping: MappedRange


class FilePages:
    """The model's storages in private file mappings, whose pages `release`
    gives back once they are freed (see the module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._recorded: dict[int, _Recorded] = {}
        weak = _weak_ref_type()
        if weak is None or _madvise() is None:
            return
        live = _live_tensors(model)
        if live is None:
            return
        maps = [m for m in file_mappings() if m.private_file]
        for tensor, (start, end) in live:
            mapping = _containing(maps, start, end)
            if mapping is not None and start < end:
                ref = weak(tensor.untyped_storage())
                self._recorded.setdefault(
                    ref.cdata, _Recorded(ref, start, end, mapping)
                )

    def release(self) -> int:
        """Drop the pages of the recorded storages no tensor holds any more
        (see the module for when); returns the bytes given back."""
        freed = [r for r in self._recorded.values() if r.ref.expired()]
        if not freed:
            return 0
        for recorded in freed:
            del self._recorded[recorded.ref.cdata]
        weak = _weak_ref_type()
        live = _live_tensors(self._model)  # held to the end: they pin mappings
        if live is None:
            return 0
        spans = [span for _, span in live]
        pins = {  # the mappings a live recorded storage has kept mapped
            self._recorded[cdata].mapping
            for cdata in (weak(t.untyped_storage()).cdata for t, _ in live)
            if cdata in self._recorded
        }
        page = mmap.PAGESIZE
        given = 0
        for recorded in freed:
            first = -(-recorded.start // page) * page  # the pages wholly inside
            last = recorded.end // page * page
            if (
                recorded.mapping not in pins
                or last <= first
                or any(s < last and first < e for s, e in spans)
            ):
                continue
            if _madvise()(first, last - first, _MADV_DONTNEED) == 0:
                given += last - first
        del live
        return given


def _live_tensors(
    model: torch.nn.Module,
) -> list[tuple[torch.Tensor, tuple[int, int]]] | None:
    """The model's CPU parameters and buffers (and those an offloading hook
    holds for it) with their storages' bytes; None when one of them shows
    no storage (a tensor subclass wrapping others): what it holds is then
    unknown, and no page is dropped."""
    from quantobs.calibration.offload import held_tensors

    tensors = [*model.parameters(), *model.buffers(), *held_tensors(model)]
    try:
        return [(t, _span(t)) for t in tensors if t.device.type == "cpu"]
    except (RuntimeError, NotImplementedError, TypeError):
        return None
