"""Every observer on a GPU (issue 24): time, host syncs, CPU == device qparams.

One command, a table per section on stdout and everything in a JSON file:

* `weights`: every registered observer x {int4 g128, int8 channel, FP8
  tensor, NVFP4, MXFP4} on one seeded 8192x8192 bfloat16 weight: best ms of
  a fresh observer's `update` + `get_qparams` (+ `get_global_scale`), its
  ratio to the `torch.aminmax` floor of the same tensor, llm-compressor
  0.14's observer of the same name on the same device and tensor where it
  exists (optional: skipped when not installed), the host syncs of one
  update and of qparams (`SyncCounter`: the ops that synchronise on CUDA),
  and whether the qparams are bit-identical to the CPU's (native kernels on,
  as a user runs them) on the first rows (the fraction of values that
  differ);
* `activations`: the same on batches of bfloat16 activations (static args:
  int8 tensor, FP8 tensor, NVFP4, MXFP4; every batch observed, then qparams);
* `torch_ao`: the torch.ao face's classes against torch.ao's own on the
  device (float32 activations, a few batches, then `calculate_qparams`);
* `calibrate`: a whole `quantobs.calibration.calibrate` of a Llama-shaped
  bfloat16 model (random weights from transformers' `LlamaConfig`, about
  0.5 B parameters, nothing downloaded) with FP8 weights and static FP8
  inputs observed by `static_minmax` / `histogram` / `percentile` /
  `static_mse`, against the plain forward of the same batches and against
  llm-compressor's `oneshot` where installed.

Needs only torch (+ transformers for `calibrate`); llm-compressor, Triton
and the native kernels are used where present. Timing: best of N after a
warm-up, the device synchronised around each call (`torch.cuda.synchronize`);
slow cells (over a second) are timed once. A section past `--budget-s`
is skipped and says so; the JSON is rewritten after every section.

Run (repo root; on a GPU machine without install: `PYTHONPATH=src`):

    python benchmarks/bench_gpu.py --json bench_gpu.json         # CUDA, full
    python benchmarks/bench_gpu.py --quick --json out.json       # fewer batches
    python benchmarks/bench_gpu.py --device cpu --small          # smoke, seconds
    make bench-gpu
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quantobs import Observer, QuantizationArgs, native
from quantobs.core.syncs import SyncCounter
from quantobs.native import runtime

QParams = list[torch.Tensor]

NVFP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "scale_dtype": torch.float8_e4m3fn,
    "zp_dtype": torch.float8_e4m3fn,
}
MXFP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": torch.uint8,
    "zp_dtype": torch.uint8,
}
# label -> args of the weights
WEIGHT_FORMATS: dict[str, dict[str, Any]] = {
    "int4 g128": {"num_bits": 4, "strategy": "group", "group_size": 128},
    "int8 channel": {"num_bits": 8, "strategy": "channel"},
    "FP8 tensor": {"num_bits": 8, "type": "float"},
    "NVFP4": NVFP4,
    "MXFP4": MXFP4,
}
# label -> static args of the activations (int4 g128 / int8 channel: weights
# only; the int8 of W8A8 inputs, static per tensor)
ACTIVATION_FORMATS: dict[str, dict[str, Any]] = {
    "int8 tensor": {"num_bits": 8},
    "FP8 tensor": {"num_bits": 8, "type": "float"},
    "NVFP4": NVFP4,
    "MXFP4": MXFP4,
}
CALIBRATION_OBSERVERS = ("static_minmax", "histogram", "percentile", "static_mse")
TORCH_AO_CLASSES = (
    ("MinMaxObserver", {}),
    ("MovingAverageMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", {"ch_axis": 0}),
    ("MovingAveragePerChannelMinMaxObserver", {"ch_axis": 0}),
    ("HistogramObserver", {}),
)


@dataclass(frozen=True)
class Sizes:
    """The run's shapes."""

    rows: int  # weight (rows, cols)
    cols: int
    act: tuple[int, ...]  # one activation batch
    act_batches: int
    identity_rows: int  # rows of the weight compared with the CPU
    hidden: int  # the Llama-shaped model
    layers: int
    vocab: int
    model_batches: int
    batch: int
    seq: int
    repeat: int


FULL = Sizes(8192, 8192, (8, 2048, 4096), 4, 256, 1536, 16, 32000, 16, 4, 512, 3)
QUICK = Sizes(8192, 8192, (4, 2048, 4096), 2, 128, 1536, 16, 32000, 4, 4, 512, 2)
SMALL = Sizes(64, 256, (2, 16, 256), 2, 16, 64, 2, 512, 2, 2, 16, 1)


# ------------------------------------------------------------------ timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_ms(
    fn: Callable[[], object], device: torch.device, repeat: int, slow_s: float = 1.0
) -> float:
    """Best wall time of `fn()` in ms: one warm-up call, then `repeat` calls
    (one, where the warm-up took over `slow_s`), the device synchronised
    around each."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    first = time.perf_counter() - start
    if first > slow_s:
        repeat = 1
    best = math.inf
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def floor_ms(xs: Sequence[torch.Tensor], device: torch.device, repeat: int) -> float:
    """`torch.aminmax` over the same tensors: one read of each."""
    return best_ms(lambda: [torch.aminmax(x) for x in xs], device, max(repeat, 3))


# --------------------------------------------------------------- observers


def our_run(
    name: str, base_name: str, args: QuantizationArgs, xs: Sequence[torch.Tensor]
) -> Callable[[], QParams]:
    """A fresh observer: every batch, then its qparams (+ global scale)."""

    def run() -> QParams:
        observer = Observer.get_class(name)(base_name, args)
        _with_importance(observer, xs[0])
        for x in xs:
            observer.update(x)
        found = list(observer.get_qparams())
        if args.strategy == "tensor_group":
            found.append(observer.get_global_scale())
        return found

    return run


def _with_importance(observer: Any, x: torch.Tensor) -> None:
    # the importance-weighted observers get a seeded E[x ** 2] of the right width
    if hasattr(observer, "set_importance") and observer.base_name == "weight":
        gen = torch.Generator().manual_seed(7)
        importance = torch.rand(x.shape[-1], generator=gen) + 0.1
        observer.set_importance(importance.to(x.device))


def syncs_of(
    name: str, base_name: str, args: QuantizationArgs, xs: Sequence[torch.Tensor]
) -> tuple[int, int]:
    """(most syncs of one update, syncs of qparams) of a fresh observer, on
    the code path CUDA tensors take (CPU data: native kernels off)."""
    on_device = xs[0].device.type != "cpu"
    previous = native.set_enabled(on_device and runtime.enabled())
    try:
        return _count_syncs(name, base_name, args, xs)
    finally:
        native.set_enabled(previous)


def _count_syncs(
    name: str, base_name: str, args: QuantizationArgs, xs: Sequence[torch.Tensor]
) -> tuple[int, int]:
    observer = Observer.get_class(name)(base_name, args)
    _with_importance(observer, xs[0])
    most = 0
    for x in xs:
        with SyncCounter() as counter:
            observer.update(x)
        most = max(most, counter.count)
    with SyncCounter() as counter:
        observer.get_qparams()  # the global scale included (tensor_group)
    return most, counter.count


def differing_fraction(found: QParams, expected: QParams) -> float:
    """Fraction of qparam values whose bits differ (dtype and shape must match)."""
    differ = total = 0
    for a, b in zip(found, expected, strict=True):
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.dtype != b.dtype or a.shape != b.shape:
            return 1.0
        if a.is_floating_point():
            a, b = (
                a.reshape(-1).view(_same_width_int(a)),
                b.reshape(-1).view(_same_width_int(b)),
            )
        differ += int((a.reshape(-1) != b.reshape(-1)).sum())
        total += a.numel()
    return differ / max(total, 1)


def _same_width_int(t: torch.Tensor) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()
    ]


def cpu_reference(
    name: str, base_name: str, args: QuantizationArgs, xs: Sequence[torch.Tensor]
) -> QParams:
    """The same observer on the CPU (native kernels as configured); for CPU
    data, on the torch path (the native kernels' twin, CUDA's code)."""
    run = our_run(name, base_name, args, [x.cpu() for x in xs])
    if xs[0].device.type != "cpu":
        return run()
    previous = native.set_enabled(False)
    try:
        return run()
    finally:
        native.set_enabled(previous)


def load_llmcompressor() -> Any:
    """llm-compressor's Observer class, or None when not installed."""
    os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "true")
    try:
        from llmcompressor.observers import Observer as Theirs
    except Exception:  # not installed, or broken: the column stays empty
        return None
    return Theirs


def their_run(
    theirs: Any, name: str, base_name: str, args: QuantizationArgs, xs: Sequence[Any]
) -> Callable[[], object] | None:
    if theirs is None or name.replace("_", "-") not in theirs.registered_names():
        return None
    ct_args = args.to_compressed_tensors()

    def run() -> object:
        observer = theirs.load_from_registry(
            name, base_name=base_name, args=ct_args.model_copy(deep=True)
        )
        for x in xs:
            observer(x)
        return observer.get_qparams()

    return run


def _error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    return text[:160]


def observer_cells(
    section: str,
    xs: Sequence[torch.Tensor],
    base_name: str,
    formats: dict[str, dict[str, Any]],
    identity: Sequence[torch.Tensor],
    theirs: Any,
    opts: argparse.Namespace,
    sizes: Sizes,
) -> list[dict[str, Any]]:
    """Every registered observer on every format: one row each."""
    device = xs[0].device
    floor = floor_ms(xs, device, sizes.repeat)
    print(f"\n{section}: {describe(xs)}; torch.aminmax floor {floor:.3f} ms")
    print(
        f"  {'observer':<24}{'format':<14}{'ms':>10}{'x floor':>9}{'llm-c ms':>10}"
        f"{'x llm-c':>9}{'syncs u/q':>11}{'CPU==dev':>10}"
    )
    rows = []
    for name in observer_names(opts.observers):
        for label, kwargs in formats.items():
            row: dict[str, Any] = {"observer": name, "format": label}
            rows.append(row)
            if time.perf_counter() > opts.deadline:
                row["skipped"] = "time budget spent"
                continue
            try:
                args = QuantizationArgs(**kwargs)
                Observer.get_class(name)(base_name, args)
            except ValueError as err:
                row["skipped"] = _error(err)
                continue
            try:
                ours = our_run(name, base_name, args, xs)
                row["ms"] = best_ms(ours, device, sizes.repeat)
                row["x_floor"] = row["ms"] / floor
                row["syncs_update"], row["syncs_qparams"] = syncs_of(
                    name, base_name, args, xs[:2]
                )
                if not opts.no_identity:
                    found = our_run(name, base_name, args, identity)()
                    expected = cpu_reference(name, base_name, args, identity)
                    row["cpu_differs"] = differing_fraction(found, expected)
            except Exception as err:  # a refusal (memory, size) is a result too
                row["error"] = _error(err)
                _free(device)
            run = (
                None if opts.no_peers else their_run(theirs, name, base_name, args, xs)
            )
            if run is not None:
                try:
                    row["llmc_ms"] = best_ms(run, device, sizes.repeat)
                except Exception as err:
                    row["llmc_error"] = _error(err)
                    _free(device)
            print_observer_row(row)
    return rows


def print_observer_row(row: dict[str, Any]) -> None:
    head = f"  {row['observer']:<24}{row['format']:<14}"
    if "skipped" in row:
        print(f"{head}{'n/a':>10}  {row['skipped'][:60]}")
        return
    if "error" in row:
        print(f"{head}{'error':>10}  {row['error']}", flush=True)
        return
    theirs = row.get("llmc_ms")
    their_text = f"{theirs:>10.3f}{theirs / row['ms']:>8.2f}x" if theirs else " " * 19
    syncs = f"{row['syncs_update']}/{row['syncs_qparams']}"
    differs = row.get("cpu_differs")
    same = "-" if differs is None else ("yes" if differs == 0 else f"{differs:.1%}")
    print(
        f"{head}{row['ms']:>10.3f}{row['x_floor']:>9.1f}{their_text}"
        f"{syncs:>11}{same:>10}",
        flush=True,
    )


def observer_names(only: Sequence[str] | None = None) -> list[str]:
    """One name per registered class (aliases share a class), or `only`'s."""
    names = {Observer.get_class(n).name for n in Observer.registry.names()}
    return sorted({Observer.get_class(n).name for n in only} if only else names)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def describe(xs: Sequence[torch.Tensor]) -> str:
    shape = "x".join(map(str, xs[0].shape))
    return f"{len(xs)} x ({shape}) {str(xs[0].dtype).replace('torch.', '')}"


# ----------------------------------------------------------------- torch.ao


def torch_ao_rows(
    xs: Sequence[torch.Tensor], repeat: int, device: torch.device
) -> list[dict[str, Any]]:
    from torch.ao.quantization import observer as theirs

    from quantobs.faces import torch_ao as ours

    print(f"\ntorch.ao face vs torch.ao: {describe(xs)}")
    print(f"  {'class':<40}{'ours ms':>10}{'torch ms':>10}{'speed':>8}")
    rows = []
    for name, kwargs in TORCH_AO_CLASSES:
        row: dict[str, Any] = {"class": name}
        rows.append(row)
        for side, module in (("ours", ours), ("torch", theirs)):
            cls = getattr(module, name)

            def run(cls: Any = cls, kw: Any = kwargs) -> object:
                observer = cls(**kw).to(device)
                for x in xs:
                    observer(x)
                return observer.calculate_qparams()

            try:
                row[f"{side}_ms"] = best_ms(run, device, repeat)
            except Exception as err:
                row[f"{side}_error"] = _error(err)
        if "ours_ms" in row and "torch_ms" in row:
            row["speed"] = row["torch_ms"] / row["ours_ms"]
            print(
                f"  {name:<40}{row['ours_ms']:>10.3f}{row['torch_ms']:>10.3f}"
                f"{row['speed']:>7.2f}x"
            )
        else:
            print(f"  {name:<40} {row.get('ours_error') or row.get('torch_error')}")
    return rows


# ---------------------------------------------------------------- calibrate


def llama(sizes: Sizes, device: torch.device) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=sizes.layers,
        num_attention_heads=max(1, sizes.hidden // 128),
        num_key_value_heads=max(1, sizes.hidden // 512),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def token_batches(sizes: Sizes, device: torch.device) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shape = (sizes.batch, sizes.seq)
    return [
        {
            "input_ids": torch.randint(0, sizes.vocab, shape, generator=gen).to(device),
            "attention_mask": torch.ones(shape, dtype=torch.long, device=device),
        }
        for _ in range(sizes.model_batches)
    ]


def calibrate_rows(
    sizes: Sizes, device: torch.device, opts: argparse.Namespace
) -> dict[str, Any]:
    from quantobs.calibration import Recipe, attach, calibrate

    model = llama(sizes, device)
    params = sum(p.numel() for p in model.parameters())
    batches = token_batches(sizes, device)

    def forward() -> None:
        with torch.no_grad():
            for batch in batches:
                model(**batch)

    plain = best_ms(forward, device, 2)
    print(
        f"\ncalibrate: Llama-shaped bfloat16, hidden {sizes.hidden}, {sizes.layers} "
        f"layers ({params / 1e6:.0f} M parameters), {len(batches)} batches of "
        f"{sizes.batch}x{sizes.seq} tokens; plain forward of all {plain:.1f} ms"
    )
    print(f"  {'FP8 weights, static FP8 inputs by':<36}{'s':>9}{'x forward':>11}")
    result: dict[str, Any] = {
        "parameters": params,
        "batches": len(batches),
        "tokens_per_batch": sizes.batch * sizes.seq,
        "plain_forward_ms": plain,
        "observers": {},
    }
    for name in CALIBRATION_OBSERVERS:
        recipe = Recipe.from_scheme("FP8", ignore=["lm_head"], input_observer=name)
        copied = copy.deepcopy(model)
        try:
            synchronize(device)
            start = time.perf_counter()
            attach(copied, recipe)
            calibrate(copied, batches, progress=False)
            synchronize(device)
            seconds = time.perf_counter() - start
            result["observers"][name] = {
                "s": seconds,
                "x_forward": seconds * 1e3 / plain,
            }
            print(f"  {name:<36}{seconds:>9.2f}{seconds * 1e3 / plain:>10.1f}x")
        except Exception as err:
            result["observers"][name] = {"error": _error(err)}
            print(f"  {name:<36} error: {_error(err)}")
        del copied
        _free(device)
    if not opts.no_peers:
        result["oneshot"] = oneshot_run(model, batches, plain)
    return result


def oneshot_run(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], plain: float
) -> dict[str, Any]:
    """llm-compressor's `oneshot`, FP8 with static inputs, same batches."""
    try:
        import datasets
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except Exception:
        print("  llm-compressor oneshot: not installed")
        return {"skipped": "llmcompressor / datasets not installed"}
    try:
        rows = [
            {key: value[i].tolist() for key, value in batch.items()}
            for batch in batches
            for i in range(batch["input_ids"].shape[0])
        ]
        dataset = datasets.Dataset.from_list(rows)
        copied = copy.deepcopy(model)
        # oneshot reads the config from the model's path: give it one
        folder = tempfile.mkdtemp(prefix="qo-bench-gpu-")
        copied.config.save_pretrained(folder)
        copied.config._name_or_path = folder
        modifier = QuantizationModifier(
            targets="Linear", scheme="FP8", ignore=["lm_head"]
        )
        synchronize(next(model.parameters()).device)
        start = time.perf_counter()
        oneshot(
            model=copied,
            processor=_word_tokenizer(),
            dataset=dataset,
            recipe=modifier,
            num_calibration_samples=len(rows),
            max_seq_length=len(rows[0]["input_ids"]),
        )
        synchronize(next(model.parameters()).device)
        seconds = time.perf_counter() - start
        shutil.rmtree(folder, ignore_errors=True)
    except Exception as err:
        print(f"  llm-compressor oneshot: error {_error(err)}")
        return {"error": _error(err)}
    label = "llm-compressor oneshot (FP8)"
    print(f"  {label:<36}{seconds:>9.2f}{seconds * 1e3 / plain:>10.1f}x")
    return {"s": seconds, "x_forward": seconds * 1e3 / plain}


def _word_tokenizer() -> Any:
    """A tokenizer built here (nothing downloaded): the dataset is tokenized
    already, oneshot only needs one for its collator."""
    import tokenizers
    import transformers

    model = tokenizers.models.WordLevel({"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model),
        unk_token="[UNK]",
        pad_token="[PAD]",
    )


# --------------------------------------------------------------------- main


def randn(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """Seeded bfloat16 values with a few outliers (made on the device)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=device)
    x = x * torch.exp(0.5 * torch.randn(shape, generator=gen, device=device))
    return x.to(torch.bfloat16)


def environment(device: torch.device) -> dict[str, Any]:
    from quantobs.native import gpu

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "native_kernels": native.available(),
        "triton": gpu.triton_importable(),
        "argv": sys.argv[1:],
    }
    if device.type == "cuda":
        found["device_name"] = torch.cuda.get_device_name(device)
    for dist in ("transformers", "llmcompressor", "compressed-tensors", "triton"):
        try:
            from importlib import metadata

            found[dist] = metadata.version(dist)
        except Exception:
            found[dist] = None
    return found


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--no-peers", action="store_true", help="no llm-compressor")
    parser.add_argument("--no-identity", action="store_true", help="no CPU check")
    parser.add_argument(
        "--only",
        action="append",
        choices=["weights", "activations", "torch_ao", "calibrate"],
        help="run these sections (repeatable; default all)",
    )
    parser.add_argument(
        "--observers",
        action="append",
        metavar="NAME",
        help="these registered observers only (repeatable; default every one)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=270.0, help="skip sections past this"
    )
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here: use --device cpu --small")
    sizes = SMALL if opts.small else QUICK if opts.quick else FULL
    warnings.filterwarnings("ignore")
    logging.getLogger("quantobs").setLevel(logging.ERROR)  # the fallback notes
    started = time.perf_counter()
    opts.deadline = started + opts.budget_s  # cells past it are skipped
    results: dict[str, Any] = {"environment": environment(device), "sizes": vars(sizes)}
    print(
        "quantobs GPU benchmark: "
        + ", ".join(f"{k} {v}" for k, v in results["environment"].items() if v)
    )
    theirs = None if opts.no_peers else load_llmcompressor()

    def weights() -> Any:
        w = randn((sizes.rows, sizes.cols), 1, device)
        formats = WEIGHT_FORMATS
        identity = [w[: sizes.identity_rows]]
        return observer_cells(
            "weights", [w], "weight", formats, identity, theirs, opts, sizes
        )

    def activations() -> Any:
        xs = [randn(sizes.act, 10 + i, device) for i in range(sizes.act_batches)]
        formats = ACTIVATION_FORMATS
        identity = [x[:1, : sizes.identity_rows] for x in xs]
        return observer_cells(
            "activations", xs, "input", formats, identity, theirs, opts, sizes
        )

    def torch_ao() -> Any:
        xs = [
            randn(sizes.act, 20 + i, device).float().reshape(-1, sizes.act[-1])
            for i in range(sizes.act_batches)
        ]
        return torch_ao_rows(xs, sizes.repeat, device)

    def calibrate_section() -> Any:
        return calibrate_rows(sizes, device, opts)

    sections = {
        "weights": weights,
        "activations": activations,
        "torch_ao": torch_ao,
        "calibrate": calibrate_section,
    }
    for name, section in sections.items():
        if opts.only and name not in opts.only:
            continue
        elapsed = time.perf_counter() - started
        if elapsed > opts.budget_s:
            results[name] = {"skipped": f"time budget spent ({elapsed:.0f} s)"}
            print(f"\n{name}: skipped, {elapsed:.0f} s of {opts.budget_s:.0f} s spent")
            continue
        try:
            results[name] = section()
        except Exception as err:  # a section that breaks leaves the others
            traceback.print_exc()
            results[name] = {"error": _error(err)}
        _free(device)
        results["seconds"] = time.perf_counter() - started
        if opts.json:
            with open(opts.json, "w") as handle:
                json.dump(results, handle, indent=1, default=str)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
