"""attach / detach: observers as submodules, hooks, q/k/v, errors."""

from __future__ import annotations

import pytest
import torch

from quantobs import QuantizationArgs
from quantobs.calibration import Recipe, attach, calibrate, detach, observers_of
from quantobs.observers import MinMaxObserver
from tests.calibration.conftest import tiny_llama, token_batches
from tests.decoders import KV_CACHE_REASON, kv_cache_quantizable

FP8_TENSOR = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
FP8_HEADS = QuantizationArgs(num_bits=8, type="float", strategy="attn_head")


def _observer_modules(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n.endswith("_observer")]


def _hook_count(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()
    )


def test_attach_registers_observers_and_detach_removes_everything(
    minilm: torch.nn.Module, batches: list
) -> None:
    hooks = _hook_count(minilm)
    attachment = attach(minilm, Recipe.from_scheme("FP8", ignore=["re:.*pooler.*"]))
    names = _observer_modules(minilm)
    assert len(names) == 2 * 36  # weight and input of 36 Linear layers
    assert "encoder.layer.0.attention.self.query.weight_observer" in names
    assert "encoder.layer.0.attention.self.query.input_observer" in names
    assert _hook_count(minilm) == hooks + 36  # one pre-hook per input observer
    assert len(attachment.entries) == 72
    entry, observer = next(observers_of(minilm))
    assert entry.key == "encoder.layer.0.attention.self.query.weight"
    assert observer is minilm.encoder.layer[0].attention.self.query.weight_observer
    assert isinstance(minilm.pooler.dense, torch.nn.Linear)
    assert not hasattr(minilm.pooler.dense, "weight_observer")  # ignored
    calibrate(minilm, batches[:1], progress=False)
    detach(minilm)
    assert _observer_modules(minilm) == []
    assert _hook_count(minilm) == hooks
    assert not hasattr(minilm, "_quantobs_attachment")
    # the qparams stay
    assert minilm.encoder.layer[0].attention.self.query.input_scale.numel() == 1


def test_observing_does_not_change_the_forward(
    minilm: torch.nn.Module, batches: list
) -> None:
    with torch.no_grad():
        before = minilm(**batches[0]).last_hidden_state
    recipe = Recipe.from_scheme("FP8")
    recipe.config_groups["attn"] = recipe.config_groups["group_0"].model_copy(
        update={"targets": ["BertSelfAttention"], "weights": None}
    )
    attach(minilm, recipe)
    assert minilm.config._attn_implementation == "quantobs_observed"
    with torch.no_grad():
        during = minilm(**batches[0]).last_hidden_state
    detach(minilm)
    assert minilm.config._attn_implementation == "sdpa"
    assert torch.equal(before, during)


def test_bert_query_states_observed_but_no_kv_cache(
    minilm: torch.nn.Module, batches: list
) -> None:
    """BERT's attention has no kv cache compressed-tensors quantizes: a
    kv_cache_scheme is refused; its query states are still observed (and
    save_compressed refuses them, tests/calibration/test_export.py)."""
    query = {"targets": ["BertSelfAttention"], "input_activations": FP8_TENSOR}
    with pytest.raises(ValueError, match=r"BertSelfAttention has none of the"):
        attach(minilm, Recipe(config_groups={"attn": query}, kv_cache_scheme=FP8_HEADS))
    assert _observer_modules(minilm) == []
    attach(minilm, Recipe(config_groups={"attn": query}))
    assert {n.rsplit(".", 1)[-1] for n in _observer_modules(minilm)} == {"q_observer"}
    calibrate(minilm, batches, progress=False)
    attention = minilm.encoder.layer[2].attention.self
    assert attention.q_scale.shape == (1,)
    assert type(attention.q_observer) is MinMaxObserver  # llm-compressor's default


@pytest.mark.skipif(not kv_cache_quantizable(), reason=KV_CACHE_REASON)
def test_llama_attention_states_after_rope_with_kv_heads() -> None:
    model = tiny_llama()
    recipe = Recipe(
        config_groups={
            "attn": {"targets": ["LlamaAttention"], "input_activations": FP8_HEADS}
        },
        kv_cache_scheme=FP8_HEADS,
    )
    attach(model, recipe)
    report = calibrate(model, token_batches(3), progress=False)
    attention = model.model.layers[1].self_attn
    assert attention.q_scale.shape == (4, 1, 1)  # attention heads
    assert attention.k_scale.shape == (2, 1, 1)  # key/value heads
    assert attention.v_scale.shape == (2, 1, 1)
    assert report.tokens["model.layers.1.self_attn.k"] == 3 * 2 * 16
    for name in ("q_scale", "k_scale", "v_scale"):
        scale = getattr(attention, name)
        assert torch.isfinite(scale).all() and (scale > 0).all()
    detach(model)
    assert model.config._attn_implementation != "quantobs_observed"


def test_unmatched_target_lists_close_names(minilm: torch.nn.Module) -> None:
    recipe = Recipe.from_scheme("W4A16", targets=["Linaer"])
    with pytest.raises(
        ValueError, match=r"target 'Linaer' matches no module.*'Linear'"
    ):
        attach(minilm, recipe)
    assert _observer_modules(minilm) == []


def test_layer_the_scheme_cannot_take_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 8))
    with pytest.raises(
        ValueError, match=r"layer '1' \(Linear, weight shape \[8, 64\]\)"
    ):
        attach(model, "W4A16")  # groups of 128 do not divide 64 columns
    assert _observer_modules(model) == []
    attach(model, Recipe.from_scheme("W4A16", ignore=["1"]))
    assert _observer_modules(model) == ["0.weight_observer"]


def test_attach_twice_and_detach_without_attach_are_errors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(128, 8))
    attach(model, "W8A16")
    with pytest.raises(RuntimeError, match="already attached"):
        attach(model, "W8A16")
    detach(model)
    with pytest.raises(RuntimeError, match="no quantobs observers"):
        detach(model)


def test_unknown_observer_name_is_a_key_error() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(128, 8))
    with pytest.raises(KeyError, match="static_mimnax"):
        attach(model, Recipe.from_scheme("FP8", input_observer="static_mimnax"))
    assert _observer_modules(model) == []
