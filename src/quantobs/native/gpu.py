"""Whether the GPU kernels (Triton) run.

Triton is optional (the `gpu` extra; torch's CUDA wheels bring it): without
it a CUDA tensor takes the torch path, with no warning. The kernels run when
Triton imports and the native kernels are enabled (`QUANTOBS_NATIVE=0` and
`quantobs.native.set_enabled(False)` turn them off with the C ones). Tests
run them on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`),
calling `kernel.native("cuda")` directly.
"""

from __future__ import annotations

import functools
import os

__all__ = ["available", "interpreted", "triton_importable"]


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
