"""Counting host-device synchronisations, on any device.

On a GPU, an operation whose result the host must read (a Python number, a
data-dependent shape) waits for every kernel queued before it: an observer
that does so in `update` stalls the calibration loop once per batch and
tensor. `SyncCounter` counts those operations as they are dispatched, so the
budget (no sync in `update`, at most two to compute qparams) is checked on a
CPU-only machine too, with the same code path a CUDA tensor takes (run it
with the native kernels off: `QUANTOBS_NATIVE=0` or `native.set_enabled`)::

    with SyncCounter() as syncs:
        observer.update(x)
    assert syncs.count == 0, syncs.by_op

What counts (each call once):

    op                                  from
    aten._local_scalar_dense            .item(), bool(t), int(t), `if t:`
    aten.is_nonzero, equal, allclose    a Python bool from tensors
    aten.nonzero, aten.masked_select    data-dependent shapes
    aten._unique*, aten.unique_*        torch.unique and friends
    aten.bincount                       sizes from the data (CUDA reads the max)
    aten.repeat_interleave.Tensor       without output_size
    aten.index(_put)                    a boolean index (t[mask], t[mask] = v)
    aten.histc                          min == max (the range read from the data)
    Tensor.tolist, Tensor.numpy         a copy to the host

Work on a host copy (`on_host`): data already brought to the host in a
counted read (e.g. a small histogram read with the deferred checks) is then
worked on with CPU tensors, whose reads wait for nothing. `SyncCounter`
cannot tell those CPU tensors from the device tensors it stands in for in a
CPU-only test, so such code runs inside `with on_host():`, and what it does
is not counted. Only copies made by a counted read belong there.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_syncs", "on_host"]

_HOST = threading.local()  # depth of `on_host` blocks in this thread


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Mark work on host copies of device data (module docstring): the
    reads it makes are free, and `SyncCounter` does not count them."""
    _HOST.depth = getattr(_HOST, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST.depth -= 1


def _counting() -> bool:
    return getattr(_HOST, "depth", 0) == 0


_aten = torch.ops.aten

#: ops that synchronise whatever their arguments
_ALWAYS = {
    _aten._local_scalar_dense.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.allclose.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.bincount.default,
}
_BOOL_INDEX = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )


def _syncs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func in _ALWAYS:
        return True
    if func in _BOOL_INDEX:
        return _has_bool_index(args)
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is _aten.histc.default:
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return bool(low == high)
    return False


class SyncCounter(TorchDispatchMode):
    """A dispatch mode counting the ops that synchronise host and device.

    Attributes:
        count: synchronising calls seen.
        by_op: those calls by op name (`"aten.nonzero.default"`, `"tolist"`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.by_op: Counter[str] = Counter()
        self._patched: dict[str, Callable[..., Any]] = {}

    def _record(self, name: str) -> None:
        self.count += 1
        self.by_op[name] += 1

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _counting() and _syncs(func, args, kwargs):
            self._record(str(func))
        return func(*args, **kwargs)

    def __enter__(self) -> SyncCounter:
        # host copies dispatch no op on a CPU tensor: count the methods
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _counting():
                self._record(name)
            return original(tensor, *args, **kwargs)

        return counted


def count_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> SyncCounter:
    """Run `fn(*args, **kwargs)` under a `SyncCounter` and return it."""
    with SyncCounter() as counter:
        fn(*args, **kwargs)
    return counter
