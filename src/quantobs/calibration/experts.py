"""MoE experts stored as fused 3-D parameters, observed per expert.

transformers 5 keeps the experts of a MoE layer in one module holding
`gate_up_proj` `(E, 2 * I, H)` and `down_proj` `(E, H, I)` (Qwen2-MoE,
Qwen3-MoE, Mixtral, DeepSeek-V3, ...: the classes decorated with
`use_experts_implementation`), called as `experts(hidden (T, H), top_k_index
(T, k), top_k_weights (T, k))`. No `nn.Linear` is there for a recipe to
target. While observers are attached, `attach` puts a `CalibrationExperts`
in its place: per expert, `nn.Linear`s named as the checkpoints name them
(`experts.3.gate_proj`, `up_proj`, `down_proj`; Mixtral's `w1`, `w3`, `w2`),
whose weights are views of slices of the fused parameters (nothing is
copied), and a forward that routes the tokens through them, so recipes
target them as they target any `Linear` (llm-compressor's linearized experts
have the same names) and the ordinary hooks observe each expert's weight and
the inputs of the tokens routed to it. `detach` puts the fused module back.

**Offloaded experts.** Where accelerate offloads the fused module (a
`device_map` sending its layer to `"cpu"` or `"disk"`: meta placeholders,
the values in its `AlignDevicesHook`'s weights map), each per-expert Linear
gets an offload hook of its own over the same weights loader, under its
expert's name (`...experts.3.gate_proj.`), its weight a meta placeholder
recorded as a slice of the fused tensor (`offload.offload_slices`): its
qparams and compressed tensors are written where the fused weights live
(the loader's CPU state dict, or files under `offload_folder/quantobs/`),
as for any offloaded module. The fused tensors are read once, for one
layer at a time, and each weight is a view of them while it is needed
(`CalibrationExperts.onloaded`, `offload.onloaded_together`): for the
block's forward, for the observation of the layer's weights
(`loaded_together`), and at the export, which writes each expert's weight
where the fused ones live and drops the fused tensors from that model's
(or copy's) loader (`keep_linear`, `offload.own_slices`); the checkpoint is
the in-memory model's, bit for bit. A weight read alone (`Entry.weight`)
reads its fused tensor whole.

Observers see real tokens only: of the batch `calibrate` runs, tokens that
are padding (`quantobs.calibration.tokens`) go through the experts they are
routed to without being observed, so the model's output is the same and no
expert's qparams depend on padding. `observe_all_experts()` (what
`calibrate(..., all_experts=True)` turns on) feeds every real token to every
expert's observers, as llm-compressor's `moe_calibrate_all_experts` (on by
default there; off here, so that an expert's input ranges are those of the
tokens it sees at inference); the output still sums only the routed
experts' weighted outputs.

The routers (`mlp.gate`) stay dense under the usual targets: in
transformers 5 they are `*TopKRouter` modules, not `Linear`s, so `"Linear"`
never reaches them (llm-compressor's examples ignore `re:.*mlp.gate$` for
the same purpose; such an ignore is harmless here). Qwen2-MoE's
`shared_expert_gate` is a `Linear` (one output) and is quantized unless
ignored (`re:.*shared_expert_gate$`), as in llm-compressor. Move the model
to its device and dtype before `attach`: the per-expert weights are views,
which moving the model would turn into copies.

The export copy (`quantobs.calibration.simulate`) keeps the per-expert
`Linear`s (`keep_linear`): compressed-tensors quantizes and compresses each,
and the checkpoint holds per-expert keys as the original checkpoints did
(`model.layers.0.mlp.experts.0.gate_proj.weight_packed`; Mixtral's
`block_sparse_moe.experts.0.w1...`, as transformers renames them on save),
the keys llm-compressor writes for linearized experts. transformers 5.17
merges them back into the fused parameters when it loads them
(`conversion_mapping.py`, with `DecompressExperts` prepended by
`CompressedTensorsHfQuantizer.update_weight_conversions`), which handles
part of what compressed-tensors stores (`reload_caveats`):

    pack-quantized (W4A16, W8A16),  weight_packed, weight_scale, weight_shape:
    mxfp4-pack-quantized (MXFP4A16) reloaded exactly
    float-quantized (FP8)           weight, weight_scale: reloaded, dequantized
                                    in bfloat16 (exact for bfloat16 models)
    int-quantized (W8A8)            its converter collects only weight_packed /
                                    _scale / _shape keys: the int8 `weight`
                                    keys match nothing and loading fails
    nvfp4-pack-quantized (NVFP4)    weight_global_scale is not collected: the
                                    experts decompress without it (wrong
                                    weights; the keys are reported unexpected)
    asymmetric weights              weight_zero_point is not collected either:
                                    loading fails
    static input activations        input_scale / input_global_scale: the fused
                                    module has no place for them (unexpected
                                    keys); its inputs are not quantized

`save_compressed` writes the checkpoint all the same (it is what an
inference engine that reads per-expert keys, as for llm-compressor's
checkpoints, expects) and warns with `ExpertsReloadWarning` naming each
caveat that applies.

(Over 500 lines: one layout change, the calibration module, its routing,
the swap in and out and the export copy's view of it belong together.)

(Over 500 lines: fused experts replaced by per-expert Linears, their routing
forward, and their offloaded tensors are one mechanism: attach, run and
detach must agree on it.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from quantobs.calibration.offload import (
    is_offloaded,
    offload_slices,
    onloaded_together,
    own_slices,
    remove_parameter,
)
from quantobs.calibration.tokens import current_mask

if TYPE_CHECKING:
    from quantobs.calibration.attach import Attachment, Entry

__all__ = [
    "CalibrationExperts",
    "ExpertTag",
    "ExpertsReloadWarning",
    "copy_memo",
    "expert_tag",
    "is_fused_experts",
    "keep_linear",
    "linearize",
    "loaded_together",
    "observe_all_experts",
    "projection_names",
    "reload_caveats",
    "restore",
    "routed_tokens",
    "uncounted",
]

#: The projections of one expert, by role, as most checkpoints name them.
_DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")
# Attribute of a per-expert Linear holding its `ExpertTag`.
_TAG = "_quantobs_expert"

# None outside `calibrate` (no routing counted); else its `all_experts`
_ALL_EXPERTS: ContextVar[bool | None] = ContextVar("quantobs_all_experts", default=None)
_UNCOUNTED: ContextVar[bool] = ContextVar("quantobs_uncounted", default=False)


@dataclass(frozen=True)
class ExpertTag:
    """Where a per-expert `Linear` belongs.

    Attributes:
        experts: the full name of the experts module (`...mlp.experts`).
        index: the expert's index.
        projection: the Linear's name (`gate_proj`, `w1`, ...).
    """

    experts: str
    index: int
    projection: str

    @property
    def expert(self) -> str:
        """The expert's full name (`...mlp.experts.3`)."""
        return f"{self.experts}.{self.index}"


def expert_tag(module: torch.nn.Module) -> ExpertTag | None:
    """The `ExpertTag` of a per-expert Linear, None for any other module."""
    tag = module.__dict__.get(_TAG)
    return tag if isinstance(tag, ExpertTag) else None


@contextmanager
def observe_all_experts(enabled: bool = True) -> Iterator[None]:
    """While the block runs (`calibrate`'s batches), the tokens routed to
    each expert are counted (`routed_tokens`) and, if `enabled`, every real
    token reaches every expert's observers (not only the experts it is
    routed to); outputs are unchanged."""
    token = _ALL_EXPERTS.set(enabled)
    try:
        yield
    finally:
        _ALL_EXPERTS.reset(token)


@contextmanager
def uncounted() -> Iterator[None]:
    """While the block runs, routing is not counted (a batch run twice)."""
    token = _UNCOUNTED.set(True)
    try:
        yield
    finally:
        _UNCOUNTED.reset(token)


# ----------------------------------------------------------------- layout


def _param3d(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    value = module._parameters.get(name)
    return value if isinstance(value, torch.Tensor) and value.ndim == 3 else None


def is_fused_experts(module: torch.nn.Module) -> bool:
    """Whether `module` holds experts as fused 3-D parameters (any layout)."""
    if isinstance(module, CalibrationExperts):
        return False
    return _param3d(module, "down_proj") is not None and (
        _param3d(module, "gate_up_proj") is not None
        or _param3d(module, "up_proj") is not None
    )


def _unsupported(module: torch.nn.Module) -> str | None:
    """Why quantobs cannot observe this fused experts module, or None."""
    gate_up = _param3d(module, "gate_up_proj")
    down = _param3d(module, "down_proj")
    if gate_up is None or down is None or not getattr(module, "has_gate", True):
        return "it has no fused gate_up_proj (experts without a gate)"
    if getattr(module, "is_transposed", False):
        return "its fused weights are transposed"
    if getattr(module, "has_bias", False) or any(
        n.endswith("_bias") for n in module._parameters
    ):
        return "its experts have biases"
    if not getattr(module, "is_concatenated", True):
        return "its gate and up rows are interleaved"
    if not isinstance(getattr(module, "act_fn", None), torch.nn.Module):
        return "it has no act_fn module"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        return "its gate is not act_fn(gate) * up"
    experts, double, hidden = gate_up.shape
    if double % 2 or tuple(down.shape) != (experts, hidden, double // 2):
        return (
            f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} "
            "are not (E, 2I, H) and (E, H, I)"
        )
    return None


def projection_names(model: torch.nn.Module) -> tuple[str, str, str]:
    """`(gate, up, down)` projection names of the model's checkpoints: those
    transformers' conversion mapping merges into `gate_up_proj` and
    `down_proj` when it loads them (Mixtral: `w1`, `w3`, `w2`), else
    `gate_proj`, `up_proj`, `down_proj`."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not model_type:
        return _DEFAULT_NAMES
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover - transformers < 5
        return _DEFAULT_NAMES
    found: dict[str, list[str]] = {}
    for conversion in get_checkpoint_conversion_mapping(model_type) or ():
        targets = getattr(conversion, "target_patterns", None) or []
        sources = getattr(conversion, "source_patterns", None) or []
        for target in targets:
            for fused in ("gate_up_proj", "down_proj"):
                if str(target).endswith(f"experts.{fused}"):
                    found[fused] = [_leaf(str(s)) for s in sources]
    gate_up, down = found.get("gate_up_proj", []), found.get("down_proj", [])
    if len(gate_up) == 2 and len(down) == 1 and all(gate_up + down):
        return gate_up[0], gate_up[1], down[0]
    return _DEFAULT_NAMES


def _leaf(pattern: str) -> str:
    """`"mlp.experts.*.gate_proj.weight"` -> `"gate_proj"` ("" if not so)."""
    parts = pattern.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] == "*":
        return parts[-2]
    return ""


# ----------------------------------------------------------------- modules


def _view_linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free Linear whose weight is `weight` itself (a view, no copy)."""
    out_features, in_features = weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class _Expert(torch.nn.Module):
    """One expert: gate, up and down Linears under the checkpoint's names."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(
        self,
        names: tuple[str, str, str],
        gate: torch.nn.Linear,
        up: torch.nn.Linear,
        down: torch.nn.Linear,
        act_fn: torch.nn.Module,
    ) -> None:
        super().__init__()
        self.names = names
        for name, linear in zip(names, (gate, up, down), strict=True):
            self.register_module(name, linear)
        # shared with the fused module (not a submodule: no second state)
        self.__dict__["act_fn"] = act_fn

    def linears(self) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear]:
        """`(gate, up, down)`."""
        gate, up, down = (self._modules[n] for n in self.names)
        if not (
            isinstance(gate, torch.nn.Linear)
            and isinstance(up, torch.nn.Linear)
            and isinstance(down, torch.nn.Linear)
        ):  # pragma: no cover - built so
            raise TypeError(f"expert projections {self.names} are not Linears")
        return gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`down(act(gate(x)) * up(x))` through the Linears (hooks observe)."""
        gate, up, down = self.linears()
        return down(self.act_fn(gate(x)) * up(x))

    def unobserved(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic on the same weights, past the hooks."""
        gate, up, down = self.linears()
        act = self.act_fn(torch.nn.functional.linear(x, gate.weight))
        hidden = act * torch.nn.functional.linear(x, up.weight)
        return torch.nn.functional.linear(hidden, down.weight)


class CalibrationExperts(torch.nn.Module):
    """A fused experts module seen as per-expert Linears (see the module's
    docstring); submodules `"0"` ... `"E-1"`, each with its projections.

    Attributes:
        num_experts: E.
        names: `(gate, up, down)` projection names.
        fused: the fused module it replaces (None in an export copy).
        routed: `(E,)` int64, real tokens routed to each expert by the
            batches `calibrate` ran so far.
        calls: those batches.
    """

    def __init__(
        self,
        fused: torch.nn.Module,
        names: tuple[str, str, str] = _DEFAULT_NAMES,
    ) -> None:
        super().__init__()
        gate_up = fused._parameters["gate_up_proj"]
        down = fused._parameters["down_proj"]
        assert gate_up is not None and down is not None  # checked by the caller
        self.num_experts = int(gate_up.shape[0])
        self.names = names
        inter = int(down.shape[2])
        act_fn = fused.act_fn
        assert isinstance(act_fn, torch.nn.Module)
        for index in range(self.num_experts):
            gate = _view_linear(gate_up.data[index, :inter])  # (I, H)
            up = _view_linear(gate_up.data[index, inter:])  # (I, H)
            low = _view_linear(down.data[index])  # (H, I)
            self.register_module(str(index), _Expert(names, gate, up, low, act_fn))
        self.__dict__["fused"] = fused
        self.routed = torch.zeros(self.num_experts, dtype=torch.int64)
        self.calls = 0

    def expert(self, index: int) -> _Expert:
        """Expert `index`."""
        found = self._modules[str(index)]
        assert isinstance(found, _Expert)
        return found

    def linears(self) -> list[torch.nn.Linear]:
        """Every expert's `(gate, up, down)`, expert by expert."""
        return [
            linear
            for index in range(self.num_experts)
            for linear in self.expert(index).linears()
        ]

    @property
    def offloaded(self) -> bool:
        """Whether accelerate offloads the experts (their Linears hold meta
        placeholders; the fused values, or their own once written, are in
        the offload hooks' weights maps)."""
        return is_offloaded(self.expert(0).linears()[0])

    def onloaded(self, weights_only: bool = False) -> Any:
        """A context in which every expert's Linears hold their values (for
        offloaded experts: the fused tensors read once, each weight a view
        of them, and the Linears' own tensors, qparams, unless
        `weights_only`; meta placeholders again after; as they are
        otherwise)."""
        if not self.offloaded:
            return nullcontext()
        return onloaded_together(self.linears(), slices_only=weights_only)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The fused module's output, each expert through its Linears.

        Args:
            hidden_states: `(T, H)`, the flattened tokens.
            top_k_index: `(T, k)`, the experts each token is routed to.
            top_k_weights: `(T, k)`, their weights.

        Returns:
            `(T, H)`: the sum over each token's experts of weight * output.
        """
        with self.onloaded():  # offloaded: this forward's only
            return self._forward(hidden_states, top_k_index, top_k_weights)

    def _forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        real = _real_rows(tokens, hidden_states.device)  # (n,) or None: all
        calibrating = _ALL_EXPERTS.get()
        all_experts = bool(calibrating)
        with torch.no_grad():
            # (E, k, T): hits[e, j, t] = token t's j-th choice is expert e
            hits = torch.nn.functional.one_hot(top_k_index, self.num_experts)
            hits = hits.permute(2, 1, 0)
            per_expert = hits[..., real].sum((1, 2)) if real is not None else None
            if calibrating is not None and not _UNCOUNTED.get():
                self._count(hits.sum((1, 2)) if per_expert is None else per_expert)
            if all_experts:
                chosen = list(range(self.num_experts))
            else:
                chosen = hits.sum((1, 2)).nonzero().reshape(-1).tolist()
        is_real = None
        if real is not None:
            is_real = torch.zeros(tokens, dtype=torch.bool, device=real.device)
            is_real[real] = True
        out = torch.zeros_like(hidden_states)
        for index in chosen:
            top_k_pos, token_idx = torch.where(hits[index])  # (n_e,), (n_e,)
            expert = self.expert(index)
            if all_experts:
                outputs = self._all_tokens(expert, hidden_states, token_idx, real)
            else:
                outputs = self._routed(expert, hidden_states, token_idx, is_real)
            if not token_idx.numel():
                continue
            weighted = outputs * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, weighted.to(out.dtype))
        return out

    def _count(self, counts: torch.Tensor) -> None:
        self.calls += 1
        if self.routed.device != counts.device:
            self.routed = self.routed.to(counts.device)
        self.routed += counts.to(torch.int64)

    @staticmethod
    def _routed(
        expert: _Expert,
        hidden: torch.Tensor,
        token_idx: torch.Tensor,
        is_real: torch.Tensor | None,
    ) -> torch.Tensor:
        """The expert's outputs for its routed tokens `(n_e, H)`; only the
        real ones are observed."""
        if is_real is None:
            return expert(hidden[token_idx])
        keep = is_real[token_idx]  # (n_e,)
        outputs = hidden.new_empty(token_idx.shape[0], hidden.shape[1])
        outputs[keep] = expert(hidden[token_idx[keep]]).to(outputs.dtype)
        pads = token_idx[~keep]
        if pads.numel():
            outputs[~keep] = expert.unobserved(hidden[pads]).to(outputs.dtype)
        return outputs

    @staticmethod
    def _all_tokens(
        expert: _Expert,
        hidden: torch.Tensor,
        token_idx: torch.Tensor,
        real: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every real token observed through the expert; the outputs of its
        routed tokens `(n_e, H)` returned."""
        if real is None:
            return expert(hidden)[token_idx]
        observed = expert(hidden[real])  # (n, H)
        row = torch.full(
            (hidden.shape[0],), -1, dtype=torch.int64, device=hidden.device
        )
        row[real] = torch.arange(real.shape[0], device=hidden.device)
        rows = row[token_idx]  # (n_e,): -1 for padding
        keep = rows >= 0
        outputs = hidden.new_empty(token_idx.shape[0], hidden.shape[1])
        outputs[keep] = observed[rows[keep]].to(outputs.dtype)
        pads = token_idx[~keep]
        if pads.numel():
            outputs[~keep] = expert.unobserved(hidden[pads]).to(outputs.dtype)
        return outputs


def _real_rows(tokens: int, device: torch.device) -> torch.Tensor | None:
    """`(n,)` rows of a `(T, H)` input that are real tokens of the batch
    `calibrate` runs; None when every row is (nothing padded, no batch)."""
    mask = current_mask()
    if mask is None or not mask.padded:
        return None
    rows, cols = mask.shape
    if rows * cols != tokens:
        return None
    return mask.index.to(device)


# ---------------------------------------------------------- attach / detach


def linearize(
    model: torch.nn.Module, targets: list[str], ignore: list[str]
) -> list[str]:
    """Replace every fused experts module of `model` by a `CalibrationExperts`.

    Args:
        model: the model.
        targets: the recipe's targets (a layout quantobs cannot observe is
            an error only where they may reach it: `Linear`, or a name or
            pattern matching the module or its per-expert projections).
        ignore: a recipe's ignore targets: a fused module they match whole
            (by name or class) is left alone.

    Returns:
        The names of the modules replaced.

    Raises:
        ValueError: a fused experts module of a layout quantobs cannot
            observe (named, with the reason and the fix).
    """
    from quantobs.calibration.attach import _matches

    names = projection_names(model)
    replaced: list[str] = []
    for name, module in list(model.named_modules()):
        if not is_fused_experts(module):
            continue
        if any(_matches(t, name, module) for t in ignore):
            continue
        why = _unsupported(module)
        if why is not None and not _reached(name, module, targets, names):
            continue
        if why is not None:
            raise ValueError(
                f"cannot observe the experts {name!r} ({type(module).__name__}): "
                f"{why}; add {name!r} to the recipe's ignore list to leave them "
                "unquantized"
            )
        calibration = CalibrationExperts(module, names)
        inter = int(calibration.expert(0).linears()[0].weight.shape[0])
        parts = {
            names[0]: ("gate_up_proj", slice(0, inter)),
            names[1]: ("gate_up_proj", slice(inter, None)),
            names[2]: ("down_proj", slice(None)),
        }
        for index in range(calibration.num_experts):
            for projection in names:
                tag = ExpertTag(name, index, projection)
                linear = calibration.expert(index)._modules[projection]
                assert linear is not None
                linear.__dict__[_TAG] = tag
                # offloaded: its weight read from the fused tensor's place
                whole, rows = parts[projection]
                offload_slices(
                    linear,
                    module,
                    f"{index}.{projection}.",
                    {"weight": (whole, (index, rows))},
                )
        model.set_submodule(name, calibration)
        replaced.append(name)
    return replaced


def _reached(
    name: str,
    module: torch.nn.Module,
    targets: list[str],
    projections: tuple[str, str, str],
) -> bool:
    """Whether a target may mean the experts of fused module `name`."""
    from quantobs.calibration.attach import _matches

    linears = [f"{name}.0.{p}" for p in projections]
    return any(
        target == "Linear"
        or _matches(target, name, module)
        or (
            target.startswith("re:")
            and any(_matches(target, n, module) for n in linears)
        )
        for target in targets
    )


def restore(model: torch.nn.Module, names: list[str]) -> None:
    """Put the fused modules back in place of the `CalibrationExperts` named
    (those of an export copy, which have none, stay), on the device and in
    the dtype of their per-expert Linears (a model moved while attached
    moves the Linears' weights, which then stop being views: move the model
    before `attach`)."""
    for name in names:
        module = model.get_submodule(name)
        fused = getattr(module, "fused", None)
        if isinstance(module, CalibrationExperts) and fused is not None:
            if module.offloaded:  # their qparams leave the weights map too
                for linear in module.linears():
                    for tensor in [n for n in linear._parameters if n != "weight"]:
                        remove_parameter(linear, tensor)
            # a model moved or cast while attached moved the views alone
            weight = module.expert(0).linears()[0].weight
            if fused.gate_up_proj.device != weight.device or (
                fused.gate_up_proj.dtype != weight.dtype
            ):
                fused.to(device=weight.device, dtype=weight.dtype)
            model.set_submodule(name, fused)


def keep_linear(model: torch.nn.Module) -> None:
    """Make every `CalibrationExperts` of `model` (an export copy) stand
    alone: each expert's Linears own their weights, the fused module is let
    go, and `restore` leaves them in place."""
    for module in model.modules():
        if not isinstance(module, CalibrationExperts):
            continue
        # offloaded: each weight written where the fused ones live
        own_slices(module.linears())
        for linear in module.modules():
            if isinstance(linear, torch.nn.Linear) and linear.weight._base is not None:
                linear.weight = torch.nn.Parameter(
                    linear.weight.detach().clone(), requires_grad=False
                )
        module.__dict__["fused"] = None


def copy_memo(model: torch.nn.Module) -> dict[int, object]:
    """A `copy.deepcopy` memo that leaves the fused modules out of a copy of
    `model` (its `CalibrationExperts` keep their own Linears instead)."""
    memo: dict[int, object] = {}
    for module in model.modules():
        fused = (
            module.__dict__.get("fused")
            if isinstance(module, CalibrationExperts)
            else None
        )
        if fused is not None:
            memo[id(fused)] = None
    return memo


def loaded_together(
    model: torch.nn.Module, entries: Iterable[Entry]
) -> Iterator[tuple[Any, list[Entry]]]:
    """`(context, entries)`: the entries of each experts module together,
    with a context in which their offloaded weights are loaded (the fused
    tensors read once for all of them, `CalibrationExperts.onloaded`); every
    other entry alone, with a context that does nothing (its weight is read
    as `Entry.weight` reads it)."""
    groups: dict[object, list[Entry]] = {}
    for entry in entries:
        tag = expert_tag(entry.module)
        groups.setdefault(tag.experts if tag else id(entry), []).append(entry)
    for key, group in groups.items():
        module = model.get_submodule(key) if isinstance(key, str) else None
        if isinstance(module, CalibrationExperts):
            yield module.onloaded(weights_only=True), group
        else:
            yield nullcontext(), group


def routed_tokens(model: torch.nn.Module) -> dict[str, int]:
    """Real tokens routed to each expert of the model's `CalibrationExperts`
    so far (`"...mlp.experts.3"` -> count); empty when none has run."""
    found: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, CalibrationExperts) and module.calls:
            for index, count in enumerate(module.routed.tolist()):
                found[f"{name}.{index}"] = int(count)
    return found


class ExpertsReloadWarning(UserWarning):
    """A checkpoint with MoE experts that transformers cannot reload as
    calibrated (see `reload_caveats`)."""


def reload_caveats(attachment: Attachment, formats: dict[str, str]) -> list[str]:
    """What transformers 5.17's `from_pretrained` loses of the checkpoint's
    quantized experts (the module's docstring has the table); empty when it
    reloads them as calibrated.

    Args:
        attachment: the calibrated model's attachment.
        formats: `{config group: compressed-tensors format}` of the checkpoint.
    """
    found: list[str] = []
    for entry in attachment.entries:
        if expert_tag(entry.module) is None:
            continue
        args, fmt = entry.args, formats.get(entry.group, "")
        if entry.base_name == "weight":
            if fmt == "int-quantized":
                found.append(
                    "int-quantized experts do not load: transformers' expert "
                    "converter collects only weight_packed / weight_scale / "
                    "weight_shape keys, not the int8 `weight`"
                )
            if args.strategy == "tensor_group":
                found.append(
                    "experts decompress without their weight_global_scale "
                    "(transformers' DecompressExperts does not collect it): the "
                    "reloaded expert weights are wrong"
                )
            if not args.symmetric:
                found.append(
                    "asymmetric experts do not load: transformers' "
                    "DecompressExperts does not collect weight_zero_point "
                    "(compressed-tensors: 'Asymmetric quant requires zero-point "
                    "values')"
                )
            if fmt == "float-quantized" and entry.observed_dtype() != torch.bfloat16:
                found.append(
                    "FP8 experts are dequantized in bfloat16 by transformers "
                    f"(the model is {entry.observed_dtype()})"
                )
        elif entry.base_name == "input":
            found.append(
                "the experts' input scales are dropped (unexpected keys: the "
                "fused experts module has no place for them), so the reloaded "
                "experts do not quantize their inputs"
            )
    return list(dict.fromkeys(found))
