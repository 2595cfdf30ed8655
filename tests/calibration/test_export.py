"""save_compressed: compressed-tensors checkpoints of the calibrated MiniLM,
read back with transformers and with compressed-tensors' own decompressors,
and the error paths (nothing half-written is ever left behind)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs import QuantizationArgs, fake_quantize
from quantobs.calibration import Recipe, attach, calibrate, detach
from quantobs.calibration.attach import QPARAM_KINDS, attachment_of
from quantobs.calibration.export import (
    SUPPORTED_FORMATS,
    checkpoint_formats,
    save_compressed,
)
from quantobs.core.layout import BASE_NAMES
from quantobs.core.presets import preset_scheme
from tests.calibration.conftest import (
    load_dequantized,
    minilm_dir,
    tiny_llama,
    token_batches,
)
from tests.decoders import KV_CACHE_REASON, kv_cache_quantizable

pytestmark = pytest.mark.peers
compressed_tensors = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationScheme,
    disable_quantization,
)
from safetensors.torch import load_file  # noqa: E402

#: Each scheme's checkpoint format (llm-compressor infers the same).
FORMATS = {
    "W4A16": "pack-quantized",
    "W4A16_ASYM": "pack-quantized",
    "W8A16": "pack-quantized",
    "W8A8": "int-quantized",
    "FP8": "float-quantized",
    "FP8_DYNAMIC": "float-quantized",
    "FP8_BLOCK": "float-quantized",
    "NVFP4": "nvfp4-pack-quantized",
    "NVFP4A16": "nvfp4-pack-quantized",
    "MXFP4": "mxfp4-pack-quantized",
}
IGNORE = ["re:.*pooler.*"]
#: compressed-tensors decompresses NVFP4 to bfloat16: code * bf16(scale /
#: global_scale), the quotient and the product each rounded to bf16 (at most
#: 2**-9 relative each). MX scales are powers of two: exact in bf16.
NVFP4_RTOL = 2**-8 + 2**-16
#: The dequantized transformers load warns that the checkpoint's own
#: quantization_config wins over the one passed (only `dequantize` is taken).
MERGE_WARNING = "ignore:You passed `quantization_config`:UserWarning"


def _fake_quantized_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every calibrated weight, fake-quantized with its own qparams."""
    found = {}
    for entry in attachment_of(model).entries:
        if entry.base_name != "weight":
            continue
        module = entry.module
        found[entry.name] = fake_quantize(
            module.weight,
            module.weight_scale,
            getattr(module, "weight_zero_point", None),
            entry.args,
            global_scale=getattr(module, "weight_global_scale", None),
        )
    return found


QPARAMS = {f"{base}_{kind}" for base in BASE_NAMES for kind in QPARAM_KINDS}


def _qparams(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The calibrated qparams, `{"module.weight_scale": tensor, ...}`."""
    return {
        name: value.detach().clone()
        for name, value in model.named_parameters()
        if name.rpartition(".")[2] in QPARAMS
    }


def _weight_tolerance(scheme: str) -> dict[str, float]:
    if scheme.startswith("NVFP4"):
        return {"rtol": NVFP4_RTOL, "atol": 0.0}
    return {"rtol": 0.0, "atol": 0.0}


@pytest.fixture(scope="module")
def calibrated(batches: list) -> Callable[[str], torch.nn.Module]:
    """MiniLM calibrated under a scheme (once per scheme and test module)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(scheme: str) -> torch.nn.Module:
        if scheme not in cache:
            model = transformers.AutoModel.from_pretrained(minilm_dir()).eval()
            attach(model, Recipe.from_scheme(scheme, ignore=IGNORE))
            calibrate(model, batches[:2], progress=False)
            cache[scheme] = model
        return cache[scheme]

    return get


@dataclass
class Exported:
    """A calibrated model, its checkpoint and what it must decompress to."""

    scheme: str
    model: torch.nn.Module
    out: Path
    weights: dict[str, torch.Tensor]  # fake-quantized, by module name
    reference: torch.nn.Module  # MiniLM with those weights, nothing else
    batch: dict[str, torch.Tensor]
    expected: torch.Tensor  # the reference's last hidden state
    output_atol: float  # 0, or what bf16 NVFP4 weights may change
    before: dict[str, Any]  # the model's state dict before export
    hooks: int


def _hooks(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()
    )


@pytest.fixture(scope="module")
def unquantized_output(batches: list) -> torch.Tensor:
    """MiniLM's last hidden state on the first batch, unquantized."""
    model = transformers.AutoModel.from_pretrained(minilm_dir()).eval()
    with torch.no_grad():
        return model(**batches[0]).last_hidden_state


@pytest.fixture(scope="module", params=list(FORMATS))
def exported(
    request: pytest.FixtureRequest,
    calibrated: Callable[[str], torch.nn.Module],
    batches: list,
    unquantized_output: torch.Tensor,
    tmp_path_factory: pytest.TempPathFactory,
) -> Exported:
    scheme = request.param
    model = calibrated(scheme)
    before = copy.deepcopy(model.state_dict())
    hooks = _hooks(model)
    # a copy: the tests read the calibrated model after its export
    out = save_compressed(
        model, tmp_path_factory.mktemp(scheme) / "checkpoint", copy=True
    )
    weights = _fake_quantized_weights(model)
    reference = transformers.AutoModel.from_pretrained(minilm_dir()).eval()
    with torch.no_grad():
        for name, weight in weights.items():
            reference.get_submodule(name).weight.copy_(weight)
        expected = reference(**batches[0]).last_hidden_state
    atol = 0.0
    if scheme.startswith("NVFP4"):
        # bf16-rounded weights (NVFP4_RTOL) through six layers: a small
        # fraction of the quantization's own effect on the outputs (about 2%)
        atol = 0.05 * float((expected - unquantized_output).abs().max())
    return Exported(
        scheme,
        model,
        out,
        weights,
        reference,
        batches[0],
        expected,
        atol,
        before,
        hooks,
    )


def _assert_outputs(exported: Exported, model: torch.nn.Module) -> None:
    with torch.no_grad():
        found = model(**exported.batch).last_hidden_state
    torch.testing.assert_close(
        found, exported.expected, rtol=0, atol=exported.output_atol
    )


# ------------------------------------------------------------ the checkpoint


def test_checkpoint_has_the_compressed_tensors_config(exported: Exported) -> None:
    config = json.loads((exported.out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    assert quant["format"] == FORMATS[exported.scheme]
    assert quant["quantization_status"] == "compressed"
    assert quant["ignore"] == ["pooler.dense"]
    (group,) = quant["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["format"] == FORMATS[exported.scheme]
    recipe = Recipe.from_scheme(exported.scheme, ignore=IGNORE)
    ours = recipe.to_compressed_tensors(FORMATS[exported.scheme])
    for part in ("weights", "input_activations", "output_activations"):
        args = getattr(ours.config_groups["group_0"], part)
        assert group[part] == (None if args is None else args.model_dump(mode="json"))
    # the source checkpoint's other files, beside what save_pretrained wrote
    source = Path(minilm_dir())
    for name in ("tokenizer.json", "vocab.txt", "modules.json", "1_Pooling"):
        assert (exported.out / name).exists(), name
    assert (exported.out / "tokenizer_config.json").read_bytes() == (
        source / "tokenizer_config.json"
    ).read_bytes()
    assert not (exported.out / ".gitattributes").exists()
    # written in place: nothing else beside it, and as readable as any
    assert os.listdir(exported.out.parent) == ["checkpoint"]
    plain = exported.out.parent / "plain"
    plain.mkdir()
    assert exported.out.stat().st_mode == plain.stat().st_mode
    plain.rmdir()


def test_checkpoint_holds_the_calibrated_qparams(exported: Exported) -> None:
    tensors = load_file(exported.out / "model.safetensors")
    assert not [k for k in tensors if "observer" in k]
    ours = _qparams(exported.model)
    for name, value in ours.items():
        kind = name.rpartition(".")[2]
        if kind == "weight_scale" or kind.endswith("zero_point"):
            continue  # stored compressed (FP8, e8m0, packed): see decompression
        torch.testing.assert_close(tensors[name], value, rtol=0, atol=0)
    assert any(k.endswith(("weight_packed", "weight")) for k in tensors)


# ------------------------------------------------------------- loading back


@pytest.mark.filterwarnings(MERGE_WARNING)
def test_transformers_loads_the_fake_quantized_model(exported: Exported) -> None:
    config = transformers.utils.quantization_config.CompressedTensorsConfig(
        dequantize=True
    )
    loaded = transformers.AutoModel.from_pretrained(
        exported.out, quantization_config=config
    ).eval()
    # FP4 checkpoints decompress to bfloat16 in this float32 model
    loaded.float()
    for name, weight in exported.weights.items():
        found = loaded.get_submodule(name).weight
        torch.testing.assert_close(found, weight, **_weight_tolerance(exported.scheme))
    expected = exported.reference.state_dict()
    for name, value in loaded.state_dict().items():
        if name in expected and name.rpartition(".")[0] not in exported.weights:
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    # the load keeps compressed-tensors' activation fake quantization: compare
    # with weights-only quantization
    loaded.apply(disable_quantization)
    _assert_outputs(exported, loaded)


def _module_tensors(
    tensors: dict[str, torch.Tensor], module: str
) -> dict[str, torch.Tensor]:
    prefix = f"{module}."
    return {
        name[len(prefix) :]: value
        for name, value in tensors.items()
        if name.startswith(prefix) and "." not in name[len(prefix) :]
    }


def test_compressed_tensors_decompresses_the_fake_quantized_weights(
    exported: Exported,
) -> None:
    config = json.loads((exported.out / "config.json").read_text())
    quant = config["quantization_config"]
    scheme = QuantizationScheme.model_validate(quant["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(quant["format"])
    tensors = load_file(exported.out / "model.safetensors")
    ours = _qparams(exported.model)
    state = {}
    for name, value in tensors.items():
        if name.rpartition(".")[0] not in exported.weights:
            state[name] = value
    for module, weight in exported.weights.items():
        found = compressor.decompress(_module_tensors(tensors, module), scheme)
        torch.testing.assert_close(
            found["weight"].float(), weight, **_weight_tolerance(exported.scheme)
        )
        for kind in ("weight_scale", "weight_zero_point", "weight_global_scale"):
            if kind in found and f"{module}.{kind}" in ours:
                torch.testing.assert_close(
                    found[kind].to(ours[f"{module}.{kind}"].dtype),
                    ours[f"{module}.{kind}"],
                    rtol=0,
                    atol=0,
                )
        state[f"{module}.weight"] = found["weight"]
        state[f"{module}.bias"] = found["bias"]
    model = copy.deepcopy(exported.reference)
    qparam_names = [k for k in state if k not in model.state_dict()]
    assert all("_scale" in k or "_zero_point" in k for k in qparam_names)
    model.load_state_dict({k: v for k, v in state.items() if k not in qparam_names})
    _assert_outputs(exported, model)


def _assert_same(found: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(found, expected) or torch.allclose(
            found, expected, rtol=0, atol=0, equal_nan=True
        )
    elif isinstance(expected, dict):
        assert found.keys() == expected.keys()
        for key, value in expected.items():
            _assert_same(found[key], value)
    else:
        assert found == expected


def test_export_leaves_the_calibrated_model_as_it_was(exported: Exported) -> None:
    model = exported.model
    # parameters, buffers and the observers' extra state
    _assert_same(model.state_dict(), exported.before)
    assert _hooks(model) == exported.hooks
    assert any(n.endswith("weight_observer") for n, _ in model.named_modules())
    assert attachment_of(model).recipe == Recipe.from_scheme(
        exported.scheme, ignore=IGNORE
    )


@pytest.mark.filterwarnings(MERGE_WARNING)
def test_groups_of_different_formats_make_a_mixed_precision_checkpoint(
    batches: list, tmp_path: Path
) -> None:
    recipe = Recipe(
        config_groups={
            "attention": preset_scheme("W4A16", [r"re:.*self\.(query|key|value)$"]),
            "rest": preset_scheme("FP8", ["Linear"]),
        },
        ignore=IGNORE,
    )
    model = transformers.AutoModel.from_pretrained(minilm_dir()).eval()
    attach(model, recipe)
    calibrate(model, batches[:1], progress=False)
    out = save_compressed(model, tmp_path / "mixed", copy=True)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "mixed-precision"
    formats = {g["format"] for g in quant["config_groups"].values()}
    assert formats == {"pack-quantized", "float-quantized"}
    # (transformers 5.24 cannot dequantize it while loading: `load_dequantized`)
    loaded = load_dequantized(out, mixed=True)
    weights = _fake_quantized_weights(model)
    assert len(weights) == 36
    for name, weight in weights.items():
        torch.testing.assert_close(
            loaded.get_submodule(name).weight.float(), weight, rtol=0, atol=0
        )


def test_targets_compressed_tensors_resolves_otherwise_are_refused(
    batches: list, tmp_path: Path
) -> None:
    # quantobs: the first group that matches; compressed-tensors: a regular
    # expression before a class name
    recipe = Recipe(
        config_groups={
            "a": preset_scheme("W8A16", ["Embedding"]),
            "b": preset_scheme("FP8_DYNAMIC", ["re:.*(word_embeddings|query)$"]),
        }
    )
    model = transformers.AutoModel.from_pretrained(minilm_dir()).eval()
    attach(model, recipe)
    calibrate(model, batches[:1], progress=False)
    with pytest.raises(ValueError, match=r"word_embeddings\.weight otherwise"):
        save_compressed(model, tmp_path / "checkpoint")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------ attention and the kv cache

FP8_TENSOR = QuantizationArgs(num_bits=8, type="float", strategy="tensor")


def _attention_recipe(attention: str) -> Recipe:
    """FP8 on every Linear, the query states of `attention` modules and the
    key / value states (kv cache)."""
    recipe = Recipe.from_scheme("FP8", ignore=["lm_head"], kv_cache_scheme=FP8_TENSOR)
    recipe.config_groups["attention"] = recipe.config_groups["group_0"].model_copy(
        update={"targets": [attention], "weights": None}
    )
    return recipe


@pytest.mark.skipif(not kv_cache_quantizable(), reason=KV_CACHE_REASON)
@pytest.mark.filterwarnings(MERGE_WARNING)
def test_attention_and_kv_cache_scales_are_exported(tmp_path: Path) -> None:
    model = tiny_llama()
    attach(model, _attention_recipe("LlamaAttention"))
    calibrate(model, token_batches(2), progress=False)
    out = save_compressed(model, tmp_path / "llama", copy=True)  # read after
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "float-quantized"
    assert quant["kv_cache_scheme"]["type"] == "float"
    formats = {g["targets"][0]: g["format"] for g in quant["config_groups"].values()}
    assert formats == {"Linear": "float-quantized", "LlamaAttention": "dense"}
    tensors = load_file(out / "model.safetensors")
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        prefix = f"model.layers.{index}.self_attn"
        for base in ("q", "k", "v"):
            torch.testing.assert_close(
                tensors[f"{prefix}.{base}_scale"],
                getattr(attention, f"{base}_scale"),
                rtol=0,
                atol=0,
            )
            assert f"{prefix}.{base}_zero_point" not in tensors  # symmetric
    config = transformers.utils.quantization_config.CompressedTensorsConfig(
        dequantize=True
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=config
    )
    for name, weight in _fake_quantized_weights(model).items():
        torch.testing.assert_close(
            loaded.get_submodule(name).weight.float(), weight, rtol=0, atol=0
        )


def test_states_compressed_tensors_does_not_quantize_are_refused(
    minilm: torch.nn.Module, batches: list, tmp_path: Path
) -> None:
    # compressed-tensors quantizes no attention state of BERT's attention: a
    # kv cache is refused by attach, the query states by save_compressed
    with pytest.raises(ValueError, match=r"kv cache of no module of BertModel"):
        attach(minilm, _attention_recipe("BertSelfAttention"))
    recipe = _attention_recipe("BertSelfAttention")
    recipe.kv_cache_scheme = None
    attach(minilm, recipe)
    calibrate(minilm, batches[:1], progress=False)
    with pytest.raises(ValueError, match=r"keeps no place for .*self\.q_scale"):
        save_compressed(minilm, tmp_path / "checkpoint")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------- bad input


def test_formats_are_inferred_per_group_and_checked() -> None:
    for scheme, expected in {**FORMATS, "MXFP4A16": "mxfp4-pack-quantized"}.items():
        recipe = Recipe.from_scheme(scheme)
        assert checkpoint_formats(recipe) == {"group_0": expected}
    # (mxfp6-pack-quantized: tests/calibration/test_export_mx.py)
    assert set(FORMATS.values()) | {"mxfp6-pack-quantized"} == set(SUPPORTED_FORMATS)
    with pytest.raises(ValueError, match=r"MXFP8.*supported: pack-quantized"):
        checkpoint_formats(Recipe.from_scheme("MXFP8"))
    with pytest.raises(ValueError, match=r"UNQUANTIZED.*nothing quantized"):
        checkpoint_formats(Recipe.from_scheme("UNQUANTIZED"))
    with pytest.raises(ValueError, match="unsupported format 'dense'"):
        checkpoint_formats(Recipe.from_scheme("W4A16"), "dense")
    with pytest.raises(ValueError, match=r"'float-quantized' cannot store.*W4A16"):
        checkpoint_formats(Recipe.from_scheme("W4A16"), "float-quantized")
    # groups without weights keep dense weights; one such group alone is refused
    recipe = _attention_recipe("LlamaAttention")
    assert checkpoint_formats(recipe) == {
        "group_0": "float-quantized",
        "attention": "dense",
    }
    del recipe.config_groups["group_0"]
    with pytest.raises(ValueError, match="quantizes no weight"):
        checkpoint_formats(recipe)
    # W8A8 may also be stored packed
    recipe = Recipe.from_scheme("W8A8")
    assert checkpoint_formats(recipe, "pack-quantized") == {"group_0": "pack-quantized"}


def test_an_uncalibrated_model_is_refused(
    minilm: torch.nn.Module, tmp_path: Path
) -> None:
    out = tmp_path / "checkpoint"
    with pytest.raises(RuntimeError, match="observers still attached"):
        save_compressed(minilm, out)
    attach(minilm, Recipe.from_scheme("W4A16", ignore=IGNORE))
    with pytest.raises(RuntimeError, match=r"not calibrated.*calibrate"):
        save_compressed(minilm, out)
    detach(minilm)
    attach(minilm, Recipe.from_scheme("MXFP8", ignore=IGNORE))
    with pytest.raises(ValueError, match=r"MXFP8.*supported"):
        save_compressed(minilm, out)
    assert os.listdir(tmp_path) == []


def test_a_detached_model_is_refused(
    calibrated: Callable[[str], torch.nn.Module], tmp_path: Path
) -> None:
    model = copy.deepcopy(calibrated("W8A16"))
    detach(model)
    with pytest.raises(RuntimeError, match="before any detach"):
        save_compressed(model, tmp_path / "checkpoint")
    assert os.listdir(tmp_path) == []


def test_an_existing_directory_is_kept_unless_overwrite(
    calibrated: Callable[[str], torch.nn.Module], tmp_path: Path
) -> None:
    model = calibrated("W8A8")
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_compressed(model, out)
    assert os.listdir(out) == ["keep.txt"]
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        save_compressed(model, file, overwrite=True)
    # overwrite replaces it whole; a forced format applies to every group
    found = save_compressed(
        model, out, overwrite=True, format="pack-quantized", copy=True
    )
    assert found == out
    assert not (out / "keep.txt").exists()
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "pack-quantized"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "file"]


def test_an_empty_directory_is_filled(
    calibrated: Callable[[str], torch.nn.Module], tmp_path: Path
) -> None:
    out = tmp_path / "nested" / "checkpoint"
    out.mkdir(parents=True)
    model = calibrated("W8A16")
    found = save_compressed(model, out, source_dir=tmp_path / "nested", copy=True)
    # source files: only what save_pretrained wrote (the source is empty)
    assert found == out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_unwritable_destinations_leave_nothing(
    calibrated: Callable[[str], torch.nn.Module],
    tmp_path: Path,
) -> None:
    model = calibrated("W8A16")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot write the checkpoint"):
        save_compressed(model, blocker / "sub" / "checkpoint")
    with pytest.raises(FileNotFoundError, match="source_dir"):
        save_compressed(model, tmp_path / "c", source_dir=tmp_path / "missing")
    assert os.listdir(tmp_path) == ["a-file"]


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="permissions do not bind root",
)
def test_a_read_only_parent_is_refused(
    calibrated: Callable[[str], torch.nn.Module], tmp_path: Path
) -> None:
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="cannot write the checkpoint"):
            save_compressed(calibrated("W8A16"), parent / "checkpoint")
        assert os.listdir(parent) == []
    finally:
        parent.chmod(0o700)


def test_a_failure_midway_removes_everything_written(
    calibrated: Callable[[str], torch.nn.Module],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quantobs.calibration import export

    def half_write(*args: Any, **kwargs: Any) -> None:
        temp = args[-1]
        (temp / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_write", half_write)
    model = calibrated("W8A16")
    with pytest.raises(OSError, match="No space left"):
        save_compressed(model, tmp_path / "new" / "deeper" / "checkpoint")
    assert os.listdir(tmp_path) == []  # the parents it made are gone too
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "old.txt").write_text("previous")
    with pytest.raises(OSError, match="No space left"):
        save_compressed(model, out, overwrite=True)
    assert os.listdir(tmp_path) == ["checkpoint"]
    assert os.listdir(out) == ["old.txt"]


def test_model_format_of_dense_groups_is_dense() -> None:
    from quantobs.calibration.simulate import _model_format

    assert _model_format({"group_0": "dense", "group_1": "dense"}) == "dense"
    assert _model_format({}) == "dense"
    assert _model_format({"a": "dense", "b": "float-quantized"}) == "float-quantized"
    assert _model_format({"a": "int-quantized", "b": "float-quantized"}) == (
        "mixed-precision"
    )
