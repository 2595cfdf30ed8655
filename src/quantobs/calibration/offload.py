"""Models loaded with accelerate's offloading: read and write the tensors of
modules whose weights live on the CPU or on disk.

A model loaded with a `device_map` that sends modules to `"cpu"` (on a
machine with an accelerator) or `"disk"` keeps those modules' parameters on
the meta device; accelerate's `AlignDevicesHook` (`module._hf_hook`, with
`offload=True`) holds their values in its `weights_map` and loads them for
each forward pass. Calibration never loads the whole model: it reads one
tensor at a time (`read_tensor`, what `Entry.weight` observes), or one
module's tensors while a block runs (`onloaded`), and writes new parameters
(qparams, compressed weights) where the module's weights live
(`write_parameter`): into the hook's `weights_map` for an offloaded module
(the loader's CPU state dict, or a safetensors file under the offload
folder's `quantobs/` directory for weights on disk), the module keeping a
meta placeholder; beside its weights otherwise. accelerate's own hooks then
load them with the weights at the next forward pass, and transformers'
`save_pretrained` finds them where it finds the weights. `remove_parameter`
drops a tensor from the module and from the weights map (the export frees
each original weight of a CPU-offloaded module as its compressed tensors
replace it).

A module whose tensor is a part of another module's offloaded tensor (a
per-expert Linear of fused MoE experts) holds a `Slice` of it and an
offload hook of its own over the same weights loader (`offload_slices`):
its new tensors go where the whole one lives, `onloaded_together` reads
each whole tensor once for all its parts (views of it while the block
runs), and `own_slices` writes the parts as the modules' own tensors and
drops the whole ones (the export).

**The files under `offload_folder/quantobs/`** belong to the weights loader
that reads them (`_Written`), counted across its deep copies (a copy of an
offloaded model reads the model's files until it writes its own): a file is
removed once no loader reads it any more, when the tensor is written again
or removed, when `release_written(model)` is called (the in-place export and
`quantobs calibrate` call it at their end: the checkpoint holds the values),
or when the loader is garbage-collected (at the latest when the interpreter
exits). The loader's own files (accelerate's `.dat` files, the source
checkpoint's safetensors) are never touched.

Nothing here needs accelerate installed: without it no module is offloaded.

(Over 500 lines: reading, writing and releasing the tensors of accelerate's
weights maps (and the files they own) are one protocol over the same
loaders.)
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Slice",
    "first_device",
    "held_tensors",
    "hooks_unwrapped",
    "is_offloaded",
    "offload_slices",
    "onloaded",
    "onloaded_together",
    "own_slices",
    "read_tensor",
    "release_written",
    "remove_parameter",
    "write_parameter",
]

#: The directory under accelerate's offload folder that holds the tensors
#: written to modules offloaded to disk.
WRITTEN_DIR = "quantobs"


def _align_hook(module: torch.nn.Module) -> Any:
    """accelerate's `AlignDevicesHook` of `module` (also inside a
    `SequentialHook`), or None."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return None
    try:
        from accelerate.hooks import AlignDevicesHook
    except ImportError:  # pragma: no cover - accelerate put the hook there
        return None
    hooks = getattr(hook, "hooks", (hook,))
    return next((h for h in hooks if isinstance(h, AlignDevicesHook)), None)


def _offload_hook(module: torch.nn.Module) -> Any:
    """The hook holding `module`'s offloaded tensors, or None."""
    hook = _align_hook(module)
    if hook is None or not hook.offload or hook.weights_map is None:
        return None
    return hook


def is_offloaded(module: torch.nn.Module) -> bool:
    """Whether accelerate keeps `module`'s own tensors off its execution
    device (on the CPU or disk; meta placeholders in the module)."""
    return _offload_hook(module) is not None


def _device(value: Any) -> torch.device:
    """accelerate's execution device (an int is a CUDA index) as a device."""
    if isinstance(value, int):
        return torch.device("cuda", value)
    return torch.device(value)


def first_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter that holds data (offloaded
    ones are on the meta device), CPU where none does: where the inputs of
    a forward pass go."""
    return next(
        (p.device for p in model.parameters() if not p.is_meta), torch.device("cpu")
    )


def _home_device(module: torch.nn.Module, tensor: torch.Tensor) -> torch.device:
    """Where a new `tensor` of a module that is not offloaded goes: beside
    its own tensors, else on its hook's execution device, else where it is."""
    own = [*module._parameters.values(), *module._buffers.values()]
    found = next((t.device for t in own if t is not None and not t.is_meta), None)
    if found is not None:
        return found
    hook = _align_hook(module)
    if hook is not None and hook.execution_device is not None:
        return _device(hook.execution_device)
    return tensor.device


def _own_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    found: torch.Tensor | None = module._parameters.get(name)
    if found is None:
        found = module._buffers.get(name)
    if found is None:
        raise AttributeError(f"{type(module).__name__} has no tensor {name!r}")
    return found


def _load(hook: Any, name: str, like: torch.Tensor) -> torch.Tensor:
    """`name` of `hook`'s weights map on its execution device, in `like`'s
    dtype where floating."""
    value = hook.weights_map[name]
    dtype = like.dtype if value.is_floating_point() else value.dtype
    return value.to(device=_device(hook.execution_device), dtype=dtype)


def read_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The value of `module`'s own parameter or buffer `name`: the tensor
    itself, or for an offloaded module (meta placeholder) its value loaded
    from the offload hook's `weights_map` onto the execution device (a new
    tensor the caller holds alone: nothing stays loaded). A `Slice` of
    another offloaded tensor (an expert of fused MoE experts) reads that
    tensor whole: read several with `onloaded_together`.

    Raises:
        AttributeError: no such tensor.
        RuntimeError: a meta tensor no offload hook holds the value of.
    """
    tensor = _own_tensor(module, name)
    if not tensor.is_meta:
        return tensor
    hook = _offload_hook(module)
    if hook is None:
        raise RuntimeError(
            f"{type(module).__name__}.{name} is on the meta device and no "
            "accelerate offload hook holds its value; load the model with "
            "transformers' device_map / offload_folder"
        )
    part = _slices(module).get(name)
    if part is not None:
        return _load(part.hook, part.name, tensor)[part.index].clone()
    return _load(hook, name, tensor)


@dataclass(frozen=True)
class Slice:
    """A module's tensor that is a part of another module's offloaded
    tensor (an expert's weight in fused MoE experts): `hook`'s weights map
    holds the whole `name`, the tensor is `whole[index]`."""

    hook: Any
    name: str
    index: tuple[int | slice, ...]

    @property
    def key(self) -> str:
        """The whole tensor's key in its weights loader."""
        prefix, _ = _dataset(self.hook.weights_map)
        return prefix + self.name


#: Attribute of a module holding its `{tensor name: Slice}`.
_SLICES_ATTR = "_quantobs_slices"


def _slices(module: torch.nn.Module) -> dict[str, Slice]:
    found = module.__dict__.get(_SLICES_ATTR)
    return found if isinstance(found, dict) else {}


def offload_slices(
    module: torch.nn.Module,
    source: torch.nn.Module,
    prefix: str,
    slices: Mapping[str, tuple[str, tuple[int | slice, ...]]],
) -> None:
    """Make `module`, whose tensors `slices` names are parts of offloaded
    `source`'s tensors (`{name: (source's tensor name, index)}`; meta
    placeholders in `module`), an offloaded module of its own: an accelerate
    `AlignDevicesHook` over `source`'s weights loader, under `source`'s
    prefix plus `prefix` (the module's name under `source`, with its dot),
    so that the tensors written to it go where `source` keeps its weights.
    The hook does not wrap the module's forward: whoever runs the module
    onloads its tensors (`onloaded_together`). Nothing for a `source` in
    memory."""
    hook = _offload_hook(source)
    if hook is None:
        return
    from accelerate.hooks import AlignDevicesHook
    from accelerate.utils import PrefixedDataset

    base, store = _dataset(hook.weights_map)
    own = AlignDevicesHook(
        execution_device=hook.execution_device,
        offload=True,
        weights_map=PrefixedDataset(store, base + prefix),
        offload_buffers=hook.offload_buffers,
        skip_keys=hook.skip_keys,
        tied_params_map=hook.tied_params_map,
    )
    module.__dict__["_hf_hook"] = own
    module.__dict__[_SLICES_ATTR] = {
        name: Slice(hook, whole, tuple(index))
        for name, (whole, index) in slices.items()
    }


def own_slices(modules: Iterable[torch.nn.Module]) -> None:
    """Write each module's `Slice`s as its own tensors, where it keeps its
    weights (`write_parameter`; the whole tensors read once, and in a
    loader's CPU state dict each part a view of its whole), then remove
    the whole tensors from their weights loaders (a model's or copy's own:
    their CPU copy freed with the last part that views it)."""
    modules = [m for m in modules if _slices(m)]
    wholes = {part.key: part for m in modules for part in _slices(m).values()}
    with onloaded_together(modules, slices_only=True):
        for module in modules:
            for name in list(_slices(module)):
                write_parameter(module, name, _own_tensor(module, name))
    for part in wholes.values():
        _forget(_dataset(part.hook.weights_map)[1], part.key)


@contextmanager
def onloaded(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """While the block runs, an offloaded module's own tensors hold their
    values (on its execution device); meta placeholders again after it
    (those the block replaced stay replaced). Other modules as they are."""
    with onloaded_together([module]):
        yield module


@contextmanager
def onloaded_together(
    modules: Iterable[torch.nn.Module], *, slices_only: bool = False
) -> Iterator[None]:
    """`onloaded` for several modules at once: the `Slice`s of one whole
    offloaded tensor (the experts of one fused MoE module) are views of it,
    read once for all of them; with `slices_only`, only those (e.g. the
    experts' weights, not their qparams)."""
    wholes: dict[tuple[int, str], torch.Tensor] = {}
    loaded: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
    try:
        for module in modules:
            if _offload_hook(module) is None:
                continue
            parts = _slices(module)
            stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for store in stores:
                for name, tensor in list(store.items()):
                    if tensor is None or not tensor.is_meta:
                        continue
                    part = parts.get(name)
                    if part is None and slices_only:
                        continue
                    if part is None:
                        value = read_tensor(module, name)
                    else:
                        key = (id(part.hook), part.name)
                        if key not in wholes:
                            wholes[key] = _load(part.hook, part.name, tensor)
                        value = wholes[key][part.index]
                    if isinstance(tensor, torch.nn.Parameter):
                        value = torch.nn.Parameter(value, requires_grad=False)
                    store[name] = value
                    loaded.append((store, name, tensor, value))
        wholes.clear()  # held by their views only
        yield
    finally:
        for store, name, meta, value in loaded:
            if store.get(name) is value:
                store[name] = meta


def _dataset(weights_map: Any) -> tuple[str, Any]:
    """`(prefix, store)` under accelerate's `PrefixedDataset` wrappers."""
    prefix = ""
    while hasattr(weights_map, "prefix") and hasattr(weights_map, "dataset"):
        prefix += weights_map.prefix
        weights_map = weights_map.dataset
    return prefix, weights_map


def _on_disk(loader: Any, module: torch.nn.Module, prefix: str) -> bool:
    """Whether the loader keeps `module`'s weights in files (its index)
    rather than in its CPU state dict (the whole tensors its `Slice`s are
    parts of count as its weights)."""
    keys = [prefix + n for n, t in module._parameters.items() if t is not None]
    keys += [part.key for part in _slices(module).values()]
    in_memory = any(k in loader.state_dict for k in keys)
    return not in_memory and loader.save_folder is not None


def _unlink(path: str) -> None:
    """Remove a file of ours, and its directory once empty."""
    file = Path(path)
    file.unlink(missing_ok=True)
    with suppress(OSError):  # other files left, or removed already
        file.parent.rmdir()


def _drop(counts: dict[str, int], path: str) -> None:
    """One reader fewer for `path`; the file removed with its last."""
    left = counts.get(path, 0) - 1
    if left > 0:
        counts[path] = left
        return
    counts.pop(path, None)
    _unlink(path)


def _release_all(counts: dict[str, int], paths: dict[str, str]) -> None:
    for path in paths.values():
        _drop(counts, path)
    paths.clear()


class _Written:
    """The files under `offload_folder/quantobs/` one weights loader reads
    (`{key: path}`), with the number of loaders reading each file (`counts`,
    shared by a loader and its deep copies: a deep copy reads the files its
    original does). A file is removed once no loader reads it: replaced,
    removed, released, or its loaders garbage-collected."""

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts: dict[str, int] = {} if counts is None else counts
        self.paths: dict[str, str] = {}
        # at the loader's end (or the interpreter's): its files go
        weakref.finalize(self, _release_all, self.counts, self.paths)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Written:
        copied = _Written(self.counts)
        copied.paths.update(self.paths)
        for path in self.paths.values():
            self.counts[path] = self.counts.get(path, 0) + 1
        return copied

    def __copy__(self) -> _Written:  # a shallow copy shares the loader's index
        return self

    def put(self, key: str, path: str) -> None:
        """`key` is read from `path` now (a new file of this loader)."""
        old = self.paths.get(key)
        self.paths[key] = path
        self.counts[path] = self.counts.get(path, 0) + 1
        if old is not None:
            _drop(self.counts, old)

    def pop(self, key: str) -> None:
        """`key` is no longer read from a file of ours."""
        old = self.paths.pop(key, None)
        if old is not None:
            _drop(self.counts, old)

    def release(self) -> list[str]:
        """Let go of every file; returns the keys they held."""
        keys = list(self.paths)
        _release_all(self.counts, self.paths)
        return keys


#: The attribute of accelerate's `OffloadedWeightsLoader` holding its `_Written`.
_WRITTEN_ATTR = "_quantobs_written"


def _written(loader: Any) -> _Written:
    found = loader.__dict__.get(_WRITTEN_ATTR)
    if not isinstance(found, _Written):
        found = _Written()
        loader.__dict__[_WRITTEN_ATTR] = found
    return found


def _is_loader(store: Any) -> bool:
    """accelerate's `OffloadedWeightsLoader` (its CPU state dict and index)."""
    return isinstance(getattr(store, "state_dict", None), dict) and isinstance(
        getattr(store, "index", None), dict
    )


def _offload(
    module: torch.nn.Module, hook: Any, name: str, value: torch.Tensor
) -> None:
    """Put `value` into the hook's `weights_map` under `name`, where the
    module's weights are kept."""
    prefix, store = _dataset(hook.weights_map)
    key = prefix + name
    value = value.detach().to("cpu").contiguous()
    if _is_loader(store):  # OffloadedWeightsLoader
        state, index = store.state_dict, store.index
        if _on_disk(store, module, prefix):
            import safetensors.torch

            folder = Path(store.save_folder) / WRITTEN_DIR
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{key}.{uuid.uuid4().hex[:12]}.safetensors"
            safetensors.torch.save_file({"tensor": value}, str(path))
            state.pop(key, None)
            index[key] = {"safetensors_file": str(path), "weight_name": "tensor"}
            _written(store).put(key, str(path))  # the file it replaces: let go
        else:
            state[key] = value
        keys = getattr(store, "all_keys", None)
        if isinstance(keys, list) and key not in keys:
            keys.append(key)
        return
    if isinstance(store, MutableMapping):  # a plain state dict
        store[key] = value
        return
    raise TypeError(
        f"cannot write {key!r}: the offload hook's weights map "
        f"({type(store).__name__}) is read-only"
    )


def write_parameter(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register `tensor` as `module`'s frozen parameter `name` (replacing any
    attribute of that name), where the module's weights live: in the offload
    hook's `weights_map` for an offloaded module (the module holds a meta
    placeholder), beside its own tensors otherwise (a copy only where the
    device differs, or where `tensor` views a larger storage)."""
    hook = _offload_hook(module)
    device = _home_device(module, tensor) if hook is None else torch.device("meta")
    if name in module._parameters or name in module._buffers or hasattr(module, name):
        delattr(module, name)
    value = tensor.detach()
    if hook is not None:
        _offload(module, hook, name, value)
        _slices(module).pop(name, None)  # its own value now
        value = torch.empty_like(value, device="meta")
    else:
        value = value.to(device)
        if value.untyped_storage().nbytes() != value.nbytes or not (
            value.is_contiguous()
        ):
            value = value.clone(memory_format=torch.contiguous_format)
    module.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def _forget(store: Any, key: str) -> None:
    """Remove `key` from a weights map (its value freed where nothing else
    holds it; a file of ours removed once no copy reads it)."""
    if _is_loader(store):
        store.state_dict.pop(key, None)
        if store.index.pop(key, None) is not None:
            _written(store).pop(key)
        keys = getattr(store, "all_keys", None)
        if isinstance(keys, list) and key in keys:
            keys.remove(key)
    elif isinstance(store, MutableMapping):
        store.pop(key, None)


def remove_parameter(module: torch.nn.Module, name: str) -> None:
    """Remove `module`'s own tensor `name`, and for an offloaded module its
    value from the offload hook's `weights_map` too (the loader's CPU state
    dict frees it; a file of ours is removed once no copy of the model reads
    it). Deep copies of the model have weights maps of their own.

    Raises:
        AttributeError: no such tensor.
    """
    if name not in module._parameters and name not in module._buffers:
        raise AttributeError(f"{type(module).__name__} has no tensor {name!r}")
    hook = _offload_hook(module)
    delattr(module, name)
    if hook is not None:
        _slices(module).pop(name, None)
        prefix, store = _dataset(hook.weights_map)
        _forget(store, prefix + name)


def _loaders(model: torch.nn.Module) -> list[Any]:
    """The distinct weights loaders of `model`'s offload hooks."""
    found: dict[int, Any] = {}
    for module in model.modules():
        hook = _offload_hook(module)
        if hook is not None:
            store = _dataset(hook.weights_map)[1]
            found.setdefault(id(store), store)
    return list(found.values())


def held_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The values `model`'s offload hooks keep in memory (the loader's CPU
    state dict, `cpu_offload`'s dict): what a copy sharing the model's
    tensors must not copy."""
    found: list[torch.Tensor] = []
    for store in _loaders(model):
        values = store.state_dict if _is_loader(store) else store
        if isinstance(values, MutableMapping):
            found.extend(v for v in values.values() if isinstance(v, torch.Tensor))
    return found


def release_written(model: torch.nn.Module) -> int:
    """Let go of the files `model`'s offloaded modules read from
    `offload_folder/quantobs/` (written by calibration and the export): each
    is removed once no copy of the model reads it, and their tensors leave
    the weights map (the modules keep meta placeholders with no value: call
    it when the model is done with, e.g. after its checkpoint is written).
    Returns the number of tensors let go (0 for a model in memory)."""
    released = 0
    for store in _loaders(model):
        written = store.__dict__.get(_WRITTEN_ATTR)
        if not isinstance(written, _Written):
            continue
        for key in written.release():
            store.index.pop(key, None)
            keys = getattr(store, "all_keys", None)
            if isinstance(keys, list) and key in keys:
                keys.remove(key)
            released += 1
    return released


@contextmanager
def hooks_unwrapped(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """While the block runs, the modules accelerate hooked have their own
    `forward` back (compressed-tensors wraps a module's bound `forward`);
    after it, accelerate's hooks wrap whatever `forward` the block left (a
    quantized forward runs with its weights loaded)."""
    wrapped = [
        (module, module.__dict__["forward"])
        for module in model.modules()
        if "_old_forward" in module.__dict__ and "forward" in module.__dict__
    ]
    for module, _ in wrapped:
        module.__dict__["forward"] = module.__dict__["_old_forward"]
    try:
        yield model
    finally:
        for module, hooked in wrapped:
            module.__dict__["_old_forward"] = module.__dict__["forward"]
            module.__dict__["forward"] = hooked
