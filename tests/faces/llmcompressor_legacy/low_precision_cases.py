"""Cases of the legacy face's low-precision parity test, shared with the
script that records llm-compressor 0.7.1's numbers (`record_legacy.py`):
plain data, no import of quantobs or of either llm-compressor."""

from __future__ import annotations

from typing import Any

import torch

#: case id -> (legacy class: "minmax" / "mse", args kwargs, observer kwargs)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "minmax-tensor": ("minmax", {"num_bits": 8}, {}),
    "minmax-tensor-asym": ("minmax", {"num_bits": 8, "symmetric": False}, {}),
    "minmax-channel": ("minmax", {"num_bits": 8, "strategy": "channel"}, {}),
    "minmax-group": (
        "minmax",
        {"num_bits": 4, "strategy": "group", "group_size": 32},
        {},
    ),
    "minmax-group-asym": (
        "minmax",
        {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False},
        {},
    ),
    "minmax-group-c1": (
        "minmax",
        {"num_bits": 4, "strategy": "group", "group_size": 32},
        {"averaging_constant": 1.0},
    ),
    "minmax-fp8-channel": (
        "minmax",
        {"num_bits": 8, "type": "float", "strategy": "channel"},
        {},
    ),
    "mse-tensor": ("mse", {"num_bits": 8}, {}),
    "mse-tensor-asym": ("mse", {"num_bits": 8, "symmetric": False}, {}),
    "mse-channel": ("mse", {"num_bits": 8, "strategy": "channel"}, {}),
    "mse-group": ("mse", {"num_bits": 4, "strategy": "group", "group_size": 32}, {}),
    "mse-group-asym": (
        "mse",
        {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False},
        {},
    ),
    "mse-group-patience1": (
        "mse",
        {"num_bits": 4, "strategy": "group", "group_size": 32},
        {"patience": 1},
    ),
    "mse-fp8-channel": (
        "mse",
        {"num_bits": 8, "type": "float", "strategy": "channel"},
        {},
    ),
}
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
BATCHES = 3


def batches(dtype: torch.dtype) -> list[torch.Tensor]:
    """The `(8, 64)` batches every case observes, growing in spread."""
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(8, 64, generator=gen) * (0.05 + i) + 0.01).to(dtype)
        for i in range(BATCHES)
    ]
