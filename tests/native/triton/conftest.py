"""The Triton kernels' tests: on CUDA where present, else on CPU tensors
under Triton's interpreter.

Triton decides interpreting when a kernel is decorated (`triton.jit` reads
`TRITON_INTERPRET` then, in 3.6 and 3.9 alike), and quantobs decorates its
kernels when `quantobs.native.triton_mse` / `triton_minmax` are first
imported, lazily: setting the variable here, at collection and before any
test imports them, makes them interpreted. On a CUDA machine the variable is
left alone and the kernels compile.
"""

from __future__ import annotations

import os

import pytest
import torch

from quantobs.native import gpu

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Where the kernels run here: CUDA, or the CPU under the interpreter.
TRITON_DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=TRITON_DEVICES)
def triton_device(request: pytest.FixtureRequest) -> torch.device:
    """The device the kernels run on; skips without Triton (or, on the CPU,
    without the interpreter)."""
    if not gpu.triton_importable():
        pytest.skip("triton is not installed")
    if request.param == "cpu" and not gpu.interpreted():
        pytest.skip("TRITON_INTERPRET is off: the kernels need a GPU")
    return torch.device(request.param)
