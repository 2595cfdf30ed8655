"""Test-wide settings (kept minimal: fixtures live next to their tests)."""

import os
from collections.abc import Iterator

import torch

# Without CUDA the Triton kernels' tests run on CPU tensors in Triton's
# interpreter. Triton reads TRITON_INTERPRET when a kernel is decorated, and
# a peer's import (llm-compressor's) can decorate its own first: set it here,
# before any test module is collected. Only CPU tensors are affected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

from quantobs import native

#: Every device this machine has: the CPU, and CUDA where present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Per-example deadlines measure torch's first-call warm-up and the load of a
# 2-core CI machine, not our code: switch them off.
settings.register_profile("quantobs", deadline=None, print_blob=True)
settings.load_profile("quantobs")


@pytest.fixture(params=["native", "eager"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the native kernels (when they build) and without."""
    previous = native.set_enabled(True)
    if request.param == "native" and not native.available():
        native.set_enabled(previous)
        pytest.skip("no C compiler: the native kernels are not built")
    native.set_enabled(request.param == "native")
    yield request.param
    native.set_enabled(previous)


def _on_cuda(value: object) -> bool:
    return (isinstance(value, str) and value == "cuda") or (
        isinstance(value, torch.device) and value.type == "cuda"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with a CUDA parameter `cuda` (`-m cuda` selects them)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(map(_on_cuda, callspec.params.values())):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Run a test on every available device (the CPU; CUDA where present)."""
    return torch.device(request.param)
