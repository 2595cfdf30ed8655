"""Freeze and compress a calibrated model for its checkpoint, module by module.

`freeze(model, qparams, formats)` turns the calibrated model itself (or a
copy) into what compressed-tensors' `ModelCompressor.compress_model` leaves:
its observers and hooks are removed (`detach`), compressed-tensors quantizes
it with the calibrated qparams (`simulate.quantize_in_place`), and each
quantized module's own tensors are replaced by compressed-tensors'
compressed ones (`weight_packed`, `weight_scale`, ...; its compressors'
`compress` on the module's state dict, as `compress_module` does). An
offloaded module is loaded for its own compression only and its compressed
tensors are written back where it keeps its weights (`offload`), so that no
more than one module's weights are ever loaded; each module's original
weight is freed as its compressed tensors replace it (in memory, and in the
loader's CPU state dict of a CPU-offloaded module; a copy's weights map is
its own, so `copy=True` leaves the model's), and its pages of the checkpoint
transformers mapped are given back (`quantobs.calibration.pages`).

The model is then a compressed-tensors model in the `compressed` state: it
saves (transformers' `save_pretrained`) but no longer calibrates or runs
(reload the checkpoint to run it). Needs compressed-tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from quantobs.calibration.attach import Attachment, attachment_of, detach
from quantobs.calibration.experts import keep_linear
from quantobs.calibration.offload import onloaded, remove_parameter, write_parameter
from quantobs.calibration.pages import FilePages
from quantobs.calibration.simulate import quantize_in_place

__all__ = ["compress_modules", "freed_after_each", "freeze", "give_back_freed_memory"]

_DENSE = "dense"


def freeze(
    model: torch.nn.Module,
    qparams: Mapping[str, Mapping[str, torch.Tensor]],
    formats: Mapping[str, str],
    attachment: Attachment | None = None,
) -> Any:
    """Quantize and compress the calibrated `model` in place.

    Args:
        model: the model, its observers still attached (they are removed),
            or a copy of it without them (`attachment` then given).
        qparams: `simulate.calibrated_qparams` of its attachment.
        formats: `{config group: compressed-tensors format}`.
        attachment: the attachment, for a copy that has none.

    Returns:
        compressed-tensors' `ModelCompressor` of the model, its config in
        the compressed state (`update_config` writes it to `config.json`).
    """
    from compressed_tensors import ModelCompressor

    if attachment is None:
        attachment = attachment_of(model)
        keep_linear(model)  # fused experts stay per-expert Linears
        detach(model)
    quantize_in_place(model, attachment, qparams, formats)
    compressor = ModelCompressor.from_pretrained_model(model)
    compress_modules(model)
    config = compressor.quantization_config
    if config is not None:
        from compressed_tensors.quantization import QuantizationStatus

        config.quantization_status = QuantizationStatus.COMPRESSED
    return compressor


def compress_modules(model: torch.nn.Module) -> None:
    """Replace each quantized module's own tensors by compressed-tensors'
    compressed ones, one module at a time (an offloaded one loaded for its
    own compression only, its compressed tensors written where it keeps its
    weights). The tensors of a module are registered anew in the order its
    compressor returns them, wherever the module lives, so that the model's
    `state_dict` order (and the checkpoint's sharding) do not depend on
    offloading."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils.helpers import is_module_quantized

    pages = FilePages(model)
    for module in model.modules():
        if not is_module_quantized(module):
            continue
        scheme: Any = module.quantization_scheme
        scheme.format = CompressionFormat(
            scheme.format or infer_module_format(type(module), scheme)
        )
        module.quantization_status = QuantizationStatus.COMPRESSED
        if scheme.format.value == _DENSE:  # its compressor changes nothing
            continue
        compressor = BaseCompressor.get_value_from_registry(scheme.format.value)
        with onloaded(module):
            state = _own_state(module)
            compressed = compressor.compress(dict(state), scheme)
        _replace(module, compressed)
        del state, compressed
        pages.release()  # the original weights' pages of a mapped checkpoint
        give_back_freed_memory()


@functools.cache
def _malloc_trim() -> Any:
    """glibc's `malloc_trim`, or None (another C library, another OS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc's `malloc_trim`; nothing
    elsewhere). After a module's compression, or a layer's calibration
    (`quantobs.calibration.sequential`, offloaded models), which free
    several times a weight's size in temporaries:
    without it the allocator keeps each module's temporaries (several times
    its weight) in fragments, and the export's resident memory grows by
    about half the model (measured: 1.6-2x the model's size instead of 1.05x
    for a 156M-parameter Llama, benchmarks/bench_scale.py)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _own_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers (compressed-tensors'
    `get_direct_state_dict`)."""
    found = {
        name: tensor.data
        for name, tensor in (*module._parameters.items(), *module._buffers.items())
        if tensor is not None
    }
    return found


def _replace(module: torch.nn.Module, compressed: Mapping[str, torch.Tensor]) -> None:
    """The module's own tensors become `compressed` (frozen parameters,
    where it keeps its weights), in `compressed`'s order; those it no longer
    has leave the module and, offloaded, its weights map (the loader's CPU
    copy of the original weight freed)."""
    old = [n for n in [*module._parameters, *module._buffers] if n not in compressed]
    for name, value in compressed.items():  # placed beside the old ones
        write_parameter(module, name, value)
    for name in old:
        remove_parameter(module, name)


@contextmanager
def freed_after_each(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """While the block runs, `give_back_freed_memory` after each forward
    pass of each of `modules` (a whole-model calibration's decoder layers).
    glibc serves the activations of a pass from its heap once their size
    has raised its mmap threshold, and keeps what they free in fragments:
    measured (FP8 static inputs, the 156M-parameter Llama of
    `benchmarks/bench_scale.py --size mid`), calibration's anonymous memory
    peaked at 0.84x the model's size, 0.57x trimmed after each batch, 0.26x
    after each layer, for 0.24x live (glibc's mmap threshold fixed)."""
    handles = [
        module.register_forward_hook(lambda *_: give_back_freed_memory())
        for module in modules
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
