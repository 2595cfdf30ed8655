"""The MSE grid search on the CPU: quantobs vs llm-compressor 0.14, one process.

One seeded float32 weight (default 1024x4096, `W4A16`: int4, group 128) and
one `memoryless_mse` observation of it per run on each side, interleaved
(ours, theirs, ours, ...) so that machine load hits both alike:

    ours    Observer.load_from_registry("memoryless_mse", ...); update; get_qparams
    theirs  llmcompressor's Observer.load_from_registry(...); obs(w); get_qparams

Reports the best wall time of each side, their ratio (theirs / ours), the
median of the per-round ratios, the same from process CPU time (less
sensitive to other processes on a shared machine; with several threads it
counts them all), and whether the scales and zero points are bit-identical.

Run: .venv/bin/python benchmarks/bench_mse_cpu.py [--repeat 6] [--threads N]
     [--rows 1024 --cols 4096] [--preset W4A16]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

import quantobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=6, help="rounds")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--preset", default="W4A16")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "true")
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.observers import Observer as TheirObserver

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(options.rows, options.cols, generator=gen)
    args = quantobs.preset_scheme(options.preset).weights
    their_args = preset_name_to_scheme(options.preset, ["Linear"]).weights
    assert args is not None and their_args is not None

    def ours() -> tuple[torch.Tensor, torch.Tensor | None]:
        observer = quantobs.Observer.load_from_registry(
            "memoryless_mse", base_name="weight", args=args
        )
        observer.update(w)
        return observer.get_qparams()

    def theirs() -> tuple[torch.Tensor, torch.Tensor | None]:
        observer = TheirObserver.load_from_registry(
            "memoryless_mse", base_name="weight", args=their_args.model_copy()
        )
        observer(w)
        found = observer.get_qparams()
        return found["scale"], found["zero_point"]

    a, b = ours(), theirs()  # also the warm-up
    same = torch.equal(a[0], b[0]) and (
        a[1] is None or b[1] is None or torch.equal(a[1].to(b[1].dtype), b[1])
    )
    runs: list[Callable[[], object]] = [ours, theirs]
    wall: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    for _ in range(options.repeat):
        for i, run in enumerate(runs):
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            cpu[i].append(time.process_time() - start_cpu)
            wall[i].append(time.perf_counter() - start)
    rounds = sorted(t / u for u, t in zip(*wall, strict=True))
    print(
        f"{options.preset} {options.rows}x{options.cols}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
        f"bit-identical: {same}"
    )
    print(
        f"wall: ours {min(wall[0]) * 1e3:.1f} ms, theirs {min(wall[1]) * 1e3:.1f} ms, "
        f"best {min(wall[1]) / min(wall[0]):.2f}x, "
        f"median round {rounds[len(rounds) // 2]:.2f}x"
    )
    print(
        f"cpu:  ours {min(cpu[0]) * 1e3:.1f} ms, theirs {min(cpu[1]) * 1e3:.1f} ms, "
        f"best {min(cpu[1]) / min(cpu[0]):.2f}x"
    )


if __name__ == "__main__":
    main()
