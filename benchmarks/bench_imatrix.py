"""imatrix observers: quantobs vs llm-compressor 0.14, and the `torch.aminmax` floor.

For each case (an observer and a preset's weight args) times one observation
of a seeded weight and its qparams, with the same importance on both sides
(`E[x ** 2]` per input channel, set before the timed window):

    ours    obs = quantobs.Observer.load_from_registry(name, base_name="weight",
          args=...); obs.set_importance(...); obs.update(w); obs.get_qparams()
          (+ get_global_scale() for NVFP4)
    theirs  obs = llmcompressor.observers.Observer.load_from_registry(...);
          obs._imatrix_sum / _imatrix_count set; obs(w); obs.get_qparams()

Observers: `imatrix_mse` (defaults: 20 candidates, norm 3, patience 5) with
W4A16 (int4 group-128) and NVFP4 args, `nvfp4_expanded_imatrix` (112
candidates, norm 2.4, no early stop) and `nvfp4_expanded_mse` (111
candidates, unweighted) with NVFP4 args. llm-compressor's `get_qparams`
deletes its statistics, so every timed run gets a fresh observer on both
sides (construction untimed). Runs are interleaved (ours, theirs, ours, ...)
so machine load hits both alike; best of `--repeat` without warm-up (seconds
per run), after one untimed run of both on a small slice. The floor is
`torch.aminmax` over the same weight, back to back: one pass over memory.

Columns: `ours ms`, `/floor` (ours / floor), `theirs ms`, `speed-up` (theirs
/ ours: above 1, quantobs is faster) and `same` ("yes": scale, zero point and
global scale bit-identical; else how many of their values differ). The
searches run many short torch ops: on a machine busy with other work they
slow down far more than one pass would, so compare rows of one run, and
watch the load average in the header.

Run: .venv/bin/python benchmarks/bench_imatrix.py [--quick] [--only NAME]
     [--rows R --cols C] [--repeat N] [--threads T]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

import quantobs
from quantobs import native
from quantobs.stats.importance import Importance
from timing import best_ms

QParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class Case:
    """One observer on one preset's weight args."""

    name: str
    preset: str

    @property
    def label(self) -> str:
        return f"{self.name} {self.preset}"


CASES = (
    Case("imatrix_mse", "W4A16"),
    Case("imatrix_mse", "NVFP4"),
    Case("nvfp4_expanded_imatrix", "NVFP4"),
    Case("nvfp4_expanded_mse", "NVFP4"),
)


def importance_of(cols: int) -> Importance:
    """A gathered importance: channels of unequal size, 4096 tokens."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, cols, generator=gen) * (torch.rand(cols, generator=gen) * 4)
    return Importance.empty((cols,), torch.device("cpu")).of_inputs(x)


def our_run(
    case: Case, args: quantobs.QuantizationArgs, imp: Importance, w: torch.Tensor
) -> Callable[[], Callable[[], QParams]]:
    def make() -> Callable[[], QParams]:
        obs = quantobs.Observer.load_from_registry(
            case.name, base_name="weight", args=args
        )
        if "imatrix" in case.name:
            obs.set_importance(imp)  # type: ignore[attr-defined]

        def run() -> QParams:
            obs.update(w)
            scale, zero_point = obs.get_qparams()
            tensor_group = args.strategy == "tensor_group"
            return scale, zero_point, obs.get_global_scale() if tensor_group else None

        return run

    return make


def their_run(
    observer_cls: Any, case: Case, args: Any, imp: Importance, w: torch.Tensor
) -> Callable[[], Callable[[], QParams]]:
    def make() -> Callable[[], QParams]:
        obs = observer_cls.load_from_registry(
            case.name, base_name="weight", args=args.model_copy(deep=True)
        )
        if "imatrix" in case.name:
            obs._imatrix_sum = imp.sum.clone()
            obs._imatrix_count = imp.count.clone()

        def run() -> QParams:
            found = obs(w).get_qparams()
            return found["scale"], found["zero_point"], found["global_scale"]

        return run

    return make


def timed(
    makers: list[Callable[[], Callable[[], QParams]]], repeat: int
) -> tuple[list[float], list[QParams]]:
    """Best ms of each maker's run and its last result; `maker()` builds a
    fresh observer outside the timed window. Interleaved, one run each per
    round."""
    best = [float("inf")] * len(makers)
    last: list[QParams] = []
    for _ in range(repeat):
        last = []
        for i, make in enumerate(makers):
            run = make()
            start = time.perf_counter()
            last.append(run())
            best[i] = min(best[i], time.perf_counter() - start)
    return [seconds * 1e3 for seconds in best], last


def same(ours: QParams, theirs: QParams) -> str:
    """ "yes" when bit-identical, else how many values differ."""
    differ, total = 0, 0
    for a, b in zip(ours, theirs, strict=True):
        if (a is None) != (b is None):
            return "no"
        if a is not None and b is not None:
            differ += int((a != b).sum())
            total += a.numel()
    return "yes" if not differ else f"{differ}/{total}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="512x1024, 1 run")
    parser.add_argument("--only", action="append", default=[], help="substring")
    options = parser.parse_args()
    if options.quick:
        options.rows, options.cols, options.repeat = 512, 1024, 1
    if options.threads:
        torch.set_num_threads(options.threads)
    os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "true")
    try:
        from compressed_tensors.quantization import preset_name_to_scheme
        from llmcompressor.observers import Observer as LObserver
    except ImportError:
        LObserver = None

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(options.rows, options.cols, generator=gen)
    imp = importance_of(options.cols)
    floor = best_ms([lambda: torch.aminmax(w)], repeat=20, warmup=3)[0]
    peers = (
        ", ".join(
            f"{d} {metadata.version(d)}"
            for d in ("llmcompressor", "compressed-tensors")
        )
        if LObserver is not None
        else "no peers"
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; quantobs "
        f"{quantobs.__version__} "
        f"({'native kernels' if native.available() else 'torch ops only'}); {peers}"
    )
    print(
        f"weight randn {options.rows}x{options.cols} float32 (seed 0); best of "
        f"{options.repeat}, no warm-up; load average {os.getloadavg()[0]:.2f}; "
        f"floor torch.aminmax {floor:.2f} ms"
    )
    header = f"{'case':<30}{'ours ms':>11}{'/floor':>8}"
    if LObserver is not None:
        header += f"{'theirs ms':>12}{'speed-up':>10}  same"
    print(header)
    print("-" * len(header))
    for case in CASES:
        if not all(token.lower() in case.label.lower() for token in options.only):
            continue
        args = quantobs.preset_scheme(case.preset).weights
        assert args is not None
        makers = [our_run(case, args, imp, w)]
        if LObserver is not None:
            ct_args = preset_name_to_scheme(case.preset, ["Linear"]).weights
            makers.append(their_run(LObserver, case, ct_args, imp, w))
            small = w[:16]  # prime one-time costs on both sides
            our_run(case, args, imp, small)()()
            their_run(LObserver, case, ct_args, imp, small)()()
        ms, results = timed(makers, options.repeat)
        line = f"{case.label:<30}{ms[0]:>11.1f}{ms[0] / floor:>8.0f}"
        if LObserver is not None:
            line += (
                f"{ms[1]:>12.1f}{ms[1] / ms[0]:>10.2f}  {same(results[0], results[1])}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
