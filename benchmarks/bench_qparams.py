"""Min-max qparams of one weight: quantobs vs the `torch.aminmax` floor and vs
llm-compressor / compressed-tensors.

For a seeded (rows, cols) float32 weight and each strategy, times
`flatten_for_calibration` + `amin`/`amax` over dims (0, -1) +
`calculate_qparams` (+ `generate_gparam` for tensor_group), the whole path a
min-max observer takes. The floor is `torch.aminmax` over the same tensor: one
pass over memory, which no min-max observer can beat. Best of N runs after
warm-up, `torch` threads left at their default.

Run: .venv/bin/python benchmarks/bench_qparams.py [--rows 4096 --cols 4096]
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import quantobs
from timing import best_ms


@dataclass(frozen=True)
class Case:
    """A strategy to time: a preset's weight args, or explicit args."""

    label: str
    preset: str | None = None
    kwargs: dict[str, Any] | None = None


CASES = (
    Case("tensor (int8)", kwargs={"num_bits": 8, "strategy": "tensor"}),
    Case("channel (int8)", kwargs={"num_bits": 8, "strategy": "channel"}),
    Case("group-128 (int4, W4A16)", preset="W4A16"),
    Case("tensor_group-16 (NVFP4)", preset="NVFP4"),
    Case("block-128 (FP8_BLOCK)", preset="FP8_BLOCK"),
)


def minmax_qparams_fn(
    flatten: Callable[[torch.Tensor, str, Any], torch.Tensor],
    calculate_qparams: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    generate_gparam: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    w: torch.Tensor,
    args: Any,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The min-max observer path for one library's functions, as a closure."""
    tensor_group = str(getattr(args.strategy, "value", args.strategy)) == "tensor_group"

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x_flat = flatten(w, "weight", args)  # (1, *qparam_shape, group_size)
        min_vals = x_flat.amin(dim=(0, -1))
        max_vals = x_flat.amax(dim=(0, -1))
        global_scale = None
        if tensor_group:
            global_scale = generate_gparam(
                min_vals.min().reshape(1), max_vals.max().reshape(1)
            )
        return calculate_qparams(min_vals, max_vals, args, global_scale=global_scale)

    return run


def our_args(case: Case) -> quantobs.QuantizationArgs:
    if case.preset is not None:
        args = quantobs.preset_scheme(case.preset).weights
        assert args is not None
        return args
    return quantobs.QuantizationArgs(**(case.kwargs or {}))


def load_peers() -> dict[str, Any] | None:
    """compressed-tensors' functions and llm-compressor's flatten, if installed."""
    try:
        from compressed_tensors.quantization import (
            QuantizationArgs,
            preset_name_to_scheme,
        )
        from compressed_tensors.quantization.utils.helpers import (
            calculate_qparams,
            generate_gparam,
        )
        from llmcompressor.observers.helpers import flatten_for_calibration
    except ImportError:
        return None
    return {
        "args": lambda case: (
            preset_name_to_scheme(case.preset, ["Linear"]).weights
            if case.preset is not None
            else QuantizationArgs(**(case.kwargs or {}))
        ),
        "flatten": flatten_for_calibration,
        "calculate_qparams": calculate_qparams,
        "generate_gparam": generate_gparam,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=30, help="timed runs (best of)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-peers", action="store_true", help="skip peer timings")
    options = parser.parse_args()

    torch.manual_seed(0)
    w = torch.randn(options.rows, options.cols, dtype=torch.float32)
    peers = None if options.no_peers else load_peers()

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; weight {options.rows}x"
        f"{options.cols} float32; best of {options.repeat} after {options.warmup} "
        f"warm-up runs"
    )

    def floor_ms() -> float:
        return best_ms([lambda: torch.aminmax(w)], options.repeat, options.warmup)[0]

    floor = floor_ms()
    rows = []
    for case in CASES:
        fns: list[Callable[[], object]] = [
            minmax_qparams_fn(
                quantobs.flatten_for_calibration,
                quantobs.calculate_qparams,
                quantobs.generate_gparam,
                w,
                our_args(case),
            )
        ]
        if peers is not None:
            fns.append(
                minmax_qparams_fn(
                    peers["flatten"],
                    peers["calculate_qparams"],
                    peers["generate_gparam"],
                    w,
                    peers["args"](case),
                )
            )
        rows.append((case.label, best_ms(fns, options.repeat, options.warmup)))
    # The floor, best of a run before and a run after the rows.
    floor = min(floor, floor_ms())
    print(f"floor: torch.aminmax(w) {floor:.3f} ms\n")

    header = f"{'strategy':<26}{'ours ms':>9}{'/floor':>8}"
    if peers is not None:
        header += f"{'theirs ms':>11}{'/floor':>8}{'ours/theirs':>13}"
    print(header)
    print("-" * len(header))
    for label, (ours, *theirs) in rows:
        line = f"{label:<26}{ours:>9.3f}{ours / floor:>8.2f}"
        if theirs:
            line += (
                f"{theirs[0]:>11.3f}{theirs[0] / floor:>8.2f}{ours / theirs[0]:>13.2f}"
            )
        print(line)
    if peers is None and not options.no_peers:
        print("\n(peers not installed: pip install 'quantobs[peers]' to compare)")


if __name__ == "__main__":
    main()
