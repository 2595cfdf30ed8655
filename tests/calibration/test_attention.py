"""Attention states and the kv cache: observed on exactly the modules
compressed-tensors quantizes, where it quantizes them, exported and reloaded
by transformers, refused where compressed-tensors cannot apply them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantobs import QuantizationArgs
from quantobs.calibration import Recipe, attach, calibrate, detach, save_compressed
from quantobs.calibration.attention import cached_attention_modules
from quantobs.calibration.experts import ExpertsReloadWarning
from quantobs.calibration.recipe import observer_for
from quantobs.observers import MinMaxObserver
from tests.decoders import (
    KV_CACHE_REASON,
    MOE,
    build_decoder,
    kv_cache_quantizable,
    tiny_tokenizer,
)

pytestmark = pytest.mark.peers
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

FP8_TENSOR = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
FP8_HEADS = QuantizationArgs(num_bits=8, type="float", strategy="attn_head")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
#: The dequantized transformers load warns that the checkpoint's own
#: quantization_config wins over the one passed (only `dequantize` is taken).
MERGE_WARNING = "ignore:You passed `quantization_config`:UserWarning"
TEXTS = [
    "The river froze early this winter, and the ferry stopped running.",
    "Rain again today.",
    "Observers watch tensors during calibration and choose their ranges.",
]


def _batches() -> list[dict[str, torch.Tensor]]:
    """One padded batch and one single text (the padding must not count)."""
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return [
        dict(tokenizer(TEXTS, return_tensors="pt", padding=True)),
        dict(tokenizer(TEXTS[1], return_tensors="pt")),
    ]


def _kv_recipe(kv: QuantizationArgs = FP8_TENSOR) -> Recipe:
    return Recipe.from_scheme("FP8", ignore=["lm_head"], kv_cache_scheme=kv)


def _kv_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{base}_scale": getattr(module, f"{base}_scale").detach().clone()
        for name, module in model.named_modules()
        for base in ("k", "v")
        if hasattr(module, f"{base}_scale")
    }


def _reloaded_kv_scales(out: Path) -> dict[str, torch.Tensor]:
    config = transformers.utils.quantization_config.CompressedTensorsConfig(
        dequantize=True
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=config
    )
    return _kv_scales(loaded)


#: the tests of what compressed-tensors quantizes in the kv cache: none where
#: the installed transformers names the cache `cache` (5.24)
needs_kv_cache = pytest.mark.skipif(not kv_cache_quantizable(), reason=KV_CACHE_REASON)

KV_FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "phi3", "deepseek_v3"]


@needs_kv_cache
@pytest.mark.slow
@pytest.mark.filterwarnings(MERGE_WARNING)
@pytest.mark.parametrize("family", KV_FAMILIES)
def test_kv_cache_scales_reload_in_transformers(family: str, tmp_path: Path) -> None:
    """A `kv_cache_scheme` observes k / v on every attention module (no
    config group targets them), and transformers loads the same scales."""
    model = build_decoder(family)
    attachment = attach(model, _kv_recipe())
    attention = [name for name, _ in cached_attention_modules(model)]
    assert len(attention) == 2
    kv_keys = [e.key for e in attachment.entries if e.group == "kv_cache"]
    assert kv_keys == [f"{n}.{b}" for n in attention for b in ("k", "v")]
    report = calibrate(model, _batches(), progress=False)
    real = sum(int(b["attention_mask"].sum()) for b in _batches())
    assert report.tokens[kv_keys[0]] == real  # padding never observed
    ours = _kv_scales(model)
    assert len(ours) == 4
    assert all(torch.isfinite(s).all() and (s > 0).all() for s in ours.values())
    if family in MOE:  # FP8 experts: transformers 5.17 drops their input scales
        with pytest.warns(ExpertsReloadWarning, match="FP8 experts"):
            out = save_compressed(model, tmp_path / family)
    else:
        out = save_compressed(model, tmp_path / family)
    loaded = _reloaded_kv_scales(out)
    assert loaded.keys() == ours.keys()
    for name, scale in ours.items():
        torch.testing.assert_close(loaded[name], scale, rtol=0, atol=0)


@needs_kv_cache
@pytest.mark.slow
@pytest.mark.filterwarnings(MERGE_WARNING)
@pytest.mark.parametrize(("family", "heads"), [("llama", 2), ("gemma3", 1)])
def test_kv_cache_per_head_gqa_and_mqa(family: str, heads: int, tmp_path: Path) -> None:
    """`attn_head`: one scale per key/value head (GQA: 2 of 4, MQA: 1)."""
    model = build_decoder(family)
    attach(model, _kv_recipe(FP8_HEADS))
    calibrate(model, _batches(), progress=False)
    ours = _kv_scales(model)
    assert {tuple(s.shape) for s in ours.values()} == {(heads, 1, 1)}
    loaded = _reloaded_kv_scales(save_compressed(model, tmp_path / family))
    for name, scale in ours.items():
        torch.testing.assert_close(loaded[name], scale, rtol=0, atol=0)


@needs_kv_cache
def test_values_are_the_cached_states() -> None:
    """Llama caches the value projection's output per head, unrepeated."""
    model = build_decoder("llama")
    seen: list[torch.Tensor] = []
    model.model.layers[1].self_attn.v_proj.register_forward_hook(
        lambda m, a, out: seen.append(out.detach())
    )
    attach(model, _kv_recipe(FP8_HEADS))
    batch = _batches()[1]  # no padding
    calibrate(model, [batch], progress=False)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    values = seen[0].reshape(-1, 2, head_dim)  # (tokens, kv heads, head_dim)
    expected = values.abs().amax(dim=(0, 2)).reshape(2, 1, 1) / FP8_MAX
    scale = model.model.layers[1].self_attn.v_scale
    torch.testing.assert_close(scale, expected, rtol=0, atol=0)


@needs_kv_cache
def test_latent_attention_caches_the_compressed_latent() -> None:
    """DeepSeek-V3 (MLA) caches the normalized latent as "keys" and the
    rotated shared key part as "values": k_scale is the latent's range, as
    compressed-tensors and llm-compressor observe it."""
    model = build_decoder("deepseek_v3")
    attention = model.model.layers[0].self_attn
    seen: list[torch.Tensor] = []
    attention.kv_a_layernorm.register_forward_hook(
        lambda m, a, out: seen.append(out.detach())
    )
    attach(model, _kv_recipe())
    report = calibrate(model, [_batches()[1]], progress=False)
    assert seen[0].shape[-1] == model.config.kv_lora_rank
    expected = seen[0].abs().amax().reshape(1) / FP8_MAX
    torch.testing.assert_close(attention.k_scale, expected, rtol=0, atol=0)
    # one latent "head": tokens counted once
    assert report.tokens["model.layers.0.self_attn.k"] == seen[0].shape[1]


@needs_kv_cache
def test_latent_attention_refuses_per_head_scales() -> None:
    model = build_decoder("deepseek_v3")
    with pytest.raises(
        ValueError, match=r"'attn_head' on latent attention .*DeepseekV3Attention"
    ):
        attach(model, _kv_recipe(FP8_HEADS))
    assert not any(n.endswith("_observer") for n, _ in model.named_modules())


def test_kv_cache_refused_where_compressed_tensors_quantizes_none() -> None:
    model = build_decoder("gpt2")
    with pytest.raises(
        ValueError,
        match=r"kv cache of no module of GPT2LMHeadModel: GPT2Attention has none "
        r"of the projections .*k_proj.*c_attn.*remove kv_cache_scheme",
    ):
        attach(
            model,
            Recipe.from_scheme("FP8", targets=["Conv1D"], kv_cache_scheme=FP8_TENSOR),
        )


@pytest.mark.skipif(
    kv_cache_quantizable(), reason="its attention takes past_key_values"
)
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_kv_cache_refused_where_transformers_calls_it_cache(family: str) -> None:
    """transformers 5.24 passes the kv cache as `cache`, which
    compressed-tensors (0.20) does not recognize: it would quantize no
    attention state, so quantobs refuses the kv_cache_scheme, naming why."""
    model = build_decoder(family)
    with pytest.raises(
        ValueError,
        match=r"kv cache of no module of .*ForCausalLM: .*Attention.forward takes "
        r"its kv cache as `cache`.*remove kv_cache_scheme from the recipe",
    ):
        attach(model, _kv_recipe())
    assert not any(n.endswith("_observer") for n, _ in model.named_modules())


@needs_kv_cache
def test_kv_cache_refused_where_the_config_cannot_size_it() -> None:
    """OPT's attention is cached attention, but compressed-tensors sizes the
    kv scales from `num_key_value_heads`, which OPTConfig lacks (its
    `apply_quantization_config` raises)."""
    model = build_decoder("opt")
    with pytest.raises(
        ValueError, match=r"OPTAttention.*OPTConfig defines no num_key_value_heads"
    ):
        attach(model, _kv_recipe())


@needs_kv_cache
def test_ignoring_an_attention_module_is_refused_with_a_kv_cache() -> None:
    model = build_decoder("llama")
    recipe = Recipe.from_scheme(
        "FP8", ignore=["lm_head", "re:.*layers\\.0\\..*"], kv_cache_scheme=FP8_TENSOR
    )
    with pytest.raises(
        ValueError, match=r"ignore target 're:.*' matches 'model.layers.0.self_attn'"
    ):
        attach(model, recipe)


@needs_kv_cache
def test_attention_states_default_to_llmcompressors_moving_average() -> None:
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
    for base in ("q", "k", "v"):
        assert observer_for(base, args) == ("minmax", {})
    model = build_decoder("llama")
    attach(model, _kv_recipe())
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.k_observer, MinMaxObserver)
    assert isinstance(attention.v_observer, MinMaxObserver)


@needs_kv_cache
@pytest.mark.filterwarnings(MERGE_WARNING)
def test_a_group_targeting_attention_quantizes_q_k_and_v(tmp_path: Path) -> None:
    """As compressed-tensors does, a group targeting the attention quantizes
    its query, key and value states under the group's input args (replacing
    the kv cache's), with no kv_cache_scheme needed."""
    model = build_decoder("llama")
    recipe = Recipe.from_scheme("FP8", ignore=["lm_head"])
    recipe.config_groups["attention"] = recipe.config_groups["group_0"].model_copy(
        update={"targets": ["LlamaAttention"], "weights": None}
    )
    attachment = attach(model, recipe)
    states = [e for e in attachment.entries if e.base_name in ("q", "k", "v")]
    assert [e.key for e in states[:3]] == [
        f"model.layers.0.self_attn.{b}" for b in ("q", "k", "v")
    ]
    assert {e.group for e in states} == {"attention"}
    calibrate(model, _batches(), progress=False)
    ours = _kv_scales(model)
    loaded = _reloaded_kv_scales(save_compressed(model, tmp_path / "llama"))
    for name, scale in ours.items():
        torch.testing.assert_close(loaded[name], scale, rtol=0, atol=0)


@needs_kv_cache
def test_observing_the_cache_does_not_change_the_forward() -> None:
    model = build_decoder("mistral")
    batch = _batches()[0]
    with torch.no_grad():
        before = model(**batch).logits
    attach(model, _kv_recipe())
    with torch.no_grad():
        during = model(**batch, use_cache=False).logits
        cached = model(**batch).logits
    detach(model)
    assert torch.equal(before, during) and torch.equal(before, cached)
    assert all(not m._forward_pre_hooks for m in model.modules())


@needs_kv_cache
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_kv_scales_equal_llmcompressor_oneshot(tmp_path: Path) -> None:
    """FP8 weights and an FP8 per-tensor kv cache: the k / v scales equal
    llm-compressor 0.14 `oneshot`'s (batch size 1, so no padding, in the
    texts' order), with its default moving-average observer, within float32
    rounding."""
    llmcompressor = pytest.importorskip("llmcompressor")
    datasets = pytest.importorskip("datasets")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from tests.decoders import save_decoder

    directory = save_decoder("llama", tmp_path / "llama")
    tokenizer = tiny_tokenizer()
    dataset = datasets.Dataset.from_dict({"text": TEXTS}).map(
        lambda row: tokenizer(row["text"]), remove_columns=["text"]
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory)
    llmcompressor.oneshot(
        model=theirs,
        dataset=dataset,
        recipe=QuantizationModifier(
            targets="Linear",
            scheme="FP8",
            ignore=["lm_head"],
            kv_cache_scheme=FP8_TENSOR.to_compressed_tensors().model_dump(),
        ),
        num_calibration_samples=len(TEXTS),
        max_seq_length=64,
        # the moving average depends on the order: ours is the texts' order
        shuffle_calibration_samples=False,
    )
    # llm-compressor calibrates under eager attention; with sdpa the second
    # layer's states differ in the last float32 bit
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager"
    )
    attach(ours, _kv_recipe())
    one_per_batch = [dict(tokenizer(t, return_tensors="pt")) for t in TEXTS]
    calibrate(ours, one_per_batch, progress=False)
    expected, found = _kv_scales(theirs), _kv_scales(ours)
    assert expected.keys() == found.keys() and len(found) == 4
    for name, value in expected.items():
        # within float32 rounding: the two forwards' states differ in the
        # last bits (llm-compressor runs its own traced pipeline)
        torch.testing.assert_close(found[name], value, rtol=1e-4, atol=0)


@needs_kv_cache
@pytest.mark.filterwarnings(MERGE_WARNING)
def test_a_wide_regex_leaves_the_attention_states_to_the_kv_cache(
    tmp_path: Path,
) -> None:
    """`re:.*self_attn.*` also matches the projections inside the attention:
    compressed-tensors then quantizes the projections only (no narrow match),
    and the kv cache keeps its own args."""
    model = build_decoder("llama")
    recipe = Recipe.from_scheme(
        "FP8", targets=["re:.*self_attn.*"], kv_cache_scheme=FP8_HEADS
    )
    attachment = attach(model, recipe)
    states = {
        e.key: e.group for e in attachment.entries if e.base_name in ("q", "k", "v")
    }
    assert states == {
        f"model.layers.{i}.self_attn.{b}": "kv_cache" for i in (0, 1) for b in "kv"
    }
    calibrate(model, _batches(), progress=False)
    ours = _kv_scales(model)
    assert {tuple(s.shape) for s in ours.values()} == {(2, 1, 1)}
    loaded = _reloaded_kv_scales(save_compressed(model, tmp_path / "llama"))
    for name, scale in ours.items():
        torch.testing.assert_close(loaded[name], scale, rtol=0, atol=0)
