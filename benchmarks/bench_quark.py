"""The Quark face vs amd-quark 0.13's own observers and the `torch.aminmax` floor.

In one process on CPU:

* block observers on a seeded 4096x4096 float32 weight, per-block scales
  along the last axis: `PerBlockMXObserver` (OCP MXFP4 and MXFP8 e4m3,
  `even` e8m0 scales, blocks of 32) and `PerBlockBFPObserver` (BFP16, blocks
  of 8). A row is `forward(w)` + `_calculate_qparams()` on a fresh observer.
* histogram observers on `--batches` seeded 16M-element float32 activations
  (4, 1024, 4096), symmetric int8 per tensor: `PerTensorPercentileObserver`
  and `PerTensorMSEObserver`. Quark's calibration computes qparams after
  every batch (`quark (flow)`); quantobs computes them once, at the end. The
  `quark (once)` column times Quark with qparams once, to separate the two
  effects.

The floor is `torch.aminmax` over the same data (one pass over memory). The
`same` column says whether both sides' qparams are equal (value, dtype,
shape). They are for the block rows; past 2**24 histogram values Quark's
percentile is not exact (its float32 CDF reaches 1.0 before the last values,
so it cuts them) and its grown histograms can bin with one bin more or less
than their edges, so the histogram rows can differ; `tests/test_quark.py`
shows both cases. Best of N interleaved runs after a warm-up; torch threads
at their default. Timings on a shared machine are noisy: compare ratios
within a run.

Run: .venv/bin/python benchmarks/bench_quark.py [--repeat 5] [--batches 4]
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Callable
from typing import Any

import torch

import quantobs.faces.quark as ours
from timing import best_ms


def quark_spec(quark: Any, **kwargs: Any) -> Any:
    """Quark's QTensorConfig from strings."""
    enums = {
        "dtype": quark.type.Dtype,
        "qscheme": quark.type.QSchemeType,
        "scale_type": quark.type.ScaleType,
    }
    out = {}
    for key, value in kwargs.items():
        if key in enums:
            value = enums[key][value]
        elif key == "round_method":
            value = quark.type.RoundType[value]
        elif key == "observer_cls":
            value = getattr(quark.obs, value)
        out[key] = value
    return quark.QTensorConfig(**out)


def builders(quark: Any, name: str, **spec: Any) -> tuple[Callable[[], Any], ...]:
    """Constructors of (our observer, Quark's) for one spec."""
    ours_spec = ours.QTensorConfig(observer_cls=name, **spec)
    theirs_spec = quark_spec(quark, observer_cls=name, **spec)
    return (
        lambda: getattr(ours, name)(ours_spec),
        lambda: getattr(quark.obs, name)(theirs_spec),
    )


def same(a: Any, b: Any) -> str:
    """`yes` if both qparams are equal in value, dtype and shape."""
    for x, y in zip(a, b, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return f"no ({a[0].item():.6g} vs {b[0].item():.6g})"
    return "yes"


def calibrate(make: Callable[[], Any], xs: list[torch.Tensor], every: bool) -> Any:
    """A fresh observer over `xs`; qparams after every batch or once."""
    observer = make()
    result = None
    for x in xs:
        observer(x)
        if every:
            result = observer._calculate_qparams()
    return result if every else observer._calculate_qparams()


def header(args: argparse.Namespace, quark_version: str) -> list[str]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [
        f"torch {torch.__version__}, amd-quark {quark_version}, "
        f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"load {load:.1f}; best of {args.repeat}",
        "",
        f"{'case':<34} {'floor ms':>9} {'ours ms':>9} {'/floor':>7} "
        f"{'quark ms':>10} {'/floor':>7} {'speed-up':>9}  same",
    ]


def line(label: str, floor: float, mine: float, theirs: float, equal: str) -> str:
    return (
        f"{label:<34} {floor:9.1f} {mine:9.1f} {mine / floor:6.1f}x "
        f"{theirs:10.1f} {theirs / floor:6.1f}x {theirs / mine:8.1f}x  {equal}"
    )


def bench_blocks(quark: Any, args: argparse.Namespace) -> list[str]:
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
    mx = {
        "qscheme": "per_group", "ch_axis": -1, "group_size": 32,
        "scale_format": "e8m0", "scale_calculation_mode": "even",
        "is_dynamic": False, "scale_type": "float", "round_method": "half_even",
    }  # fmt: skip
    cases = [
        ("MXFP4 4096x4096", "PerBlockMXObserver", {"dtype": "fp4", **mx}),
        ("MXFP8 e4m3 4096x4096", "PerBlockMXObserver", {"dtype": "fp8_e4m3", **mx}),
        (
            "BFP16 4096x4096",
            "PerBlockBFPObserver",
            {"dtype": "bfp16", "ch_axis": -1, "group_size": 8},
        ),
    ]
    rows = []
    for label, name, spec in cases:
        mine, theirs = builders(quark, name, **spec)
        equal = same(calibrate(mine, [w], False), calibrate(theirs, [w], False))
        times = best_ms(
            [
                lambda: torch.aminmax(w),
                lambda make=mine: calibrate(make, [w], False),
                lambda make=theirs: calibrate(make, [w], False),
            ],
            args.repeat,
            1,
        )
        rows.append(line(label, *times, equal))
    return rows


def bench_histograms(quark: Any, args: argparse.Namespace) -> list[str]:
    g = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(4, 1024, 4096, generator=g) * (1 + i / 2)
        for i in range(args.batches)
    ]
    spec = {
        "dtype": "int8", "qscheme": "per_tensor", "symmetric": True,
        "is_dynamic": False, "scale_type": "float", "round_method": "half_even",
    }  # fmt: skip
    rows = []
    for label, name in (
        ("percentile", "PerTensorPercentileObserver"),
        ("MSE", "PerTensorMSEObserver"),
    ):
        mine, theirs = builders(quark, name, **spec)
        equal = same(calibrate(mine, xs, False), calibrate(theirs, xs, True))
        floor, ours_ms, flow_ms, once_ms = best_ms(
            [
                lambda: [torch.aminmax(x) for x in xs],
                lambda make=mine: calibrate(make, xs, False),
                lambda make=theirs: calibrate(make, xs, True),
                lambda make=theirs: calibrate(make, xs, False),
            ],
            args.repeat,
            0,
        )
        case = f"{label} {args.batches}x16M"
        rows.append(line(f"{case} (flow)", floor, ours_ms, flow_ms, equal))
        rows.append(line(f"{case} (once)", floor, ours_ms, once_ms, equal))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds")
    parser.add_argument("--batches", type=int, default=4, help="activation batches")
    args = parser.parse_args(argv)
    from importlib.metadata import version

    from quark.torch.quantization.config import type as quark_type
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.observer import observer as quark_observer

    quark = argparse.Namespace(
        QTensorConfig=QTensorConfig, type=quark_type, obs=quark_observer
    )
    rows = header(args, version("amd-quark"))
    rows += bench_blocks(quark, args)
    rows += bench_histograms(quark, args)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
