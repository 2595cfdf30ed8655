"""The torch.ao face vs torch.ao's own observers and the `torch.aminmax` floor.

In one process on CPU, for a seeded 4096x4096 float32 weight and a seeded
16M-element float32 activation (16, 1024, 1024), times:

* `MinMaxObserver.forward` (per tensor),
* `PerChannelMinMaxObserver.forward` for each channel axis,
* `HistogramObserver.forward` (steady state: a batch within the range),
* `HistogramObserver.calculate_qparams` (the L2 search alone) on 1M-sample
  batches of several distributions: quantobs in torch's mode and with
  `search="global"`.

The floor is `torch.aminmax` over the same tensor: one pass over memory, which
no min-max observer can beat. Each row checks that quantobs' qparams equal
torch's before timing. Best of N interleaved runs after warm-up, torch threads
left at their default. Timings on a shared machine are noisy: compare the
ratios within one run.

Run: .venv/bin/python benchmarks/bench_torch_ao.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import platform
import warnings

import torch
from torch.ao.quantization import observer as tob

import quantobs.faces.torch_ao as ours
from timing import best_ms


def same_qparams(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    (sa, za), (sb, zb) = a.calculate_qparams(), b.calculate_qparams()
    return torch.equal(sa, sb) and torch.equal(za, zb) and za.dtype == zb.dtype


def row(label: str, floor: float, mine: float, theirs: float | None) -> str:
    theirs_cols = (
        f"{theirs:10.2f} {theirs / floor:8.1f}x {theirs / mine:9.1f}x"
        if theirs is not None
        else f"{'':10} {'':9} {'':10}"
    )
    return f"{label:<40} {floor:8.2f} {mine:9.2f} {mine / floor:7.2f}x {theirs_cols}"


def bench_forward(
    label: str,
    name: str,
    kwargs: dict[str, object],
    x: torch.Tensor,
    args: argparse.Namespace,
) -> str:
    a, b = getattr(ours, name)(**kwargs), getattr(tob, name)(**kwargs)
    a(x)
    b(x)
    if not same_qparams(a, b):
        raise AssertionError(f"{label}: qparams differ from torch.ao's")
    floor, mine, theirs = best_ms(
        [lambda: torch.aminmax(x), lambda: a(x), lambda: b(x)],
        args.repeat,
        args.warmup,
    )
    return row(label, floor, mine, theirs)


def search_distributions() -> dict[str, torch.Tensor]:
    """1M-sample batches whose histograms make torch's greedy search short
    (normal) or long (heavy tails; a scale whose float32 errors overflow)."""
    g = torch.Generator().manual_seed(1)
    n = 1 << 20
    normal = torch.randn(n, generator=g)
    return {
        "normal": normal,
        "relu": normal.clamp(min=0),
        "student-t(2)": torch.randn(n, generator=g)
        / torch.randn(n, generator=g).abs().sqrt(),
        "normal + one 1e4 outlier": torch.cat([normal, torch.tensor([1e4])]),
        "normal * 1e25 (float32 errors overflow)": normal * 1e25,
    }


def bench_histogram_search(args: argparse.Namespace) -> list[str]:
    """`calculate_qparams` (the search alone) per distribution."""
    lines = []
    for label, x in search_distributions().items():
        a, b = ours.HistogramObserver(), tob.HistogramObserver()
        c = ours.HistogramObserver(search="global")
        for obs in (a, b, c):
            obs(x)
        if not same_qparams(a, b):
            raise AssertionError(f"{label}: qparams differ from torch.ao's")
        slow = "1e25" in label  # torch walks ~1e5 steps there: time it once
        repeat, warmup = (1, 0) if slow else (args.repeat, 1)
        # The two searches compared run interleaved (same conditions); the
        # global search, ~50 ms of other work, is timed on its own.
        mine, theirs = best_ms(
            [a.calculate_qparams, b.calculate_qparams], repeat, warmup
        )
        (global_,) = best_ms([c.calculate_qparams], repeat, warmup)
        lines.append(
            f"  {label:<40} {mine:9.2f} {theirs:10.2f} {theirs / mine:8.1f}x "
            f"{global_:10.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)  # torch's reduce_range notes

    g = torch.Generator().manual_seed(0)
    tensors = {
        "weight 4096x4096": torch.randn(4096, 4096, generator=g) * 0.02,
        "activation 16x1024x1024": torch.randn(16, 1024, 1024, generator=g),
    }
    axes = {"weight 4096x4096": (0, 1), "activation 16x1024x1024": (0, 1, 2)}
    print(
        f"torch {torch.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads; best of {args.repeat}"
    )
    header = (
        f"{'case':<40} {'floor ms':>8} {'ours ms':>9} {'/floor':>8} "
        f"{'torch ms':>10} {'/floor':>9} {'speedup':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, x in tensors.items():
        print(name)
        print(bench_forward("  MinMaxObserver", "MinMaxObserver", {}, x, args))
        for axis in axes[name]:
            print(
                bench_forward(
                    f"  PerChannelMinMaxObserver ch_axis={axis}",
                    "PerChannelMinMaxObserver",
                    {"ch_axis": axis},
                    x,
                    args,
                )
            )
        print(
            bench_forward(
                "  HistogramObserver.forward", "HistogramObserver", {}, x, args
            )
        )
    print(
        "\nHistogramObserver.calculate_qparams (2048 bins; the search alone)\n"
        f"  {'distribution':<40} {'ours ms':>9} {'torch ms':>10} {'speedup':>9} "
        f"{'global ms':>10}"
    )
    for line in bench_histogram_search(args):
        print(line)
    print(
        "\nfloor = torch.aminmax over the tensor; speedup = torch ms / ours ms; "
        "ours = torch's greedy search bit for bit; global = search='global'."
    )


if __name__ == "__main__":
    main()
