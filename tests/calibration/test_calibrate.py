"""calibrate: qparams written as compressed-tensors names them, fused global
scales, observers that saw nothing, the report, retained memory."""

from __future__ import annotations

import gc

import pytest
import torch

import quantobs
from quantobs import QuantizationArgs
from quantobs.calibration import (
    DEFAULT_EMPTY_RANGE,
    Recipe,
    attach,
    calibrate,
    observers_of,
)
from quantobs.core.qparams import amax_to_global_scale
from tests.calibration.conftest import tiny_llama, token_batches

INT8_STATIC = QuantizationArgs(num_bits=8, strategy="tensor", symmetric=False)


def test_qparams_equal_the_observers_on_the_same_values(
    minilm: torch.nn.Module, batches: list
) -> None:
    """weight_scale: the weight's own qparams; input_scale: static min-max
    over every real token (padding excluded) that reached the layer."""
    layer = minilm.encoder.layer[3].intermediate.dense
    inputs: list[torch.Tensor] = []
    layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
    recipe = Recipe(
        config_groups={
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "group_size": 128},
                "input_activations": INT8_STATIC,
            }
        },
        ignore=["re:.*pooler.*"],
    )
    attach(minilm, recipe)
    report = calibrate(minilm, batches, progress=False)
    args = recipe.config_groups["g"]
    w_args, a_args = args.weights, args.input_activations
    assert w_args is not None and a_args is not None
    flat = quantobs.flatten_for_calibration(layer.weight, "weight", w_args)
    scale, zero_point = quantobs.calculate_qparams(
        flat.amin(dim=(0, -1)), flat.amax(dim=(0, -1)), w_args
    )
    assert torch.equal(layer.weight_scale, scale)
    assert torch.equal(layer.weight_zero_point, zero_point)
    values = torch.cat(
        [x[b["attention_mask"] != 0] for x, b in zip(inputs, batches, strict=True)]
    )
    assert values.shape[0] < sum(x.shape[0] * x.shape[1] for x in inputs)  # padded
    scale, zero_point = quantobs.calculate_qparams(
        values.min().reshape(1), values.max().reshape(1), a_args
    )
    assert torch.equal(layer.input_scale, scale)
    assert torch.equal(layer.input_zero_point, zero_point)
    assert layer.input_zero_point.dtype == torch.int8
    assert layer.weight_scale.dtype == torch.float32  # the model's dtype
    assert report.tokens["encoder.layer.3.intermediate.dense.input"] == values.shape[0]
    assert report.batches == len(batches) and report.empty == []
    assert len(report.modules) == 36
    assert "calibrated 36 modules on 4 batches" in str(report)


def test_scale_dtype_follows_the_model() -> None:
    model = tiny_llama().to(torch.bfloat16)
    attach(model, Recipe.from_scheme("FP8", ignore=["lm_head"]))
    calibrate(model, token_batches(2), progress=False)
    proj = model.model.layers[0].mlp.down_proj
    assert proj.weight_scale.dtype == torch.bfloat16
    assert proj.input_scale.dtype == torch.bfloat16
    assert proj.input_zero_point.dtype == torch.float8_e4m3fn
    assert not proj.weight_scale.requires_grad


def test_nvfp4_global_scales_are_shared_by_fused_layers() -> None:
    model = tiny_llama()
    attach(model, Recipe.from_scheme("NVFP4", ignore=["lm_head"]))
    calibrate(model, token_batches(2), progress=False)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        amax = max(float(m.weight.detach().abs().max()) for m in qkv)
        expected = amax_to_global_scale(torch.tensor([amax]))
        for module in qkv:
            assert torch.equal(module.weight_global_scale, expected)
        assert torch.equal(
            mlp.gate_proj.weight_global_scale, mlp.up_proj.weight_global_scale
        )
        # not fused: its own
        own = amax_to_global_scale(attn.o_proj.weight.detach().abs().amax().reshape(1))
        assert torch.equal(attn.o_proj.weight_global_scale, own)
        # the group scales are computed under the shared global scale
        args = QuantizationArgs(
            num_bits=4,
            type="float",
            strategy="tensor_group",
            group_size=16,
            scale_dtype=torch.float8_e4m3fn,
            zp_dtype=torch.float8_e4m3fn,
        )
        flat = quantobs.flatten_for_calibration(attn.k_proj.weight, "weight", args)
        scale, _ = quantobs.calculate_qparams(
            flat.amin(dim=(0, -1)), flat.amax(dim=(0, -1)), args, expected
        )
        assert torch.equal(attn.k_proj.weight_scale, scale)
        # NVFP4 inputs are locally dynamic: only their global scale is static
        assert hasattr(attn.q_proj, "input_global_scale")
        assert not hasattr(attn.q_proj, "input_scale")


class _TwoExperts(torch.nn.Module):
    """Token routing where expert 1 may get no token at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
        self.route_all_to_first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, 32)
        chosen = (
            torch.zeros(len(tokens), dtype=torch.long)
            if self.route_all_to_first
            else torch.arange(len(tokens)) % 2
        )
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            mask = chosen == index
            if mask.any():
                out[mask] = expert(tokens[mask])
        return out


def test_an_expert_no_token_reached_raises_by_default() -> None:
    model = _TwoExperts()
    attach(model, Recipe.from_scheme("FP8"))
    with pytest.raises(RuntimeError, match=r"saw no data: experts\.1\.input"):
        calibrate(model, [torch.randn(4, 32)], progress=False)
    assert not hasattr(model.experts[1], "input_scale")  # nothing half-written


def test_an_expert_no_token_reached_falls_back_to_its_siblings() -> None:
    model = _TwoExperts()
    attach(model, Recipe.from_scheme("FP8"))
    x = torch.randn(4, 32)
    with pytest.warns(RuntimeWarning, match=r"experts\.1\.input"):
        report = calibrate(model, [x], progress=False, on_empty="fallback")
    assert report.empty == ["experts.1.input"]
    assert report.tokens == {"experts.0.input": 4, "experts.1.input": 0}
    assert torch.equal(model.experts[1].input_scale, model.experts[0].input_scale)
    assert torch.equal(model.experts[0].input_scale, (x.abs().max() / 448).reshape(1))


def test_fallback_without_siblings_uses_the_documented_default() -> None:
    model = _TwoExperts()
    recipe = Recipe(
        config_groups={
            "a": {"targets": ["experts.0"], "input_activations": INT8_STATIC},
            "b": {"targets": ["experts.1"], "input_activations": INT8_STATIC},
        }
    )
    attach(model, recipe)
    with pytest.warns(RuntimeWarning, match="saw no data"):
        calibrate(model, [torch.randn(4, 32)], progress=False, on_empty="fallback")
    low, high = DEFAULT_EMPTY_RANGE
    scale, zero_point = quantobs.calculate_qparams(
        torch.tensor([low]), torch.tensor([high]), INT8_STATIC
    )
    assert torch.equal(model.experts[1].input_scale, scale)
    assert torch.equal(model.experts[1].input_zero_point, zero_point)
    assert torch.isfinite(model.experts[1].input_scale).all()


def test_calibrating_again_continues() -> None:
    """Two calls on halves give the qparams of one call on everything."""
    batches = token_batches(4)
    recipe = Recipe.from_scheme("FP8", ignore=["lm_head"], input_observer="histogram")
    whole, halves = tiny_llama(), tiny_llama()
    attach(whole, recipe)
    calibrate(whole, batches, progress=False)
    attach(halves, recipe)
    calibrate(halves, batches[:2], progress=False)
    calibrate(halves, batches[2:], progress=False)
    assert torch.equal(
        whole.model.layers[1].mlp.down_proj.input_scale,
        halves.model.layers[1].mlp.down_proj.input_scale,
    )


def _state_bytes(model: torch.nn.Module) -> int:
    buffers = [b for _, o in observers_of(model) for b in o.buffers()]
    return sum(b.numel() * b.element_size() for b in buffers)


def _live_tensor_bytes() -> int:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("observer", ["static_minmax", "histogram", "static_mse"])
def test_retained_memory_does_not_grow_with_batches(observer: str) -> None:
    """Observers keep O(qparams) state: after 2 or 12 batches the same bytes
    are alive (an 8-layer model; no activation is kept)."""
    model = tiny_llama(layers=8)
    attach(
        model, Recipe.from_scheme("FP8", ignore=["lm_head"], input_observer=observer)
    )
    batches = token_batches(12)
    calibrate(model, batches[:2], progress=False)
    state = sum(
        b.numel() * b.element_size()
        for _, o in observers_of(model)
        for b in o.buffers()
    )
    after_two = _live_tensor_bytes()
    calibrate(model, batches[2:], progress=False)
    after_twelve = _live_tensor_bytes()
    assert after_twelve == after_two
    again = sum(
        b.numel() * b.element_size()
        for _, o in observers_of(model)
        for b in o.buffers()
    )
    if observer != "histogram":  # histograms may re-bin to a wider grid
        assert again == state


def test_batches_of_every_form() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    attach(model, Recipe.from_scheme("FP8"))
    x = torch.randn(3, 16)
    report = calibrate(model, iter([x, (x,), {"input": x}]), progress=False)
    assert report.batches == 3 and report.tokens == {"0.input": 9}


def test_calibrate_needs_observers_and_distributed_sync_needs_a_group() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    with pytest.raises(RuntimeError, match="no quantobs observers"):
        calibrate(model, [torch.randn(2, 16)])
    attach(model, Recipe.from_scheme("FP8"))
    with pytest.raises(RuntimeError, match=r"initialized torch\.distributed"):
        calibrate(model, [torch.randn(2, 16)], sync=True)


def test_progress_bar_on_request_and_off_when_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    attach(model, Recipe.from_scheme("FP8"))
    calibrate(model, [torch.randn(2, 16)] * 3, progress=True)
    assert "calibrating" in capsys.readouterr().err
    calibrate(model, [torch.randn(2, 16)] * 3)  # stderr is captured: no TTY
    assert capsys.readouterr().err == ""


def test_imatrix_weights_are_weighted_by_the_calibration_inputs() -> None:
    """`imatrix_mse` weights are searched after the batches, weighted by the
    importance E[x ** 2] of the inputs the layer saw; detach removes the
    importance hooks too."""
    model = tiny_llama()
    proj = model.model.layers[1].mlp.down_proj
    inputs: list[torch.Tensor] = []
    proj.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
    hooks = len(proj._forward_pre_hooks)
    recipe = Recipe.from_scheme(
        "W4A16", targets=["re:.*down_proj$"], weight_observer="imatrix_mse"
    )
    attach(model, recipe)
    calibrate(model, token_batches(3), progress=False)
    x = torch.cat([i.reshape(-1, proj.in_features) for i in inputs])
    weights = recipe.config_groups["group_0"].weights
    assert weights is not None
    reference = quantobs.Observer.load_from_registry(
        "imatrix_mse", base_name="weight", args=weights
    )
    reference.set_importance(x.pow(2).mean(0))
    scale, zero_point = reference(proj.weight.detach())
    assert torch.equal(proj.weight_scale, scale)
    assert torch.equal(proj.weight_zero_point, zero_point)
    unweighted = quantobs.Observer.load_from_registry(
        "imatrix_mse", base_name="weight", args=weights
    )
    assert not torch.equal(unweighted(proj.weight.detach())[0], scale)
    from quantobs.calibration import detach

    detach(model)
    assert len(proj._forward_pre_hooks) == hooks
