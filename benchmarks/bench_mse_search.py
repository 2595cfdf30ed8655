"""MSE searches beyond the grid on MiniLM's weights: error gained, time spent.

For each weight scheme (`W4A16`, `W4A16_ASYM`, `W8A8`, `NVFP4`, `MXFP4`) and
each of MiniLM's linear weights (2-D `.weight` tensors without `embed` or
`norm` in the name), one `memoryless_mse` observation per row:

    llm-compressor  llm-compressor 0.14's `memoryless_mse`, in this process
    default         ours with the default options (its scales must equal
                    llm-compressor's: the `equal` column)
    <options>       ours with each opt-in search that applies to the scheme
                    (`search="fine"` / `"refine"`, `independent_bounds=True`
                    for asymmetric args, `scale_search="discrete"` for NVFP4
                    and MX, `round_scales=True` for NVFP4)

Every row's qparams (with its own NVFP4 global scale) fake-quantize the
weights with `quantobs.fake_quantize`; the columns are the total squared
error over all the weights, the SQNR in dB (`10 log10(sum w^2 / sum e^2)`),
the change of the squared error against llm-compressor's, the search's own
objective `sum |e| ** 2.4` and its change, and the time of `update` +
`get_qparams` (+ `get_global_scale`) summed over the weights (best of
`--repeat` runs; llm-compressor's: one run). Ours runs with the native
kernels when they are built.

Run: .venv/bin/python benchmarks/bench_mse_search.py [--schemes W4A16 ...]
     [--limit N] [--repeat N] [--threads N] [--no-peers]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file

import quantobs
from quantobs import Observer, fake_quantize, native, preset_scheme
from quantobs.cli.default_model import default_model_path

NORM = 2.4  # the MSE observers' error exponent
SCHEMES = ("W4A16", "W4A16_ASYM", "W8A8", "NVFP4", "MXFP4")


@dataclass(frozen=True)
class Row:
    """One observer configuration of a scheme."""

    label: str
    options: dict[str, Any] = field(default_factory=dict)


def rows_for(args: quantobs.QuantizationArgs) -> list[Row]:
    """The option rows that apply to these args (default first)."""
    rows = [Row("default"), Row("fine", {"search": "fine"})]
    rows.append(Row("refine", {"search": "refine"}))
    if not args.symmetric:
        rows += [
            Row("grid + bounds", {"independent_bounds": True}),
            Row("refine + bounds", {"search": "refine", "independent_bounds": True}),
            Row("fine + bounds", {"search": "fine", "independent_bounds": True}),
        ]
    if args.strategy == "tensor_group":
        rows.append(Row("round_scales", {"round_scales": True}))
    if args.is_mx or args.scale_dtype == torch.float8_e4m3fn:
        rows.append(Row("discrete", {"scale_search": "discrete"}))
    return rows


def linear_weights(limit: int | None) -> dict[str, torch.Tensor]:
    """MiniLM's linear weights, float32, in file order (`limit`: the first)."""
    state = load_file(str(default_model_path()))
    names = [
        name
        for name, value in state.items()
        if value.ndim == 2
        and name.endswith(".weight")
        and "embed" not in name
        and "norm" not in name
    ]
    return {name: state[name].float() for name in names[:limit]}


QParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def ours(args: quantobs.QuantizationArgs, options: dict[str, Any]) -> Callable:
    def run(w: torch.Tensor) -> QParams:
        observer = Observer.load_from_registry(
            "memoryless_mse", base_name="weight", args=args, **options
        )
        observer.update(w)
        scale, zero_point = observer.get_qparams()
        gscale = None
        if args.strategy == "tensor_group":
            gscale = observer.get_global_scale()
        return scale, zero_point, gscale

    return run


def theirs(scheme: str) -> Callable:
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.observers import Observer as LCObserver

    ct_args = preset_name_to_scheme(scheme, ["Linear"]).weights

    def run(w: torch.Tensor) -> QParams:
        observer = LCObserver.load_from_registry(
            "memoryless_mse", base_name="weight", args=ct_args.model_copy()
        )
        observer(w)
        found = observer.get_qparams()
        return found["scale"], found["zero_point"], found["global_scale"]

    return run


@dataclass
class Totals:
    """Errors and time of one row over all the weights."""

    squared: float = 0.0
    objective: float = 0.0
    seconds: float = 0.0
    qparams: list[QParams] = field(default_factory=list)


def measure(
    run: Callable,
    weights: dict[str, torch.Tensor],
    args: quantobs.QuantizationArgs,
    repeat: int,
) -> Totals:
    totals = Totals()
    for w in weights.values():
        best = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            found = run(w)
            best = min(best, time.perf_counter() - start)
        totals.seconds += best
        scale, zero_point, gscale = found
        fq = fake_quantize(w, scale, zero_point, args, global_scale=gscale)
        error = (fq - w).abs().double()
        totals.squared += float((error**2).sum())
        totals.objective += float((error**NORM).sum())
        totals.qparams.append(found)
    return totals


def same(a: list[QParams], b: list[QParams]) -> bool:
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            if (u is None) != (v is None):
                return False
            if (
                u is not None
                and v is not None
                and not torch.equal(u.float(), v.float())
            ):
                return False
    return True


def report(
    scheme: str,
    signal: float,
    results: list[tuple[str, Totals]],
    reference: Totals,
    equal: bool | None,
) -> None:
    print(f"\n{scheme}")
    header = (
        f"{'observer':<18} {'sq. error':>12} {'SQNR dB':>8} {'vs LC %':>8} "
        f"{'|e|^2.4':>12} {'vs LC %':>8} {'time s':>8}"
    )
    print(header)
    print("-" * len(header))
    for label, totals in results:
        sqnr = 10 * math.log10(signal / totals.squared)
        gain = 100 * (totals.squared / reference.squared - 1)
        obj = 100 * (totals.objective / reference.objective - 1)
        print(
            f"{label:<18} {totals.squared:>12.6e} {sqnr:>8.3f} {gain:>+8.3f} "
            f"{totals.objective:>12.6e} {obj:>+8.3f} {totals.seconds:>8.2f}"
        )
    if equal is not None:
        print(f"default == llm-compressor, every scale bit for bit: {equal}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--limit", type=int, default=None, help="first N weights")
    parser.add_argument("--repeat", type=int, default=1, help="best of N (ours)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-peers", action="store_true")
    options = parser.parse_args(argv)
    if options.threads:
        torch.set_num_threads(options.threads)
    weights = linear_weights(options.limit)
    signal = sum(float((w.double() ** 2).sum()) for w in weights.values())
    info = native.backend_info()
    print(
        f"{len(weights)} MiniLM linear weights, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, kernels: {info.backend}"
    )
    for scheme in options.schemes:
        args = preset_scheme(scheme).weights
        assert args is not None
        results: list[tuple[str, Totals]] = []
        peer = None
        if not options.no_peers:
            peer = measure(theirs(scheme), weights, args, 1)
            results.append(("llm-compressor", peer))
        for row in rows_for(args):
            found = measure(ours(args, row.options), weights, args, options.repeat)
            results.append((row.label, found))
        default = results[1 if peer else 0][1]
        equal = None if peer is None else same(default.qparams, peer.qparams)
        report(scheme, signal, results, peer or default, equal)


if __name__ == "__main__":
    main()
