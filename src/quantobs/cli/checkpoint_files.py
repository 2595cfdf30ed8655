"""Which tensors of a `.safetensors` checkpoint are linear weights, and
reading them (the input side of `quantobs weights`).

Which tensors are linear weights (`is_linear_weight`): a name ending in
`.weight`, exactly 2 dims, a floating dtype, and a name that contains neither
`embed` nor `norm` (case-insensitive; so embeddings, `embed_tokens`,
`LayerNorm`, `input_layernorm`, `norm`... are left out). 1-D biases and norms,
4-D convolutions and 3-D stacked experts are not linear weights. `lm_head` is
a linear weight and is kept.

Tensors are read one at a time (`safetensors.safe_open`), selected from
their header. A file safetensors cannot read raises a `ValueError` naming
it; `quantized_evidence` tells, from the headers alone, whether a checkpoint
is already quantized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

__all__ = [
    "EXCLUDED_NAME_PARTS",
    "find_safetensors",
    "is_linear_weight",
    "iter_linear_weights",
    "quantized_evidence",
]

# Lower-case name parts that mark a 2-D `.weight` as not a linear layer.
EXCLUDED_NAME_PARTS: tuple[str, ...] = ("embed", "norm")

# Name endings of the tensors a quantized checkpoint stores beside (or
# instead of) a linear weight: compressed-tensors (`weight_scale`,
# `weight_packed`, ...), DeepSeek-style FP8 (`weight_scale_inv`), GPTQ / AWQ
# (`qweight`, `qzeros`, `scales`).
_QUANTIZED_SUFFIXES: tuple[str, ...] = (
    ".weight_scale",
    ".weight_scale_inv",
    ".weight_packed",
    ".weight_zero_point",
    ".weight_global_scale",
    ".weight_shape",
    ".qweight",
    ".qzeros",
    ".scales",
)
# Header dtypes of floats too narrow to be an unquantized weight.
_QUANTIZED_FLOAT_DTYPES: tuple[str, ...] = ("F8_", "F6_", "F4")


def is_linear_weight(name: str, shape: Sequence[int], is_floating: bool) -> bool:
    """Whether a checkpoint tensor is a linear layer's weight (module docstring).

    Args:
        name: tensor name, e.g. `encoder.layer.0.attention.self.query.weight`.
        shape: tensor shape.
        is_floating: whether the stored dtype is a floating-point one.
    """
    if not name.endswith(".weight") or len(shape) != 2 or not is_floating:
        return False
    lowered = name.lower()
    return not any(part in lowered for part in EXCLUDED_NAME_PARTS)


def _natural_key(text: str) -> list[int | str]:
    # "layer.10" after "layer.2", and "model-00002-of-00010" after "00001".
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def find_safetensors(path: Path) -> list[Path]:
    """The `.safetensors` files of a checkpoint: a file, or those in a directory.

    Raises:
        FileNotFoundError: the path does not exist, or the directory has no
            `.safetensors` file (subdirectories are not searched).
        ValueError: a file that is not a `.safetensors` file.
    """
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"), key=lambda p: _natural_key(p.name))
        if not files:
            raise FileNotFoundError(
                f"no .safetensors file in directory {str(path)!r}; pass a "
                f".safetensors file or a directory that holds one"
            )
        return files
    if path.suffix != ".safetensors":
        raise ValueError(
            f"model path {str(path)!r} is not a .safetensors file; pass a "
            f".safetensors file or a directory that holds one"
        )
    return [path]


def _is_floating_dtype(safetensors_dtype: str) -> bool:
    # Header dtypes: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 F8_E8M0 F6_* F4 | I* U* BOOL C64
    return safetensors_dtype.startswith(("F", "BF"))


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(
        f"{str(path)!r} is not a readable .safetensors file ({error}); "
        f"is it truncated or corrupt?"
    )


def _open(path: Path):  # type: ignore[no-untyped-def]
    """`safe_open(path)`, with safetensors' own errors as a `ValueError`."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as error:  # safetensors comes with the `cli` extra
        raise ImportError(
            "reading checkpoints needs safetensors: pip install 'quantobs[cli]'"
        ) from error
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise _unreadable(path, error) from error


def quantized_evidence(files: Sequence[Path]) -> str | None:
    """Why the checkpoint looks already quantized, or None (headers only).

    Evidence: a `quantization_config` in the `config.json` beside the files,
    a tensor named like a quantized layer's companion (`*.weight_scale`,
    `*.qweight`, ...), or a 2-D `.weight` stored as an integer or as a float
    of 8 bits or fewer.

    Raises:
        ValueError: a file safetensors cannot read.
    """
    for directory in {path.parent for path in files}:
        config = directory / "config.json"
        try:
            document = json.loads(config.read_text()) if config.is_file() else {}
        except (OSError, ValueError):
            document = {}
        if isinstance(document, dict) and "quantization_config" in document:
            method = document["quantization_config"]
            if isinstance(method, dict):
                method = method.get("quant_method", method.get("format", "?"))
            return f"{config} has a quantization_config ({method})"
    for path in files:
        with _open(path) as handle:
            names = handle.keys()
            for name in names:
                if name.endswith(_QUANTIZED_SUFFIXES):
                    return f"it holds {name!r}"
                if not name.endswith(".weight"):
                    continue
                header = handle.get_slice(name)
                dtype = header.get_dtype()
                narrow = dtype.startswith(_QUANTIZED_FLOAT_DTYPES)
                if len(header.get_shape()) == 2 and (
                    narrow or not _is_floating_dtype(dtype)
                ):
                    return f"{name!r} is stored as {dtype}"
    return None


def iter_linear_weights(
    files: Sequence[Path], limit: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for the linear weights, reading one at a time.

    Args:
        files: `.safetensors` files, read in order; names in each in natural
            order (`layer.2` before `layer.10`).
        limit: stop after this many linear weights (None: all).

    Raises:
        ValueError: a file safetensors cannot read (truncated, corrupt).
    """
    from safetensors import SafetensorError

    count = 0
    for path in files:
        with _open(path) as handle:
            for name in sorted(handle.keys(), key=_natural_key):
                if limit is not None and count >= limit:
                    return
                header = handle.get_slice(name)
                if not is_linear_weight(
                    name, header.get_shape(), _is_floating_dtype(header.get_dtype())
                ):
                    continue
                count += 1
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError) as error:
                    raise _unreadable(path, error) from error
                yield name, tensor
