"""MoE experts stored fused (transformers 5's 3-D `gate_up_proj` /
`down_proj`) in layers accelerate offloads: they calibrate and export as in
memory, bit for bit, reading each layer's fused tensors once at a time.

Both decoder layers of the tiny MoE models are offloaded, to disk (a real
`device_map` with `offload_folder`) or to the CPU (what accelerate's
`dispatch_model` does for a `"cpu"` entry on a machine with an accelerator:
on a CPU-only machine a `"cpu"` entry is not offloaded, so the hooks are
attached as it would attach them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs.calibration import Recipe, attach, calibrate, detach, save_compressed
from quantobs.calibration.attach import attachment_of
from quantobs.calibration.experts import CalibrationExperts
from quantobs.calibration.offload import WRITTEN_DIR, is_offloaded
from quantobs.calibration.simulate import calibrated_qparams
from tests.calibration.conftest import SENTENCES
from tests.decoders import save_decoder

pytestmark = [
    pytest.mark.peers,
    pytest.mark.filterwarnings("ignore::quantobs.calibration.ExpertsReloadWarning"),
    pytest.mark.filterwarnings("ignore:Attempting to save a model with offloaded"),
]
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("compressed_tensors")

#: both MoE layers offloaded; the rest stays in memory
LAYERS = ["model.layers.0", "model.layers.1"]
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}
#: small enough that the checkpoint takes several shards (with an index)
SHARDS = 150_000
FAMILIES = ("qwen3_moe", "mixtral")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread (faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-sources")
    return {family: save_decoder(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """`(family, scheme) -> (checkpoint, qparams, logits)` of the model
    calibrated in memory (filled on first use)."""
    return {"root": tmp_path_factory.mktemp("moe-references")}


def _batches(source: Path) -> list[dict[str, torch.Tensor]]:
    from quantobs.calibration import text_batches

    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = tokenizer.eos_token
    return text_batches(tokenizer, SENTENCES[:6], batch_size=3, max_length=24)


def _cpu_dispatched(model: torch.nn.Module) -> Any:
    """The decoder layers offloaded to the CPU as `dispatch_model` does on a
    machine with an accelerator (an `OffloadedWeightsLoader`'s CPU state
    dict, meta placeholders, `AlignDevicesHook`s); returns the loader."""
    from accelerate.hooks import attach_align_device_hook_on_blocks
    from accelerate.utils import OffloadedWeightsLoader, extract_submodules_state_dict

    state = extract_submodules_state_dict(model.state_dict(), LAYERS)
    loader = OffloadedWeightsLoader(state_dict=state)
    device_map = dict.fromkeys(DEVICE_MAP, "cpu")
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"": "cpu", **device_map},
        offload={n: n in LAYERS for n in DEVICE_MAP},
        weights_map=loader,
    )
    model.hf_device_map = device_map  # transformers' mark of an offloaded model
    return loader


def _load(source: Path, kind: str | None = None, folder: Path | None = None) -> Any:
    extra: dict[str, Any] = {}
    if kind == "disk":
        extra = {"device_map": DEVICE_MAP, "offload_folder": str(folder)}
    model = transformers.AutoModelForCausalLM.from_pretrained(source, **extra)
    if kind == "cpu":
        _cpu_dispatched(model)
    assert (kind is not None) == is_offloaded(model.model.layers[1].mlp.experts)
    return model.eval()


def _recipe(scheme: str) -> Recipe:
    return Recipe.from_scheme(scheme, ignore=["lm_head"])


def _logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def _files(directory: Path) -> dict[str, str]:
    """`{file name: sha256}` of the checkpoint's weights, index and config."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.suffix in (".safetensors", ".json")
    }


def _reference(
    references: dict[Any, Any], sources: dict[str, Path], family: str, scheme: str
) -> tuple[Path, dict[str, Any], torch.Tensor]:
    key = (family, scheme)
    if key not in references:
        source = sources[family]
        model = _load(source)
        attach(model, _recipe(scheme))
        calibrate(model, _batches(source), progress=False)
        qparams = calibrated_qparams(attachment_of(model))
        logits = _logits(model, _batches(source)[0])
        out = references["root"] / f"{family}-{scheme}"
        save_compressed(model, out, max_shard_size=SHARDS)
        assert (out / "model.safetensors.index.json").is_file()
        references[key] = (out, qparams, logits)
    found: tuple[Path, dict[str, Any], torch.Tensor] = references[key]
    return found


def _expert_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [
        linear
        for module in model.modules()
        if isinstance(module, CalibrationExperts)
        for linear in module.linears()
    ]


_CASES = [
    ("qwen3_moe", "disk", "W4A16"),
    ("qwen3_moe", "cpu", "FP8"),
    ("mixtral", "cpu", "W4A16"),
    ("mixtral", "disk", "FP8"),
    pytest.param("qwen3_moe", "disk", "FP8", marks=pytest.mark.slow),
    pytest.param("mixtral", "cpu", "FP8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "kind", "scheme"), _CASES)
def test_offloaded_experts_calibrate_and_export_the_in_memory_checkpoint(
    family: str,
    kind: str,
    scheme: str,
    sources: dict[str, Path],
    references: dict[Any, Any],
    tmp_path: Path,
) -> None:
    """The offloaded model's qparams and logits are the in-memory model's;
    its checkpoint (copy=True, then in place) is the in-memory one, every
    shard, the index and config.json the same bytes; nothing stays loaded,
    and no file of ours is left."""
    expected, qparams, logits = _reference(references, sources, family, scheme)
    source = sources[family]
    folder = tmp_path / "offload"
    model = _load(source, kind, folder)
    attach(model, _recipe(scheme))
    linears = _expert_linears(model)
    assert len(linears) == 2 * 4 * 3
    assert all(is_offloaded(m) and m.weight.is_meta for m in linears)
    calibrate(model, _batches(source), progress=False)
    found = calibrated_qparams(attachment_of(model))
    assert found.keys() == qparams.keys()
    for module, values in qparams.items():
        assert found[module].keys() == values.keys(), module
        for name, value in values.items():
            assert torch.equal(found[module][name], value), f"{module}.{name}"
    torch.testing.assert_close(
        _logits(model, _batches(source)[0]), logits, rtol=0, atol=0
    )
    # each expert's qparams where the fused weights live, not in the module
    assert all(m.weight.is_meta and m.weight_scale.is_meta for m in linears)
    written = list((folder / WRITTEN_DIR).glob("*.experts.3.*weight_scale*"))
    assert bool(written) == (kind == "disk")

    copied = save_compressed(model, tmp_path / "copy", copy=True, max_shard_size=SHARDS)
    assert attachment_of(model).entries  # the model as it was
    in_place = save_compressed(model, tmp_path / "in-place", max_shard_size=SHARDS)
    assert _files(copied) == _files(expected)
    assert _files(in_place) == _files(expected)
    assert all(m.weight_scale.is_meta for m in linears)  # compressed where they live
    assert not (folder / WRITTEN_DIR).exists()


def test_a_cpu_offloaded_export_frees_the_fused_weights(
    sources: dict[str, Path], references: dict[Any, Any], tmp_path: Path
) -> None:
    """In place, the fused tensors leave the loader's CPU state dict (each
    expert's weight a view of them until compressed), and no expert's
    original weight is left once the export is written."""
    expected, _, _ = _reference(references, sources, "qwen3_moe", "W4A16")
    source = sources["qwen3_moe"]
    model = _load(source)
    loader = _cpu_dispatched(model)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert fused in loader.state_dict
    attach(model, _recipe("W4A16"))
    calibrate(model, _batches(source), progress=False)
    out = save_compressed(model, tmp_path / "out", max_shard_size=SHARDS)
    assert _files(out) == _files(expected)
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in loader.state_dict)
    assert not any(".experts." in k and k.endswith("weight") for k in loader.state_dict)
    packed = "model.layers.1.mlp.experts.3.down_proj.weight_packed"
    assert packed in loader.state_dict


class _Probe:
    """Records each read of a fused experts tensor from accelerate's
    weights loader and, at every read and every module call, the decoder
    layers whose experts hold loaded weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.reads: dict[str, int] = {}
        self.most_layers = 0
        self.calls = 0

    def check(self) -> None:
        layers = {
            name.split(".")[2]
            for name, module in self.model.named_modules()
            if isinstance(module, torch.nn.Linear)
            and ".experts." in name
            and not module.weight.is_meta
        }
        self.most_layers = max(self.most_layers, len(layers))

    def read(self, key: str) -> None:
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            self.reads[key] = self.reads.get(key, 0) + 1
        self.check()

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.calls += 1
        self.check()


@pytest.mark.parametrize("pipeline", ["model", "layer"])
def test_one_layer_of_experts_is_loaded_at_a_time(
    pipeline: str,
    sources: dict[str, Path],
    references: dict[Any, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Disk-offloaded: each layer's fused tensors are read once for its
    weights' observation (not once per expert), once per batch it runs and
    once by the export; never are two layers' experts loaded at once. Layer
    by layer, the checkpoint is the whole-model pass's, bit for bit."""
    from accelerate.utils import OffloadedWeightsLoader

    expected, _, _ = _reference(references, sources, "qwen3_moe", "FP8")
    source = sources["qwen3_moe"]
    model = _load(source, "disk", tmp_path / "offload")
    attach(model, _recipe("FP8"))
    probe = _Probe(model)
    original = OffloadedWeightsLoader.__getitem__

    def getitem(self: Any, key: str) -> Any:
        probe.read(key)
        return original(self, key)

    monkeypatch.setattr(OffloadedWeightsLoader, "__getitem__", getitem)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(probe)
    try:
        batches = _batches(source)
        calibrate(model, batches, progress=False, pipeline=pipeline)
        observed = dict(probe.reads)
        out = save_compressed(model, tmp_path / "out", max_shard_size=SHARDS)
    finally:
        handle.remove()
    assert probe.calls > 50
    assert probe.most_layers == 1
    fused = ("gate_up_proj", "down_proj")
    keys = [f"{layer}.mlp.experts.{n}" for layer in LAYERS for n in fused]
    assert observed == dict.fromkeys(keys, 1 + len(batches))
    assert probe.reads == dict.fromkeys(keys, 2 + len(batches))
    assert _files(out) == _files(expected)


def test_detach_puts_the_offloaded_fused_experts_back(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """Quantized propagation (which needs the weights in memory) is
    refused; detached, the offloaded model has its fused modules (and their
    hooks) back, runs as before, and the experts' qparams leave the offload
    folder."""
    source = sources["mixtral"]
    folder = tmp_path / "offload"
    model = _load(source, "disk", folder)
    batch = _batches(source)[0]
    before = _logits(model, batch)
    fused = model.model.layers[1].mlp.experts
    attach(model, Recipe.from_scheme("FP8", targets=[r"re:.*experts\.\d+\.w1$"]))
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight is offloaded"):
        calibrate(model, _batches(source), pipeline="layer", propagate="quantized")
    detach(model)
    attach(model, _recipe("FP8"))
    calibrate(model, _batches(source), progress=False)
    assert list((folder / WRITTEN_DIR).glob("*.experts.*"))
    detach(model)
    assert model.model.layers[1].mlp.experts is fused and is_offloaded(fused)
    assert not list((folder / WRITTEN_DIR).glob("*.experts.*"))
    torch.testing.assert_close(_logits(model, batch), before, rtol=0, atol=0)


def test_an_offloaded_moe_evaluates_as_in_memory(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """compressed-tensors' copy and view of the offloaded calibrated model
    (their experts' weights and qparams onloaded per forward) give the
    in-memory model's logits, and `evaluate` its numbers, bit for bit."""
    from quantobs.calibration.simulate import (
        compressed_tensors_copy,
        compressed_tensors_view,
    )
    from quantobs.report.evaluate import HeldOut, evaluate

    source = sources["qwen3_moe"]
    batch = _batches(source)[0]
    found = []
    for kind in (None, "disk"):
        model = _load(source, kind, tmp_path / "offload")
        held_out = HeldOut.of(model, [batch])
        attach(model, _recipe("FP8"))
        calibrate(model, _batches(source), progress=False)
        copied = _logits(compressed_tensors_copy(model), batch)
        viewed = _logits(compressed_tensors_view(model), batch)
        found.append((copied, viewed, evaluate(model, held_out)))
    (copied, viewed, expected), (copied_off, viewed_off, evaluated) = found
    assert torch.equal(copied_off, copied) and torch.equal(viewed_off, viewed)
    assert torch.equal(copied, viewed)
    assert evaluated == expected
