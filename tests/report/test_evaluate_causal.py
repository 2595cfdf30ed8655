"""A causal LM's held-out reference (`quantobs.report.evaluate`): the
next-token log-probabilities of the real tokens, whatever the padding."""

from __future__ import annotations

import pytest
import torch

from quantobs.cli.model_loading import ensure_pad_token
from quantobs.report.causal import perplexity
from quantobs.report.evaluate import HeldOut, next_token_logprobs
from quantobs.report.tasks import CAUSAL_LM
from tests.decoders import build_decoder, tiny_tokenizer

TEXTS = [
    "Observers watch tensors during calibration.",
    "Rain.",
    "She planted tomatoes, basil and three kinds of peppers.",
]


def _batches(tokenizer: object, size: int) -> list[dict[str, torch.Tensor]]:
    return [
        dict(tokenizer(TEXTS[i : i + size], padding=True, return_tensors="pt"))  # type: ignore[operator]
        for i in range(0, len(TEXTS), size)
    ]


def test_padding_takes_no_part() -> None:
    model = build_decoder("llama", dtype=torch.float64)
    tokenizer = tiny_tokenizer()
    ensure_pad_token(tokenizer)
    alone, alone_targets = next_token_logprobs(model, _batches(tokenizer, 1))
    padded, padded_targets = next_token_logprobs(model, _batches(tokenizer, 3))
    assert torch.equal(alone_targets, padded_targets)
    # one row per real next token: (length - 1) per text
    lengths = [len(tokenizer(text)["input_ids"]) for text in TEXTS]
    assert alone.shape == (sum(lengths) - len(TEXTS), model.config.vocab_size)
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)


def test_held_out_of_a_causal_lm() -> None:
    model = build_decoder("llama")
    tokenizer = tiny_tokenizer()
    ensure_pad_token(tokenizer)
    held_out = HeldOut.of(model, _batches(tokenizer, 2))
    assert held_out.task == CAUSAL_LM
    assert held_out.targets is not None
    assert held_out.reference.dtype == torch.float32
    assert perplexity(held_out.reference, held_out.targets) > 1
    with pytest.raises(ValueError, match="need at least 3"):
        HeldOut.of(model, _batches(tokenizer, 2)[:1])
