"""The checkpoint's shards: their largest size, and the order of the
tensors that fills them.

`save_compressed` writes through transformers' `save_pretrained`, which
fills each safetensors file up to `max_shard_size` in the order of the state
dict it is given; a model loaded whole has its names sorted first (as
transformers converts them back to the checkpoint's names), an offloaded one
shard by shard. `sorted_state` gives it the sorted order in both cases, so
that the same tensors land in the same files however the model was loaded.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_SHARD_SIZE", "shard_bytes", "sorted_state"]

#: The largest safetensors file `save_compressed` writes by default (the
#: Hugging Face Hub's customary 5 GB; transformers 5's own default is 50GB).
DEFAULT_SHARD_SIZE = "5GB"


def shard_bytes(max_shard_size: int | str) -> int:
    """`max_shard_size` in bytes (`"5GB"`, `"500MB"`, `"2GiB"` or an int).

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(max_shard_size, bool):
        raise ValueError(f"max_shard_size must be a size, got {max_shard_size!r}")
    if isinstance(max_shard_size, int):
        size = max_shard_size
    else:
        from huggingface_hub.serialization._base import parse_size_to_int

        try:
            size = parse_size_to_int(str(max_shard_size))
        except ValueError:
            raise ValueError(
                f"max_shard_size {max_shard_size!r} is not a size such as '5GB', "
                "'500MB' or '2GiB'"
            ) from None
    if size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    return size


def sorted_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in the order transformers sorts the names of
    one it converts back to its checkpoint's names, so that the shards hold
    the same tensors whether the model is offloaded (converted shard by
    shard) or not (converted whole)."""
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:  # pragma: no cover - depends on transformers' version
        return model.state_dict()
    return dict(
        sorted(model.state_dict().items(), key=lambda kv: dot_natural_key(kv[0]))
    )
