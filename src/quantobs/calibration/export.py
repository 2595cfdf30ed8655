"""Save a calibrated model as a compressed-tensors checkpoint.

(One concept, about 500 lines: the checkpoint's formats, checks and the
atomic write; freezing and sharding live in `freeze.py` and `shards.py`.)

`save_compressed(model, out_dir)` writes what llm-compressor writes, with
compressed-tensors' own compressors: it freezes the calibrated model itself
(`quantobs.calibration.freeze`: observers and hooks removed,
compressed-tensors' quantization with our qparams, each module compressed in
turn) or, with `copy=True`, a deep copy of it (the model, its observers and
hooks stay as they were); saves with `save_pretrained` shard by shard
(`max_shard_size`) and adds `quantization_config` to `config.json`
(`ModelCompressor.update_config`). A model loaded with accelerate's
offloading is compressed one module at a time where it keeps its weights
(`quantobs.calibration.offload`); its checkpoint is the in-memory one, bit
for bit.
The other files of the source checkpoint (tokenizer, README, ...) are copied
beside them. The checkpoint loads with transformers (`CompressedTensorsConfig`)
and vLLM.

The format of each config group is compressed-tensors' own inference
(llm-compressor's default), limited to `SUPPORTED_FORMATS`::

    W4A16, W4A16_ASYM, W8A16          pack-quantized
    W8A8 (int weights and inputs)     int-quantized
    FP8, FP8_DYNAMIC, FP8_BLOCK       float-quantized
    NVFP4, NVFP4A16                   nvfp4-pack-quantized
    MXFP4, MXFP4A16, MXFP4XFP8        mxfp4-pack-quantized
    MXFP6A16, MXFP6A8                 mxfp6-pack-quantized (compressed-tensors
                                      >= 0.20; FP6 anywhere in a recipe needs it)

Groups of different formats make a `mixed-precision` checkpoint; a group
that quantizes no weight (attention states) keeps dense weights. Scales of
the kv cache and of attention states are exported where compressed-tensors
treats the module as attention (`quantobs.calibration.attention`: a
`k_proj`, `v_proj`, `qkv_proj` or `kv_b_proj` and a kv cache); elsewhere
`save_compressed` refuses rather than drop them. Calibrated `Conv1D` layers
(GPT-2's transposed weights) are refused too: neither compressed-tensors nor
transformers loads a quantized `Conv1D` (evaluate them through
`simulate.compressed_tensors_copy`, which holds their Linear equivalent).

MoE experts stored as fused 3-D parameters are written per expert, under
the names of the original checkpoints (`quantobs.calibration.experts`);
where transformers cannot reload them as calibrated (int-quantized, NVFP4,
asymmetric weights, static input scales), `save_compressed` warns with
`ExpertsReloadWarning` and says why.

Nothing half-written is left behind: the checkpoint is written into a hidden
temporary directory beside `out_dir` (`.NAME.partial-<pid>-*`), which is
renamed into place once complete and removed on any failure (an existing
checkpoint replaced with `overwrite` is moved aside to `.NAME.old-<pid>-*`
meanwhile); those a killed process left (`tempfiles.LEFTOVER_KINDS`) are
removed by the next save to the same `out_dir`. The final check-and-rename
holds the lock of `out_dir` (`quantobs.calibration.locking`): a second writer
of the same `out_dir` meanwhile is refused (`DestinationBusy`).

In place, the export holds no second copy of the weights (each module's
compressed tensors replace its weight; the shards are written from the
model's own tensors); `copy=True` holds a second set while it is written
(on the model's device). Under `torch.distributed`, call it on one process.

A disk-offloaded model keeps the tensors calibration and the export write
in files under `offload_folder/quantobs/` (`quantobs.calibration.offload`).
The export removes those of what it froze once the checkpoint is written
(or the write failed): in place, all of the model's (the exported model no
longer saves again); with `copy=True`, the copy's only (the model keeps its
qparams there and calibrates on). The files of a model that is never
exported in place go with it (garbage-collected, or at the interpreter's
exit), or at once with `offload.release_written(model)`.
It needs the `export` extra (compressed-tensors, transformers, safetensors).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from quantobs.calibration.attach import attachment_of
from quantobs.calibration.experts import ExpertsReloadWarning, reload_caveats
from quantobs.calibration.freeze import freeze
from quantobs.calibration.locking import exclusive
from quantobs.calibration.offload import release_written
from quantobs.calibration.recipe import Recipe
from quantobs.calibration.shards import DEFAULT_SHARD_SIZE, shard_bytes, sorted_state
from quantobs.calibration.simulate import calibrated_qparams, detached_copy
from quantobs.calibration.tempfiles import remove_leftovers, temp_path
from quantobs.calibration.transposed import is_transposed
from quantobs.core.args import QuantizationArgs
from quantobs.core.peer_versions import check_fp6, uses_fp6
from quantobs.core.presets import PRESET_SCHEMES, QuantizationScheme, preset_scheme

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "SUPPORTED_FORMATS",
    "checkpoint_formats",
    "save_compressed",
    "shard_bytes",
]


#: The compressed-tensors formats `save_compressed` writes.
SUPPORTED_FORMATS = (
    "pack-quantized",
    "int-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp6-pack-quantized",
)
_EXAMPLES = (
    "schemes W4A16, W4A16_ASYM, W8A16, W8A8, FP8, FP8_DYNAMIC, FP8_BLOCK, "
    "NVFP4, NVFP4A16, MXFP4, MXFP4A16, MXFP4XFP8, MXFP6A16, MXFP6A8"
)
#: The format compressed-tensors 0.20 added (FP6 e2m3 in groups of 32).
_FP6_FORMAT = "mxfp6-pack-quantized"
# The format of a group that quantizes no weight (its scales stay beside
# dense weights).
_DENSE = "dense"
# Files of a source checkpoint that hold weights: never copied (the
# checkpoint's own weights replace them).
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".onnx_data",
    ".gguf",
    ".tflite",
    ".ot",
    ".index.json",
)


# ------------------------------------------------------------------ formats


_PARTS = ("weights", "input_activations", "output_activations")


def _dump(scheme: QuantizationScheme) -> list[Any]:
    """A scheme's args without targets and observers (to recognize presets)."""
    skip = {"observer", "observer_kwargs"}
    return [
        None if args is None else args.model_dump(exclude=skip)
        for args in (getattr(scheme, part) for part in _PARTS)
    ]


def _args_text(args: QuantizationArgs) -> str:
    """`int4 group 128`, `float8 tensor`, ..."""
    kind = getattr(args.type, "value", args.type)
    strategy = getattr(args.strategy, "value", args.strategy)
    size = f" {args.group_size}" if args.group_size and args.group_size > 0 else ""
    return f"{kind}{args.num_bits} {strategy}{size}"


def _describe(recipe: Recipe, group: str) -> str:
    """`config group 'g' (W4A16: weights int4 group)`: for error messages."""
    scheme = recipe.config_groups[group]
    names = [n for n in PRESET_SCHEMES if _dump(preset_scheme(n)) == _dump(scheme)]
    parts = [
        f"{part} {_args_text(args)}"
        for part in _PARTS
        if (args := getattr(scheme, part)) is not None
    ]
    label = " = ".join(names) + ": " if names else ""
    return f"config group {group!r} ({label}{', '.join(parts) or 'nothing quantized'})"


def checkpoint_formats(recipe: Recipe, format: str | None = None) -> dict[str, str]:
    """The compressed-tensors format of each config group of `recipe`.

    A group that quantizes no weight (attention states, activations only)
    stores its scales beside dense weights: format `dense`.

    Args:
        recipe: the recipe.
        format: force this format on every group with weights (it must be
            able to store them), or None to infer each group's as
            compressed-tensors and llm-compressor do.

    Returns:
        `{group name: format}`.

    Raises:
        ValueError: an unknown or unsupported format, a format that cannot
            store a group's weights, a group with no supported format, or a
            recipe that quantizes no weight (the message names the schemes
            and the supported formats).
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format

    supported = ", ".join(SUPPORTED_FORMATS)
    if format is not None and format not in SUPPORTED_FORMATS:
        raise ValueError(f"unsupported format {format!r}; supported: {supported}")
    _require_fp6(recipe, format)
    # (a format is given: compressed-tensors' config takes no None)
    ct_schemes = recipe.to_compressed_tensors(_DENSE).config_groups
    found: dict[str, str] = {}
    for group, scheme in recipe.config_groups.items():
        if scheme.weights is None:
            found[group] = _DENSE
            continue
        ct_scheme = ct_schemes[group]
        inferred = infer_module_format(torch.nn.Linear, ct_scheme).value
        if format is not None:
            compressor = BaseCompressor.get_value_from_registry(format)
            if not compressor.can_compress(torch.nn.Linear, ct_scheme):
                raise ValueError(
                    f"format {format!r} cannot store {_describe(recipe, group)}; "
                    f"its format is {inferred!r}"
                )
            inferred = format
        elif inferred not in SUPPORTED_FORMATS:
            raise ValueError(
                f"{_describe(recipe, group)} has no compressed-tensors checkpoint "
                f"format quantobs exports (compressed-tensors would use "
                f"{inferred!r}); supported: {supported} ({_EXAMPLES})"
            )
        found[group] = inferred
    if set(found.values()) == {_DENSE}:
        groups = "; ".join(_describe(recipe, group) for group in found)
        raise ValueError(
            f"the recipe quantizes no weight ({groups}): there is nothing for a "
            f"compressed-tensors checkpoint format to store; supported: "
            f"{supported} ({_EXAMPLES})"
        )
    return found


def _require_fp6(recipe: Recipe, format: str | None) -> None:
    """Raise where `recipe` (any args of any group) or `format` needs FP6
    and the installed compressed-tensors has none (before 0.20)."""
    if format == _FP6_FORMAT:
        check_fp6(f"format {format!r}", "export")
    for group, scheme in recipe.config_groups.items():
        if uses_fp6(scheme):
            check_fp6(_describe(recipe, group), "export")
    if uses_fp6(recipe.kv_cache_scheme):
        check_fp6("the FP6 (e2m3) kv_cache_scheme", "export")


def _refuse_transposed(attachment: Any) -> None:
    """Raise if the recipe quantizes `Conv1D` layers: no checkpoint of them
    loads (compressed-tensors initializes only Linear and Embedding layers,
    transformers' GPT-2 builds Conv1D)."""
    layers = list(
        dict.fromkeys(e.name for e in attachment.entries if is_transposed(e.module))
    )
    if not layers:
        return
    leaves = sorted({name.rpartition(".")[2] for name in layers})
    pattern = f"re:.*\\.({'|'.join(leaves)})$"
    raise ValueError(
        f"cannot save {len(layers)} quantized Conv1D layer(s) (e.g. {layers[0]!r}; "
        "transformers' Conv1D stores its weight transposed): neither "
        "compressed-tensors nor transformers loads a quantized Conv1D. Add them "
        f"to the recipe's ignore list (e.g. ignore=['Conv1D'] or {pattern!r}) to "
        "save the rest; quantobs compare evaluates them quantized without a "
        "checkpoint"
    )


# --------------------------------------------------------------- directories


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} exists and is not empty; pass overwrite=True to replace it"
        )


def _make_parents(parent: Path) -> list[Path]:
    """Create `parent` and its missing ancestors; return those created."""
    missing = []
    for path in (parent, *parent.parents):
        if path.exists():
            break
        missing.append(path)
    created: list[Path] = []
    try:
        for path in reversed(missing):
            path.mkdir()
            created.append(path)
    except OSError:
        _remove_empty(created)
        raise
    return created


def _remove_empty(paths: list[Path]) -> None:
    for path in reversed(paths):
        try:
            path.rmdir()
        except OSError:
            return


def _temp_dir(out: Path) -> tuple[Path, list[Path]]:
    """A new hidden directory beside `out`, and the parents made for it.

    Raises:
        OSError (its own kind): the parent cannot be created or written to.
    """
    created: list[Path] = []
    try:
        created = _make_parents(out.parent)
        # not mkdtemp: its mode 0o700 would stay the checkpoint's
        remove_leftovers(out)
        temp = temp_path(out, "partial")
        temp.mkdir()
    except OSError as err:
        _remove_empty(created)
        raise type(err)(
            err.errno,
            f"cannot write the checkpoint {out}: {err.strerror or err}",
            str(out.parent),
        ) from err
    return temp, created


def _move_into_place(temp: Path, out: Path) -> None:
    """Rename the complete checkpoint `temp` to `out`, replacing `out`."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(temp, out)
        return
    old = temp_path(out, "old")
    os.rename(out, old)
    try:
        os.rename(temp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _has_weights(path: Path) -> bool:
    return any(
        p.name.endswith(_WEIGHT_SUFFIXES) for p in path.rglob("*") if p.is_file()
    )


def _copy_sources(source: Path, dest: Path, out: Path) -> None:
    """Copy the source checkpoint's files that `dest` lacks: top-level files
    and weight-free subdirectories (`1_Pooling/`), never weights, hidden
    entries, nor `out` itself (a checkpoint written inside its source)."""
    for path in sorted(source.iterdir()):
        target = dest / path.name
        if path.name.startswith(".") or target.exists():
            continue
        if path.absolute() == out or path.resolve() == out.resolve():
            continue
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, target)
        elif path.is_dir() and not _has_weights(path):
            shutil.copytree(path, target)


def _default_source(model: torch.nn.Module) -> Path | None:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(
        model, "name_or_path", None
    )
    if isinstance(name, str | os.PathLike) and name and os.path.isdir(name):
        return Path(name)
    return None


# ------------------------------------------------------------------- writing


def _write(
    model: torch.nn.Module,
    qparams: Mapping[str, Mapping[str, torch.Tensor]],
    formats: Mapping[str, str],
    temp: Path,
    *,
    copy: bool,
    max_shard_size: int,
) -> None:
    attachment = attachment_of(model)
    target = detached_copy(model) if copy else model
    try:
        compressor = freeze(target, qparams, formats, attachment if copy else None)
        with warnings.catch_warnings():
            # transformers' advice for offloaded models: it writes shard by shard
            warnings.filterwarnings(
                "ignore", "Attempting to save a model with offloaded"
            )
            target.save_pretrained(  # type: ignore[operator]
                temp, state_dict=sorted_state(target), max_shard_size=max_shard_size
            )
        compressor.update_config(str(temp))
    finally:  # the frozen model's (or copy's) files under offload_folder/quantobs
        release_written(target)


def save_compressed(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    source_dir: str | os.PathLike[str] | None = None,
    format: str | None = None,
    overwrite: bool = False,
    copy: bool = False,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
) -> Path:
    """Write the calibrated `model` as a compressed-tensors checkpoint.

    Call it after `calibrate`, with the observers still attached (the
    attachment holds the recipe). By default the model itself is frozen and
    compressed (`quantobs.calibration.freeze`: observers and hooks removed,
    each module compressed in turn, its original weight freed), so that the
    export needs no second copy of the weights; it is then a
    compressed-tensors model that no longer calibrates or runs. `copy=True`
    compresses a copy instead and leaves the model as it was (twice the
    weights' memory). The weights are written shard by shard (transformers'
    `save_pretrained`: safetensors files of at most `max_shard_size`, with a
    `model.safetensors.index.json` when there are several): no more than one
    shard is held beyond the model, and a model loaded with accelerate's
    offloading (`device_map`, `offload_folder`) is compressed one module at
    a time and written without loading all its weights; the files it and
    calibration wrote under `offload_folder/quantobs/` for what was frozen
    are removed at the end (in place: all of the model's; `copy=True`: the
    copy's; `offload.release_written(model)` removes a model's at once,
    otherwise they go with it). The checkpoint is
    the same, bit for bit, whichever way. It loads with
    `transformers.AutoModel.from_pretrained(out_dir)` (dequantized with
    `CompressedTensorsConfig(dequantize=True)`) and with vLLM::

        attach(model, Recipe.from_scheme("W4A16", ignore=["lm_head"]))
        calibrate(model, text_batches(tokenizer, sentences))
        save_compressed(model, "model-W4A16")

    Args:
        model: a calibrated transformers `PreTrainedModel`.
        out_dir: the checkpoint directory (created with its parents).
        source_dir: the checkpoint the model was loaded from, whose other
            files (tokenizer, README, ...; no weights) are copied; default:
            `model.config._name_or_path` when it is a directory.
        format: a compressed-tensors format (`SUPPORTED_FORMATS`) for every
            config group; None infers each group's as llm-compressor does.
        overwrite: replace an existing non-empty `out_dir`.
        copy: compress a copy and leave the model unchanged (its observers
            attached, calibration resumable) instead of the model itself.
        max_shard_size: the largest safetensors file (`"5GB"`, `"500MB"`, or
            bytes); a tensor larger than it gets a file of its own.

    Returns:
        The checkpoint directory (absolute).

    Raises:
        RuntimeError: no observers attached, or the model is not calibrated.
        TypeError: the model has no `save_pretrained`.
        ValueError: a scheme with no supported format, a `format` that
            cannot store it, calibrated `Conv1D` layers (named, with the
            ignore pattern that leaves them out), a bad `max_shard_size`, or
            qparams compressed-tensors would not place as calibrated (states
            it does not quantize, targets it resolves otherwise; found once
            the model is frozen: without `copy` its observers are gone).
        FileExistsError: `out_dir` is a file, or not empty without
            `overwrite`.
        FileNotFoundError: `source_dir` is not a directory.
        OSError: the directory cannot be written; nothing is left behind.
    """
    try:
        attachment = attachment_of(model)
    except RuntimeError as err:
        raise RuntimeError(
            "save_compressed needs a model calibrated with its observers still "
            "attached (attach(model, recipe); calibrate(model, batches); then "
            "save_compressed before any detach)"
        ) from err
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(
            "save_compressed needs a transformers PreTrainedModel (one with "
            f"save_pretrained); got {type(model).__name__}"
        )
    _refuse_transposed(attachment)
    formats = checkpoint_formats(attachment.recipe, format)
    shard_size = shard_bytes(max_shard_size)
    qparams = calibrated_qparams(attachment)  # not calibrated: fail before writing
    caveats = reload_caveats(attachment, formats)
    if caveats:
        warnings.warn(
            "the checkpoint's MoE experts are written per expert (as "
            "llm-compressor writes them), but transformers' from_pretrained "
            "does not reload them as calibrated: " + "; ".join(caveats),
            ExpertsReloadWarning,
            stacklevel=2,
        )
    source = _default_source(model) if source_dir is None else Path(source_dir)
    if source is not None and not source.is_dir():
        raise FileNotFoundError(f"source_dir {source} is not a directory")
    out = Path(out_dir).expanduser().absolute()
    if out.is_symlink():
        out = out.resolve()
    _check_destination(out, overwrite)
    temp, created = _temp_dir(out)
    try:
        _write(model, qparams, formats, temp, copy=copy, max_shard_size=shard_size)
        if source is not None:
            _copy_sources(source, temp, out)
        with exclusive(out):
            _check_destination(out, overwrite)  # nothing appeared meanwhile
            _move_into_place(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        _remove_empty(created)
        raise
    return out
