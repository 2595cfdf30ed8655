"""Weights stored transposed (transformers' `Conv1D`, GPT-2): observed along
their output channels, evaluated through an equivalent Linear, refused by
save_compressed; recipes that quantize nothing are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantobs import QuantizationArgs, fake_quantize
from quantobs.calibration import Recipe, attach, calibrate, save_compressed
from quantobs.calibration.simulate import compressed_tensors_copy
from quantobs.calibration.transposed import as_linear, is_transposed
from quantobs.core.qparams import calculate_qparams
from tests.decoders import build_decoder, tiny_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The river froze early this winter, and the ferry stopped running.",
    "Rain again today.",
    "Observers watch tensors during calibration and choose their ranges.",
    "She planted tomatoes, basil and three kinds of peppers.",
]
INT8_CHANNEL = QuantizationArgs(num_bits=8, strategy="channel")
INT4_GROUP = QuantizationArgs(num_bits=4, strategy="group", group_size=16)


def _batches() -> list[dict[str, torch.Tensor]]:
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return [dict(tokenizer(TEXTS, return_tensors="pt", padding=True))]


def _weights_recipe(args: QuantizationArgs, **kw: object) -> Recipe:
    return Recipe(
        config_groups={"g": {"targets": ["Conv1D"], "weights": args}},
        **kw,  # type: ignore[arg-type]
    )


def _conv1d_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if is_transposed(m)}


@pytest.mark.parametrize("args", [INT8_CHANNEL, INT4_GROUP], ids=["channel", "group"])
def test_conv1d_weights_quantized_per_output_channel(args: QuantizationArgs) -> None:
    """qparams are the min-max ones of `weight.T` `(out, in)`: one row per
    output feature, groups along the input features."""
    model = build_decoder("gpt2")
    attach(model, _weights_recipe(args))
    calibrate(model, [], progress=False)
    layers = _conv1d_layers(model)
    assert len(layers) == 8
    for name, layer in layers.items():
        linear = layer.weight.detach().t()  # (out, in)
        out_features, in_features = linear.shape
        if args.strategy == "group":
            view = linear.reshape(out_features, in_features // 16, 16)
        else:
            view = linear.reshape(out_features, 1, in_features)
        scale, _ = calculate_qparams(view.amin(-1), view.amax(-1), args)
        assert layer.weight_scale.shape == scale.shape, name
        torch.testing.assert_close(layer.weight_scale, scale, rtol=0, atol=0)


def test_conv1d_inputs_observed() -> None:
    model = build_decoder("gpt2")
    attach(model, Recipe.from_scheme("FP8", targets=["Conv1D"]))
    report = calibrate(model, _batches(), progress=False)
    layer = model.transformer.h[0].mlp.c_proj  # 256 -> 64
    assert layer.input_scale.shape == (1,)
    assert report.tokens["transformer.h.0.mlp.c_proj.input"] == int(
        _batches()[0]["attention_mask"].sum()
    )


def test_as_linear_computes_the_same() -> None:
    layer = build_decoder("gpt2").transformer.h[0].attn.c_attn
    x = torch.randn(3, 5, layer.weight.shape[0])  # (B, S, in)
    with torch.no_grad():
        torch.testing.assert_close(as_linear(layer)(x), layer(x))


@pytest.mark.peers
def test_compressed_tensors_copy_holds_the_equivalent_linear() -> None:
    """The evaluation copy replaces each calibrated Conv1D by a Linear that
    compressed-tensors fake-quantizes with our qparams: its logits equal the
    model with each weight fake-quantized along its output channels."""
    pytest.importorskip("compressed_tensors")
    model = build_decoder("gpt2")
    attach(model, _weights_recipe(INT8_CHANNEL))
    calibrate(model, [], progress=False)
    copy = compressed_tensors_copy(model)
    for name in _conv1d_layers(model):
        assert type(copy.get_submodule(name)) is torch.nn.Linear, name
    expected = build_decoder("gpt2")
    with torch.no_grad():
        for name, layer in _conv1d_layers(expected).items():
            ours = model.get_submodule(name)
            fake = fake_quantize(
                layer.weight.t(),
                ours.weight_scale,
                ours.weight_zero_point,
                INT8_CHANNEL,
            )
            layer.weight.copy_(fake.t())
    batch = _batches()[0]
    with torch.no_grad():
        found = copy(**batch).logits
        wanted = expected(**batch).logits
        plain = model(**batch).logits
    torch.testing.assert_close(found, wanted)
    assert not torch.allclose(found, plain)  # the weights were quantized


@pytest.mark.peers
def test_evaluation_of_a_conv1d_model() -> None:
    pytest.importorskip("compressed_tensors")
    from quantobs.report.evaluate import HeldOut, evaluate

    model = build_decoder("gpt2").transformer  # the base GPT2Model
    held_out = HeldOut.of(model, _batches())
    attach(model, Recipe.from_scheme("FP8", targets=["Conv1D"]))
    calibrate(model, _batches(), progress=False)
    evaluation = evaluate(model, held_out)
    assert len(evaluation.weight_sqnr) == 8
    assert all(20 < db < 60 for db in evaluation.weight_sqnr.values())
    assert 0.9 < evaluation.cosine_mean <= 1.0


@pytest.mark.peers
def test_save_compressed_refuses_conv1d_layers(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")
    model = build_decoder("gpt2")
    attach(model, _weights_recipe(INT8_CHANNEL))
    calibrate(model, [], progress=False)
    with pytest.raises(
        ValueError,
        match=r"cannot save 8 quantized Conv1D layer\(s\) \(e\.g\. "
        r"'transformer\.h\.0\.attn\.c_attn'.*ignore.*c_attn\|c_fc\|c_proj",
    ):
        save_compressed(model, tmp_path / "gpt2")
    assert list(tmp_path.iterdir()) == []


def test_linear_target_missing_conv1d_layers_is_refused() -> None:
    """compressed-tensors matches "Linear" by class: GPT-2's Conv1D layers
    would be skipped silently (llm-compressor 0.14 then quantizes none)."""
    model = build_decoder("gpt2")
    with pytest.raises(
        ValueError,
        match=r"targets 'Linear', which does not match the 8 Conv1D layers of "
        r"GPT2LMHeadModel .*add 'Conv1D' to the targets",
    ):
        attach(model, Recipe.from_scheme("W8A16"))
    # leaving them out on purpose is fine: only lm_head is quantized
    attachment = attach(model, Recipe.from_scheme("FP8_DYNAMIC", ignore=["Conv1D"]))
    assert [e.key for e in attachment.entries] == ["lm_head.weight"]


def test_recipe_that_quantizes_nothing_is_refused() -> None:
    model = build_decoder("gpt2")
    with pytest.raises(
        ValueError,
        match=r"quantizes nothing: every module its targets \['Linear'\] match is "
        r"in its ignore list \['lm_head', 'Conv1D'\]; the model's linear layers "
        r"are Conv1D .*target 'Conv1D'",
    ):
        attach(model, Recipe.from_scheme("W8A16", ignore=["lm_head", "Conv1D"]))
    assert not any(n.endswith("_observer") for n, _ in model.named_modules())


def test_recipe_that_quantizes_nothing_names_fused_experts() -> None:
    model = build_decoder("qwen3_moe")
    with pytest.raises(
        ValueError,
        match=r"quantizes nothing.*MoE experts are fused 3-D parameters "
        r"\(e\.g\. 'model\.layers\.0\.mlp\.experts'\)",
    ):
        attach(model, Recipe.from_scheme("W8A16", ignore=["Linear"]))
