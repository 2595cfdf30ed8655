"""Histogram observers vs torch.ao's HistogramObserver, and vs the aminmax floor.

Three measurements, in one process on CPU (torch threads at their default
unless --threads is given):

1. Per-tensor activations: `--batches` batches of `--elems` float32 values
   (default 4 x 16M, N(0, 1) with a growing scale so that every batch widens
   the range and both sides re-bin). Update time per batch and qparams time:

       torch   torch.ao.quantization.HistogramObserver (quint8, affine): obs(x);
               obs.calculate_qparams()
       ours    quantobs Observer "histogram" (uint8-range int8 asymmetric,
               per tensor): obs.update(x); obs.get_qparams()  (global search)
               and the same with mode="torch"

2. Search only, on identical input: torch's own histogram after those
   batches, searched by torch (`_non_linear_param_search`) and by
   `quantobs.solvers.torch_l2.torch_l2_search` (same result, checked),
   plus the L2 error (torch's closed form) of torch's range and of the global
   search's range on that histogram.

3. Per-channel: a 4096x4096 weight, observer "entropy" with
   strategy="channel" (4096 histograms, bins="auto": 256 each; 2048 before
   issue 15): update + qparams, as a ratio to `torch.aminmax` over the same
   tensor (the floor of any observer). benchmarks/bench_histogram_channels.py
   measures every histogram observer per channel and per group.

Timings are the best of `--repeat` runs after a warm-up; the machine is
shared, so compare the ratios within one run.

Run: .venv/bin/python benchmarks/bench_histogram.py [--elems N] [--batches B]
     [--repeat R] [--threads T] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import quantobs
from quantobs import Observer, QuantizationArgs
from quantobs.solvers import l2_errors, l2_search, torch_l2_search


def best_of(
    repeat: int, run: Callable[[], Any], setup: Callable[[], Any] | None = None
) -> float:
    """Best wall time (s) of `run` over `repeat` runs, `setup` untimed."""
    if setup is not None:
        setup()
    run()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def make_batches(elems: int, batches: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rows = max(1, elems // 4096)
    return [
        torch.randn(rows, 4096, generator=gen) * (1.0 + 0.5 * k) for k in range(batches)
    ]


def torch_observer() -> torch.ao.quantization.HistogramObserver:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.HistogramObserver(
            dtype=torch.quint8, qscheme=torch.per_tensor_affine
        )


def ours(mode: str = "global") -> Observer:
    args = QuantizationArgs(num_bits=8, symmetric=False)
    return Observer.load_from_registry(
        "histogram", base_name="input", args=args, mode=mode
    )


def bench_per_tensor(
    batches: list[torch.Tensor], repeat: int
) -> list[tuple[str, float, float]]:
    """Rows (what, ms, torch ms) for updates and qparams."""
    rows = []
    holder: dict[str, Any] = {}

    def feed_torch() -> None:
        obs = torch_observer()
        for x in batches:
            obs(x)
        holder["torch"] = obs

    def feed_ours() -> None:
        obs = ours()
        for x in batches:
            obs.update(x)
        holder["ours"] = obs

    n = len(batches)
    t_torch = best_of(repeat, feed_torch) / n
    t_ours = best_of(repeat, feed_ours) / n
    rows.append(("update, per batch", t_ours, t_torch))

    torch_obs, our_obs = holder["torch"], holder["ours"]
    q_torch = best_of(repeat, torch_obs.calculate_qparams)
    q_ours = best_of(repeat, our_obs.get_qparams)
    rows.append(("qparams (global L2 search)", q_ours, q_torch))
    torch_mode = ours("torch")
    torch_mode.load_state_dict(our_obs.state_dict())
    q_mode = best_of(repeat, torch_mode.get_qparams)
    rows.append(('qparams (mode="torch" search)', q_mode, q_torch))
    holder_torch_obs.append(torch_obs)
    return rows


holder_torch_obs: list[Any] = []


def bench_search(
    obs: Any, repeat: int
) -> tuple[list[tuple[str, float, float]], list[str]]:
    hist, min_val, max_val = obs.histogram, obs.min_val, obs.max_val
    expected = obs._non_linear_param_search()
    got = torch_l2_search(hist, min_val, max_val, obs.dst_nbins)
    same = torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    t_torch = best_of(repeat, obs._non_linear_param_search)
    t_ours = best_of(
        repeat, lambda: torch_l2_search(hist, min_val, max_val, obs.dst_nbins)
    )
    lo = min_val.double()
    width = (max_val.double() - lo) / obs.bins
    t_global = best_of(repeat, lambda: l2_search(hist, lo, width, 256))
    global_range = l2_search(hist, lo, width, 256)

    def error(r: tuple[torch.Tensor, torch.Tensor]) -> float:
        low = r[0].double().reshape(1)
        high = r[1].double().reshape(1)
        return float(l2_errors(hist, lo, width, low, high, 256))

    notes = [
        f"torch_l2_search == torch's search on torch's histogram: {same}",
        f"torch's range {tuple(round(float(v), 4) for v in expected)}, L2 error "
        f"{error(expected):.6g}; global range "
        f"{tuple(round(float(v), 4) for v in global_range)}, L2 error "
        f"{error(global_range):.6g}",
    ]
    rows = [
        ("search: torch_l2_search (same result)", t_ours, t_torch),
        ("search: l2_search (global, 256 levels)", t_global, t_torch),
    ]
    return rows, notes


def bench_per_channel(repeat: int, size: int) -> tuple[float, float, float, int]:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(size, size, generator=gen)
    floor = best_of(repeat, lambda: torch.aminmax(weight))
    args = QuantizationArgs(num_bits=8, strategy="channel")
    holder: dict[str, Observer] = {}

    def update() -> None:
        obs = Observer.load_from_registry("entropy", base_name="weight", args=args)
        obs.update(weight)
        holder["obs"] = obs

    t_update = best_of(max(1, repeat // 2), update)
    obs = holder["obs"]
    cache = getattr(obs, "_solved", None)  # time the search, not the cache

    def qparams() -> None:
        if cache is not None:
            cache.clear()
        obs.get_qparams()

    t_entropy = best_of(1, qparams)
    bins = int(obs.histogram.bins)  # type: ignore[attr-defined]
    return floor, t_update, t_entropy, bins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elems", type=int, default=1 << 24)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--channel-size", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="1M elements, 1 repeat")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.elems, opts.repeat, opts.channel_size = 1 << 20, 1, 1024
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(
        f"quantobs {quantobs.__version__}, torch {torch.__version__}, "
        f"{platform.machine()}, {torch.get_num_threads()} threads"
    )
    batches = make_batches(opts.elems, opts.batches)
    print(
        f"\nper tensor: {opts.batches} batches of {batches[0].numel():,} float32 "
        "(growing range)"
    )
    rows = bench_per_tensor(batches, opts.repeat)
    search_rows, notes = bench_search(holder_torch_obs[-1], opts.repeat)
    print(f"{'':42s} {'ours ms':>10s} {'torch ms':>10s} {'speed-up':>9s}")
    for what, mine, theirs in rows + search_rows:
        print(
            f"{what:42s} {mine * 1e3:10.2f} {theirs * 1e3:10.2f} {theirs / mine:8.1f}x"
        )
    for note in notes:
        print("  " + note)

    floor, t_update, t_entropy, bins = bench_per_channel(opts.repeat, opts.channel_size)
    n = opts.channel_size
    print(f"\nper channel: {n}x{n} weight, entropy observer ({n} x {bins} bins)")
    print(f"{'':42s} {'ms':>10s} {'x floor':>9s}")
    for what, t in (
        ("torch.aminmax (floor)", floor),
        ("histogram update", t_update),
        ("entropy search (qparams)", t_entropy),
        ("update + entropy", t_update + t_entropy),
    ):
        print(f"{what:42s} {t * 1e3:10.2f} {t / floor:8.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
