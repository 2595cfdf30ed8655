"""A two-layer BERT model directory for end-to-end CLI and report tests.

Random weights (seeded) saved as safetensors, with the embedded MiniLM's
tokenizer files, so transformers loads it offline exactly as it loads a
real model directory; calibrating and evaluating it takes well under a
second.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

from quantobs.cli.default_model import default_model_path

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)

TEXTS = [
    "The cat slept on the warm windowsill all afternoon.",
    "Interest rates rose by half a point in March.",
    "Whisk two eggs with a pinch of salt and a little milk.",
    "Is it going to rain in Oslo on Saturday?",
    "The orchestra rehearsed the second movement twice.",
    "Our train was forty minutes late near the coast.",
]
HELDOUT = [
    "A ferry crosses the bay every hour in summer.",
    "She repaired the bicycle chain with a borrowed tool.",
    "The soup needs more pepper and a squeeze of lemon.",
    "Stock markets fell sharply after the announcement.",
    "Bring a warm jacket if you hike above the tree line.",
]


def write_tiny_bert(directory: Path, hidden: int = 128, seed: int = 0) -> Path:
    """Write a 2-layer `BertModel` (`hidden` features, 2 heads, intermediate
    `2 * hidden`, a pooler) with MiniLM's tokenizer into `directory`."""
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(directory)
    source = default_model_path().parent
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, directory / name)
    return directory


def write_texts(path: Path, texts: list[str]) -> Path:
    """`texts` one per line (with a trailing blank line, which is skipped)."""
    path.write_text("\n".join(texts) + "\n\n", encoding="utf-8")
    return path
