"""Tiny decoders of every dense family calibrated by quantobs and by
llm-compressor 0.14's `oneshot` with the same recipe and texts: weight
qparams equal bit for bit, input qparams within float32 rounding (the two
run their forwards differently, so activations differ in the last bits).

One text per batch: llm-compressor observes padded positions, quantobs does
not, so only unpadded batches are comparable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantobs.calibration import Recipe, attach, calibrate
from tests.calibration.conftest import SENTENCES
from tests.decoders import save_decoder, tiny_tokenizer

pytestmark = [
    pytest.mark.peers,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

TEXTS = SENTENCES[:6]
#: dense families llm-compressor's `Linear` targets cover (GPT-2's Conv1D
#: layers are no `Linear`; MoE experts: tests/calibration/test_experts.py)
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "opt")
#: scheme -> model dtype (NVFP4 models run in bf16, as they are served)
SCHEMES = {"W4A16": torch.float32, "FP8": torch.float32, "NVFP4": torch.bfloat16}


def _qparams(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: value.detach().clone()
        for name, value in model.named_parameters()
        if name.endswith(("_scale", "_zero_point"))
    }


def _load(directory: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def _oneshot(directory: Path, scheme: str) -> dict[str, torch.Tensor]:
    llmcompressor = pytest.importorskip("llmcompressor")
    datasets = pytest.importorskip("datasets")
    import transformers
    from llmcompressor.modifiers.quantization import QuantizationModifier

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = _load(directory)
    dataset = datasets.Dataset.from_dict({"text": TEXTS}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=64),
        remove_columns=["text"],
    )
    llmcompressor.oneshot(
        model=model,
        processor=tokenizer,
        dataset=dataset,
        recipe=QuantizationModifier(
            targets="Linear", scheme=scheme, ignore=["lm_head"]
        ),
        num_calibration_samples=len(TEXTS),
        max_seq_length=64,
    )
    return _qparams(model)


def _ours(directory: Path, scheme: str) -> dict[str, torch.Tensor]:
    tokenizer = tiny_tokenizer()
    model = _load(directory)
    attach(model, Recipe.from_scheme(scheme, ignore=["lm_head"]))
    one_per_batch = [
        dict(tokenizer(t, truncation=True, max_length=64, return_tensors="pt"))
        for t in TEXTS
    ]
    calibrate(model, one_per_batch, progress=False)
    return _qparams(model)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_qparams_equal_oneshot(family: str, scheme: str, tmp_path: Path) -> None:
    directory = save_decoder(family, tmp_path / family, dtype=SCHEMES[scheme])
    expected, found = _oneshot(directory, scheme), _ours(directory, scheme)
    assert found.keys() == expected.keys() and found
    wrong = []
    for name, value in expected.items():
        if found[name].dtype != value.dtype:
            wrong.append((name, "dtype", found[name].dtype, value.dtype))
        elif name.endswith(("input_scale", "input_global_scale")):
            # the activations' last bits differ; in bf16 models llm-compressor
            # also computes an activation's global scale in bf16 (issue 25)
            rtol = (
                1e-5
                if value.dtype == torch.float32 and SCHEMES[scheme] == torch.float32
                else 2**-8
            )
            if not torch.allclose(found[name], value, rtol=rtol, atol=0):
                wrong.append((name, found[name].flatten()[:4], value.flatten()[:4]))
        elif not torch.equal(found[name], value):
            wrong.append((name, found[name].flatten()[:4], value.flatten()[:4]))
    assert not wrong, wrong
