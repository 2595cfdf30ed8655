"""calibrate gives llm-compressor's `oneshot` qparams bit for bit (the same
model, sentences and observers)."""

from __future__ import annotations

import pytest
import torch
import transformers

from quantobs.calibration import Recipe, attach, calibrate
from tests.calibration.conftest import SENTENCES, minilm_dir, oneshot_attention

pytestmark = [pytest.mark.peers, pytest.mark.slow]


def _qparams(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value.detach().clone()
        for name, module in model.named_modules()
        for key, value in module.named_parameters(recurse=False)
        if key.endswith(("_scale", "_zero_point"))
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_static_inputs_equal_oneshot(tokenizer: object) -> None:
    llmcompressor = pytest.importorskip("llmcompressor")
    datasets = pytest.importorskip("datasets")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    texts = SENTENCES[:8]
    # llm-compressor 0.14.0.1 runs its calibration forward with eager
    # attention, its nightly with the model's own; so do we here (sdpa's
    # float results differ in the last bits: `oneshot_attention`).
    theirs = transformers.AutoModel.from_pretrained(minilm_dir())
    dataset = datasets.Dataset.from_dict({"text": texts}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=64),
        remove_columns=["text"],
    )
    llmcompressor.oneshot(
        model=theirs,
        dataset=dataset,
        recipe=QuantizationModifier(
            targets="Linear", scheme="FP8", ignore=["re:.*pooler.*"]
        ),
        num_calibration_samples=len(texts),
        max_seq_length=64,
    )
    attention = oneshot_attention()
    kwargs = {} if attention is None else {"attn_implementation": attention}
    ours = transformers.AutoModel.from_pretrained(minilm_dir(), **kwargs)
    attach(ours, Recipe.from_scheme("FP8", ignore=["re:.*pooler.*"]))
    one_per_batch = [
        dict(tokenizer(t, truncation=True, max_length=64, return_tensors="pt"))
        for t in texts
    ]
    calibrate(ours, one_per_batch, progress=False)
    expected, found = _qparams(theirs), _qparams(ours)
    assert expected.keys() == found.keys() and len(found) == 4 * 36
    for name, value in expected.items():
        assert torch.equal(value, found[name]), name
