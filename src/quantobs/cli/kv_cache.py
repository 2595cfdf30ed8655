"""`--kv-cache-scheme`: the args of the attention's key and value states.

=========  ==========================================================
name       args (static: one scale per tensor, calibrated)
=========  ==========================================================
FP8        float8_e4m3fn, per tensor, static, symmetric (num_bits 8,
           type float, strategy tensor, dynamic False, symmetric True:
           llm-compressor's kv-cache examples)
INT8       int8, per tensor, static, symmetric
=========  ==========================================================

The args go to `Recipe.from_scheme(..., kv_cache_scheme=...)`; `attach`
puts `k_observer` / `v_observer` on the attention modules, and a model on
which none is attached is refused (`check_attached`).
"""

from __future__ import annotations

from typing import Any

from quantobs.cli.inputs import UsageError

__all__ = ["KV_CACHE_SCHEMES", "check_attached", "kv_cache_args"]

#: name -> the compressed-tensors fields of the k / v args
KV_CACHE_SCHEMES: dict[str, dict[str, Any]] = {
    "FP8": {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    },
    "INT8": {
        "num_bits": 8,
        "type": "int",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    },
}


def kv_cache_args(name: str | None) -> Any:
    """The `QuantizationArgs` of `--kv-cache-scheme name` (case-insensitive),
    or None when not given.

    Raises:
        UsageError: an unknown name (the valid ones listed).
    """
    if name is None:
        return None
    from quantobs.core.args import QuantizationArgs

    key = name.strip().upper()
    if key not in KV_CACHE_SCHEMES:
        raise UsageError(
            f"unknown --kv-cache-scheme {name!r}; one of {', '.join(KV_CACHE_SCHEMES)}"
        )
    return QuantizationArgs(**KV_CACHE_SCHEMES[key])


def check_attached(model: Any, name: str) -> None:
    """Refuse a `--kv-cache-scheme` that put no observer on the model.

    Raises:
        UsageError: no attention module took `k` / `v` observers.
    """
    from quantobs.calibration.attach import attachment_of

    entries = attachment_of(model).entries
    if not any(entry.group == "kv_cache" for entry in entries):
        raise UsageError(
            f"--kv-cache-scheme {name}: no attention module of this model took "
            "k/v observers; leave the option out for this model"
        )
