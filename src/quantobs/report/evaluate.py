"""Evaluate a calibrated model against the unquantized one on held-out text.

The quantized model is compressed-tensors' fake-quantized copy of the
calibrated model (`quantobs.calibration.simulate.compressed_tensors_copy`):
weights and static inputs under our qparams, dynamic inputs computed on the
fly, as an inference engine computes them from the checkpoint. Both models
embed each held-out text by mean pooling their last hidden states
(sentence-transformers' pooling for all-MiniLM-L6-v2; for other models a
representation-level comparison), and `quantobs.report.metrics` compares the
embeddings. Per layer, it measures the SQNR of each quantized weight and of
each quantized input on the held-out data.

    held_out = HeldOut.of(model, batches)       # before attach: the reference
    attach(model, recipe); calibrate(model, calibration_batches)
    evaluation = evaluate(model, held_out)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quantobs.calibration.attach import attachment_of
from quantobs.calibration.calibrate import to_model_device
from quantobs.calibration.simulate import compressed_tensors_copy
from quantobs.report.metrics import (
    cosine_to_reference,
    mean_pool,
    neighbour_agreement,
    pairwise_spearman,
    sqnr_db_from_energies,
)

__all__ = ["Evaluation", "HeldOut", "embed", "evaluate", "input_ranges"]


def _last_hidden(output: Any) -> torch.Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, tuple | list) and output:
        hidden = output[0]
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
        raise TypeError(
            "the model's output has no last_hidden_state (B, S, H); evaluation "
            "needs a base model (transformers AutoModel), not a head"
        )
    return hidden


def embed(model: torch.nn.Module, batches: Sequence[dict[str, Any]]) -> torch.Tensor:
    """Mean-pooled embeddings `(N, H)` (float64) of the texts in `batches`
    (tokenizer outputs with `attention_mask`)."""
    pooled = []
    with torch.no_grad():
        for batch in batches:
            batch = to_model_device(batch, model)
            hidden = _last_hidden(model(**batch))  # (B, S, H)
            mask = batch["attention_mask"].to(hidden.device)  # (B, S)
            pooled.append(mean_pool(hidden, mask).cpu())  # (B, H)
    return torch.cat(pooled)  # (N, H)


@dataclass(frozen=True)
class HeldOut:
    """The held-out batches and the unquantized model's embeddings of them."""

    batches: Sequence[dict[str, Any]]
    reference: torch.Tensor  # (N, H) float64

    @classmethod
    def of(cls, model: torch.nn.Module, batches: Sequence[dict[str, Any]]) -> HeldOut:
        """Embed `batches` with the (unquantized) `model`.

        Raises:
            ValueError: fewer than 3 held-out texts (the pairwise ranking
                needs three).
        """
        reference = embed(model, batches)
        if reference.shape[0] < 3:
            raise ValueError(
                f"{reference.shape[0]} held-out text(s): the metrics need at least 3"
            )
        return cls(batches=batches, reference=reference)


@dataclass(frozen=True)
class Evaluation:
    """The metrics of one calibrated model (see `quantobs.report.metrics`)."""

    cosine_mean: float
    cosine_worst: float
    neighbours: float
    spearman: float
    weight_sqnr: dict[str, float]
    input_sqnr: dict[str, float]

    def summary(self) -> str:
        """One line for the console."""
        return (
            f"held-out: cos mean {self.cosine_mean:.4f}, worst "
            f"{self.cosine_worst:.4f}, top-1 agreement {self.neighbours:.2f}, "
            f"spearman {self.spearman:.4f}"
        )


def _quantized_parts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, Any]]:
    """`(name, module, scheme)` of each module compressed-tensors quantizes."""
    return [
        (name, module, scheme)
        for name, module in model.named_modules()
        if (scheme := getattr(module, "quantization_scheme", None)) is not None
    ]


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    found = getattr(module, name, None)
    if not isinstance(found, torch.Tensor):  # pragma: no cover - set by calibrate
        raise RuntimeError(f"{type(module).__name__} has no tensor {name!r}")
    return found


def _quantize_weights(
    parts: list[tuple[str, torch.nn.Module, Any]],
) -> dict[str, float]:
    """Fake-quantize each weight once, in place (compressed-tensors'
    `forward_quantize`), and mark the module compressed so its forward does
    not repeat it on every batch; returns `{layer: weight SQNR dB}`."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    found = {}
    with torch.no_grad():
        for name, module, scheme in parts:
            if scheme.weights is None:
                continue
            weight = _tensor(module, "weight")
            fake = forward_quantize(module, weight, "weight", scheme.weights)
            signal = float(weight.double().square().sum())
            noise = float((weight.double() - fake.double()).square().sum())
            found[name] = sqnr_db_from_energies(signal, noise)
            weight.copy_(fake)
            module.quantization_status = QuantizationStatus.COMPRESSED
    return found


class _InputEnergies:
    """Forward pre-hooks summing each quantized input's signal and noise
    energies (compressed-tensors' own fake quantization of the input)."""

    def __init__(self, parts: list[tuple[str, torch.nn.Module, Any]]) -> None:
        self.sums: dict[str, list[float]] = {}
        self.handles = [
            module.register_forward_pre_hook(self._hook(name, scheme.input_activations))
            for name, module, scheme in parts
            if scheme.input_activations is not None
        ]

    def _hook(self, name: str, args: Any) -> Any:
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        def hook(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
            x = inputs[0]
            fake = forward_quantize(module, x, "input", args)
            sums = self.sums.setdefault(name, [0.0, 0.0])
            sums[0] += float(x.double().square().sum())
            sums[1] += float((x.double() - fake.double()).square().sum())

        return hook

    def sqnr(self) -> dict[str, float]:
        for handle in self.handles:
            handle.remove()
        return {
            name: sqnr_db_from_energies(signal, noise)
            for name, (signal, noise) in self.sums.items()
        }


def evaluate(model: torch.nn.Module, held_out: HeldOut) -> Evaluation:
    """Compare the calibrated `model` (observers attached) with the reference.

    Raises:
        RuntimeError: the model is not calibrated.
        ValueError: the quantized model's embeddings are not finite.
    """
    quantized = compressed_tensors_copy(model)
    parts = _quantized_parts(quantized)
    weight_sqnr = _quantize_weights(parts)
    energies = _InputEnergies(parts)
    try:
        test = embed(quantized, held_out.batches)
    finally:
        input_sqnr = energies.sqnr()
    cosine_mean, cosine_worst = cosine_to_reference(held_out.reference, test)
    return Evaluation(
        cosine_mean=cosine_mean,
        cosine_worst=cosine_worst,
        neighbours=neighbour_agreement(held_out.reference, test),
        spearman=pairwise_spearman(held_out.reference, test),
        weight_sqnr=weight_sqnr,
        input_sqnr=input_sqnr,
    )


def input_ranges(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """`{module: (low, high)}`: the values each static per-tensor input can
    represent under the calibrated qparams.

    Int and FP8 inputs: ``((q_min - z) * s, (q_max - z) * s)``. NVFP4 inputs
    (local scales under a static global scale ``g``): the largest e4m3 group
    scale times the largest FP4 value, ``+-448 * 6 / g``.
    """
    from quantobs.core.formats import get_format

    ranges = {}
    for entry in attachment_of(model).entries:
        args = entry.args
        if entry.base_name != "input" or args.dynamic is True:
            continue
        module = entry.module
        if args.strategy == "tensor":
            fmt = args.format
            scale = float(_tensor(module, "input_scale").reshape(-1)[0])
            zero = getattr(module, "input_zero_point", None)
            z = 0.0 if zero is None else float(zero.reshape(-1)[0])
            ranges[entry.name] = ((fmt.min - z) * scale, (fmt.max - z) * scale)
        elif args.strategy == "tensor_group":
            largest = get_format("float8_e4m3fn").max * args.format.max
            bound = largest / float(
                _tensor(module, "input_global_scale").reshape(-1)[0]
            )
            if math.isfinite(bound):
                ranges[entry.name] = (-bound, bound)
    return ranges
