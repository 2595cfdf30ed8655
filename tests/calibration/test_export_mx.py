"""save_compressed with compressed-tensors 0.20's MX presets: MXFP6
(`mxfp6-pack-quantized`), MXFP4XFP8 (MXFP4 weights, FP8 inputs in groups of
128) and a mixed-precision MX checkpoint, read back with transformers (5.17
and 5.24) bit for bit; and, under compressed-tensors 0.19, FP6 calibrated
and fake-quantized by quantobs but refused by export and compare with the
version it needs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from quantobs import fake_quantize, scale_to_storage
from quantobs.calibration import Recipe, attach, calibrate
from quantobs.calibration.attach import attachment_of
from quantobs.calibration.export import checkpoint_formats, save_compressed
from quantobs.core.args import QuantizationArgs
from quantobs.core.peer_versions import (
    COMPARE_TASK,
    check_fp6_schemes,
    compressed_tensors_has_fp6,
)
from quantobs.core.presets import preset_scheme
from tests.calibration.conftest import load_dequantized, token_batches

pytestmark = pytest.mark.peers
pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

HAS_FP6 = compressed_tensors_has_fp6()
NEEDS_FP6 = pytest.mark.skipif(
    not HAS_FP6, reason="compressed-tensors < 0.20 has no FP6 (mxfp6-pack-quantized)"
)
#: compressed-tensors 0.19 warns that MXFP4XFP8's weight and input groups
#: differ in size (0.20 accepts it: the preset means it)
GROUP_SIZES_WARNING = "ignore:Using GROUP strategy for both:UserWarning"
#: the dequantized load warns that the checkpoint's config wins
MERGE_WARNING = "ignore:You passed `quantization_config`:UserWarning"
ATTENTION = r"re:.*self_attn\.(q|k|v|o)_proj$"


def _llama() -> torch.nn.Module:
    """A one-layer random Llama whose every Linear input is a multiple of
    128 columns (MXFP4XFP8's input groups)."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _calibrated(recipe: Recipe) -> torch.nn.Module:
    model = _llama()
    attach(model, recipe)
    calibrate(model, token_batches(1), progress=False)
    return model


def _fake_quantized_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        entry.name: fake_quantize(
            entry.module.weight, entry.module.weight_scale, None, entry.args
        )
        for entry in attachment_of(model).entries
        if entry.base_name == "weight"
    }


def _assert_loads_back(model: torch.nn.Module, out: Path, mixed: bool) -> None:
    """The checkpoint's weights are ours fake-quantized (bit for bit: MX
    values times powers of two are exact in bfloat16), its e8m0 scale codes
    ours, and the rest of the model unchanged."""
    weights = _fake_quantized_weights(model)
    tensors = load_file(out / "model.safetensors")
    for entry in attachment_of(model).entries:
        if entry.base_name == "weight" and entry.args.is_mx:
            stored = tensors[f"{entry.name}.weight_scale"]
            expected = scale_to_storage(entry.module.weight_scale, entry.args)
            assert torch.equal(stored, expected.reshape(stored.shape))
    loaded = load_dequantized(out, mixed, transformers.AutoModelForCausalLM)
    assert len(weights) == 7
    for name, weight in weights.items():
        found = loaded.get_submodule(name).weight  # bfloat16 (FP4 / FP6)
        torch.testing.assert_close(found.float(), weight, rtol=0, atol=0)
    reference = dict(model.named_parameters())
    for name, value in loaded.named_parameters():
        if name.rpartition(".")[0] not in weights and name in reference:
            assert torch.equal(value.float(), reference[name]), name


@pytest.mark.filterwarnings(GROUP_SIZES_WARNING, MERGE_WARNING)
@pytest.mark.parametrize(
    ("scheme", "fmt"),
    [
        pytest.param("MXFP6A16", "mxfp6-pack-quantized", marks=NEEDS_FP6),
        pytest.param("MXFP6A8", "mxfp6-pack-quantized", marks=NEEDS_FP6),
        ("MXFP4XFP8", "mxfp4-pack-quantized"),
    ],
)
def test_mx_checkpoint_loads_back(scheme: str, fmt: str, tmp_path: Path) -> None:
    recipe = Recipe.from_scheme(scheme, ignore=["lm_head"])
    assert checkpoint_formats(recipe) == {"group_0": fmt}
    model = _calibrated(recipe)
    out = save_compressed(model, tmp_path / scheme, copy=True)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == fmt
    (group,) = quant["config_groups"].values()
    ours = recipe.to_compressed_tensors(fmt).config_groups["group_0"]
    for part in ("weights", "input_activations"):
        args = getattr(ours, part)
        assert group[part] == (None if args is None else args.model_dump(mode="json"))
    _assert_loads_back(model, out, mixed=False)


@pytest.mark.filterwarnings(GROUP_SIZES_WARNING, MERGE_WARNING)
def test_mixed_mx_checkpoint_loads_back(tmp_path: Path) -> None:
    # MXFP4XFP8 attention, MXFP6 (FP8 before compressed-tensors 0.20) MLP
    rest = "MXFP6A16" if HAS_FP6 else "FP8"
    recipe = Recipe(
        config_groups={
            "attention": preset_scheme("MXFP4XFP8", [ATTENTION]),
            "mlp": preset_scheme(rest, ["Linear"]),
        },
        ignore=["lm_head"],
    )
    rest_format = "mxfp6-pack-quantized" if HAS_FP6 else "float-quantized"
    assert checkpoint_formats(recipe) == {
        "attention": "mxfp4-pack-quantized",
        "mlp": rest_format,
    }
    model = _calibrated(recipe)
    out = save_compressed(model, tmp_path / "mixed", copy=True)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "mixed-precision"
    _assert_loads_back(model, out, mixed=True)


# ------------------------------------------- before compressed-tensors 0.20


@pytest.mark.skipif(HAS_FP6, reason="compressed-tensors >= 0.20 exports FP6")
def test_fp6_is_calibrated_but_not_exported_before_compressed_tensors_0_20(
    tmp_path: Path,
) -> None:
    needs = r"needs compressed-tensors >= 0\.20 to export \(installed: 0\.1"
    for scheme in ("MXFP6A16", "MXFP6A8"):
        with pytest.raises(ValueError, match=rf"{scheme}: weights float6.*{needs}"):
            checkpoint_formats(Recipe.from_scheme(scheme))
    with pytest.raises(ValueError, match=rf"'mxfp6-pack-quantized' {needs}"):
        checkpoint_formats(Recipe.from_scheme("MXFP4A16"), "mxfp6-pack-quantized")
    fp6 = QuantizationArgs(num_bits=6, type="float")
    kv_cache = Recipe.from_scheme("FP8", kv_cache_scheme=fp6)
    with pytest.raises(ValueError, match=rf"kv_cache_scheme {needs}"):
        checkpoint_formats(kv_cache)
    # quantobs' own calibration and fake quantization: e2m3 values times
    # the blocks' power-of-two scales
    model = _calibrated(Recipe.from_scheme("MXFP6A16", ignore=["lm_head"]))
    levels = set(QuantizationArgs(num_bits=6, type="float").format.values().tolist())
    for entry in attachment_of(model).entries:
        scale = entry.module.weight_scale  # (out, in / 32)
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
        weight = fake_quantize(entry.module.weight, scale, None, entry.args)
        codes = weight.unflatten(-1, (-1, 32)) / scale.unsqueeze(-1)
        assert set(codes.unique().tolist()) <= levels
    with pytest.raises(ValueError, match=needs):
        save_compressed(model, tmp_path / "checkpoint")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(HAS_FP6, reason="compressed-tensors >= 0.20 evaluates FP6")
def test_compare_refuses_fp6_before_compressed_tensors_0_20() -> None:
    needs = r"scheme MXFP6A8 needs compressed-tensors >= 0\.20 to evaluate it"
    with pytest.raises(ValueError, match=needs):
        check_fp6_schemes(["W4A16", "MXFP6A8"], None, COMPARE_TASK)
    check_fp6_schemes(["W4A16", "MXFP4XFP8"], None, COMPARE_TASK)  # no FP6


@NEEDS_FP6
def test_fp6_schemes_pass_the_check_with_compressed_tensors_0_20() -> None:
    fp6 = QuantizationArgs(num_bits=6, type="float")
    check_fp6_schemes(["MXFP6A16", "MXFP6A8"], fp6, COMPARE_TASK)
    fp6_format = "mxfp6-pack-quantized"
    recipe = Recipe.from_scheme("MXFP6A16")
    assert checkpoint_formats(recipe, fp6_format) == {"group_0": fp6_format}
    with pytest.raises(ValueError, match=r"'mxfp6-pack-quantized' cannot store"):
        checkpoint_formats(Recipe.from_scheme("W4A16"), fp6_format)
