"""Observers end to end: quantobs vs llm-compressor, and vs the `torch.aminmax` floor.

For each case (a seeded tensor and a preset's args) and each observer
(`memoryless_minmax`, `static_minmax`, `memoryless_mse`, and `memoryless_mse`
with early stopping off), times one observation and its qparams on both sides:

    ours    obs = quantobs.Observer.load_from_registry(name, base_name=...,
          args=...); obs.update(x); obs.get_qparams()  (+ get_global_scale())
    theirs  obs = llmcompressor.observers.Observer.load_from_registry(...);
          obs(x); obs.get_qparams()   (a dict with the global scale)

llm-compressor's `get_qparams` deletes the statistics, so every timed run gets
a fresh observer on both sides; construction is outside the timed window on
both sides. Runs are interleaved (ours, theirs, ours, ...) so that machine
load hits both alike; best of N after warm-up for the min-max observers, best
of a few without warm-up for MSE (seconds per run). The floor is
`torch.aminmax` over the same tensor: one pass over memory, which no min-max
observer can beat. For the min-max rows it runs in the same rotation as the
two observers (the same cache and load conditions: run back to back, the
64 MB tensor stays in this machine's large L3 cache, which the observers'
rotation does not allow them); the case header gives its best time back to
back. The MSE rows also report the quantization
error of both results, scored alike with `quantobs.fake_quantize`.

Ours uses the native kernels (`quantobs.native`) when they build; `--eager`
times the torch-only path.

Run: .venv/bin/python benchmarks/bench_observers.py [--quick] [--only NAME]
     [--eager]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import torch

import quantobs
from quantobs import native

NORM = 2.4  # the MSE observers' default error exponent


class QParams(NamedTuple):
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    global_scale: torch.Tensor | None


@dataclass(frozen=True)
class Case:
    """One tensor and one preset's args for it."""

    label: str
    preset: str
    part: str  # "weights" or "input_activations"
    base_name: str
    tensor: str  # key into the tensors of the run
    mse_repeat: int  # best of this many MSE runs (overridden by --mse-repeat)
    exact_mse: bool = True  # also time MSE with early stopping off


@dataclass(frozen=True)
class Variant:
    """An observer name and the options both sides get."""

    label: str
    name: str
    ours: dict[str, Any] = field(default_factory=dict)
    theirs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_mse(self) -> bool:
        return "mse" in self.name


CASES = (
    Case("W4A16 int4 group-128", "W4A16", "weights", "weight", "weight", 2),
    Case("W8A8 int8 channel", "W8A8", "weights", "weight", "weight", 2),
    Case("NVFP4 tensor_group-16", "NVFP4", "weights", "weight", "weight", 2),
    Case("FP8 tensor, input float32", "FP8", "input_activations", "input", "act", 1),
    Case(
        "FP8 tensor, input bfloat16",
        "FP8",
        "input_activations",
        "input",
        "act_bf16",
        1,
        exact_mse=False,
    ),
)

VARIANTS = (
    Variant("memoryless_minmax", "memoryless_minmax"),
    Variant("static_minmax", "static_minmax"),
    Variant("memoryless_mse", "memoryless_mse"),
    # Every candidate scored: the mode in which the two searches must agree.
    Variant(
        "memoryless_mse exact",
        "memoryless_mse",
        ours={"patience": None},
        theirs={"patience": 1000},
    ),
)


@dataclass
class Row:
    case: Case
    variant: Variant
    repeat: int
    ms: list[float]
    results: list[QParams]
    floor: float | None = None  # aminmax ms timed in the row's rotation


# ----------------------------------------------------------------- timing


def best_of(
    makers: Sequence[Callable[[], Callable[[], QParams]]], repeat: int, warmup: int
) -> tuple[list[float], list[QParams]]:
    """Best wall time in ms of each maker's run, and its last result.

    `maker()` builds a fresh observer outside the timed window and returns the
    run to time. The makers run interleaved, one run each per round.
    """
    for _ in range(warmup):
        for make in makers:
            make()()
    best = [float("inf")] * len(makers)
    last: list[QParams | None] = [None] * len(makers)
    for _ in range(repeat):
        for i, make in enumerate(makers):
            run = make()
            start = time.perf_counter()
            last[i] = run()
            best[i] = min(best[i], time.perf_counter() - start)
    return [s * 1e3 for s in best], [r for r in last if r is not None]


def sample(x: torch.Tensor) -> torch.Tensor:
    """A small slice of `x` with the same layout (for priming)."""
    return x[:16] if x.ndim == 2 else x[:1, :16]


def floor_ms(x: torch.Tensor, repeat: int, warmup: int) -> float:
    for _ in range(warmup):
        torch.aminmax(x)
    best = float("inf")
    for _ in range(max(repeat, 3)):
        start = time.perf_counter()
        torch.aminmax(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def floor_maker(x: torch.Tensor) -> Callable[[], Callable[[], Any]]:
    """`torch.aminmax(x)` as a maker, to time the floor in a rotation."""

    def run() -> None:
        torch.aminmax(x)

    return lambda: run


def our_maker(
    variant: Variant, case: Case, args: quantobs.QuantizationArgs, x: torch.Tensor
) -> Callable[[], Callable[[], QParams]]:
    tensor_group = args.strategy == "tensor_group"

    def make() -> Callable[[], QParams]:
        obs = quantobs.Observer.load_from_registry(
            variant.name, base_name=case.base_name, args=args, **variant.ours
        )

        def run() -> QParams:
            obs.update(x)
            scale, zero_point = obs.get_qparams()
            global_scale = obs.get_global_scale() if tensor_group else None
            return QParams(scale, zero_point, global_scale)

        return run

    return make


def their_maker(
    observer_cls: Any, variant: Variant, case: Case, args: Any, x: torch.Tensor
) -> Callable[[], Callable[[], QParams]]:
    # Their Observer updates args.observer_kwargs in place: give the variant its
    # own copy rather than passing options as keyword arguments.
    args = args.model_copy(update={"observer_kwargs": dict(variant.theirs)})

    def make() -> Callable[[], QParams]:
        obs = observer_cls.load_from_registry(
            variant.name, base_name=case.base_name, args=args
        )

        def run() -> QParams:
            obs(x)
            qparams = obs.get_qparams()
            return QParams(
                qparams["scale"], qparams["zero_point"], qparams.get("global_scale")
            )

        return run

    return make


# ---------------------------------------------------------------- results


def quant_error(
    x: torch.Tensor, qparams: QParams, args: quantobs.QuantizationArgs
) -> tuple[float, float]:
    """`sum |fake_quant(x) - x| ** 2.4` and the mean squared error."""
    fq = quantobs.fake_quantize(
        x,
        qparams.scale,
        qparams.zero_point,
        args,
        global_scale=qparams.global_scale,
    )
    diff = (fq.to(torch.float32) - x.to(torch.float32)).abs_()
    del fq
    err = float(diff.pow(NORM).sum(dtype=torch.float64))
    mse = float(diff.square_().mean(dtype=torch.float64))
    return err, mse


def compare(ours: QParams, theirs: QParams) -> tuple[str, str | None]:
    """`("yes" | "no" | "dtype", detail)`: bit-identical (dtype included)?"""
    dtype_notes, diff_notes = [], []
    for name in QParams._fields:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a is None or b is None:
            if (a is None) != (b is None):
                diff_notes.append(f"{name} only on one side")
            continue
        if a.dtype != b.dtype:
            dtype_notes.append(f"{name} {a.dtype} vs {b.dtype}")
        if a.shape != b.shape:
            diff_notes.append(f"{name} shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        differ = a64 != b64
        if bool(differ.any()):
            rel = ((a64 - b64).abs() / b64.abs().clamp_min(1e-30)).max()
            diff_notes.append(
                f"{int(differ.sum())} of {differ.numel()} {name} values differ "
                f"(max rel. diff {float(rel):.2e})"
            )
    detail = "; ".join(diff_notes + dtype_notes) or None
    if diff_notes:
        return "no", detail
    return ("dtype" if dtype_notes else "yes"), detail


# ------------------------------------------------------------------- main


def load_peers() -> dict[str, Any] | None:
    """llm-compressor's Observer and compressed-tensors' presets, if installed."""
    # llm-compressor logs a warning at import on a machine without accelerator.
    os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "true")
    try:
        from compressed_tensors.quantization import preset_name_to_scheme
        from llmcompressor.observers import Observer as LObserver
    except ImportError:
        return None
    return {
        "observer": LObserver,
        "args": lambda case: getattr(
            preset_name_to_scheme(case.preset, ["Linear"]), case.part
        ),
        "versions": ", ".join(
            f"{dist} {metadata.version(dist)}"
            for dist in ("llmcompressor", "compressed-tensors")
        ),
    }


def selected(case: Case, variant: Variant, only: list[str]) -> bool:
    text = f"{case.label} {case.preset} {case.base_name} {variant.label}".lower()
    return all(token.lower() in text for token in only)


def make_tensors(quick: bool, needed: set[str]) -> dict[str, torch.Tensor]:
    """The run's tensors; each has its own seed, so --only does not change it."""

    def randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    weight_shape = (512, 1024) if quick else (4096, 4096)
    act_shape = (2, 256, 1024) if quick else (8, 2048, 4096)
    tensors: dict[str, torch.Tensor] = {}
    if "weight" in needed:
        tensors["weight"] = randn(weight_shape, 0)
    if needed & {"act", "act_bf16"}:
        act = randn(act_shape, 1)
        if "act" in needed:
            tensors["act"] = act
        if "act_bf16" in needed:
            tensors["act_bf16"] = act.to(torch.bfloat16)
    return tensors


def git_revision() -> str:
    """`git <short hash>[, modified]` of the checkout, or '' outside one."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", *argv], cwd=root, capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return ""
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src")
    return f" (git {head}{', src modified' if dirty else ''})"


def describe(x: torch.Tensor) -> str:
    return "x".join(map(str, x.shape)) + " " + str(x.dtype).removeprefix("torch.")


def print_header(
    options: argparse.Namespace,
    tensors: dict[str, torch.Tensor],
    peers: dict[str, Any] | None,
) -> None:
    mse_repeat = (
        str(options.mse_repeat)
        if options.mse_repeat
        else "2 (weights) / 1 (activations)"
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; quantobs "
        f"{quantobs.__version__}{git_revision()} "
        f"({'native kernels' if native.available() else 'torch ops only'}); "
        f"{peers['versions'] if peers else 'no peers'}"
    )
    print(
        "tensors (randn, seed 0 weight, seed 1 input): "
        + "; ".join(f"{key} {describe(x)}" for key, x in tensors.items())
    )
    print(
        f"min-max: best of {options.repeat} after {options.warmup} warm-up runs; "
        f"MSE: best of {mse_repeat}, no warm-up; load average "
        f"{os.getloadavg()[0]:.2f} (the machine's other work skews timings)"
    )
    print(
        """
How to read this
  ms         best wall time of one fresh observer's update + qparams (ours:
             update(x), get_qparams(), get_global_scale() for NVFP4; theirs:
             obs(x), get_qparams()); construction is not timed on either side
  speed-up   theirs ms / ours ms (above 1: quantobs is faster)
  floor ms   torch.aminmax(x), same tensor, same run: for min-max rows timed
             in their rotation, for MSE rows the best back to back
  /floor     ours ms / floor ms (the floor is one pass over memory; a min-max
             observer cannot go below 1)
  same       scale, zero point and global scale bit-identical, dtype included
             ("dtype": equal values, different dtypes; details below)
  exact      memoryless_mse with early stopping off: patience=None (ours),
             patience=1000 (theirs); every candidate scored on both sides
  err^2.4    sum |fake_quant(x) - x| ** 2.4 (the MSE objective) and MSE,
             both sides scored with quantobs.fake_quantize
"""
    )


def print_timings(rows: list[Row], floors: dict[str, float], peers: bool) -> None:
    header = f"{'observer':<22}{'n':>3}{'ours ms':>11}{'floor ms':>10}{'/floor':>8}"
    if peers:
        header += f"{'theirs ms':>12}{'speed-up':>10}{'same':>7}"
    print(header)
    print("-" * len(header))
    case = None
    for row in rows:
        if row.case is not case:
            case = row.case
            print(f"{case.label} (floor {floors[case.tensor]:.2f} ms back to back)")
        ours = row.ms[0]
        floor = row.floor if row.floor is not None else floors[row.case.tensor]
        line = (
            f"  {row.variant.label:<20}{row.repeat:>3}{ours:>11.1f}"
            f"{floor:>10.2f}{ours / floor:>8.1f}"
        )
        if peers and len(row.ms) > 1:
            theirs = row.ms[1]
            same, _ = compare(row.results[0], row.results[1])
            line += f"{theirs:>12.1f}{theirs / ours:>10.2f}{same:>7}"
        print(line)


def print_quality(
    rows: list[Row],
    tensors: dict[str, torch.Tensor],
    our_args: Callable[[Case], quantobs.QuantizationArgs],
    peers: bool,
) -> None:
    quality_rows = [
        row
        for row in rows
        if row.variant.is_mse or row.variant.name == "memoryless_minmax"
    ]
    if not any(row.variant.is_mse for row in quality_rows):
        return
    print("\nQuantization error of the chosen qparams (memoryless_minmax: reference)")
    header = f"{'observer':<22}{'err^2.4 ours':>14}{'MSE ours':>12}"
    if peers:
        header += f"{'err^2.4 theirs':>16}{'MSE theirs':>12}{'theirs/ours':>13}"
    print(header)
    print("-" * len(header))
    case = None
    for row in quality_rows:
        if row.case is not case:
            case = row.case
            print(case.label)
        x, args = tensors[row.case.tensor], our_args(row.case)
        err, mse = quant_error(x, row.results[0], args)
        line = f"  {row.variant.label:<20}{err:>14.6e}{mse:>12.4e}"
        if peers and len(row.results) > 1:
            their_err, their_mse = quant_error(x, row.results[1], args)
            line += f"{their_err:>16.6e}{their_mse:>12.4e}{their_err / err:>13.6f}"
        print(line)


def print_differences(rows: list[Row]) -> None:
    notes = []
    for row in rows:
        if len(row.results) < 2:
            continue
        same, detail = compare(row.results[0], row.results[1])
        if same != "yes":
            notes.append(f"  {row.case.label}, {row.variant.label}: {detail}")
    if notes:
        print("\nWhere the qparams are not bit-identical (ours vs theirs)")
        print("\n".join(notes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 512x1024 weight, 2x256x1024 input, 1 run, no warm-up",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="keep rows whose case or observer contains NAME (case-insensitive; "
        "repeat to narrow: --only mse --only nvfp4)",
    )
    parser.add_argument("--repeat", type=int, default=20, help="min-max: best of")
    parser.add_argument("--warmup", type=int, default=3, help="min-max warm-up runs")
    parser.add_argument(
        "--mse-repeat", type=int, default=0, help="MSE: best of (default: per case)"
    )
    parser.add_argument("--no-peers", action="store_true", help="skip peer timings")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="ours without the native kernels (torch ops only)",
    )
    options = parser.parse_args()
    native.set_enabled(not options.eager)
    if options.quick:
        options.repeat, options.warmup = 1, 0
        options.mse_repeat = options.mse_repeat or 1

    plan = [
        (case, variant)
        for case in CASES
        for variant in VARIANTS
        if (case.exact_mse or variant.label != "memoryless_mse exact")
        and selected(case, variant, options.only)
    ]
    if not plan:
        parser.error(f"--only {' '.join(options.only)} selects no row")
    peers = None if options.no_peers else load_peers()
    tensors = make_tensors(options.quick, {case.tensor for case, _ in plan})

    def our_args(case: Case) -> quantobs.QuantizationArgs:
        args = getattr(quantobs.preset_scheme(case.preset), case.part)
        assert args is not None
        return args

    print_header(options, tensors, peers)
    floors = {
        key: floor_ms(x, options.repeat, options.warmup) for key, x in tensors.items()
    }

    def makers_for(case: Case, variant: Variant, x: torch.Tensor) -> list[Any]:
        makers = [our_maker(variant, case, our_args(case), x)]
        if peers is not None:
            their_args = peers["args"](case)
            makers.append(their_maker(peers["observer"], variant, case, their_args, x))
        return makers

    # Prime every path once on a small slice, so that one-time costs (lazy
    # imports, first allocations) land in no timing, best of 1 included.
    for case, variant in plan:
        best_of(makers_for(case, variant, sample(tensors[case.tensor])), 1, 0)
    rows = []
    for case, variant in plan:
        x = tensors[case.tensor]
        makers = makers_for(case, variant, x)
        if variant.is_mse:
            repeat, warmup = options.mse_repeat or case.mse_repeat, 0
            ms, results = best_of(makers, repeat, warmup)
            rows.append(Row(case, variant, repeat, ms, results))
            continue
        ms, results = best_of([floor_maker(x), *makers], options.repeat, options.warmup)
        rows.append(Row(case, variant, options.repeat, ms[1:], results, ms[0]))
    # The floor: best of a run before and a run after the rows.
    for key, x in tensors.items():
        floors[key] = min(floors[key], floor_ms(x, options.repeat, options.warmup))

    print_timings(rows, floors, peers is not None)
    print(f"(load average after timing: {os.getloadavg()[0]:.2f})")
    print_quality(rows, tensors, our_args, peers is not None)
    print_differences(rows)
    if peers is None and not options.no_peers:
        print("\n(peers not installed: pip install 'quantobs[peers]' to compare)")


if __name__ == "__main__":
    main()
