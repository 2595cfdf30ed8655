"""Layer by layer (`calibrate(..., pipeline="layer")`): the qparams of a
whole-model pass bit for bit on tiny decoders of several families (dense,
GQA, Conv1D, MoE, per-layer masks, kv cache, static_mse and imatrix_mse,
`lm_head` targeted), alone and synced over 2 gloo processes; the quantized
propagation against the same model with the first layer's weights
fake-quantized by hand; how the pipeline is chosen and where the layers are
found."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs.calibration import Recipe, attach, attachment_of, calibrate, text_batches
from quantobs.calibration.lifecycle import Calibration
from quantobs.calibration.sequential import (
    activation_bytes,
    choose,
    decoder_layers,
    fits,
    free_memory,
)
from quantobs.core.quantize import fake_quantize
from tests.calibration import dist_workers as workers
from tests.calibration.conftest import SENTENCES
from tests.decoders import build_decoder, kv_cache_quantizable, tiny_tokenizer

Qparams = dict[str, torch.Tensor]

_STATIC8 = {"num_bits": 8, "strategy": "tensor", "observer": "static_mse"}
_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor"}


def _recipe(case: str, family: str) -> Recipe:
    targets = ["Linear", "Conv1D"] if family == "gpt2" else ["Linear"]
    if case == "kv_fp8":  # FP8 weights, static FP8 inputs, FP8 kv cache
        weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
        group = {"targets": targets, "weights": weights, "input_activations": _FP8}
        # (no kv cache where compressed-tensors cannot quantize one:
        # tests/decoders.py kv_cache_quantizable)
        kv = _FP8 if kv_cache_quantizable() else None
        return Recipe(
            config_groups={"g": group}, ignore=["lm_head"], kv_cache_scheme=kv
        )
    if case == "mse":  # static_mse inputs, imatrix_mse weights
        weights = {"num_bits": 4, "strategy": "channel", "observer": "imatrix_mse"}
        group = {"targets": targets, "weights": weights, "input_activations": _STATIC8}
        return Recipe(config_groups={"g": group}, ignore=["lm_head"])
    if case == "head":  # lm_head targeted: run on the last layer's outputs
        weights = {"num_bits": 8, "strategy": "channel"}
        inputs = {"num_bits": 8, "strategy": "tensor"}
        group = {"targets": targets, "weights": weights, "input_activations": inputs}
        return Recipe(config_groups={"g": group})
    return Recipe.from_scheme(case, targets=targets, ignore=["lm_head"])


@functools.cache
def _batches() -> list[dict[str, torch.Tensor]]:
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return text_batches(tokenizer, SENTENCES[:6], batch_size=3, max_length=24)


def _qparams(model: torch.nn.Module) -> Qparams:
    return {
        name: value.detach().clone()
        for name, value in model.named_parameters()
        if name.endswith(("_scale", "_zero_point"))
    }


def _calibrated(family: str, case: str, pipeline: str) -> tuple[Qparams, Any]:
    model = build_decoder(family)
    attach(model, _recipe(case, family))
    report = calibrate(model, _batches(), progress=False, pipeline=pipeline)
    return _qparams(model), report


@pytest.mark.parametrize(
    ("family", "case"),
    [
        ("llama", "kv_fp8"),  # GQA, kv cache and static inputs
        ("gemma2", "FP8"),  # sliding / global layers: per-layer masks
        ("gpt2", "head"),  # Conv1D weights, lm_head after the layers
        ("qwen2_moe", "FP8"),  # routed experts and a shared expert
        pytest.param("mixtral", "mse", marks=pytest.mark.slow),
        ("opt", "mse"),  # static_mse references, imatrix importance
    ],
)
def test_layer_by_layer_equals_the_whole_model(family: str, case: str) -> None:
    whole, whole_report = _calibrated(family, case, "model")
    layered, layered_report = _calibrated(family, case, "layer")
    assert len(whole) > 10
    assert whole.keys() == layered.keys()
    for key, value in whole.items():
        assert torch.equal(layered[key], value), key
    assert layered_report.tokens == whole_report.tokens
    assert layered_report.experts == whole_report.experts
    assert layered_report.batches == whole_report.batches == len(_batches())
    if case == "head":
        assert "lm_head.input_scale" in layered


def _one_process(name: str) -> tuple[Qparams, dict[str, int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: matmul results depend on it
    try:
        everything = list(range(workers.NUM_BATCHES))
        return workers.calibrate_model(name, everything, sync=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_synced_layer_by_layer_equals_one_whole_model_process(tmp_path: Path) -> None:
    """2 gloo processes, each its shard, one layer at a time: the qparams and
    token counts of one process calibrating the whole model on every batch
    (static_mse references agreed per layer, imatrix importance synced per
    layer)."""
    runs = workers.launch(workers.layered, 2, tmp_path)
    for name in ("static_mse", "imatrix_mse"):
        expected, tokens = _one_process(name)
        for rank, run in enumerate(runs):
            found, found_tokens = run[name]
            assert found.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(found[key], value), (rank, name, key)
            assert found_tokens == tokens


# ------------------------------------------------------- quantized outputs


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(128, 128, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(hidden))


class _Toy(torch.nn.Module):
    """Embedding, two blocks, a head: the decoder layers of no transformers
    class (found as the ModuleList of one class)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(40, 128)
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(128, 40)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


def _toy_recipe() -> Recipe:
    weights = {"num_bits": 4, "strategy": "channel"}
    inputs = {"num_bits": 8, "strategy": "tensor"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return Recipe(config_groups={"g": group}, ignore=["head"])


def _toy_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (2, 7), generator=generator)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # padding: the hooks keep real tokens only
    return [{"input_ids": ids, "attention_mask": mask}]


def test_quantized_propagation_passes_the_fake_quantized_outputs() -> None:
    batches = _toy_batches()
    plain = _Toy()
    attach(plain, _toy_recipe())
    calibrate(plain, batches, progress=False, pipeline="layer")
    quantized = _Toy()
    attach(quantized, _toy_recipe())
    calibrate(
        quantized, batches, progress=False, pipeline="layer", propagate="quantized"
    )
    # the first layer's weights are those it sees: its qparams are the same
    first = "layers.0.fc"
    plain_q, found = _qparams(plain), _qparams(quantized)
    for kind in ("weight_scale", "input_scale"):
        assert torch.equal(found[f"{first}.{kind}"], plain_q[f"{first}.{kind}"])
    # by hand: layer 0's weight fake-quantized under its written qparams, then
    # the whole model calibrated on it gives layer 1's input scale
    fc = quantized.layers[0].fc
    entries = attachment_of(quantized).entries
    args = next(e.args for e in entries if e.key == f"{first}.weight")
    by_hand = _Toy()
    with torch.no_grad():
        by_hand.layers[0].fc.weight.copy_(
            fake_quantize(fc.weight, fc.weight_scale, fc.weight_zero_point, args)
        )
    attach(by_hand, _toy_recipe())
    calibrate(by_hand, batches, progress=False, pipeline="model")
    expected = _qparams(by_hand)["layers.1.fc.input_scale"]
    assert torch.equal(found["layers.1.fc.input_scale"], expected)
    assert not torch.equal(plain_q["layers.1.fc.input_scale"], expected)
    # the model's weights are left as they were
    assert torch.equal(quantized.layers[0].fc.weight, _Toy().layers[0].fc.weight)


# ------------------------------------------------------------- the choice


def test_decoder_layers_are_found_generically() -> None:
    assert decoder_layers(build_decoder("llama"))[0] == "model.layers"  # type: ignore[index]
    assert decoder_layers(build_decoder("gpt2"))[0] == "transformer.h"  # type: ignore[index]
    assert decoder_layers(build_decoder("opt"))[0] == "model.decoder.layers"  # type: ignore[index]
    assert decoder_layers(_Toy())[0] == "layers"  # type: ignore[index]
    assert decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


def test_auto_is_layer_by_layer_for_a_model_accelerate_offloads() -> None:
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    model = build_decoder("llama")
    assert choose(model, "auto", needs_data=True) == "model"
    assert choose(model, "layer", needs_data=False) == "model"  # no batch runs
    hook = accelerate_hooks.ModelHook()
    accelerate_hooks.add_hook_to_module(model.model.layers[1], hook)
    assert choose(model, "auto", needs_data=True) == "layer"
    assert choose(model, "model", needs_data=True) == "model"


def test_fits_counts_parameters_and_activations_against_free_memory() -> None:
    assert fits(600, 400, 1000)
    assert not fits(600, 401, 1000)
    assert not fits(1, 0, 0)
    assert fits(10**15, 10**15, None)  # not measurable: taken to fit


def test_activations_are_estimated_from_the_widest_output() -> None:
    model = build_decoder("llama")
    widest = max(
        model.config.vocab_size,
        *(m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)),
    )
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert activation_bytes(model, {"input_ids": ids}) == 2 * 5 * widest * 4 * 3
    assert activation_bytes(model, (ids,)) == activation_bytes(model, ids)
    assert activation_bytes(model, None) == 0


def test_free_memory_is_measured_where_it_can_be() -> None:
    found = free_memory(torch.device("cpu"))
    assert found is None or found > 0  # psutil, else /proc/meminfo
    assert free_memory(torch.device("meta")) is None


def test_auto_is_layer_by_layer_when_the_model_does_not_fit_its_device() -> None:
    """`device_memory` stands for the device: one byte short of the model's
    parameters and its first batch's activations, `"auto"` calibrates layer
    by layer (with the whole model's qparams); with room, whole."""
    model, plain = build_decoder("llama"), build_decoder("llama")
    tensors = [*model.parameters(), *model.buffers()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    needed = size + activation_bytes(model, _batches()[0])
    batch = _batches()[0]
    assert choose(model, "auto", True, batch=batch, device_memory=needed) == "model"
    assert choose(model, "auto", True, batch=batch, device_memory=needed - 1) == (
        "layer"
    )
    for each in (model, plain):
        attach(each, _recipe("FP8", "llama"))
    calibrate(model, iter(_batches()), progress=False, device_memory=needed - 1)
    calibrate(plain, _batches(), progress=False, device_memory=needed)
    assert Calibration.of(model).pipeline == "layer"
    assert Calibration.of(plain).pipeline == "model"
    found, expected = _qparams(model), _qparams(plain)
    assert found.keys() == expected.keys() and len(found) > 10
    assert all(torch.equal(found[k], v) for k, v in expected.items())


def test_bad_pipelines_are_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(128, 128))
    attach(model, _toy_recipe())
    batch = torch.randn(2, 128)
    with pytest.raises(ValueError, match="pipeline='layer' needs decoder layers"):
        calibrate(model, [batch], progress=False, pipeline="layer")
    with pytest.raises(ValueError, match="pipeline must be one of"):
        calibrate(model, [batch], progress=False, pipeline="layers")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="propagate must be one of"):
        calibrate(model, [batch], progress=False, propagate="fake")  # type: ignore[arg-type]
    calibrate(model, [batch], progress=False)  # auto: the whole model
    assert "0.input_scale" in _qparams(model)


def test_a_model_with_accelerate_hooks_calibrates_layer_by_layer() -> None:
    """accelerate's `AlignDevicesHook` on every layer (its forward wrapped):
    `"auto"` calibrates layer by layer, with the qparams of the whole model,
    and leaves accelerate's forwards in place."""
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    hooked, plain = build_decoder("llama"), build_decoder("llama")
    for layer in hooked.model.layers:
        accelerate_hooks.add_hook_to_module(
            layer, accelerate_hooks.AlignDevicesHook(execution_device="cpu")
        )
    wrapped = [layer.forward for layer in hooked.model.layers]
    for model in (hooked, plain):
        attach(model, _recipe("kv_fp8", "llama"))
    assert choose(hooked, "auto", needs_data=True) == "layer"
    calibrate(hooked, _batches(), progress=False)  # auto: layer by layer
    calibrate(plain, _batches(), progress=False, pipeline="model")
    found, expected = _qparams(hooked), _qparams(plain)
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[k], v) for k, v in expected.items())
    assert [layer.forward for layer in hooked.model.layers] == wrapped
