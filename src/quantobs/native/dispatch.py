"""One mechanism for every kernel: a torch implementation paired with native
implementations, chosen by the device of the data.

A `Kernel` wraps the torch implementation of an operation (correct on every
device: it is the reference) and holds native implementations registered
per device type. A call runs the native implementation registered for the
device of its first tensor argument when the native kernels are enabled and
built; a native implementation may decline a call by returning None (a
dtype, layout or size it does not handle), and the torch implementation then
runs. A CUDA tensor always finds a correct path (the torch one), and a GPU
kernel (Triton, `quantobs.native.gpu`) is one more registration::

    @kernel
    def channel_minmax(
        x3: Tensor,
    ) -> tuple[Tensor, Tensor]: ...  # torch ops: the reference, any device


    channel_minmax.register("cpu", native.minmax)  # returns None to decline
    channel_minmax.register("cuda", gpu_minmax)  # Triton; None declines too

`kernel.torch(...)` and `kernel.native(device)(...)` call one side directly
(tests compare the two).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar

import torch

__all__ = ["Kernel", "kernel"]

P = ParamSpec("P")
R = TypeVar("R")


def _enabled(device_type: str) -> bool:
    """Whether the native implementations for `device_type` may run: the C
    library on the CPU, Triton (`quantobs.native.gpu`) elsewhere; both off
    under `QUANTOBS_NATIVE=0` / `set_enabled(False)`."""
    if device_type == "cpu":
        from quantobs import native  # the loader: imported late (builds lazily)

        return native.available()
    from quantobs.native import gpu

    return gpu.available()


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


class Kernel(Generic[P, R]):
    """A torch implementation and its native twins, by device type.

    Args:
        torch_impl: the reference implementation (torch ops, any device).
    """

    def __init__(self, torch_impl: Callable[P, R]) -> None:
        self.torch = torch_impl
        self._native: dict[str, Callable[P, R | None]] = {}
        functools.update_wrapper(self, torch_impl)

    def register(
        self, device_type: str, impl: Callable[P, R | None]
    ) -> Callable[P, R | None]:
        """Add the native implementation for `device_type` (e.g. "cpu")."""
        self._native[device_type] = impl
        return impl

    def native(self, device_type: str) -> Callable[P, R | None] | None:
        """The native implementation for `device_type`, if one is registered."""
        return self._native.get(device_type)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        device = _device_type(args, kwargs)
        impl = self._native.get(device) if device is not None else None
        if impl is not None and device is not None and _enabled(device):
            found = impl(*args, **kwargs)
            if found is not None:
                return found
        return self.torch(*args, **kwargs)

    def __repr__(self) -> str:
        devices = ", ".join(sorted(self._native)) or "none"
        return f"<kernel {self.torch.__qualname__} (native: {devices})>"


def kernel(torch_impl: Callable[P, R]) -> Kernel[P, R]:
    """Decorator: make a torch implementation a `Kernel` (see the module)."""
    return Kernel(torch_impl)
