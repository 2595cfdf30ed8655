"""save_state / load_state: a crashed calibration resumes bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantobs import QuantizationArgs
from quantobs.calibration import Recipe, attach, calibrate
from quantobs.calibration.state import load_state, save_state
from tests.calibration.conftest import tiny_llama, token_batches

INT8 = QuantizationArgs(num_bits=8, strategy="tensor")
EXACT_OBSERVERS = [
    "static_minmax",
    "static_mse",
    "histogram",
    "percentile",
    "entropy",
    "histogram_mse",
]


def _recipe(observer: str) -> Recipe:
    return Recipe(
        config_groups={
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "strategy": "channel"},
                "input_activations": INT8.model_copy(update={"observer": observer}),
                "output_activations": INT8.model_copy(update={"observer": observer}),
            }
        },
        ignore=["lm_head"],
    )


def _qparams(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: value.detach().clone()
        for name, value in model.named_parameters()
        if name.endswith(("_scale", "_zero_point"))
    }


@pytest.mark.parametrize("observer", EXACT_OBSERVERS)
def test_resume_after_a_crash_is_bit_identical(observer: str, tmp_path: Path) -> None:
    first, second = token_batches(3, seed=1), token_batches(3, seed=2, size=(3, 9))
    whole = tiny_llama()
    attach(whole, _recipe(observer))
    calibrate(whole, first + second, progress=False)

    crashed = tiny_llama()
    attach(crashed, _recipe(observer))
    calibrate(crashed, first, progress=False)
    path = save_state(crashed, tmp_path / "state.safetensors")
    del crashed

    resumed = tiny_llama()
    attach(resumed, _recipe(observer))
    load_state(resumed, path)
    report = calibrate(resumed, second, progress=False)

    expected, found = _qparams(whole), _qparams(resumed)
    assert expected.keys() == found.keys() and len(found) > 20
    for name, value in expected.items():
        assert torch.equal(value, found[name]), name
    # tokens carry over
    assert report.tokens["model.layers.0.mlp.down_proj.input"] == 3 * 2 * 16 + 3 * 3 * 9


def test_state_file_has_a_json_header(tmp_path: Path) -> None:
    from safetensors import safe_open

    import quantobs

    model = tiny_llama()
    attach(model, _recipe("histogram"))
    calibrate(model, token_batches(1), progress=False)
    path = save_state(model, tmp_path / "s.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata()
        keys = list(handle.keys())
    assert header["quantobs_version"] == quantobs.__version__
    assert Recipe.from_json(header["recipe"]) == _recipe("histogram")
    entries = json.loads(header["entries"])
    assert entries["model.layers.0.mlp.up_proj.input"]["extra"]["observer"] == (
        "histogram"
    )
    assert any(k.startswith("model.layers.0.mlp.up_proj.input/") for k in keys)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temp left


def test_load_state_refuses_what_does_not_fit(tmp_path: Path) -> None:
    model = tiny_llama()
    attach(model, _recipe("static_minmax"))
    calibrate(model, token_batches(1), progress=False)
    path = save_state(model, tmp_path / "s.safetensors")

    other = tiny_llama()
    attach(other, _recipe("histogram"))
    with pytest.raises(ValueError, match="saved under another recipe"):
        load_state(other, path)

    bigger = tiny_llama(layers=3)
    attach(bigger, _recipe("static_minmax"))
    with pytest.raises(ValueError, match="holds other observers than the model"):
        load_state(bigger, path)

    with pytest.raises(FileNotFoundError, match="no calibration state file"):
        load_state(bigger, tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_state(bigger, garbage)
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(1)}, str(foreign))
    with pytest.raises(ValueError, match="not a quantobs calibration state"):
        load_state(bigger, foreign)


def test_save_into_a_missing_directory_writes_nothing(tmp_path: Path) -> None:
    model = tiny_llama()
    attach(model, _recipe("static_minmax"))
    calibrate(model, token_batches(1), progress=False)
    with pytest.raises(OSError):
        save_state(model, tmp_path / "missing" / "s.safetensors")
    assert list(tmp_path.iterdir()) == []
