"""The calibrated model as compressed-tensors sees it: the copy that
`save_compressed` compresses and `quantobs compare` evaluates.

`compressed_tensors_view(model)` is the same without copying any tensor: a
copy of the model's modules sharing every weight with the model (only the
qparams are new), whose compressed-tensors forward fake-quantizes each
weight as its module runs (the weight restored after, one module's
quantized weight at a time, an offloaded one onloaded for its module only):
what `quantobs.report.evaluate` runs, bit for bit the deep copy's outputs.

`compressed_tensors_copy(model)` deep-copies a calibrated model (its
observers and hooks stay on the original), applies the recipe's
compressed-tensors config to the copy and copies the calibrated qparams into
the parameters compressed-tensors created, in its dtypes and shapes. The
copy's forward is compressed-tensors' own fake quantization (weights and
static activations with our qparams, dynamic activations computed on the
fly), which is what an inference engine computes from the checkpoint; its
`ModelCompressor` writes the checkpoint from it.

The copy starts without calibrated qparams (compressed-tensors sizes and
types its own from the module's first parameter, which a leftover float8
zero point would turn into float16 scales). Calibrated `Conv1D` layers
(weights stored transposed, which compressed-tensors does not quantize)
become the equivalent `nn.Linear` in the copy, targeted by name in their
config group: the copy computes what the calibrated model would, but is no
checkpoint transformers reloads as the model's class (`save_compressed`
refuses them).

Needs the `export` extra (compressed-tensors).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from quantobs.calibration.attach import (
    QPARAM_KINDS,
    Attachment,
    attachment_of,
    detach,
)
from quantobs.calibration.experts import copy_memo, keep_linear
from quantobs.calibration.offload import (
    held_tensors,
    hooks_unwrapped,
    read_tensor,
    write_parameter,
)
from quantobs.calibration.transposed import as_linear, is_transposed
from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import BASE_NAMES

__all__ = [
    "calibrated_qparams",
    "compressed_tensors_copy",
    "compressed_tensors_view",
    "detached_copy",
    "quantize_in_place",
]

#: the format of the copy when none is given: the forward does not depend on it
_DENSE = "dense"
_MIXED = "mixed-precision"


def _qparam_names(base_name: str, args: QuantizationArgs) -> list[str]:
    """The qparams calibration writes for one entry."""
    names = [] if args.dynamic == "local" else [f"{base_name}_scale"]
    if args.strategy == "tensor_group":
        names.append(f"{base_name}_global_scale")
    return names


def calibrated_qparams(attachment: Attachment) -> dict[str, dict[str, torch.Tensor]]:
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
            name = f"{entry.base_name}_{kind}"
            if isinstance(module._parameters.get(name), torch.Tensor):
                # an offloaded module's from where it keeps them
                own[name] = read_tensor(module, name).detach()
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
        for name, param in list(_ct_qparams(module)):
            value = ours.get(name)
            where = f"{module_name}.{name}"
            if value is None:
                if _symmetric_zero_point(scheme, name):
                    # compressed-tensors' zeros (then dropped), written where
                    # an offloaded module keeps its tensors
                    zeros = torch.zeros(param.shape, dtype=param.dtype)
                    write_parameter(module, name, zeros)
                    continue
                raise ValueError(
                    f"compressed-tensors expects {where}, which calibration did not "
                    "write; the recipe and the model's quantization disagree"
                )
            if _squeezed(value.shape) != _squeezed(param.shape):
                raise ValueError(
                    f"{where}: calibrated shape {list(value.shape)} is not "
                    f"compressed-tensors' {list(param.shape)}"
                )
            # a copy of its own: fused layers share one global scale tensor
            value = value.reshape(param.shape).to(param.dtype, copy=True)
            write_parameter(module, name, value)
            used.add((module_name, name))
    lost = [
        f"{module}.{name}"
        for module, names in qparams.items()
        for name, value in names.items()
        if (module, name) not in used and not _zero(name, value)
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


def _model_format(formats: Mapping[str, str]) -> str:
    stored = {f for f in formats.values() if f != _DENSE}
    if not stored:
        return _DENSE
    return stored.pop() if len(stored) == 1 else _MIXED


def _zero(name: str, value: torch.Tensor) -> bool:
    """Whether `name` is a zero point of zeros (symmetric args: nothing is
    lost where compressed-tensors keeps none, as for the kv cache)."""
    return name.endswith("_zero_point") and not bool(value.any())


def _squeezed(shape: torch.Size) -> list[int]:
    """A qparam shape without its size-1 dims (`(C, 1)` and `(C,)` agree)."""
    return [size for size in shape if size != 1]


def _symmetric_zero_point(scheme: Any, name: str) -> bool:
    """Whether `name` is a zero point that symmetric args leave at zero
    (attention states' `q/k/v_zero_point`: their args' symmetry decides in
    `_drop_symmetric_zero_points`)."""
    if not name.endswith("_zero_point"):
        return False
    part = {
        "weight": "weights",
        "input": "input_activations",
        "output": "output_activations",
    }.get(name.removesuffix("_zero_point"))
    args = getattr(scheme, part, None) if part else None
    return args is None or bool(args.symmetric)


def _drop_calibrated(model: torch.nn.Module) -> None:
    """Remove calibrated qparams from every module (the copy's own)."""
    names = [f"{base}_{kind}" for base in BASE_NAMES for kind in QPARAM_KINDS]
    for module in model.modules():
        for name in names:
            if name in module._parameters:
                delattr(module, name)


def _linearize(model: torch.nn.Module, attachment: Attachment, config: Any) -> None:
    """Replace the calibrated `Conv1D` layers of the copy `model` by their
    `nn.Linear`, each added by its exact name to its config group's targets
    (exact names take precedence in compressed-tensors' matching)."""
    for entry in attachment.entries:
        if entry.base_name != "weight" or not is_transposed(entry.module):
            continue
        parent_name, _, leaf = entry.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, leaf)
        if not is_transposed(layer):  # pragma: no cover - replaced already
            continue
        setattr(parent, leaf, as_linear(layer))
        config.config_groups[entry.group].targets.append(entry.name)


def quantize_in_place(
    model: torch.nn.Module,
    attachment: Attachment,
    qparams: Mapping[str, Mapping[str, torch.Tensor]],
    formats: Mapping[str, str] | None = None,
) -> None:
    """Quantize `model` by compressed-tensors with the calibrated `qparams`
    (`calibrated_qparams(attachment)`): `model` is the calibrated model or a
    copy of it, its observers and hooks removed (`detach`) and its fused
    experts kept as Linears (`experts.keep_linear`). Offloaded modules get
    their qparams where they keep their weights (`offload.write_parameter`).

    Raises:
        ValueError: compressed-tensors resolves a module otherwise than the
            recipe, or has no place for a calibrated qparam.
    """
    from compressed_tensors.quantization import apply_quantization_config

    groups = attachment.recipe.config_groups
    formats = formats if formats is not None else dict.fromkeys(groups, _DENSE)
    config = attachment.recipe.to_compressed_tensors(_model_format(formats))
    for group, scheme in config.config_groups.items():
        scheme.format = formats[group]
    _drop_calibrated(model)
    _linearize(model, attachment, config)
    with hooks_unwrapped(model):  # accelerate's hooks wrap CT's forward
        apply_quantization_config(model, config, show_progress=False)
    _check_schemes(model, attachment)
    _fill_qparams(model, qparams)
    _drop_symmetric_zero_points(model)


def compressed_tensors_copy(
    model: torch.nn.Module,
    formats: Mapping[str, str] | None = None,
    *,
    qparams: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> torch.nn.Module:
    """A deep copy of the calibrated `model` quantized by compressed-tensors.

    The copy has no observers or hooks of ours; its quantized modules hold
    `quantization_scheme` and the calibrated qparams as compressed-tensors
    parameters, and their forward fake-quantizes (compressed-tensors'
    `forward_quantize`). The model is not modified.

    Args:
        model: a model calibrated with its observers attached.
        formats: `{config group: compressed-tensors format}` for a checkpoint
            (`checkpoint_formats`); None for evaluation only (dense).
        qparams: `calibrated_qparams` of the model's attachment, where the
            caller has them already (None: read them).

    Returns:
        The copy, on the model's device, in eval mode as the model is.

    Raises:
        RuntimeError: no observers attached, or the model is not calibrated.
        ValueError: compressed-tensors resolves a module otherwise than the
            recipe, or has no place for a calibrated qparam.
    """
    attachment = attachment_of(model)
    if qparams is None:
        qparams = calibrated_qparams(attachment)
    clone = detached_copy(model)
    quantize_in_place(clone, attachment, qparams, formats)
    return clone


def compressed_tensors_view(
    model: torch.nn.Module,
    *,
    qparams: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> torch.nn.Module:
    """The calibrated `model` quantized by compressed-tensors, sharing its
    tensors: a copy of its modules (no observers or hooks of ours, fused
    experts as per-expert Linears viewing the fused weights) whose every
    parameter, buffer and offloaded value is the model's own; only the
    qparams compressed-tensors places are new (written where offloaded
    modules keep their weights, in the view's own weights maps). Its forward
    is compressed-tensors' fake quantization with each weight quantized as
    its module runs (`forward_quantize` of the onloaded weight, restored
    after), so that it never holds more than one module's quantized weight.

    Never change its tensors in place: they are the model's. An offloaded
    model's view may write files under `offload_folder/quantobs/`: call
    `offload.release_written(view)` when done (or drop the view).

    Raises:
        RuntimeError: no observers attached, or the model is not calibrated.
        ValueError: compressed-tensors resolves a module otherwise than the
            recipe, or has no place for a calibrated qparam.
    """
    attachment = attachment_of(model)
    if qparams is None:
        qparams = calibrated_qparams(attachment)
    memo = copy_memo(model)  # the fused experts modules left out
    for tensor in (*model.parameters(), *model.buffers(), *held_tensors(model)):
        memo[id(tensor)] = tensor
    view = copy.deepcopy(model, memo)
    detach(view)  # the experts' Linears stay, viewing the model's fused weights
    quantize_in_place(view, attachment, qparams)
    return view


def detached_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the calibrated `model` without observers or hooks of
    ours (the model keeps its own), its fused experts as per-expert Linears."""
    clone = copy.deepcopy(model, copy_memo(model))
    keep_linear(clone)
    detach(clone)
    return clone
