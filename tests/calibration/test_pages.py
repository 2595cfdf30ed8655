"""The in-place export gives the kernel back the file pages of the weights it
freed (`quantobs.calibration.pages`), and only those: pages a live tensor
still uses stay, anonymous memory is never touched.

Residency is read from `/proc/self/pagemap` (bit 63: the page is present in
this process's page tables), so the tests run on Linux only.
"""

from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path

import pytest
import torch

from quantobs.calibration import Recipe, attach, calibrate, save_compressed
from quantobs.calibration.pages import FilePages, file_mappings
from tests.calibration.conftest import SENTENCES
from tests.decoders import save_decoder

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap"
)
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

_PAGE = mmap.PAGESIZE


def _inner_pages(tensor: torch.Tensor) -> range:
    """The addresses of the pages wholly inside `tensor`'s storage."""
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    return range(-(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE, _PAGE)


def _present(addresses: range) -> list[bool]:
    """Whether each page is mapped in this process's page tables."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        found = []
        for address in addresses:
            pagemap.seek(address // _PAGE * 8)
            (entry,) = struct.unpack("<Q", pagemap.read(8))
            found.append(bool(entry >> 63))
        return found


def _in_private_file(tensor: torch.Tensor) -> bool:
    address = tensor.untyped_storage().data_ptr()
    return any(m.private_file and m.start <= address < m.end for m in file_mappings())


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_decoder("llama", tmp_path_factory.mktemp("pages") / "llama")


def _batches(source: Path) -> list[dict[str, torch.Tensor]]:
    from quantobs.calibration import text_batches

    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = tokenizer.eos_token
    return text_batches(tokenizer, SENTENCES[:4], batch_size=2, max_length=16)


@pytest.mark.peers
def test_an_in_place_export_frees_the_original_weights_and_their_pages(
    source: Path, tmp_path: Path
) -> None:
    """transformers maps the checkpoint (its weights alias the file); after
    the in-place export every quantized weight's storage is freed and its
    pages are no longer resident, while the tensors the model keeps (the
    embeddings, lm_head, the norms) keep theirs and their values; the
    checkpoint is the one `copy=True` writes, bit for bit."""
    pytest.importorskip("compressed_tensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert _in_private_file(q_proj)  # a view of the mapped file, not a copy
    quantized = {
        name: module.weight
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    }
    refs = {name: StorageWeakRef(w.untyped_storage()) for name, w in quantized.items()}
    pages = {name: _inner_pages(w) for name, w in quantized.items()}
    for weight in quantized.values():
        weight.sum()  # resident now, as calibration leaves them
    assert all(all(_present(p)) for p in pages.values())
    kept = {"lm_head": model.lm_head.weight, "embed": model.model.embed_tokens.weight}
    values = {name: t.clone() for name, t in kept.items()}
    del quantized, q_proj, weight
    attach(model, Recipe.from_scheme("W4A16", ignore=["lm_head"]))
    calibrate(model, _batches(source), progress=False)
    copied = save_compressed(model, tmp_path / "copy", copy=True)
    in_place = save_compressed(model, tmp_path / "in-place")

    assert all(ref.expired() for ref in refs.values())
    assert sum(len(p) for p in pages.values()) > 0
    assert not any(any(_present(p)) for p in pages.values())
    for name, tensor in kept.items():  # still mapped, resident and intact
        assert _in_private_file(tensor) and all(_present(_inner_pages(tensor)))
        assert torch.equal(tensor, values[name])
    for path in copied.glob("*.safetensors"):
        assert path.read_bytes() == (in_place / path.name).read_bytes()


def test_only_freed_file_backed_storages_are_released(tmp_path: Path) -> None:
    """A freed mapped tensor's pages go; a mapped tensor held elsewhere (a
    view), one whose bytes another live storage of the model maps (two
    reads of one file tensor), and freed anonymous memory keep theirs (the
    live ones their values)."""
    from safetensors import safe_open

    shape = (4 * _PAGE // 4,)  # four pages of float32
    path = tmp_path / "tensors.safetensors"
    safetensors_torch.save_file(
        {name: torch.full(shape, float(i)) for i, name in enumerate("abcd")}, path
    )
    module = torch.nn.Module()
    with safe_open(path, "pt") as file:
        for name in "abcd":
            module.register_buffer(name, file.get_tensor(name))
        c_again = file.get_tensor("c")  # another storage over the same bytes
    module.register_buffer("anon", torch.full(shape, 7.0))
    assert all(_in_private_file(getattr(module, name)) for name in "abcd")
    assert not _in_private_file(module.anon)
    view = module.b[1:]  # the user still holds part of `b`
    pages = {name: _inner_pages(getattr(module, name)) for name in "abc"}
    for tensor in module.buffers():
        tensor.sum()  # resident
    release = FilePages(module)  # (module.d keeps the mapping mapped)
    assert release.release() == 0  # nothing freed yet

    for name in ("a", "b", "c", "anon"):
        delattr(module, name)
    module.register_buffer("c_again", c_again)
    del c_again
    given = release.release()

    assert given == len(pages["a"]) * _PAGE  # `a` alone
    assert not any(_present(pages["a"]))
    assert all(_present(pages["b"])) and torch.equal(view, torch.ones(shape[0] - 1))
    assert all(_present(pages["c"]))
    assert torch.equal(module.c_again, torch.full(shape, 2.0))
    assert release.release() == 0  # each storage once


def test_freed_memory_is_given_back_after_each_layer_while_calibrating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole-model pass trims the heap after each decoder layer's forward
    (`freeze.freed_after_each`); the hooks doing it leave with the pass."""
    from quantobs.calibration import freeze
    from quantobs.calibration.sequential import decoder_layers
    from tests.decoders import build_decoder

    model = build_decoder("llama").eval()
    layers = decoder_layers(model)
    assert layers is not None and len(layers[1]) > 1
    calls: list[int] = []
    trim = freeze.give_back_freed_memory
    monkeypatch.setattr(freeze, "give_back_freed_memory", lambda: calls.append(1))
    attach(model, Recipe.from_scheme("FP8", ignore=["lm_head"]))
    batches = [{"input_ids": torch.arange(8)[None] + i} for i in range(3)]
    calibrate(model, batches, progress=False, pipeline="model")
    assert len(calls) == len(layers[1]) * len(batches)
    assert not any(layer._forward_hooks for layer in layers[1])
    monkeypatch.setattr(freeze, "give_back_freed_memory", trim)
    trim()  # the real one runs (glibc's malloc_trim, or nothing)
