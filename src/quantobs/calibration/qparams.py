"""Write the attached observers' qparams onto the model, as compressed-tensors
names and stores them.

Every quantized module gets `{base}_scale` and `{base}_zero_point` (and
`{base}_global_scale` for NVFP4's `tensor_group`) as frozen parameters:
scales in the module's dtype (float16 where that is not a float dtype),
zero points in `args.zp_dtype`, global scales in float32; NVFP4's locally
dynamic activations get only their global scale. Fused layers (`q_proj` /
`k_proj` / `v_proj`, `gate_proj` / `up_proj`, ... : `FUSED_LAYER_NAMES`)
share one weight global scale, from the largest absmax of the group, as vLLM
requires. NVFP4 global and group scales of bfloat16 / float16 modules are
rounded in that dtype as compressed-tensors rounds them (the observers'
`arithmetic` option; `quantobs.core.qparams.compressed_tensors`).

An activation observer that saw no data (an MoE expert no token reached)
never gets a made-up scale silently: `on_empty="raise"` names the modules
(and the experts); `on_empty="fallback"` warns and uses the union of the
ranges its siblings chose (same config group, tensor and args; for an
expert's projection, the same projection of the other experts of its layer),
or `DEFAULT_EMPTY_RANGE` when none saw data either.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from quantobs.calibration.attach import Attachment, Entry
from quantobs.calibration.experts import ExpertTag, expert_tag
from quantobs.calibration.offload import write_parameter
from quantobs.calibration.transposed import linear_weight
from quantobs.core.layout import qparam_shape
from quantobs.core.qparams import amax_to_global_scale, calculate_qparams

__all__ = [
    "DEFAULT_EMPTY_RANGE",
    "FUSED_LAYER_NAMES",
    "EmptyPolicy",
    "QParams",
    "compute_qparams",
    "empty_experts",
    "fused_groups",
    "set_qparams",
]

EmptyPolicy = Literal["raise", "fallback"]

#: Sibling layers that share a weight global scale: llm-compressor 0.14's
#: groups, plus BERT's `query` / `key` / `value` (vLLM fuses them too).
FUSED_LAYER_NAMES: tuple[tuple[str, ...], ...] = (
    ("gate_proj", "up_proj"),
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
    ("query", "key", "value"),
)

#: Range of an activation no sibling observed either (`on_empty="fallback"`).
DEFAULT_EMPTY_RANGE = (-1.0, 1.0)

# {"scale": (*Q,), "zero_point": (*Q,), "global_scale": (1,)}, float32 scales
QParams = dict[str, torch.Tensor]


def fused_groups(entries: Sequence[Entry]) -> list[list[Entry]]:
    """Weight entries grouped by shared global scale: each fused set of
    sibling `tensor_group` layers is one group, every other weight its own."""
    weights = [e for e in entries if e.base_name == "weight"]
    by_name = {e.name: e for e in weights}
    taken: set[str] = set()
    groups: list[list[Entry]] = []
    for entry in weights:
        if entry.name in taken:
            continue
        group = [entry]
        parent, _, leaf = entry.name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for names in FUSED_LAYER_NAMES:
            if leaf not in names:
                continue
            members = [by_name.get(prefix + n) for n in names]
            found = [m for m in members if m is not None]
            if len(found) > 1 and all(m.args.strategy == "tensor_group" for m in found):
                group = found
            break
        taken.update(e.name for e in group)
        groups.append(group)
    return groups


def _arithmetic_dtype(entry: Entry) -> torch.dtype | None:
    """The dtype the entry's scales are rounded in (compressed-tensors'
    arithmetic on what its observer saw, else on its module's dtype); None
    for float32 arithmetic."""
    observer = entry.observer
    if observer.options.arithmetic == "float32":
        return None
    return observer.observed_dtype or entry.observed_dtype()


def _weight_qparams(group: Sequence[Entry]) -> dict[str, QParams]:
    """qparams of a fused group of weight entries (observed already)."""
    found: dict[str, QParams] = {}
    global_scale = None
    if group[0].args.strategy == "tensor_group":
        amax = torch.stack([e.observer.global_amax() for e in group]).amax(0)
        global_scale = amax_to_global_scale(
            amax, observed_dtype=_arithmetic_dtype(group[0])
        )
    for entry in group:
        observer = entry.observer
        min_vals, max_vals = observer.get_range()
        scale, zero_point = calculate_qparams(
            min_vals,
            max_vals,
            entry.args,
            global_scale,
            empty_as_zero=True,
            observed_dtype=_arithmetic_dtype(entry),
        )
        found[entry.key] = {"scale": scale, "zero_point": zero_point}
        if global_scale is not None:
            found[entry.key]["global_scale"] = global_scale
    return found


def _expected_shape(entry: Entry) -> tuple[int, ...] | None:
    """The qparam shape of an activation entry without data, where known."""
    weight = linear_weight(entry.module)  # (out, in), Conv1D's transposed
    if isinstance(weight, torch.Tensor) and weight.ndim == 2:
        features = weight.shape[1] if entry.base_name == "input" else weight.shape[0]
        if entry.base_name in ("input", "output"):
            return qparam_shape((1, int(features)), entry.base_name, entry.args)
    if entry.base_name in ("q", "k", "v") and entry.args.strategy == "tensor":
        return (1,)
    return None


def _activation_qparams(
    entries: Sequence[Entry], on_empty: EmptyPolicy
) -> tuple[dict[str, QParams], list[str]]:
    """qparams of activation / attention entries, and the keys that fell back."""
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    empty: list[Entry] = []
    for entry in entries:
        observer = entry.observer
        if observer.has_statistics:
            ranges[entry.key] = observer.get_range()
        else:
            empty.append(entry)
    if empty and on_empty == "raise":
        names = ", ".join(e.key for e in empty)
        experts = empty_experts(empty)
        routed = (
            f" (experts no token was routed to: {', '.join(experts)}; "
            "calibrate(..., all_experts=True) feeds every token to every expert)"
            if experts
            else ""
        )
        raise RuntimeError(
            f"{len(empty)} observer(s) saw no data: {names}{routed}; calibrate "
            "with data that reaches them, or pass on_empty='fallback' to use "
            "their siblings' ranges"
        )
    for entry in empty:
        ranges[entry.key] = _fallback_range(entry, entries, ranges)
    if empty:
        warnings.warn(
            f"{len(empty)} observer(s) saw no data and use a fallback range "
            f"(siblings' union, else {DEFAULT_EMPTY_RANGE}): "
            + ", ".join(e.key for e in empty),
            RuntimeWarning,
            stacklevel=3,
        )
    found: dict[str, QParams] = {}
    for entry in entries:
        min_vals, max_vals = ranges[entry.key]
        args = entry.args
        global_scale = None
        dtype = _arithmetic_dtype(entry)
        if args.strategy == "tensor_group":
            global_scale = amax_to_global_scale(
                torch.maximum(-min_vals.min(), max_vals.max()).clamp(min=0),
                observed_dtype=dtype,
            )
        qparams: QParams = (
            {} if global_scale is None else {"global_scale": global_scale}
        )
        if args.dynamic != "local":
            scale, zero_point = calculate_qparams(
                min_vals,
                max_vals,
                args,
                global_scale,
                empty_as_zero=True,
                observed_dtype=dtype,
            )
            qparams.update(scale=scale, zero_point=zero_point)
        found[entry.key] = qparams
    return found, [e.key for e in empty]


def _fallback_range(
    entry: Entry,
    entries: Iterable[Entry],
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    tag = expert_tag(entry.module)
    siblings = [
        ranges[e.key]
        for e in entries
        if e.key in ranges
        and e.group == entry.group
        and e.base_name == entry.base_name
        and e.args == entry.args
        and e.observer.has_statistics
        and _same_projection(tag, e)
    ]
    shape = _expected_shape(entry)
    siblings = [r for r in siblings if shape is None or tuple(r[0].shape) == shape]
    if siblings:
        low = torch.stack([r[0] for r in siblings]).amin(0)
        high = torch.stack([r[1] for r in siblings]).amax(0)
        return low, high
    if shape is None:
        raise RuntimeError(
            f"{entry.key} saw no data and neither did any sibling; its qparam "
            "shape is unknown, so no fallback range exists: calibrate with data "
            "that reaches it"
        )
    return (
        torch.full(shape, DEFAULT_EMPTY_RANGE[0]),
        torch.full(shape, DEFAULT_EMPTY_RANGE[1]),
    )


def _same_projection(tag: ExpertTag | None, entry: Entry) -> bool:
    """Whether `entry` may lend its range to an entry of expert tag `tag`:
    any entry for a non-expert; the same projection of the same layer's
    experts for an expert."""
    if tag is None:
        return True
    other = expert_tag(entry.module)
    return (
        other is not None
        and tag.experts == other.experts
        and tag.projection == other.projection
    )


def empty_experts(entries: Iterable[Entry]) -> list[str]:
    """The experts (`...mlp.experts.3`) some of `entries` belong to, in order."""
    found = [tag.expert for e in entries if (tag := expert_tag(e.module))]
    return list(dict.fromkeys(found))


def compute_qparams(
    attachment: Attachment,
    *,
    on_empty: EmptyPolicy = "raise",
    weights: Iterable[Sequence[Entry]] | None = None,
) -> tuple[dict[str, QParams], list[str]]:
    """Every entry's qparams from its observer (float32 scales).

    Args:
        attachment: the model's attachment.
        on_empty: what an activation observer with no data gets.
        weights: the fused weight groups to compute (default: all).

    Returns:
        `({entry key: qparams}, [keys that fell back to a default range])`.
    """
    found: dict[str, QParams] = {}
    groups = fused_groups(attachment.entries) if weights is None else weights
    for group in groups:
        found.update(_weight_qparams(group))
    activations = [e for e in attachment.entries if e.base_name != "weight"]
    acts, fell_back = _activation_qparams(activations, on_empty)
    found.update(acts)
    return found, fell_back


def scale_dtype_of(entry: Entry) -> torch.dtype:
    """compressed-tensors' scale dtype: the module's float dtype, else float16."""
    dtype = entry.observed_dtype()
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return dtype
    return torch.float16


def set_qparams(entry: Entry, qparams: QParams) -> None:
    """Register `{base}_scale`, `{base}_zero_point`, `{base}_global_scale` on
    the entry's module as frozen parameters, in compressed-tensors' dtypes,
    where the module's weights live (`offload.write_parameter`)."""
    dtypes = {
        "scale": scale_dtype_of(entry),
        "zero_point": entry.args.zp_dtype or torch.int8,
        "global_scale": torch.float32,
    }
    for kind, value in qparams.items():
        # beside the weights, or where an offloaded module keeps them
        write_parameter(
            entry.module, f"{entry.base_name}_{kind}", value.to(dtype=dtypes[kind])
        )
