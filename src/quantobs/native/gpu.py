"""Whether the GPU kernels (Triton) run.

Triton is optional (the `gpu` extra; torch's CUDA wheels bring it): without
it a CUDA tensor takes the torch path, with no warning. The kernels run when
Triton imports and the native kernels are enabled (`QUANTOBS_NATIVE=0` and
`quantobs.native.set_enabled(False)` turn them off with the C ones). Tests
run them on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`),
calling `kernel.native("cuda")` directly.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

__all__ = ["available", "interpreted", "interpreter_quiet", "triton_importable"]


@functools.cache
def triton_importable() -> bool:
    """Whether `import triton` works here (checked once)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install: take the torch path
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`):
    on CPU tensors, for the tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """Whether the GPU kernels may run: enabled, and Triton importable."""
    from quantobs.native import runtime

    return runtime.enabled() and triton_importable()


@contextlib.contextmanager
def interpreter_quiet() -> Iterator[None]:
    """Around a kernel launch: under the interpreter, numpy's warnings of
    float overflow and invalid values are off (a kernel's inf or NaN is the
    torch reference's too; on a GPU nothing warns)."""
    if not interpreted():
        yield
        return
    import numpy as np  # the interpreter's own dependency

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        yield
