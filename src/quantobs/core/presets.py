"""Named quantization schemes (`W4A16`, `FP8`, `NVFP4`, ...).

The weights / input-activation args of each preset equal compressed-tensors'
preset of the same name (0.19; MXFP4XFP8, MXFP6A16 and MXFP6A8 as
compressed-tensors 0.20 defines them; exporting the MXFP6 ones needs 0.20).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from quantobs.core.args import QuantizationArgs

__all__ = ["PRESET_SCHEMES", "QuantizationScheme", "preset_scheme"]


class QuantizationScheme(BaseModel):
    """The args for a layer's weights, inputs and outputs (None: unquantized)."""

    model_config = ConfigDict(extra="forbid")

    targets: list[str] = Field(default_factory=lambda: ["Linear"])
    weights: QuantizationArgs | None = None
    input_activations: QuantizationArgs | None = None
    output_activations: QuantizationArgs | None = None


def _int_weights(bits: int, symmetric: bool = True) -> dict[str, Any]:
    return {
        "num_bits": bits,
        "strategy": "group",
        "group_size": 128,
        "symmetric": symmetric,
    }


def _int_tokens(bits: int) -> dict[str, Any]:
    return {"num_bits": bits, "strategy": "token", "dynamic": True}


def _float(bits: int, strategy: str, **extra: Any) -> dict[str, Any]:
    return {"num_bits": bits, "type": "float", "strategy": strategy, **extra}


_FP8 = torch.float8_e4m3fn
_NVFP4 = _float(4, "tensor_group", group_size=16, scale_dtype=_FP8, zp_dtype=_FP8)
_MX = {"group_size": 32, "scale_dtype": torch.uint8, "zp_dtype": torch.uint8}

# name -> {"weights": args kwargs, "input_activations": args kwargs}
_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "UNQUANTIZED": {},
    "W4A16_ASYM": {"weights": _int_weights(4, symmetric=False)},
    "W8A8": {
        "weights": {"num_bits": 8, "strategy": "channel"},
        "input_activations": _int_tokens(8),
    },
    "W4AFP8": {
        "weights": _int_weights(4),
        "input_activations": _float(8, "token", dynamic=True),
    },
    "FP8": {
        "weights": _float(8, "tensor"),
        "input_activations": _float(8, "tensor", observer="static_minmax"),
    },
    "FP8_DYNAMIC": {
        "weights": _float(8, "channel"),
        "input_activations": _float(8, "token", dynamic=True),
    },
    "FP8_BLOCK": {
        "weights": _float(8, "block", block_structure=[128, 128]),
        "input_activations": _float(8, "group", group_size=128, dynamic=True),
    },
    "NVFP4A16": {"weights": _NVFP4},
    "NVFP4": {
        "weights": _NVFP4,
        "input_activations": {
            **_NVFP4,
            "dynamic": "local",
            "observer": "static_minmax",
        },
    },
    "MXFP4A16": {"weights": _float(4, "group", **_MX)},
    "MXFP4": {
        "weights": _float(4, "group", **_MX),
        "input_activations": _float(4, "group", dynamic=True, **_MX),
    },
    "MXFP8A16": {"weights": _float(8, "group", **_MX)},
    "MXFP8": {
        "weights": _float(8, "group", **_MX),
        "input_activations": _float(8, "group", dynamic=True, **_MX),
    },
    # compressed-tensors 0.20: MXFP4 weights with dynamic FP8 inputs in
    # groups of 128 (plain float scales, not MX); MXFP6 (e2m3) weights alone
    # or with dynamic MXFP8 inputs.
    "MXFP4XFP8": {
        "weights": _float(4, "group", **_MX),
        "input_activations": _float(8, "group", group_size=128, dynamic=True),
    },
    "MXFP6A16": {"weights": _float(6, "group", **_MX)},
    "MXFP6A8": {
        "weights": _float(6, "group", **_MX),
        "input_activations": _float(8, "group", dynamic=True, **_MX),
    },
}
_PRESETS["INT8"] = _PRESETS["W8A8"]
# W{w}A{a}: int weights in groups of 128, optional dynamic per-token int inputs.
for _w in range(2, 9):
    for _a in (4, 8, 16):
        if _w <= _a:
            _scheme = {"weights": _int_weights(_w)}
            if _a < 16:
                _scheme["input_activations"] = _int_tokens(_a)
            _PRESETS.setdefault(f"W{_w}A{_a}", _scheme)
PRESET_SCHEMES: tuple[str, ...] = tuple(sorted(_PRESETS))


def preset_scheme(name: str, targets: list[str] | None = None) -> QuantizationScheme:
    """The scheme of a preset name (case-insensitive), e.g. `preset_scheme("W4A16")`.

    Raises:
        KeyError: unknown name; the message lists every preset.
    """
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a str, got {type(name).__name__}")
    key = name.strip().upper()
    if key not in _PRESETS:
        raise KeyError(
            f"unknown preset scheme {name!r}; available: {', '.join(PRESET_SCHEMES)}"
        )
    fields = {
        part: QuantizationArgs(**kwargs) for part, kwargs in _PRESETS[key].items()
    }
    return QuantizationScheme(targets=targets or ["Linear"], **fields)
