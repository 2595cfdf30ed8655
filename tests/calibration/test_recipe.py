"""Recipes: presets, observers, compressed-tensors configs, JSON."""

from __future__ import annotations

import pytest
import torch

from quantobs import QuantizationArgs
from quantobs.calibration import Recipe
from quantobs.calibration.recipe import observer_for


def test_from_scheme_takes_preset_and_observers() -> None:
    recipe = Recipe.from_scheme(
        "FP8",
        ignore=["lm_head"],
        weight_observer="static_mse",
        input_observer=("histogram", {"bins": 512}),
    )
    scheme = recipe.config_groups["group_0"]
    assert scheme.targets == ["Linear"]
    assert recipe.ignore == ["lm_head"]
    assert scheme.weights is not None and scheme.input_activations is not None
    assert observer_for("weight", scheme.weights) == ("static_mse", {})
    assert observer_for("input", scheme.input_activations) == (
        "histogram",
        {"bins": 512},
    )


def test_default_observers_are_llmcompressors() -> None:
    args = QuantizationArgs(num_bits=4, group_size=128)
    assert observer_for("weight", args) == ("memoryless_minmax", {})
    assert observer_for("input", args) == ("static_minmax", {})
    assert observer_for("k", args) == ("minmax", {})  # attention states


def test_coerce_accepts_names_schemes_and_dicts() -> None:
    assert Recipe.coerce("W4A16").config_groups["group_0"].weights is not None
    data = {
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "strategy": "channel"},
            }
        },
        "ignore": ["lm_head"],
    }
    recipe = Recipe.coerce(data)
    assert recipe.config_groups["g"].weights == QuantizationArgs(
        num_bits=8, strategy="channel"
    )
    assert Recipe.coerce(recipe) is recipe


def test_json_round_trip_keeps_dtypes() -> None:
    recipe = Recipe.from_scheme(
        "NVFP4",
        kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", strategy="tensor"),
    )
    again = Recipe.from_json(recipe.to_json())
    assert again == recipe
    weights = again.config_groups["group_0"].weights
    assert weights is not None and weights.scale_dtype == torch.float8_e4m3fn


@pytest.mark.peers
def test_compressed_tensors_round_trip() -> None:
    ct = pytest.importorskip("compressed_tensors.quantization")
    recipe = Recipe.from_scheme("W4A16_ASYM", ignore=["lm_head"])
    config = recipe.to_compressed_tensors(format="pack-quantized")
    assert isinstance(config, ct.QuantizationConfig)
    assert config.format == "pack-quantized"
    assert Recipe.from_compressed_tensors(config) == recipe
    assert Recipe.from_compressed_tensors(recipe.to_compressed_tensors()) == recipe
    as_dict = config.model_dump()
    assert Recipe.from_compressed_tensors(as_dict) == recipe
    # compressed-tensors' own preset expands to the same args
    preset = ct.QuantizationConfig(
        config_groups={"group_0": ct.preset_name_to_scheme("W4A16_ASYM", ["Linear"])},
        ignore=["lm_head"],
    )
    assert Recipe.from_compressed_tensors(preset) == recipe


def test_bad_recipes_say_what_is_wrong() -> None:
    with pytest.raises(KeyError, match="unknown preset scheme 'W3A99'"):
        Recipe.from_scheme("W3A99")
    with pytest.raises(ValueError, match="config_groups must be a non-empty"):
        Recipe(config_groups={})
    with pytest.raises(TypeError, match="a scheme is a QuantizationScheme"):
        Recipe(config_groups={"g": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="an observer is a name or"):
        Recipe.from_scheme("FP8", input_observer=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="QuantizationConfig or its dict"):
        Recipe.from_compressed_tensors(3)
