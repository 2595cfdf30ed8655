"""Save and resume a model's calibration: every observer's state in one file.

`save_state(model, path)` writes one safetensors file holding every attached
observer's statistic buffers (`"{module}.{base}/{buffer}"`), with a JSON
header (safetensors metadata) carrying the quantobs version, the recipe and
each observer's name, counts and tokens. `load_state(model, path)` puts them
back into a model with the same recipe attached, so that::

    calibrate(A); save_state; (crash) attach; load_state; calibrate(B)

gives the qparams `calibrate(A then B)` gives, bit for bit, for every
observer whose statistic merges exactly. Under `torch.distributed`, save on
process 0 after a synced `calibrate` (it holds the combined statistics) and
load on every process (the others keep only the shared settings, such as
`static_mse`'s reference), then go on with `calibrate(..., sync=True)`.
The file is written to a temporary name beside `path` and renamed into
place: never half-written.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from quantobs.calibration.attach import Attachment, attachment_of

__all__ = ["FORMAT_VERSION", "load_state", "save_state"]

#: Version of the state file layout.
FORMAT_VERSION = 1
_EXTRA = "_extra_state"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "saving calibration state needs safetensors; pip install safetensors"
        ) from err
    return safetensors.torch


def save_state(model: torch.nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write every attached observer's state to one safetensors file.

    Args:
        model: a model with observers attached.
        path: the file to write (replaced atomically if it exists).

    Returns:
        The path written.

    Raises:
        RuntimeError: no observers attached.
        OSError: the directory is missing or not writable.
    """
    from quantobs import __version__

    attachment = attachment_of(model)
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}
    for entry in attachment.entries:
        state = entry.observer.state_dict()
        extra = state.pop(_EXTRA, None)
        for name, value in state.items():
            tensors[f"{entry.key}/{name}"] = value.detach().cpu().contiguous()
        entries[entry.key] = {"extra": extra, "tokens": entry.tokens}
    header = {
        "format": str(FORMAT_VERSION),
        "quantobs_version": __version__,
        "recipe": attachment.recipe.to_json(),
        "entries": json.dumps(entries, sort_keys=True),
    }
    target = Path(path)
    handle, temp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or "."
    )
    os.close(handle)
    try:
        _safetensors().save_file(tensors, temp, metadata=header)
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return target


def load_state(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Restore what `save_state` wrote into a model with the same recipe.

    Raises:
        RuntimeError: no observers attached.
        FileNotFoundError: no such file.
        ValueError: not a quantobs state file, another format version, a
            different recipe, or observers that differ.
    """
    attachment = attachment_of(model)
    target = Path(path)
    if not target.is_file():
        raise FileNotFoundError(f"no calibration state file at {target}")
    st = _safetensors()
    try:
        with st.safe_open(str(target), framework="pt") as handle:
            header = handle.metadata() or {}
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    except Exception as err:
        raise ValueError(f"{target} is not a readable safetensors file: {err}") from err
    if header.get("format") != str(FORMAT_VERSION) or "recipe" not in header:
        raise ValueError(
            f"{target} is not a quantobs calibration state (format "
            f"{FORMAT_VERSION}); write it with quantobs.calibration.save_state"
        )
    if header["recipe"] != attachment.recipe.to_json():
        raise ValueError(
            f"{target} was saved under another recipe; attach the same recipe "
            f"before load_state. Saved: {header['recipe']}"
        )
    entries = json.loads(header["entries"])
    by_key = attachment.by_key()
    if set(entries) != set(by_key):
        missing = sorted(set(by_key) - set(entries))[:5]
        extra = sorted(set(entries) - set(by_key))[:5]
        raise ValueError(
            f"{target} holds other observers than the model: missing {missing}, "
            f"unknown {extra} (a different model?)"
        )
    grouped: dict[str, dict[str, torch.Tensor]] = {key: {} for key in entries}
    for name, value in tensors.items():
        key, _, buffer = name.rpartition("/")
        if key not in grouped:
            raise ValueError(f"{target}: tensor {name!r} belongs to no observer")
        grouped[key][buffer] = value
    for key, saved in entries.items():
        entry = by_key[key]
        state: dict[str, Any] = dict(grouped[key])
        if saved["extra"] is not None:
            state[_EXTRA] = saved["extra"]
        entry.observer.load_state_dict(state)
        entry.tokens = int(saved["tokens"])
    _keep_on_first_process(attachment)


def _keep_on_first_process(attachment: Attachment) -> None:
    """Under `torch.distributed`, process 0 keeps the loaded activation
    statistics and the others an empty state with the same shared settings
    (what a synced `calibrate` leaves), so a synced resume counts them once."""
    from quantobs.calibration.distributed import rank_and_world

    if rank_and_world()[0] == 0:
        return
    for entry in attachment.entries:
        if entry.base_name != "weight":
            entry.observer.clear_data()
            entry.tokens = 0
