"""The histogram counting kernel (`quantobs.native.triton_histogram`)
against its torch reference (`quantobs.stats.binning._add_counts`), exactly.

On CUDA where present; else on CPU tensors under Triton's interpreter,
which must be on (`TRITON_INTERPRET=1`) before Triton is first imported:
this module sets it at collection when nothing imported Triton yet (the
kernel is imported lazily), and where something did (in a whole-suite run,
llm-compressor's imports do) its tests run again in a fresh process.
Shapes are tiny (the interpreter runs each program in numpy):
per tensor (several programs per qparam: atomic adds), per channel and per
group (one program per qparam), bf16 / fp16 / float32, |x|, NaN and
infinities, bins that are not a power of two, grids from `histogram_grid`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs import Observer, QuantizationArgs
from quantobs.native import gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton imported already, not interpreted: too late for this process
_LATE = DEVICE == "cpu" and "triton" in sys.modules and not gpu.interpreted()
if DEVICE == "cpu" and not _LATE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.skipif(
    not gpu.triton_importable(), reason="triton is not installed"
)


@pytest.fixture(autouse=True)
def _kernel_runs_here(request: pytest.FixtureRequest) -> None:
    if request.node.name == "test_in_a_fresh_process":
        return
    if DEVICE == "cpu" and not gpu.interpreted():
        pytest.skip(
            "TRITON_INTERPRET is off here (Triton came first): a fresh process "
            "runs these tests (test_in_a_fresh_process)"
        )


DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# (N, Q, G, bins): per tensor (one qparam, sliced), per channel, per group
SHAPES = [
    (2, 1, 3000, 2048),
    (3, 5, 40, 100),
    (1, 12, 16, 64),
    (4, 3, 1, 8),
    (1, 2, 9, 16),
]


def _grid(x3: torch.Tensor, bins: int, absolute: bool):
    from quantobs.stats.histogram import grid_range, histogram_grid
    from quantobs.stats.reduce import minmax_omit_nonfinite

    low, high = minmax_omit_nonfinite(x3)
    exponent, offset = histogram_grid(*grid_range(low, high, absolute), bins)
    inv = torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), -exponent)
    return inv.float(), offset.float()


def _counts(x3, inv, off, bins, absolute, impl):
    out = torch.zeros(x3.shape[1], bins, dtype=torch.int64, device=x3.device)
    found = impl(x3, inv, off, out, absolute, True)
    assert found is out
    return out


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_counts_equal_the_torch_reference(shape, dtype, absolute) -> None:
    from quantobs.stats.binning import _add_counts

    n, q, g, bins = shape
    gen = torch.Generator().manual_seed(n * 100 + q * 10 + g)
    x3 = (torch.randn(n, q, g, generator=gen) * 3 + 0.5).to(dtype)
    flat = x3.view(-1)
    flat[:: max(1, flat.numel() // 5)] = math.nan  # skipped
    if flat.numel() > 3:
        flat[1], flat[2] = math.inf, -math.inf  # the end bins
    x3 = x3.to(DEVICE)
    inv, off = _grid(x3, bins, absolute)
    kernel = _add_counts.native("cuda")
    assert kernel is not None
    ours = _counts(x3, inv, off, bins, absolute, kernel)
    expected = _counts(x3, inv, off, bins, absolute, _add_counts.torch)
    assert torch.equal(ours, expected)
    # on top of existing counts (the kernel adds)
    again = kernel(x3, inv, off, ours.clone(), absolute, True)
    assert again is not None and torch.equal(again, 2 * expected)


def test_offsets_far_from_zero_and_wide_bins() -> None:
    from quantobs.stats.binning import _add_counts

    x3 = 1000 + torch.rand(2, 3, 50, generator=torch.Generator().manual_seed(3))
    x3 = x3.to(DEVICE)
    inv, off = _grid(x3, 64, False)
    wide = (inv / 1024, torch.floor(off / 1024))  # every value in a few bins
    for grid in ((inv, off), wide):
        ours = _counts(x3, *grid, 64, False, _add_counts.native("cuda"))
        assert torch.equal(ours, _counts(x3, *grid, 64, False, _add_counts.torch))


def test_declines_what_it_does_not_count() -> None:
    from quantobs.native import triton_histogram

    x3 = torch.randn(1, 2, 8, dtype=torch.float64, device=DEVICE)
    out = torch.zeros(2, 8, dtype=torch.int64, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    assert triton_histogram.add_counts(x3, ones, ones, out, False, False) is None
    x3 = x3.float()
    assert triton_histogram.add_counts(x3, ones, ones, out.int(), False, False) is None


@pytest.mark.parametrize(
    ("n", "q", "g", "bins"),
    [(1, 1, 1 << 28, 2048), (4, 1, 4096, 2048), (1, 8192, 8192, 256), (1, 1, 7, 64)],
)
def test_plan_covers_every_value(n: int, q: int, g: int, bins: int) -> None:
    from quantobs.native.triton_histogram import plan

    slices, chunk, block, size = plan(n, q, g, bins)
    assert chunk % block == 0 and chunk <= 1 << 30
    assert (slices - 1) * chunk < n * g <= slices * chunk
    assert size >= max(bins, 32) and size & (size - 1) == 0
    assert block & (block - 1) == 0 and 16 <= block <= 1024


@pytest.mark.skipif(DEVICE != "cuda", reason="the dispatch runs the kernel on CUDA")
@pytest.mark.parametrize(
    "name", ["histogram", "percentile", "entropy", "histogram_mse"]
)
def test_observers_count_the_same_on_cuda(name: str) -> None:
    args = QuantizationArgs(num_bits=8, strategy="channel")
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(5))
    x = x.to(torch.bfloat16)
    found = {}
    for device in ("cpu", "cuda"):
        observer = Observer.get_class(name)("weight", args)
        for scale in (1.0, 2.5, 1.0):
            observer.update((x * scale).to(device))
        found[device] = observer.statistic().state()
    for field, value in found["cpu"].items():
        assert torch.equal(found["cuda"][field].cpu(), value), field


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the dispatch runs it (above)")
@pytest.mark.parametrize(
    ("base_name", "kwargs"),
    [
        ("weight", {"num_bits": 8, "strategy": "channel"}),
        ("input", {"num_bits": 8, "symmetric": False}),
    ],
    ids=["channel", "tensor-asym"],
)
@pytest.mark.parametrize(
    "name", ["histogram", "percentile", "entropy", "histogram_mse"]
)
def test_observers_count_the_same_through_the_kernel(
    name: str,
    base_name: str,
    kwargs: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The interpreted kernel stands in for the CPU registration: whole
    # observers (growing ranges, re-binning, |x|) against the torch path.
    from quantobs import native
    from quantobs.stats.binning import _add_counts

    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(6))
    found = {}
    for path in ("triton", "torch"):
        with monkeypatch.context() as patch:
            if path == "triton":
                patch.setitem(_add_counts._native, "cpu", _add_counts.native("cuda"))
                patch.setattr(native, "available", lambda: True)
            previous = native.set_enabled(path == "triton")
            try:
                observer = Observer.get_class(name)(
                    base_name, QuantizationArgs(**kwargs)
                )
                for scale in (1.0, 3.0, 0.5):
                    observer.update((x * scale).to(torch.bfloat16))
                found[path] = observer.statistic().state()
            finally:
                native.set_enabled(previous)
    for field, value in found["torch"].items():
        assert torch.equal(found["triton"][field], value), field


@pytest.mark.skipif(not _LATE, reason="this process runs the tests itself")
def test_in_a_fresh_process() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root / "src"), str(root), env.get("PYTHONPATH")) if p
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
