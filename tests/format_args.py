"""Keyword arguments of `QuantizationArgs` for the microscaling formats the
tests build by hand (the presets' weight args, spelled out)."""

from __future__ import annotations

from typing import Any

import torch

#: NVFP4: e2m1 values in groups of 16, e4m3 group scales under a global scale
NVFP4: dict[str, Any] = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "scale_dtype": torch.float8_e4m3fn,
}
#: MXFP4: e2m1 values in groups of 32, e8m0 (uint8) scales
MXFP4: dict[str, Any] = {
    "num_bits": 4,
    "type": "float",
    "group_size": 32,
    "scale_dtype": torch.uint8,
    "zp_dtype": torch.uint8,
}
