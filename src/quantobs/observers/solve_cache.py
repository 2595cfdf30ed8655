"""A solver's last result, kept while the statistic it came from is unchanged.

Histogram searches cost milliseconds to seconds, and callers ask for qparams
more than once per statistic (torch.ao's `convert` calls
`calculate_qparams` again after calibration; llm-compressor asks for the
range and then the qparams). `SolveCache.get` returns the cached result
while every tensor of the statistic is the same tensor object, unchanged in
place since, under the same settings:

* tensor identity, held by weak reference: an update, merge, reset, state-
  dict load or `.to()` that replaces a buffer drops the entry (a dead or
  different tensor never matches);
* the tensor's in-place version counter (`Tensor._version`, bumped by every
  in-place op: `copy_` in `load_state_dict`, counts added in place): a
  buffer changed in place drops it too;
* the settings (`args`, options, a face's attributes), compared by
  identity or equality: a changed setting drops it.

Results are handed out as clones (the caller may change them in place).
The cache holds no tensor of the statistic alive, and is not saved:
pickling and `copy.deepcopy` give an empty cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["SolveCache"]

T = TypeVar("T", bound=tuple[torch.Tensor, ...])


def _version(tensor: torch.Tensor) -> int | None:
    """The in-place version counter (None: an inference tensor, untracked)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


class SolveCache:
    """The last `(tensors, settings) -> result` of one solver (module docstring)."""

    def __init__(self) -> None:
        self._refs: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self._settings: tuple[Any, ...] = ()
        self._value: tuple[torch.Tensor, ...] | None = None

    def clear(self) -> None:
        """Drop the cached result."""
        self._refs, self._settings, self._value = [], (), None

    def _matches(
        self, tensors: Sequence[torch.Tensor], settings: tuple[Any, ...]
    ) -> bool:
        if self._value is None or len(tensors) != len(self._refs):
            return False
        if len(settings) != len(self._settings) or any(
            not (a is b or a == b)
            for a, b in zip(settings, self._settings, strict=True)
        ):
            return False
        for tensor, (ref, version) in zip(tensors, self._refs, strict=True):
            if ref() is not tensor or _version(tensor) != version:
                return False
        return True

    def get(
        self,
        tensors: Sequence[torch.Tensor],
        settings: tuple[Any, ...],
        compute: Callable[[], T],
    ) -> T:
        """`compute()`'s result for these tensors and settings, cached.

        Args:
            tensors: the statistic's tensors (its buffers).
            settings: what else the result depends on (compared by identity
                or equality).
            compute: the solver call.

        Returns:
            A tuple of tensors (clones of the cached ones).
        """
        if self._matches(tensors, settings):
            assert self._value is not None
            return tuple(t.clone() for t in self._value)  # type: ignore[return-value]
        value = compute()
        refs = []
        for tensor in tensors:
            version = _version(tensor)
            if version is None:  # untracked: never cached
                self.clear()
                return value
            refs.append((weakref.ref(tensor), version))
        self._refs = refs
        self._settings = tuple(settings)
        self._value = tuple(t.clone() for t in value)
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {}  # weak references do not pickle; an empty cache does

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.clear()
