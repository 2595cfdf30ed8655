"""Save a calibrated model as a compressed-tensors checkpoint.

(One concept, a little over 500 lines: the format inference, the checks
that compressed-tensors stores every calibrated qparam, and the atomic
write each exist only for `save_compressed`; split apart they would be
modules with one caller each.)

`save_compressed(model, out_dir)` writes what llm-compressor writes, with
compressed-tensors' own compressors: on a deep copy of the model (the
calibrated model, its observers and hooks stay as they were) it applies the
recipe's compressed-tensors config, copies the calibrated qparams into the
parameters compressed-tensors created (in its dtypes and shapes), compresses
the weights (`ModelCompressor.compress_model`), saves with `save_pretrained`
and adds `quantization_config` to `config.json` (`ModelCompressor.update_config`).
The other files of the source checkpoint (tokenizer, README, ...) are copied
beside them. The checkpoint loads with transformers (`CompressedTensorsConfig`)
and vLLM.

The format of each config group is compressed-tensors' own inference
(llm-compressor's default), limited to `SUPPORTED_FORMATS`::

    W4A16, W4A16_ASYM, W8A16          pack-quantized
    W8A8 (int weights and inputs)     int-quantized
    FP8, FP8_DYNAMIC, FP8_BLOCK       float-quantized
    NVFP4, NVFP4A16                   nvfp4-pack-quantized
    MXFP4, MXFP4A16                   mxfp4-pack-quantized

Groups of different formats make a `mixed-precision` checkpoint; a group
that quantizes no weight (attention states) keeps dense weights. Scales of
the kv cache and of attention states are exported where compressed-tensors
treats the module as attention (Llama-style `q_proj` / `k_proj` / `v_proj`);
elsewhere `save_compressed` refuses rather than drop them.

Nothing half-written is left behind: the checkpoint is written into a hidden
temporary directory beside `out_dir`, which is renamed into place once
complete and removed on any failure.

The copy holds a second set of the model's weights while it is written (on
the model's device). Under `torch.distributed`, call it on one process. It
needs the `export` extra (compressed-tensors, transformers, safetensors).
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from quantobs.calibration.attach import (
    QPARAM_KINDS,
    Attachment,
    attachment_of,
    detach,
)
from quantobs.calibration.recipe import Recipe
from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import BASE_NAMES
from quantobs.core.presets import PRESET_SCHEMES, QuantizationScheme, preset_scheme

__all__ = ["SUPPORTED_FORMATS", "checkpoint_formats", "save_compressed"]

#: The compressed-tensors formats `save_compressed` writes.
SUPPORTED_FORMATS = (
    "pack-quantized",
    "int-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
)
_EXAMPLES = (
    "schemes W4A16, W4A16_ASYM, W8A16, W8A8, FP8, FP8_DYNAMIC, FP8_BLOCK, "
    "NVFP4, NVFP4A16, MXFP4, MXFP4A16"
)
_MIXED = "mixed-precision"
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


def _model_format(formats: Mapping[str, str]) -> str:
    stored = {f for f in formats.values() if f != _DENSE}
    return stored.pop() if len(stored) == 1 else _MIXED


# ------------------------------------------------------------------ qparams


def _qparam_names(base_name: str, args: QuantizationArgs) -> list[str]:
    """The qparams calibration writes for one entry."""
    names = [] if args.dynamic == "local" else [f"{base_name}_scale"]
    if args.strategy == "tensor_group":
        names.append(f"{base_name}_global_scale")
    return names


def _calibrated_qparams(attachment: Attachment) -> dict[str, dict[str, torch.Tensor]]:
    """`{module name: {qparam name: tensor}}` written by calibration.

    Raises:
        RuntimeError: some qparam is missing (the model is not calibrated).
    """
    found: dict[str, dict[str, torch.Tensor]] = {}
    missing: list[str] = []
    for entry in attachment.entries:
        module = entry.module
        for name in _qparam_names(entry.base_name, entry.args):
            if not isinstance(module._parameters.get(name), torch.Tensor):
                missing.append(f"{entry.name}.{name}" if entry.name else name)
        own = found.setdefault(entry.name, {})
        for kind in QPARAM_KINDS:
            value = module._parameters.get(f"{entry.base_name}_{kind}")
            if isinstance(value, torch.Tensor):
                own[f"{entry.base_name}_{kind}"] = value.detach()
    if missing:
        raise RuntimeError(
            f"the model is not calibrated: {len(missing)} qparam(s) missing "
            f"(e.g. {', '.join(missing[:3])}); run "
            "quantobs.calibration.calibrate(model, batches) before save_compressed"
        )
    return found


def _ct_qparams(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The qparam parameters compressed-tensors registered on `module`."""
    names = {f"{base}_{kind}" for base in BASE_NAMES for kind in QPARAM_KINDS}
    for name, param in module._parameters.items():
        if name in names and param is not None:
            yield name, param


def _fill_qparams(
    model: torch.nn.Module, qparams: Mapping[str, Mapping[str, torch.Tensor]]
) -> None:
    """Copy the calibrated qparams into compressed-tensors' parameters.

    Raises:
        ValueError: compressed-tensors expects a qparam calibration did not
            write, has no place for one it did (the checkpoint would lose it),
            or expects another shape.
    """
    used: set[tuple[str, str]] = set()
    for module_name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        ours = qparams.get(module_name, {})
        for name, param in _ct_qparams(module):
            value = ours.get(name)
            where = f"{module_name}.{name}"
            if value is None:
                if name.endswith("_zero_point"):
                    continue  # symmetric: compressed-tensors' zeros, then dropped
                raise ValueError(
                    f"compressed-tensors expects {where}, which calibration did not "
                    "write; the recipe and the model's quantization disagree"
                )
            if value.numel() != param.numel():
                raise ValueError(
                    f"{where}: calibrated shape {list(value.shape)} is not "
                    f"compressed-tensors' {list(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value.reshape(param.shape).to(param.dtype))
            used.add((module_name, name))
    lost = [
        f"{module}.{name}"
        for module, names in qparams.items()
        for name in names
        if (module, name) not in used
    ]
    if lost:
        raise ValueError(
            f"compressed-tensors keeps no place for {', '.join(lost[:5])}"
            f"{' ...' if len(lost) > 5 else ''}: it does not quantize these "
            "modules or tensors (e.g. attention states of a model it does not "
            "treat as attention); remove them from the recipe to export"
        )


_SAME_FIELDS = (
    "num_bits",
    "type",
    "symmetric",
    "strategy",
    "group_size",
    "block_structure",
    "dynamic",
)
_CT_PART = {
    "weight": "weights",
    "input": "input_activations",
    "output": "output_activations",
}


def _check_schemes(model: torch.nn.Module, attachment: Attachment) -> None:
    """Raise unless compressed-tensors gave every calibrated weight, input and
    output the args quantobs calibrated it under (both resolve a module that
    several config groups target, each its own way)."""
    for entry in attachment.entries:
        part = _CT_PART.get(entry.base_name)
        if part is None:
            continue
        scheme = getattr(model.get_submodule(entry.name), "quantization_scheme", None)
        ct_args = getattr(scheme, part, None)
        ours = entry.args.to_compressed_tensors()
        if ct_args is None or any(
            getattr(ct_args, f) != getattr(ours, f) for f in _SAME_FIELDS
        ):
            raise ValueError(
                f"compressed-tensors quantizes {entry.key} otherwise than the "
                f"recipe's config group {entry.group!r} (its targets and ignore "
                "list resolve differently where several groups match one module); "
                "make the config groups' targets disjoint"
            )


def _drop_symmetric_zero_points(model: torch.nn.Module) -> None:
    """Remove the zero points of symmetric attention states (all zeros,
    forced by compressed-tensors' initialization; its compressors drop those
    of weights and activations, not these)."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        args = getattr(scheme, "input_activations", None)
        if args is None or not args.symmetric:
            continue
        for base in ("q", "k", "v"):
            if f"{base}_zero_point" in module._parameters:
                delattr(module, f"{base}_zero_point")


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
        temp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:12]}"
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
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
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
    attachment: Attachment,
    formats: Mapping[str, str],
    qparams: Mapping[str, Mapping[str, torch.Tensor]],
    temp: Path,
) -> None:
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    config = attachment.recipe.to_compressed_tensors(_model_format(formats))
    for group, scheme in config.config_groups.items():
        scheme.format = formats[group]
    clone = copy.deepcopy(model)
    detach(clone)  # the copy's observers and hooks; the model keeps its own
    apply_quantization_config(clone, config, show_progress=False)
    _check_schemes(clone, attachment)
    _fill_qparams(clone, qparams)
    _drop_symmetric_zero_points(clone)
    compressor = ModelCompressor.from_pretrained_model(clone)
    compressor.compress_model(clone)
    clone.save_pretrained(temp)  # type: ignore[operator]
    compressor.update_config(str(temp))


def save_compressed(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    source_dir: str | os.PathLike[str] | None = None,
    format: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the calibrated `model` as a compressed-tensors checkpoint.

    Call it after `calibrate`, with the observers still attached (the
    attachment holds the recipe); the model is not modified. The checkpoint
    loads with `transformers.AutoModel.from_pretrained(out_dir)` (dequantized
    with `CompressedTensorsConfig(dequantize=True)`) and with vLLM::

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

    Returns:
        The checkpoint directory (absolute).

    Raises:
        RuntimeError: no observers attached, or the model is not calibrated.
        TypeError: the model has no `save_pretrained`.
        ValueError: a scheme with no supported format, a `format` that
            cannot store it, or qparams compressed-tensors would not place as
            calibrated (states it does not quantize, targets it resolves
            otherwise).
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
    formats = checkpoint_formats(attachment.recipe, format)
    qparams = _calibrated_qparams(attachment)
    source = _default_source(model) if source_dir is None else Path(source_dir)
    if source is not None and not source.is_dir():
        raise FileNotFoundError(f"source_dir {source} is not a directory")
    out = Path(out_dir).expanduser().absolute()
    if out.is_symlink():
        out = out.resolve()
    _check_destination(out, overwrite)
    temp, created = _temp_dir(out)
    try:
        _write(model, attachment, formats, qparams, temp)
        if source is not None:
            _copy_sources(source, temp, out)
        _check_destination(out, overwrite)  # nothing appeared meanwhile
        _move_into_place(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        _remove_empty(created)
        raise
    return out
