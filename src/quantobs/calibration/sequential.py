"""Layer by layer: calibrate one decoder layer at a time, as llm-compressor's
sequential pipeline does, for models bigger than the device.

`calibrate(model, batches, pipeline="layer")` (the default, `"auto"`, for a
model that does not fit its device: see `choose`) runs:

1. **Capture.** Each batch runs through the model with every decoder layer
   replaced by one that records its arguments and passes its input on
   (nothing is onloaded; the run stops at the last layer): the first
   layer's hidden states, and each layer's other arguments (position
   embeddings, attention mask: Gemma's differ between sliding and global
   layers; the kv cache dropped: each layer writes its keys and values to
   observers only) are cached with the batch's real-token mask, on the CPU
   when accelerate offloads the model (else where they are; tensors every
   layer shares are kept once).
2. **Each layer** (onloaded by accelerate's hooks where it offloads it; its
   fused MoE experts by their `experts.CalibrationExperts`, once a forward):
   its weights observed, its references agreed across processes, every
   cached batch run through it with its observers' hooks (real tokens only,
   MoE experts, attention states and kv cache as in a whole-model pass),
   its importance-weighted weights observed, its weight qparams computed and
   written (frozen); its outputs become the next layer's cached inputs.
3. **Outside the layers** (embeddings before, final norm and `lm_head`
   after), where a module there is observed from its activations: each batch
   runs through the whole model again with every decoder layer replaced by
   the last layer's cached outputs (so only the modules outside run).

Then `Calibration.sync` / `freeze` finish as for a whole-model pass.

**What a layer passes on** (`propagate`): `"unquantized"` (the default)
passes the layer's own outputs, so every observer sees exactly what it sees
in a whole-model pass and the qparams are bit for bit those of
`pipeline="model"` (in one process or synced). `"quantized"` passes the
outputs of the layer with its weights fake-quantized by the qparams just
written (`quantobs.core.quantize.fake_quantize`; activations and attention
states are not quantized on the way, as llm-compressor's `propagate_error`),
so that later layers are calibrated on the inputs they see once quantized,
as GPTQ-style pipelines need; it changes the qparams of every layer after
the first, and needs the layer's weights in memory.

Peak memory: one layer's weights (where accelerate offloads the others) plus
the cached inputs of every batch at one layer boundary.

Decoder layers are found generically (`decoder_layers`): the `ModuleList`
of the model's `_no_split_modules` classes (llm-compressor's rule), e.g.
`model.model.layers`, GPT-2's `transformer.h`, OPT's `model.decoder.layers`;
else the largest `ModuleList` of modules of one class.

(Over 500 lines: the layer pipeline's capture, per-layer run and outside
step share the cached items and the choice of pipeline.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from quantobs.calibration import offload
from quantobs.calibration.experts import uncounted
from quantobs.calibration.freeze import give_back_freed_memory
from quantobs.calibration.running import move, progress_bar, run_batch
from quantobs.calibration.segment import Segment
from quantobs.calibration.tokens import TokenMask, current_mask, using_mask
from quantobs.core.quantize import fake_quantize
from quantobs.observers.needs import Need

if TYPE_CHECKING:
    from quantobs.calibration.attach import Entry
    from quantobs.calibration.lifecycle import Calibration

__all__ = [
    "activation_bytes",
    "check_propagate",
    "choose",
    "decoder_layers",
    "fits",
    "free_memory",
    "is_offloaded",
    "observe_layers",
]

_PIPELINES = ("auto", "model", "layer")
_PROPAGATE = ("unquantized", "quantized")
_CPU = torch.device("cpu")


# ------------------------------------------------------------- discovery


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def decoder_layers(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]] | None:
    """`(name, layers)` of the model's decoder layers, or None.

    The largest `ModuleList` whose modules are all of the model's
    `_no_split_modules` classes (transformers' unit of device placement,
    llm-compressor's sequential targets); for a model that names none, the
    largest `ModuleList` of modules of one class holding parameters.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    best: tuple[str, list[torch.nn.Module]] | None = None
    size = -1
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or not len(module):
            continue
        kinds = {type(m).__name__ for m in module}
        ok = kinds <= names if names else len(kinds) == 1
        numel = _numel(module)
        if ok and numel > size:
            best, size = (name, list(module)), numel
    return best if size > 0 else None


def is_offloaded(model: torch.nn.Module) -> bool:
    """Whether accelerate offloads the model (a module with an `_hf_hook`,
    or a weight on the meta device)."""
    return any(hasattr(m, "_hf_hook") for m in model.modules()) or any(
        p.device.type == "meta" for p in model.parameters()
    )


#: How many times a batch's widest output `activation_bytes` counts (the
#: output, the input it is computed from, one temporary).
_ACTIVATION_COPIES = 3
#: The bytes of a float32 element: transformers computes the logits in it.
_FLOAT32 = 4


def fits(parameter_bytes: int, activation_bytes: int, free_bytes: int | None) -> bool:
    """Whether a whole-model pass fits its device: the parameters plus the
    activations of one batch within `free_bytes` (None: unknown, taken to
    fit)."""
    if free_bytes is None:
        return True
    return parameter_bytes + activation_bytes <= free_bytes


def _meminfo_available() -> int | None:
    """Linux's `MemAvailable` in bytes, or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_memory(device: torch.device) -> int | None:
    """The free memory of `device` in bytes: CUDA's `mem_get_info`, the
    CPU's available RAM (psutil where installed, else `/proc/meminfo`);
    None where it cannot be measured (other devices, other systems)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        import psutil  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return _meminfo_available()
    return int(psutil.virtual_memory().available)


def _tokens(batch: Any) -> int:
    """The token positions of one batch (`(B, S)` of its ids), 0 where it
    cannot tell."""
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids", batch.get("inputs_embeds"))
    elif isinstance(batch, list | tuple):
        batch = next((b for b in batch if isinstance(b, torch.Tensor)), None)
    if not isinstance(batch, torch.Tensor) or batch.ndim == 0:
        return 0
    return int(batch.shape[0] * batch.shape[1]) if batch.ndim >= 2 else batch.numel()


def activation_bytes(model: torch.nn.Module, batch: Any) -> int:
    """An estimate of a whole-model pass's activations for `batch`: its
    widest output (the largest `out_features` / `embedding_dim` / vocabulary:
    a causal LM's logits) per token in float32, `_ACTIVATION_COPIES` times.
    A decoder layer at a time, the modules after the layers (a head the
    recipe ignores) do not run at all."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    widths = [vocab] if isinstance(vocab, int) else []
    for module in model.modules():
        for name in ("out_features", "embedding_dim"):
            value = getattr(module, name, None)
            if isinstance(value, int):
                widths.append(value)
    return _tokens(batch) * max(widths, default=0) * _FLOAT32 * _ACTIVATION_COPIES


def _bytes(tensors: Iterable[torch.Tensor], device: torch.device | None) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in tensors
        if device is None or t.device == device
    )


def choose(
    model: torch.nn.Module,
    pipeline: str,
    needs_data: bool,
    *,
    batch: Any = None,
    device_memory: int | None = None,
) -> str:
    """`"model"` or `"layer"`: how `calibrate(..., pipeline=...)` runs.

    `"auto"` is `"layer"` for a model with decoder layers that does not fit
    its device, else `"model"`. A model does not fit when accelerate
    offloads it, or when its parameters (and buffers) plus the activations
    of its first batch (`activation_bytes`) exceed the memory it may take on its device
    (`fits`): `device_memory` where given, else the device's free memory
    (`free_memory`: CUDA's `mem_get_info`, the CPU's available RAM) plus the
    bytes its tensors already take there (which the free memory counts as
    used). Unmeasurable memory is taken to fit. Without observers that need
    data no batch runs: `"model"`.

    Raises:
        ValueError: an unknown pipeline, or `"layer"` for a model with no
            decoder layers.
    """
    if pipeline not in _PIPELINES:
        raise ValueError(f"pipeline must be one of {_PIPELINES}, got {pipeline!r}")
    if not needs_data or pipeline == "model":
        return "model"
    layers = decoder_layers(model)
    if pipeline == "layer" and layers is None:
        raise ValueError(
            f"pipeline='layer' needs decoder layers (a ModuleList of the "
            f"model's _no_split_modules), and {type(model).__name__} has none; "
            "use pipeline='model'"
        )
    if pipeline == "layer":
        return "layer"
    if layers is None:
        return "model"
    if is_offloaded(model):
        return "layer"
    device = offload.first_device(model)
    tensors = [*model.parameters(), *model.buffers()]
    budget = device_memory
    if budget is None:
        free = free_memory(device)
        budget = None if free is None else free + _bytes(tensors, device)
    needed = _bytes(tensors, None)
    return "model" if fits(needed, activation_bytes(model, batch), budget) else "layer"


def check_propagate(propagate: str, entries: Iterable[Entry] = ()) -> None:
    """Raise ValueError for an unknown `propagate`, or for
    `propagate="quantized"` with a weight accelerate offloads (its
    fake-quantized values could not reach the forward), before any work."""
    if propagate not in _PROPAGATE:
        raise ValueError(f"propagate must be one of {_PROPAGATE}, got {propagate!r}")
    if propagate != "quantized":
        return
    for entry in entries:
        if entry.base_name == "weight" and offload.is_offloaded(entry.module):
            raise ValueError(
                f"propagate='quantized' needs the weights in memory; {entry.key} "
                "is offloaded (use propagate='unquantized')"
            )


# ------------------------------------------------------------- the cache


class _Captured(Exception):
    """Stops the model at the first decoder layer (its inputs are caught)."""


def _is_cache(value: Any) -> bool:
    """A transformers kv cache (duck-typed: no transformers import)."""
    return callable(getattr(value, "update", None)) and callable(
        getattr(value, "get_seq_length", None)
    )


def _without_cache(value: Any) -> Any:
    return None if _is_cache(value) else value


@dataclass
class _Item:
    """One batch at the layer boundaries.

    Attributes:
        batch: the batch as given (the replay outside the layers runs it).
        records: each layer's `(args, kwargs)` as the model called it, but
            for the hidden states (`hidden`); dropped once the layer ran.
        mask: the batch's real tokens (`tokens.TokenMask`).
        device: where the layers take their inputs.
        offloaded: whether the tensors are kept on the CPU meanwhile.
        hidden: the next layer's hidden states.
        output: the last layer's outputs, as it returned them.
    """

    batch: Any
    records: list[tuple[tuple[Any, ...], dict[str, Any]] | None]
    mask: TokenMask | None
    device: torch.device
    offloaded: bool
    hidden: Any = None
    output: Any = None

    def inputs(self, index: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Layer `index`'s arguments, with the current hidden states."""
        record = self.records[index]
        if record is None:  # pragma: no cover - each layer runs in order
            raise RuntimeError(f"layer {index}'s inputs were dropped")
        args, kwargs = record
        if args:
            args = (self.hidden, *args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": self.hidden}
        if not self.offloaded:
            return args, kwargs
        return move(args, self.device), move(kwargs, self.device)

    def keep(self, value: Any, memo: dict[int, Any] | None = None) -> Any:
        """`value` as kept: on the CPU when offloaded (tensors the model
        passes to every layer, e.g. masks, moved once through `memo`)."""
        if not self.offloaded:
            return value
        return _moved(value, _CPU, {} if memo is None else memo)

    def advance(self, index: int, output: Any) -> None:
        """Layer `index`'s `output` becomes the next layer's hidden states."""
        self.records[index] = None
        hidden = output[0] if isinstance(output, tuple) else output
        memo: dict[int, Any] = {}  # the hidden states are moved once
        self.hidden = self.keep(hidden, memo)
        self.output = self.keep(output, memo)


def _moved(value: Any, device: torch.device, memo: dict[int, Any]) -> Any:
    """`move` sharing the copies of tensors met before (by identity)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.to(device)
        return memo[id(value)]
    if isinstance(value, Mapping):
        return {k: _moved(v, device, memo) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_moved(v, device, memo) for v in value)
    return value


def _hidden_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


@contextmanager
def _replaced(
    layers: list[torch.nn.Module], forward: Callable[[int], Callable[..., Any]]
) -> Iterator[None]:
    """While inside, layer `i` runs `forward(i)` instead of its own forward
    (nor accelerate's, which wraps it: nothing is onloaded)."""
    saved = [layer.__dict__.get("forward") for layer in layers]
    for index, layer in enumerate(layers):
        layer.forward = forward(index)
    try:
        yield
    finally:
        for layer, own in zip(layers, saved, strict=True):
            if own is None:
                del layer.forward
            else:
                layer.forward = own


def _capture(
    model: torch.nn.Module, layers: list[torch.nn.Module], batch: Any, offloaded: bool
) -> _Item:
    """Run `batch` with every decoder layer replaced by one that records its
    arguments and passes its hidden states on; stop at the last layer (so
    the modules after the layers do not run)."""
    records: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * len(layers)
    masks: list[TokenMask | None] = []

    def recorder(index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            records[index] = (
                tuple(_without_cache(a) for a in args),
                {k: _without_cache(v) for k, v in kwargs.items()},
            )
            masks.append(current_mask())
            if index == len(layers) - 1:
                raise _Captured
            return _hidden_of(args, kwargs)

        return forward

    with _replaced(layers, recorder), suppress(_Captured):
        run_batch(model, batch)
    if any(r is None for r in records):
        raise RuntimeError(
            f"the model ran without calling each of its decoder layers "
            f"({type(layers[0]).__name__}) once; use pipeline='model'"
        )
    hidden = _hidden_of(*(records[0] or ((), {})))
    device = hidden.device if isinstance(hidden, torch.Tensor) else _CPU
    item = _Item(batch, [], masks[0], device, offloaded)
    memo: dict[int, Any] = {}
    item.records = [item.keep(r, memo) for r in records]
    item.hidden = item.keep(hidden, memo)
    return item


# ------------------------------------------------------- quantized outputs


@contextmanager
def _fake_quantized(entries: Iterable[Entry]) -> Iterator[None]:
    """While inside, the entries' weights hold their fake-quantized values
    under the qparams written on their modules (restored after)."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for entry in entries:  # in memory (`check_propagate`)
            weight = entry.weight
            module = entry.module
            scale = module.get_parameter("weight_scale")
            quantized = fake_quantize(
                weight,
                scale,
                getattr(module, "weight_zero_point", None),
                entry.args,
                g_idx=getattr(module, "weight_g_idx", None),
                global_scale=getattr(module, "weight_global_scale", None),
            )
            saved.append((weight, weight.detach().clone()))
            weight.data.copy_(quantized)
        yield
    finally:
        for weight, original in saved:
            weight.data.copy_(original)


@contextmanager
def _gathering_paused(entries: Iterable[Entry]) -> Iterator[None]:
    """The engines observers fill from their own hooks (`Need.INPUT_IMPORTANCE`)
    as they were on entry, whatever runs inside."""
    engines = [
        engine
        for e in entries
        if Need.INPUT_IMPORTANCE in e.observer.needs
        for engine in e.observer.gathered()
    ]
    states = [{k: v.clone() for k, v in e.state_dict().items()} for e in engines]
    try:
        yield
    finally:
        for engine, state in zip(engines, states, strict=True):
            engine.load_state_dict(state)


# ------------------------------------------------------------- the pipeline


def _inside(entries: Iterable[Entry], prefix: str) -> list[Entry]:
    return [e for e in entries if e.name == prefix or e.name.startswith(prefix + ".")]


def _run_layer(layer: torch.nn.Module, index: int, item: _Item) -> Any:
    args, kwargs = item.inputs(index)
    with using_mask(item.mask):
        return layer(*args, **kwargs)


def observe_layers(
    calibration: Calibration,
    batches: Iterable[Any],
    *,
    progress: bool | None = None,
    propagate: str = "unquantized",
) -> int:
    """Observe the model's batches one decoder layer at a time (the module's
    steps 1-3); the layers' weight qparams are written. Returns the batches.

    Raises:
        ValueError: a model with no decoder layers, or `"quantized"`
            propagation through offloaded weights.
    """
    model = calibration.model
    found = decoder_layers(model)
    if found is None:  # pragma: no cover - `choose` refused it
        raise ValueError("the model has no decoder layers")
    prefix, layers = found
    entries = calibration.attachment.entries
    offloaded = is_offloaded(model)
    # 1. capture the first layer's inputs (no observer outside sees them yet)
    items: list[_Item] = []
    with calibration.only([]):
        for batch in batches:
            items.append(_capture(model, layers, batch, offloaded))
    indices = list(range(len(items)))
    first = 0 if items else None
    # 2. each layer
    per_layer = [
        _inside(entries, f"{prefix}.{i}" if prefix else str(i))
        for i in range(len(layers))
    ]
    steps = progress_bar(list(enumerate(layers)), progress, "calibrating layers")
    for index, layer in steps:
        mine = per_layer[index]
        outputs: dict[int, Any] = {}

        def run(
            i: int,
            layer: torch.nn.Module = layer,
            index: int = index,
            out: dict[int, Any] = outputs,
        ) -> None:  # each output kept (on the CPU when offloaded) as it comes
            out[i] = items[i].keep(_run_layer(layer, index, items[i]))

        calibration.observe_segment(Segment(mine, run, indices, first))
        calibration.freeze_weights(calibration.segment_groups(mine))
        if propagate == "quantized":
            weights = [e for e in mine if e.base_name == "weight"]
            with ExitStack() as stack:
                stack.enter_context(calibration.only([]))
                stack.enter_context(uncounted())
                stack.enter_context(_gathering_paused(mine))
                stack.enter_context(_fake_quantized(weights))
                for i in indices:
                    run(i)
        for i in indices:
            items[i].advance(index, outputs.pop(i))
        if offloaded:  # the layer's onloaded weights and temporaries, freed
            give_back_freed_memory()
    # 3. outside the layers
    inside = {id(e) for mine in per_layer for e in mine}
    outside = [e for e in entries if id(e) not in inside]
    _observe_outside(calibration, outside, layers, items)
    return len(items)


def _observe_outside(
    calibration: Calibration,
    outside: list[Entry],
    layers: list[torch.nn.Module],
    items: list[_Item],
) -> None:
    """Observe the entries outside the decoder layers: the whole model runs
    each batch with every layer replaced by the last layer's outputs."""
    fed = [
        e
        for e in outside
        if e.base_name != "weight" or Need.INPUT_IMPORTANCE in e.observer.needs
    ]

    def replay(i: int) -> None:
        item = items[i]
        output = move(item.output, item.device) if item.offloaded else item.output
        replaced = _replaced(layers, lambda _: lambda *a, **k: output)
        with replaced, calibration.only(outside):
            run_batch(calibration.model, item.batch)

    indices = list(range(len(items))) if fed else []
    first = 0 if indices else None
    calibration.observe_segment(Segment(outside, replay, indices, first))
