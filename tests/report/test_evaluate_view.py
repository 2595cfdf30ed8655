"""`evaluate` quantizes each weight as its module runs, on a view sharing the
model's tensors (`simulate.compressed_tensors_view`): its numbers are those
of the former evaluation, a deep copy with every weight fake-quantized
beforehand, bit for bit, and the model is left as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quantobs.calibration import Recipe, attach, calibrate
from quantobs.calibration.simulate import compressed_tensors_copy
from quantobs.report.evaluate import (
    HeldOut,
    _InputEnergies,
    _quantized_parts,
    evaluate,
    next_token_logprobs,
)
from quantobs.report.metrics import sqnr_db_from_energies
from tests.decoders import build_decoder

pytestmark = pytest.mark.peers
pytest.importorskip("compressed_tensors")

#: family, scheme, model dtype: group weights, static FP8 inputs with an FP8
#: kv cache, NVFP4 in bf16, fused MoE experts (their Linears view the
#: fused weights)
CASES = [
    ("llama", "W4A16", torch.float32, None),
    ("llama", "FP8", torch.float32, "kv"),
    ("llama", "NVFP4", torch.bfloat16, None),
    pytest.param("qwen3_moe", "W8A8", torch.float32, None, marks=pytest.mark.slow),
]


def _batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return [
        {"input_ids": ids[:2], "attention_mask": mask[:2]},
        {"input_ids": ids[2:], "attention_mask": mask[2:]},
    ]


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _deep_copy_evaluation(model: torch.nn.Module, held_out: HeldOut) -> Any:
    """The former evaluation: a deep copy, each weight fake-quantized once
    in place and its module marked compressed. Returns `(logprobs, weight
    SQNR, input SQNR)`."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    quantized = compressed_tensors_copy(model)
    parts = _quantized_parts(quantized)
    weights = {}
    with torch.no_grad():
        for name, module, scheme in parts:
            if scheme.weights is None:
                continue
            weight = module.weight
            fake = forward_quantize(module, weight, "weight", scheme.weights)
            signal = float(weight.double().square().sum())
            noise = float((weight.double() - fake.double()).square().sum())
            weights[name] = sqnr_db_from_energies(signal, noise)
            weight.copy_(fake)
            module.quantization_status = QuantizationStatus.COMPRESSED
    energies = _InputEnergies(parts)
    logprobs, _ = next_token_logprobs(quantized, held_out.batches)
    return logprobs, weights, energies.sqnr()


@pytest.mark.parametrize(("family", "scheme", "dtype", "kv"), CASES)
def test_the_view_evaluates_as_the_deep_copy_did(
    family: str, scheme: str, dtype: torch.dtype, kv: str | None
) -> None:
    from quantobs.calibration.simulate import compressed_tensors_view
    from quantobs.report.causal import next_token_kl
    from tests.decoders import kv_cache_quantizable

    if kv and not kv_cache_quantizable():
        pytest.skip("compressed-tensors quantizes no kv cache here")
    model = build_decoder(family, dtype=dtype)
    held_out = HeldOut.of(model, _batches())
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor"} if kv else None
    recipe = Recipe.from_scheme(scheme, ignore=["lm_head"], kv_cache_scheme=kv_scheme)
    attach(model, recipe)
    calibrate(model, _batches(), progress=False)
    before = {n: t.clone() for n, t in _tensors(model).items()}
    logprobs, weight_sqnr, input_sqnr = _deep_copy_evaluation(model, held_out)
    found = evaluate(model, held_out)
    assert found.weight_sqnr == weight_sqnr and len(weight_sqnr) > 4
    assert found.input_sqnr == input_sqnr
    assert found.kl_divergence == next_token_kl(held_out.reference, logprobs)
    view = compressed_tensors_view(model)
    shown, _ = next_token_logprobs(view, held_out.batches)
    assert torch.equal(shown, logprobs)
    # the view shares the model's weights; the model is unchanged
    q_proj = view.get_submodule("model.layers.0.self_attn.q_proj")
    own = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert q_proj is not own and q_proj.weight is own.weight
    after = _tensors(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], t) for n, t in before.items())
