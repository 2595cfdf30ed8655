"""Host work of the GPU path, counted on a CPU: aten ops and Triton launches.

On a GPU the MSE observers' `update` costs the Triton scoring pass plus every
small torch op around it (each a kernel launch and a few microseconds of
host time). This script counts them without a GPU: an observer's `update`
and `get_qparams` run on CPU tensors with every `@kernel` routed to its
`"cuda"` registration (the Triton kernels, under `TRITON_INTERPRET=1`, set
here when there is no CUDA), the ops dispatched by torch counted by a
`TorchDispatchMode` (`OpCounter`: every aten call, views included; the
interpreter's own copies inside a launch are not counted) and the Triton
launches by their `run`. On CUDA (`--device cuda`) the same counts come from
the real path.

Run (repo root):

    PYTHONPATH=src python benchmarks/gpu_ops.py            # table on stdout
    PYTHONPATH=src python benchmarks/gpu_ops.py --json ops.json

The shapes are small (the interpreter runs each Triton program in numpy):
the counts do not depend on the tensor's size except through chunking,
which the GPU path does not do for these shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

if not torch.cuda.is_available():  # before any Triton kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode

from quantobs import Observer, QuantizationArgs, native
from quantobs.core.syncs import SyncCounter, on_host
from quantobs.native import dispatch

NVFP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "scale_dtype": torch.float8_e4m3fn,
    "zp_dtype": torch.float8_e4m3fn,
}
MXFP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": torch.uint8,
    "zp_dtype": torch.uint8,
}
INT4_G128 = {"num_bits": 4, "strategy": "group", "group_size": 128}

# label -> (observer, args kwargs): the MSE and min-max cases of issue 24's
# GPU table, and more min-max formats
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "memoryless_mse int4 g128": ("memoryless_mse", INT4_G128),
    "memoryless_mse NVFP4": ("memoryless_mse", NVFP4),
    "memoryless_mse MXFP4": ("memoryless_mse", MXFP4),
    "memoryless_mse int8 channel": (
        "memoryless_mse",
        {"num_bits": 8, "strategy": "channel"},
    ),
    "memoryless_mse FP8 tensor": ("memoryless_mse", {"num_bits": 8, "type": "float"}),
    "imatrix_mse int4 g128": ("imatrix_mse", INT4_G128),
    "nvfp4_expanded_mse": ("nvfp4_expanded_mse", NVFP4),
    "memoryless_minmax int4 g128": ("memoryless_minmax", INT4_G128),
    "memoryless_minmax NVFP4": ("memoryless_minmax", NVFP4),
    "memoryless_minmax MXFP4": ("memoryless_minmax", MXFP4),
    "memoryless_minmax int8 channel": (
        "memoryless_minmax",
        {"num_bits": 8, "strategy": "channel"},
    ),
    "memoryless_minmax FP8 tensor": (
        "memoryless_minmax",
        {"num_bits": 8, "type": "float"},
    ),
    "static_minmax int4 g128 asym": (
        "static_minmax",
        {**INT4_G128, "symmetric": False},
    ),
    "static_minmax NVFP4": ("static_minmax", NVFP4),
}
SHAPE = (8, 256)  # rows, columns of the weight


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched (by name), and the Triton launches.

    Attributes:
        ops: aten calls by op name.
        launches: Triton kernel launches by kernel name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self._inside = 0  # depth of launches: the interpreter's copies

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not self._inside:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def op_count(self) -> int:
        return sum(self.ops.values())

    @property
    def launch_count(self) -> int:
        return sum(self.launches.values())

    @contextlib.contextmanager
    def launching(self, name: str) -> Iterator[None]:
        """Around one Triton launch: counted once, its host copies not."""
        self.launches[name] += 1
        self._inside += 1
        try:
            with on_host():  # the interpreter's numpy copies are no GPU sync
                yield
        finally:
            self._inside -= 1


def _run_classes() -> list[Any]:
    """The classes whose `run` launches a Triton kernel (compiled or
    interpreted)."""
    classes: list[Any] = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:  # pragma: no cover - no Triton: nothing launches
        return classes
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    return classes


@contextlib.contextmanager
def counting() -> Iterator[OpCounter]:
    """`OpCounter` over the block, with Triton's launches counted."""
    counter = OpCounter()
    originals = {cls: cls.run for cls in _run_classes()}

    def patched(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("warmup"):
                return original(self, *args, **kwargs)
            name = getattr(getattr(self, "fn", None), "__name__", "kernel")
            with counter.launching(name):
                return original(self, *args, **kwargs)

        return run

    for cls, original in originals.items():
        cls.run = patched(original)
    try:
        with counter:
            yield counter
    finally:
        for cls, original in originals.items():
            cls.run = original


@contextlib.contextmanager
def as_cuda() -> Iterator[None]:
    """Every `@kernel` called with CPU tensors runs its `"cuda"`
    implementation (the GPU path, on CPU tensors: Triton's interpreter), and
    the torch one where none is registered, as a CUDA tensor would."""
    original = dispatch._device_type
    previous = native.set_enabled(True)

    def device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        found = original(args, kwargs)
        return "cuda" if found == "cpu" else found

    dispatch._device_type = device_type  # type: ignore[assignment]
    try:
        yield
    finally:
        dispatch._device_type = original  # type: ignore[assignment]
        native.set_enabled(previous)


@dataclass
class Count:
    """One case's counts: aten ops, Triton launches and host syncs of one
    `update`, and of `get_qparams` after it."""

    case: str
    update_ops: int
    update_launches: int
    update_syncs: int
    qparams_ops: int
    qparams_launches: int
    top_ops: list[tuple[str, int]]


def _weight(
    shape: tuple[int, int], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def count_case(
    name: str,
    kwargs: dict[str, Any],
    device: torch.device | None = None,
    dtype: torch.dtype = torch.bfloat16,
    label: str = "",
    shape: tuple[int, int] = SHAPE,
) -> Count:
    """Counts of one fresh observer `name` (args `kwargs`) on one `shape`
    weight."""
    device = device or torch.device("cpu")
    weight = _weight(shape, device, dtype)
    observer = Observer.get_class(name)("weight", QuantizationArgs(**kwargs))
    if hasattr(observer, "set_importance"):
        gen = torch.Generator().manual_seed(1)
        observer.set_importance(torch.rand(shape[1], generator=gen).to(device))
    routed = as_cuda() if device.type == "cpu" else contextlib.nullcontext()
    with routed:
        with SyncCounter() as syncs, counting() as update:
            observer.update(weight)
        with counting() as qparams:
            observer.get_qparams()
    return Count(
        case=label or name,
        update_ops=update.op_count,
        update_launches=update.launch_count,
        update_syncs=syncs.count,
        qparams_ops=qparams.op_count,
        qparams_launches=qparams.launch_count,
        top_ops=update.ops.most_common(8),
    )


def count_all(
    cases: dict[str, tuple[str, dict[str, Any]]] | None = None,
    device: torch.device | None = None,
    shape: tuple[int, int] = SHAPE,
) -> list[Count]:
    """`count_case` of every case (issue 24's table by default)."""
    return [
        count_case(name, kwargs, device, label=label, shape=shape)
        for label, (name, kwargs) in (cases or CASES).items()
    ]


def main(argv: Sequence[str] | None = None) -> list[Count]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu: the interpreter")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--ops", action="store_true", help="the most frequent ops")
    opts = parser.parse_args(argv)
    counts = count_all(device=torch.device(opts.device))
    header = f"{'case':30} {'update ops':>10} {'launches':>8} {'syncs':>5}"
    print(f"{header} {'qparams ops':>11} {'launches':>8}")
    for c in counts:
        print(
            f"{c.case:30} {c.update_ops:10d} {c.update_launches:8d} "
            f"{c.update_syncs:5d} {c.qparams_ops:11d} {c.qparams_launches:8d}"
        )
        if opts.ops:
            print("    " + ", ".join(f"{op} {n}" for op, n in c.top_ops))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump([asdict(c) for c in counts], f, indent=1)
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
