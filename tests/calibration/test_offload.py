"""Models loaded with accelerate's offloading (transformers' `device_map`,
`offload_folder`) calibrate and export: weights on the meta device are read
one at a time, qparams and compressed weights are written where the module
keeps its weights, and the checkpoint is the in-memory one, bit for bit.

On a CPU-only machine accelerate offloads only what the `device_map` sends
to `"disk"` (a `"cpu"` entry is the execution device itself, not offloaded:
checked below), so the tests put a decoder layer and `lm_head` on disk;
accelerate's `cpu_offload` gives the CPU variant (its weights map a state
dict in memory).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs.calibration import Recipe, attach, calibrate, save_compressed
from quantobs.calibration.attach import attachment_of
from quantobs.calibration.offload import (
    WRITTEN_DIR,
    is_offloaded,
    onloaded,
    read_tensor,
    release_written,
    remove_parameter,
    write_parameter,
)
from quantobs.calibration.simulate import calibrated_qparams
from tests.calibration.conftest import SENTENCES
from tests.decoders import save_decoder

pytestmark = pytest.mark.peers
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("compressed_tensors")

#: layer 0 and the embeddings on the CPU, layer 1 and lm_head on disk
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}
#: scheme -> model dtype (NVFP4 models run in bf16)
SCHEMES = {"W4A16": torch.float32, "FP8": torch.float32, "NVFP4": torch.bfloat16}
#: small enough that the tiny decoder's checkpoint takes several shards
SMALL_SHARDS = 40_000
MERGE_WARNING = "ignore:You passed `quantization_config`:UserWarning"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[torch.dtype, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        dtype: save_decoder("llama", root / str(dtype).split(".")[1], dtype=dtype)
        for dtype in set(SCHEMES.values())
    }


def _batches(source: Path) -> list[dict[str, torch.Tensor]]:
    from quantobs.calibration import text_batches

    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = tokenizer.eos_token
    return text_batches(tokenizer, SENTENCES[:8], batch_size=4, max_length=32)


def _load(source: Path, dtype: torch.dtype, offload: Path | None = None) -> Any:
    extra: dict[str, Any] = {}
    if offload is not None:
        extra = {"device_map": DEVICE_MAP, "offload_folder": str(offload)}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, **extra
    )
    return model.eval()


def _calibrated(
    source: Path, scheme: str, offload: Path | None = None
) -> torch.nn.Module:
    model = _load(source, SCHEMES[scheme], offload)
    attach(model, Recipe.from_scheme(scheme, ignore=["lm_head"]))
    calibrate(model, _batches(source), progress=False)
    return model


def _files(directory: Path) -> dict[str, str]:
    """`{file name: sha256}` of the checkpoint's weights, index and config."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.suffix in (".safetensors", ".json")
    }


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def _assert_same_tensors(found: dict[str, torch.Tensor], expected: dict) -> None:
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        other = found[name]
        assert other.dtype == value.dtype and other.shape == value.shape, name
        assert torch.equal(other.view(torch.uint8), value.view(torch.uint8)), name


def _meta_offloaded(model: torch.nn.Module) -> list[str]:
    """The names of the offloaded modules' tensors (all still meta)."""
    names = []
    for name, module in model.named_modules():
        if is_offloaded(module):
            for tensor_name, tensor in module.named_parameters(recurse=False):
                assert tensor.is_meta, f"{name}.{tensor_name} was left loaded"
                names.append(f"{name}.{tensor_name}")
    return names


def test_a_cpu_entry_is_not_offloaded_on_a_cpu_only_machine(
    sources: dict[torch.dtype, Path], tmp_path: Path
) -> None:
    model = _load(sources[torch.float32], torch.float32, tmp_path / "offload")
    assert not is_offloaded(model.model.layers[0].self_attn.q_proj)
    assert is_offloaded(model.model.layers[1].self_attn.q_proj)
    assert model.model.layers[1].self_attn.q_proj.weight.is_meta
    assert not model.model.layers[0].self_attn.q_proj.weight.is_meta


def _assert_same_qparams(model: torch.nn.Module, expected: dict) -> None:
    found = calibrated_qparams(attachment_of(model))
    assert found.keys() == expected.keys()
    for module, qparams in expected.items():
        assert found[module].keys() == qparams.keys(), module
        for name, value in qparams.items():
            torch.testing.assert_close(found[module][name], value, rtol=0, atol=0)


#: NVFP4 and FP8 take 10-15 s each on 2 shared cores
_SCHEME_PARAMS = [
    pytest.param(s, marks=() if s == "W4A16" else pytest.mark.slow) for s in SCHEMES
]


@pytest.mark.filterwarnings(MERGE_WARNING)
@pytest.mark.parametrize("scheme", _SCHEME_PARAMS)
def test_an_offloaded_model_calibrates_and_exports_the_in_memory_checkpoint(
    scheme: str, sources: dict[torch.dtype, Path], tmp_path: Path
) -> None:
    """The offloaded model's qparams are the in-memory ones; in memory (one
    file, then small shards) and offloaded (small shards): every shard, the
    index and config.json are the same bytes, and the sharded checkpoint
    reloads to the same logits."""
    source = sources[SCHEMES[scheme]]
    in_memory = _calibrated(source, scheme)
    qparams = calibrated_qparams(attachment_of(in_memory))
    whole = save_compressed(in_memory, tmp_path / "whole")
    model = _calibrated(source, scheme, tmp_path / "offload")
    _assert_same_qparams(model, qparams)
    # nothing stays loaded: the offloaded modules' weights and qparams are
    # meta placeholders, their qparams in the offload folder
    assert "model.layers.1.self_attn.q_proj.weight_scale" in _meta_offloaded(model)
    assert list((tmp_path / "offload" / WRITTEN_DIR).glob("*weight_scale*"))

    offloaded = save_compressed(
        model, tmp_path / "offloaded", max_shard_size=SMALL_SHARDS
    )
    sharded = save_compressed(
        _calibrated(source, scheme), tmp_path / "sharded", max_shard_size=SMALL_SHARDS
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert _files(offloaded) == _files(sharded)
    _assert_same_tensors(_tensors(offloaded), _tensors(whole))
    config_json = (whole / "config.json").read_bytes()
    assert config_json == (offloaded / "config.json").read_bytes()
    # the export compressed the offloaded modules where they live
    names = _meta_offloaded(model)
    assert "model.layers.1.self_attn.q_proj.weight_packed" in names or (
        "model.layers.1.self_attn.q_proj.weight" in names  # FP8: weight kept
    )
    # the in-place export let go of every file it and calibration wrote
    assert not (tmp_path / "offload" / WRITTEN_DIR).exists()

    config = transformers.CompressedTensorsConfig(dequantize=True)
    batch = _batches(source)[0]
    with torch.no_grad():
        expected = transformers.AutoModelForCausalLM.from_pretrained(
            whole, quantization_config=config
        )(**batch).logits
        found = transformers.AutoModelForCausalLM.from_pretrained(
            offloaded, quantization_config=config
        )(**batch).logits
    torch.testing.assert_close(found, expected, rtol=0, atol=0)


def test_copy_keeps_the_model_and_writes_the_same_checkpoint(
    sources: dict[torch.dtype, Path], tmp_path: Path
) -> None:
    source = sources[torch.float32]
    model = _calibrated(source, "W4A16")
    kept = {n: t.clone() for n, t in model.named_parameters()}
    copied = save_compressed(model, tmp_path / "copy", copy=True)
    assert attachment_of(model).entries  # still attached, still calibrates
    state = dict(model.named_parameters())
    assert state.keys() == kept.keys()
    assert all(torch.equal(state[n], t) for n, t in kept.items())
    calibrate(model, _batches(source)[:1], progress=False)

    in_place = save_compressed(model, tmp_path / "in-place")
    # the model itself is frozen and compressed: no observers, packed weights
    with pytest.raises(RuntimeError, match="exported in place"):
        attachment_of(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert "weight" not in q_proj._parameters
    assert q_proj.weight_packed.dtype == torch.int32
    assert not any(n.endswith("_observer") for n, _ in model.named_modules())
    again = save_compressed(
        _calibrated(source, "W4A16"), tmp_path / "fresh", copy=False
    )
    assert _files(copied) == _files(again)
    assert _files(in_place) == _files(again)  # the extra batch: same weights


def test_a_bad_shard_size_is_refused_before_anything_is_written(
    sources: dict[torch.dtype, Path], tmp_path: Path
) -> None:
    model = _calibrated(sources[torch.float32], "W4A16")
    for size in ["0GB", "five", -1, 0, True]:
        with pytest.raises(ValueError, match="max_shard_size"):
            save_compressed(model, tmp_path / "out", max_shard_size=size)
    assert list(tmp_path.iterdir()) == []
    assert attachment_of(model).entries  # untouched


def _tiny() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)).eval()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_write_parameter_keeps_values_where_the_weights_live(
    kind: str, tmp_path: Path
) -> None:
    """accelerate's own `cpu_offload` (a state dict in memory) and
    `disk_offload` (.dat files): a written parameter is a meta placeholder
    whose value accelerate's hook loads with the weights at the forward."""
    model = _tiny()
    weight = model[0].weight.detach().clone()
    inputs = torch.randn(3, 8)
    expected = model(inputs)
    if kind == "cpu":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        accelerate.disk_offload(
            model, str(tmp_path), execution_device=torch.device("cpu")
        )
    layer = model[0]
    assert is_offloaded(layer) and layer.weight.is_meta
    torch.testing.assert_close(read_tensor(layer, "weight"), weight, rtol=0, atol=0)
    write_parameter(layer, "weight_scale", torch.full((4, 1), 0.5))
    assert layer.weight_scale.is_meta and layer.weight.is_meta
    torch.testing.assert_close(
        read_tensor(layer, "weight_scale"), torch.full((4, 1), 0.5)
    )
    hook = layer._hf_hook  # what accelerate does around the forward
    hook.pre_forward(layer, inputs)
    assert torch.equal(layer.weight_scale, torch.full((4, 1), 0.5))
    hook.post_forward(layer, None)
    assert layer.weight_scale.is_meta
    torch.testing.assert_close(model(inputs), expected)
    with onloaded(layer):
        assert not layer.weight.is_meta
        torch.testing.assert_close(layer.weight, weight, rtol=0, atol=0)
    assert layer.weight.is_meta and layer.weight_scale.is_meta


def test_write_parameter_on_a_module_in_memory_replaces_in_place() -> None:
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    big = torch.arange(12.0)
    write_parameter(layer, "weight_scale", big[:4].reshape(4, 1))
    scale = layer.weight_scale
    assert isinstance(scale, torch.nn.Parameter) and not scale.requires_grad
    assert scale.untyped_storage().nbytes() == scale.nbytes  # not the view's base
    write_parameter(layer, "weight_scale", torch.ones(4, 1))
    assert torch.equal(layer.weight_scale, torch.ones(4, 1))
    assert list(layer._parameters) == ["weight", "bias", "weight_scale"]
    with onloaded(layer):  # not offloaded: as it is
        assert layer.weight.device.type == "cpu"


def test_a_meta_weight_without_an_offload_hook_is_a_clear_error() -> None:
    layer = torch.nn.Linear(8, 4, device="meta")
    with pytest.raises(RuntimeError, match="no accelerate offload hook"):
        read_tensor(layer, "weight")


@pytest.mark.filterwarnings("ignore::quantobs.calibration.ExpertsReloadWarning")
def test_fused_experts_export_in_place_as_from_a_copy(tmp_path: Path) -> None:
    """MoE experts stored fused: the in-place export keeps their per-expert
    Linears and writes the checkpoint a copy writes."""
    from tests.decoders import build_decoder

    def calibrated() -> torch.nn.Module:
        model = build_decoder("qwen3_moe")
        attach(model, Recipe.from_scheme("W4A16", ignore=["lm_head"]))
        calibrate(model, [{"input_ids": torch.arange(32).reshape(2, 16)}])
        return model

    copied = save_compressed(calibrated(), tmp_path / "copy", copy=True)
    in_place = save_compressed(calibrated(), tmp_path / "in-place")
    assert _files(in_place) == _files(copied)
    assert any("experts.3." in k for k in _tensors(in_place))


def _written_files(folder: Path) -> set[Path]:
    return set((folder / WRITTEN_DIR).glob("*.safetensors"))


def test_written_files_belong_to_the_model_and_its_copies(tmp_path: Path) -> None:
    """accelerate's `disk_offload`: a file of ours is removed once no copy of
    the model reads it (written again, removed, released, or the copy gone);
    a copy writing its own never removes the model's."""
    import copy
    import gc

    model = _tiny()
    inputs = torch.randn(3, 8)
    expected = model(inputs)
    accelerate.disk_offload(model, str(tmp_path), execution_device=torch.device("cpu"))
    layer = model[0]
    write_parameter(layer, "weight_scale", torch.full((4, 1), 0.25))
    first = _written_files(tmp_path)
    write_parameter(layer, "weight_scale", torch.full((4, 1), 0.5))  # replaced
    mine = _written_files(tmp_path)
    assert len(first) == len(mine) == 1 and first != mine  # no orphaned file

    clone = copy.deepcopy(model)  # reads the model's file until it writes its own
    torch.testing.assert_close(
        read_tensor(clone[0], "weight_scale"), torch.full((4, 1), 0.5)
    )
    write_parameter(clone[0], "weight_scale", torch.full((4, 1), 2.0))
    assert len(_written_files(tmp_path)) == 2 and mine < _written_files(tmp_path)
    torch.testing.assert_close(
        read_tensor(layer, "weight_scale"), torch.full((4, 1), 0.5)
    )
    torch.testing.assert_close(model(inputs), expected)  # its forward as before
    again = copy.deepcopy(model)
    del clone
    gc.collect()  # the copy's own file goes with it, the shared one stays
    assert _written_files(tmp_path) == mine
    assert release_written(model) == 1  # the model lets go: the copy still reads it
    assert _written_files(tmp_path) == mine
    torch.testing.assert_close(
        read_tensor(again[0], "weight_scale"), torch.full((4, 1), 0.5)
    )
    remove_parameter(again[0], "weight_scale")  # its last reader
    assert not (tmp_path / WRITTEN_DIR).exists()
    assert "weight_scale" not in again[0]._parameters
    torch.testing.assert_close(again(inputs), expected)
    with pytest.raises(AttributeError, match="no tensor"):
        remove_parameter(again[0], "weight_scale")


def _enabled(model: torch.nn.Module, on: bool) -> None:
    for entry in attachment_of(model).entries:
        entry.enabled = on


@pytest.mark.filterwarnings(MERGE_WARNING)
def test_an_export_of_a_copy_leaves_the_model_and_its_files(
    sources: dict[torch.dtype, Path], tmp_path: Path
) -> None:
    """copy=True on a disk-offloaded model: the copy's files go at the end of
    the export, the model keeps its own and runs as before; its in-place
    export then writes the same checkpoint and leaves no file of ours."""
    source = sources[torch.float32]
    folder = tmp_path / "offload"
    model = _calibrated(source, "FP8", folder)
    before = _written_files(folder)
    assert before
    qparams = calibrated_qparams(attachment_of(model))
    batch = _batches(source)[0]
    _enabled(model, False)
    with torch.no_grad():
        logits = model(**batch).logits
    _enabled(model, True)
    copied = save_compressed(model, tmp_path / "copy", copy=True)
    assert _written_files(folder) == before
    _assert_same_qparams(model, qparams)
    _enabled(model, False)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, logits, rtol=0, atol=0)
    _enabled(model, True)
    in_place = save_compressed(model, tmp_path / "in-place")
    assert _files(in_place) == _files(copied)
    assert not (folder / WRITTEN_DIR).exists()


#: `DEVICE_MAP` as a machine with an accelerator offloads it to the CPU
CPU_OFFLOADED = ["model.layers.1", "lm_head"]


def _cpu_dispatched(model: torch.nn.Module) -> Any:
    """What accelerate's `dispatch_model` does for a device map sending
    `CPU_OFFLOADED` to "cpu" on a machine with an accelerator (on a CPU-only
    machine it does not offload to the CPU): their weights in an
    `OffloadedWeightsLoader`'s CPU state dict, meta placeholders in the
    modules, `AlignDevicesHook`s loading them for each forward. Returns the
    loader."""
    from accelerate.hooks import attach_align_device_hook_on_blocks
    from accelerate.utils import (
        OffloadedWeightsLoader,
        extract_submodules_state_dict,
    )

    state = extract_submodules_state_dict(model.state_dict(), CPU_OFFLOADED)
    loader = OffloadedWeightsLoader(state_dict=state)
    device_map = dict.fromkeys(DEVICE_MAP, "cpu")
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"": "cpu", **device_map},
        offload={n: n in CPU_OFFLOADED for n in DEVICE_MAP},
        weights_map=loader,
    )
    model.hf_device_map = device_map  # transformers' mark of an offloaded model
    return loader


@pytest.mark.filterwarnings(MERGE_WARNING)
def test_a_cpu_offloaded_export_frees_the_original_weights(
    sources: dict[torch.dtype, Path], tmp_path: Path
) -> None:
    """In place, each original weight leaves the loader's CPU state dict as
    its compressed tensors are written; the checkpoint is the in-memory one
    bit for bit. copy=True leaves the model's weights map whole."""
    source = sources[torch.float32]
    expected = save_compressed(_calibrated(source, "W4A16"), tmp_path / "memory")
    model = _load(source, torch.float32)
    loader = _cpu_dispatched(model)
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert model.model.layers[1].self_attn.q_proj.weight.is_meta
    assert q_proj in loader.state_dict and "lm_head.weight" in loader.state_dict
    attach(model, Recipe.from_scheme("W4A16", ignore=["lm_head"]))
    calibrate(model, _batches(source), progress=False)
    copied = save_compressed(model, tmp_path / "copy", copy=True)
    assert q_proj in loader.state_dict  # the copy's weights map was its own
    in_place = save_compressed(model, tmp_path / "in-place")
    originals = [k for k in loader.state_dict if k.endswith("_proj.weight")]
    assert originals == []  # freed, their compressed tensors in their place
    assert f"{q_proj}_packed" in loader.state_dict
    assert "lm_head.weight" in loader.state_dict  # not quantized: kept
    assert _files(in_place) == _files(expected) == _files(copied)


class _Probe:
    """A global forward pre-hook (every module of every model) recording, at
    each module call, what the evaluation holds: the offloaded modules with
    weights loaded, the weights of modules in memory that are not the
    model's own tensors, and the weights written under the offload folder."""

    def __init__(self, model: torch.nn.Module, folder: Path) -> None:
        self.own = {id(t) for t in model.parameters()}
        self.folder = folder / WRITTEN_DIR
        self.seen: dict[int, torch.nn.Module] = {}
        self.most_loaded = 0
        self.copied: set[str] = set()
        self.weight_files: set[str] = set()
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.calls += 1
        self.seen[id(module)] = module
        loaded = 0
        for seen in self.seen.values():
            weight = seen._parameters.get("weight")
            if weight is None:
                continue
            if is_offloaded(seen):
                loaded += not weight.is_meta
            elif id(weight) not in self.own:
                self.copied.add(type(seen).__name__)
        self.most_loaded = max(self.most_loaded, loaded)
        self.weight_files.update(
            p.name for p in self.folder.glob("*.weight.*.safetensors")
        )


@pytest.mark.filterwarnings(MERGE_WARNING)
@pytest.mark.parametrize("kind", ["disk", "cpu"])
def test_an_offloaded_model_evaluates_one_weight_at_a_time(
    kind: str, sources: dict[torch.dtype, Path], tmp_path: Path
) -> None:
    """The evaluation of an offloaded model copies no weight (its view
    shares the model's, in memory and in the loader's CPU state dict),
    writes no quantized weight under the offload folder and never has more
    than one offloaded module loaded; its numbers are those of the model in
    memory, bit for bit, and it leaves no file."""
    from quantobs.calibration.offload import _dataset
    from quantobs.report.evaluate import HeldOut, evaluate

    source = sources[torch.float32]
    in_memory = _load(source, torch.float32)
    held_out = HeldOut.of(in_memory, _batches(source)[:1])
    attach(in_memory, Recipe.from_scheme("W4A16", ignore=["lm_head"]))
    calibrate(in_memory, _batches(source), progress=False)
    expected = evaluate(in_memory, held_out)

    folder = tmp_path / "offload"
    if kind == "disk":
        model = _calibrated(source, "W4A16", folder)
        originals: dict[str, torch.Tensor] = {}
    else:
        model = _load(source, torch.float32)
        originals = dict(_cpu_dispatched(model).state_dict)
        attach(model, Recipe.from_scheme("W4A16", ignore=["lm_head"]))
        calibrate(model, _batches(source), progress=False)
    files = _written_files(folder)
    probe = _Probe(model, folder)
    shared: list[bool] = []

    def loader_values(module: torch.nn.Module, args: Any) -> None:
        if is_offloaded(module) and "weight" in module._parameters:
            prefix, store = _dataset(module._hf_hook.weights_map)
            value = store.state_dict.get(prefix + "weight")
            if value is not None:
                shared.append(value is originals[prefix + "weight"])

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(hook)
        for hook in (probe, loader_values)
    ]
    try:
        found = evaluate(model, held_out)
    finally:
        for handle in handles:
            handle.remove()
    assert probe.calls > 20
    assert probe.most_loaded <= 1
    assert probe.copied == set()  # every weight in memory is the model's own
    assert probe.weight_files == set()  # no quantized weight written
    assert _written_files(folder) == files  # the view's qparams gone with it
    assert all(shared) and (len(shared) >= 8) == (kind == "cpu")
    assert found == expected
