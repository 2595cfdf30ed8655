"""`quantobs weights` against reading the checkpoint: seconds per billion parameters.

Writes a synthetic Llama-shaped checkpoint (`--params` billion parameters of
seeded N(0, 0.02) weights, `--dtype`, shards of ~1 GB, Llama-7B layer shapes:
q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008) into a temporary
directory, then, with the file in the page cache (a cold disk read is not
measured: it depends on the disk, not on us), times in one process:

- `read`: every linear weight through `iter_linear_weights` (safetensors'
  `get_tensor`, one tensor at a time), doing nothing with it;
- `floor`: read + cast to float32 + one `torch.aminmax` pass, the least a
  min-max error report can cost;
- `weights_report(scheme)` for each scheme: read, min-max qparams, fake
  quantization, SQNR and max error of every layer.

Each is best of `--repeat`, as seconds per billion parameters and as a ratio
to the floor. The embedded MiniLM (10.8M parameters, float32) is timed the
same way (`--no-minilm` skips it).

Run: .venv/bin/python benchmarks/bench_weights_report.py [--params 0.25]
     [--dtype bfloat16] [--schemes W4A16,W8A8,FP8,NVFP4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from quantobs.cli.checkpoint_files import find_safetensors, iter_linear_weights
from quantobs.cli.weights_report import weights_report

#: one Llama-7B decoder layer: (name, rows, cols)
LAYER = [
    ("self_attn.q_proj", 4096, 4096),
    ("self_attn.k_proj", 4096, 4096),
    ("self_attn.v_proj", 4096, 4096),
    ("self_attn.o_proj", 4096, 4096),
    ("mlp.gate_proj", 11008, 4096),
    ("mlp.up_proj", 11008, 4096),
    ("mlp.down_proj", 4096, 11008),
]
_SHARD_BYTES = 1 << 30


def write_checkpoint(directory: Path, params: float, dtype: torch.dtype) -> int:
    """Write Llama-shaped layers until `params` billion; returns the count."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    target, written, layer = params * 1e9, 0, 0
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_index = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_index
        if shard:
            save_file(shard, str(directory / f"model-{shard_index:05d}.safetensors"))
            shard, shard_bytes, shard_index = {}, 0, shard_index + 1

    while written < target:
        for name, rows, cols in LAYER:
            w = torch.randn(rows, cols, generator=generator).mul_(0.02).to(dtype)
            shard[f"model.layers.{layer}.{name}.weight"] = w
            shard_bytes += w.numel() * w.element_size()
            written += w.numel()
            if shard_bytes >= _SHARD_BYTES:
                flush()
        layer += 1
    flush()
    return written


def best_s(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_only(files: list[Path]) -> None:
    for _name, _w in iter_linear_weights(files):
        pass


def floor(files: list[Path]) -> None:
    for _name, w in iter_linear_weights(files):
        torch.aminmax(w.to(torch.float32))


def table(
    label: str, model: Path, params: int, schemes: list[str], repeat: int
) -> None:
    files = find_safetensors(model)
    weights_report(model, schemes[0], limit=1)  # one-time costs off the clock
    floor_s = best_s(lambda: floor(files), repeat)
    rows = [("read", best_s(lambda: read_only(files), repeat)), ("floor", floor_s)]
    for scheme in schemes:
        seconds = best_s(lambda name=scheme: weights_report(model, name), repeat)  # type: ignore[misc]
        rows.append((f"weights {scheme}", seconds))
    per_billion = 1e9 / params
    print(f"\n{label}: {params / 1e6:,.1f}M parameters")
    print(f"{'':<18}{'s':>9}{'s / 1B params':>15}{'x floor':>9}")
    for name, seconds in rows:
        print(
            f"{name:<18}{seconds:>9.3f}{seconds * per_billion:>15.2f}"
            f"{seconds / floor_s:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--params", type=float, default=0.25, help="billions (synthetic)"
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"]
    )
    parser.add_argument("--schemes", default="W4A16,W8A8,FP8,NVFP4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-minilm", action="store_true")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    schemes = [
        name.strip().upper() for name in options.schemes.split(",") if name.strip()
    ]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}; best of {options.repeat}, page cache warm"
    )
    if not options.no_minilm:
        from quantobs.cli.default_model import default_model_path

        minilm = default_model_path()
        params = sum(
            w.numel() for _, w in iter_linear_weights(find_safetensors(minilm))
        )
        table("MiniLM (float32)", minilm, params, schemes, options.repeat)
    with tempfile.TemporaryDirectory(prefix="qo-bench-weights-") as directory:
        path = Path(directory)
        params = write_checkpoint(path, options.params, getattr(torch, options.dtype))
        table(
            f"synthetic Llama layers ({options.dtype})",
            path,
            params,
            schemes,
            options.repeat,
        )


if __name__ == "__main__":
    main()
