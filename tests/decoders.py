"""Tiny random-weight decoder LLMs of every family, built offline from
transformers' config classes, and a byte-level tokenizer trained here.

`FAMILIES` maps a family name to a builder of a small `*ForCausalLM` (0.3-1
million parameters; every linear input a multiple of 128, so that W4A16's
groups of 128 fit) that covers one shape of
real LLMs: dense and GQA/MQA attention, sliding windows, fused qkv
(Phi-3), transposed `Conv1D` weights (GPT-2), MoE experts stored as fused
3-D parameters (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3) and multi-head
latent attention (DeepSeek-V3). `save_decoder` writes one as a Hugging Face
model directory with a tokenizer that, like Llama-3's and Mistral's, has
no pad token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DENSE",
    "FAMILIES",
    "KV_CACHE_REASON",
    "MOE",
    "VOCAB",
    "build_decoder",
    "kv_cache_quantizable",
    "save_decoder",
    "tiny_tokenizer",
]

#: Vocabulary of the tiny tokenizer and models (bytes + merges + specials).
VOCAB = 320

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "tie_word_embeddings": False,
}


def _config(name: str, **fields: Any) -> Any:
    import transformers

    return getattr(transformers, name)(**{**_COMMON, **fields})


def _llama() -> Any:  # GQA
    return _config("LlamaConfig", num_key_value_heads=2)


def _qwen2() -> Any:  # GQA, q/k/v biases, tied embeddings
    return _config("Qwen2Config", num_key_value_heads=2, tie_word_embeddings=True)


def _qwen3() -> Any:  # q/k norms, explicit head_dim
    return _config("Qwen3Config", num_key_value_heads=2, head_dim=32)


def _mistral() -> Any:  # sliding window
    return _config("MistralConfig", num_key_value_heads=2, sliding_window=8)


def _gemma2() -> Any:  # alternating sliding / global attention, soft-capping
    return _config(
        "Gemma2Config",
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=8,
        tie_word_embeddings=True,
    )


def _gemma3() -> Any:
    return _config(
        "Gemma3TextConfig",
        num_key_value_heads=1,  # MQA
        head_dim=32,
        sliding_window=8,
        tie_word_embeddings=True,
    )


def _phi3() -> Any:  # fused qkv_proj and gate_up_proj
    return _config("Phi3Config", num_key_value_heads=2, pad_token_id=None)


def _gpt2() -> Any:  # Conv1D weights, fused c_attn
    import transformers

    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=128,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
    )


def _opt() -> Any:
    import transformers

    return transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )


def _qwen2_moe() -> Any:  # routed experts + a gated shared expert
    return _config(
        "Qwen2MoeConfig",
        num_key_value_heads=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )


def _qwen3_moe() -> Any:
    return _config(
        "Qwen3MoeConfig",
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )


def _mixtral() -> Any:
    return _config(
        "MixtralConfig",
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def _deepseek_v3() -> Any:  # MLA + routed and shared experts, first layer dense
    return _config(
        "DeepseekV3Config",
        num_key_value_heads=4,
        moe_intermediate_size=128,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
    )


#: family -> config builder (each a `*ForCausalLM` through AutoModelForCausalLM)
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "opt": _opt,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
}
#: families whose experts are fused 3-D parameters
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
DENSE = tuple(f for f in FAMILIES if f not in MOE)


def kv_cache_quantizable() -> bool:
    """Whether compressed-tensors quantizes the installed transformers' attention
    states: it finds a cached attention module by a `past_key_value(s)`
    argument of its forward, which transformers 5.24 renamed to `cache`
    (quantobs then refuses a kv_cache_scheme, see `KV_CACHE_REASON`)."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaAttention

    parameters = inspect.signature(LlamaAttention.forward).parameters
    return any(p in parameters for p in ("past_key_value", "past_key_values"))


#: why a test skips its kv cache part where `kv_cache_quantizable()` is False
KV_CACHE_REASON = (
    "this transformers' attention takes its kv cache as `cache`, which "
    "compressed-tensors does not look for: no kv cache or attention state is "
    "quantized (quantobs refuses a kv_cache_scheme there)"
)


def build_decoder(
    family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A random tiny `*ForCausalLM` of `family`, in eval mode.

    Weights are drawn with std 0.1 (larger than the configs' 0.02, so that
    activations and routing are not degenerate in a 2-layer model).
    """
    import transformers

    config = FAMILIES[family]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2 or name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model.eval()


_TRAINING_TEXT = (
    "The river froze early this winter, and the ferry stopped running. "
    "Quantization maps real numbers to a small set of levels. "
    "She planted tomatoes, basil and three kinds of peppers. "
    "Observers watch tensors during calibration and choose their ranges. "
)


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer of `VOCAB` entries trained on a few
    sentences; bos `<s>` (1), eos `</s>` (2), `<unk>` (0) and no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def save_decoder(
    family: str,
    directory: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a tiny `family` decoder and the tiny tokenizer to `directory`
    (a Hugging Face model directory: config.json, model.safetensors,
    tokenizer files); returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    build_decoder(family, seed=seed, dtype=dtype).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory
