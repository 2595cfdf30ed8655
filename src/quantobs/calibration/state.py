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
The file is written to a temporary name beside `path` (`.NAME.state-<pid>-*.tmp`)
and renamed into place: never half-written; the temporary files of killed
writers are removed by the next save to the same path. The rename holds the
lock of `path` (`quantobs.calibration.locking`): while another live process
holds it, `save_state` raises `DestinationBusy`; with `expected`, it also
refuses to replace a file another process wrote since (`DestinationChanged`).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from quantobs.calibration.attach import Attachment, Entry, attachment_of
from quantobs.calibration.locking import DestinationChanged, exclusive
from quantobs.calibration.tempfiles import (
    FileStamp,
    remove_leftovers,
    stamp,
    temp_path,
)

__all__ = [
    "FORMAT_VERSION",
    "SavedState",
    "apply_state",
    "load_state",
    "read_state",
    "save_state",
]

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


def save_state(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    expected: FileStamp | Literal["any"] | None = "any",
) -> Path:
    """Write every attached observer's state to one safetensors file.

    Args:
        model: a model with observers attached.
        path: the file to write (replaced atomically if it exists).
        expected: `"any"` replaces whatever file is at `path`; otherwise
            what `tempfiles.stamp(path)` gave when the caller started (None:
            no file), and a file that differs now, written by another
            process meanwhile, is kept and `DestinationChanged` raised.

    Returns:
        The path written.

    Raises:
        RuntimeError: no observers attached.
        DestinationBusy: another live process is renaming its file to `path`.
        DestinationChanged: the file at `path` is not the `expected` one.
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
    remove_leftovers(target)
    temp = temp_path(target, "state", ".tmp")
    os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        _safetensors().save_file(tensors, temp, metadata=header)
        with exclusive(target):
            if expected != "any" and stamp(target) != expected:
                raise DestinationChanged(
                    f"{target} was written by another process while this one "
                    "ran (that file is kept)"
                )
            os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return target


@dataclass
class SavedState:
    """A state file read and checked by `read_state`, not yet applied."""

    path: Path
    recipe: str
    entries: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]


def load_state(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Restore what `save_state` wrote into a model with the same recipe.

    Raises:
        RuntimeError: no observers attached.
        FileNotFoundError: no such file.
        ValueError: not a quantobs state file, another format version, a
            NaN statistic, a different recipe, or observers (names or
            statistic shapes) that differ.
    """
    apply_state(model, read_state(path))


def read_state(path: str | os.PathLike[str]) -> SavedState:
    """Read and check a state file without a model: readable, well-formed
    header, tensors named by its observers, no NaN statistic.

    Raises:
        FileNotFoundError: no such file.
        ValueError: what is wrong with the file.
    """
    target = Path(path)
    if not target.is_file():
        raise FileNotFoundError(f"no calibration state file at {target}")
    try:
        with _safetensors().safe_open(str(target), framework="pt") as handle:
            header = handle.metadata() or {}
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    except Exception as err:
        raise ValueError(f"{target} is not a readable safetensors file: {err}") from err
    entries = _entries(target, header)
    return SavedState(
        target, header["recipe"], entries, _grouped(target, entries, tensors)
    )


def _entries(target: Path, header: dict[str, str]) -> dict[str, Any]:
    """The header's per-observer entries, checked for their fields."""
    if header.get("format") != str(FORMAT_VERSION) or "recipe" not in header:
        raise ValueError(
            f"{target} is not a quantobs calibration state (format "
            f"{FORMAT_VERSION}); write it with quantobs.calibration.save_state"
        )
    try:
        entries = json.loads(header.get("entries", ""))
        for saved in entries.values():
            int(saved["tokens"])
            _ = saved["extra"]
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(
            f"{target} has a malformed header ({err!r}); save the state again"
        ) from None
    if not isinstance(entries, dict):
        raise ValueError(f"{target} has a malformed header; save the state again")
    return entries


def _grouped(
    target: Path, entries: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors by observer key, each checked to hold no NaN."""
    grouped: dict[str, dict[str, torch.Tensor]] = {key: {} for key in entries}
    for name, value in tensors.items():
        key, _, buffer = name.rpartition("/")
        if key not in grouped:
            raise ValueError(f"{target}: tensor {name!r} belongs to no observer")
        if value.is_floating_point() and bool(value.isnan().any()):
            raise ValueError(
                f"{target}: tensor {name!r} holds NaN (a corrupt or diverged "
                "state); calibrate again without --resume"
            )
        grouped[key][buffer] = value
    return grouped


def apply_state(model: torch.nn.Module, saved: SavedState) -> None:
    """Load a `read_state` result into a model with the same recipe attached,
    checking the observers' names and statistic shapes against the model.

    Raises:
        RuntimeError: no observers attached.
        ValueError: a different recipe, observers or statistic shapes.
    """
    attachment = attachment_of(model)
    target = saved.path
    if saved.recipe != attachment.recipe.to_json():
        raise ValueError(
            f"{target} was saved under another recipe; attach the same recipe "
            f"before load_state. Saved: {saved.recipe}"
        )
    by_key = attachment.by_key()
    if set(saved.entries) != set(by_key):
        missing = sorted(set(by_key) - set(saved.entries))[:5]
        extra = sorted(set(saved.entries) - set(by_key))[:5]
        raise ValueError(
            f"{target} holds other observers than the model: missing {missing}, "
            f"unknown {extra} (a different model?)"
        )
    for key, entry_saved in saved.entries.items():
        entry = by_key[key]
        state: dict[str, Any] = dict(saved.tensors[key])
        if entry_saved["extra"] is not None:
            state[_EXTRA] = entry_saved["extra"]
        try:
            entry.observer.load_state_dict(state)
        except (RuntimeError, KeyError, TypeError) as err:
            raise ValueError(f"{target}: observer {key!r} cannot load: {err}") from None
        _check_shape(target, entry)
        entry.tokens = int(entry_saved["tokens"])
    _keep_on_first_process(attachment)


def _probe(entry: Entry) -> torch.Tensor | None:
    """A tensor shaped as the entry's observer sees it (None: unknown)."""
    if entry.base_name == "weight":
        return entry.weight
    weight = getattr(entry.module, "weight", None)
    if entry.base_name == "input" and isinstance(weight, torch.Tensor):
        return torch.zeros(1, entry.weight.shape[-1], dtype=torch.float32)
    return None


def _check_shape(target: Path, entry: Entry) -> None:
    """The loaded statistic's qparam shape is the one the entry's tensor gives."""
    loaded = entry.observer.statistic()
    sample = _probe(entry)
    if loaded is None or sample is None:
        return
    probe = copy.deepcopy(entry.observer)
    probe.reset()
    with torch.no_grad():
        probe.update(sample.detach())
    expected = probe.statistic()
    if expected is not None and expected.qparam_shape != loaded.qparam_shape:
        raise ValueError(
            f"{target}: observer {entry.key!r} holds statistics of shape "
            f"{tuple(loaded.qparam_shape)}, the model's gives "
            f"{tuple(expected.qparam_shape)} (a different model?)"
        )


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
