"""A segment: the part of a model whose observers see the same batches
together (the whole model, one decoder layer, or the modules outside the
layers), as the calibration lifecycle serves it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quantobs.calibration.attach import Entry

__all__ = ["Only", "Segment"]


@dataclass
class Segment:
    """One segment of a calibration pass.

    Attributes:
        entries: its entries (observed tensors).
        run: runs one item with the hooks on (a batch, or a cached index).
        items: the items of the pass (streamed once, unless a second pass
            needs them again: then held).
        first: the item of the reference pass (`Need.SHARED_REFERENCE`
            across processes); None without one.
    """

    entries: list[Entry]
    run: Callable[[Any], Any]
    items: Iterable[Any]
    first: Any = None


class Only:
    """While inside, the hooks feed only `chosen` of `entries` (among those
    an enclosing `Only` left on)."""

    def __init__(self, entries: Sequence[Entry], chosen: Iterable[Entry]) -> None:
        self.entries = entries
        self.chosen = {id(e) for e in chosen}
        self.saved: list[bool] = []

    def __enter__(self) -> None:
        self.saved = [e.enabled for e in self.entries]
        for entry in self.entries:
            entry.enabled = entry.enabled and id(entry) in self.chosen

    def __exit__(self, *exc: object) -> None:
        for entry, enabled in zip(self.entries, self.saved, strict=True):
            entry.enabled = enabled
