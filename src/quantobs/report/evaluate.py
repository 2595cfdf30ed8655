"""Evaluate a calibrated model against the unquantized one on held-out text.

The quantized model is compressed-tensors' fake-quantized view of the
calibrated model (`quantobs.calibration.simulate.compressed_tensors_view`:
its modules copied, its tensors shared, nothing copied): weights and static
inputs under our qparams, dynamic inputs computed on the fly, as an
inference engine computes them from the checkpoint. Each weight is
fake-quantized as its module runs (compressed-tensors' forward: the
onloaded weight quantized for that forward only), so that the evaluation
holds no more than one module's quantized weight beyond the model, and a
model accelerate offloads evaluates without being loaded whole; the results
are those of a deep copy with every weight quantized beforehand, bit for
bit. What is
compared depends on the model's task (`quantobs.report.tasks`):

- causal LMs: the model's own next-token distributions at every held-out
  position whose next token is real (`quantobs.report.causal`): KL
  divergence to the unquantized model, top-1 agreement, perplexity (and the
  unquantized model's, for context). The reference keeps the unquantized
  log-probabilities of those positions in float32 (positions x vocabulary x
  4 bytes: 2,000 positions of a 128k vocabulary take 1 GB);
- other models: each held-out text embedded by mean pooling the last hidden
  states (sentence-transformers' pooling for all-MiniLM-L6-v2; for other
  models a representation-level comparison), compared by
  `quantobs.report.metrics`.

Per layer, it measures the SQNR of each quantized weight and of each
quantized input on the held-out data.

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
from quantobs.calibration.offload import onloaded, release_written
from quantobs.calibration.simulate import compressed_tensors_view
from quantobs.report.causal import (
    next_token_kl,
    next_token_positions,
    perplexity,
    token_agreement,
)
from quantobs.report.metrics import (
    cosine_to_reference,
    mean_pool,
    neighbour_agreement,
    pairwise_spearman,
    sqnr_db_from_energies,
)
from quantobs.report.tasks import CAUSAL_LM, EMBEDDING, task_of

__all__ = [
    "Evaluation",
    "HeldOut",
    "embed",
    "evaluate",
    "input_ranges",
    "next_token_logprobs",
]


def _last_hidden(output: Any) -> torch.Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    states = getattr(output, "hidden_states", None)
    if hidden is None and isinstance(states, tuple | list) and states:
        hidden = states[-1]  # a model with a head: its last hidden states
    if hidden is None and isinstance(output, tuple | list) and output:
        hidden = output[0]
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
        raise TypeError(
            "the model's output has no last hidden states (B, S, H) to embed "
            "the texts with"
        )
    return hidden


def embed(model: torch.nn.Module, batches: Sequence[dict[str, Any]]) -> torch.Tensor:
    """Mean-pooled embeddings `(N, H)` (float64) of the texts in `batches`
    (tokenizer outputs with `attention_mask`)."""
    pooled = []
    # a model with a head (BertForMaskedLM) returns its hidden states on demand
    base = getattr(model, "base_model", model)
    extra = {} if base is model else {"output_hidden_states": True}
    with torch.no_grad():
        for batch in batches:
            batch = to_model_device(batch, model)
            hidden = _last_hidden(model(**batch, **extra))  # (B, S, H)
            mask = batch["attention_mask"].to(hidden.device)  # (B, S)
            pooled.append(mean_pool(hidden, mask).cpu())  # (B, H)
    return torch.cat(pooled)  # (N, H)


def next_token_logprobs(
    model: torch.nn.Module, batches: Sequence[dict[str, Any]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's next-token log-probabilities where the next token is
    real (`quantobs.report.causal.next_token_positions`).

    Returns:
        `(logprobs, targets)`: `(T, V)` float32 log-probabilities and `(T,)`
        the ids of the tokens that follow, batch after batch.
    """
    found, targets = [], []
    with torch.no_grad():
        for batch in batches:
            batch = to_model_device(batch, model)
            logits = model(**batch, use_cache=False).logits  # (B, S, V)
            keep = next_token_positions(batch["attention_mask"]).to(logits.device)
            rows = logits[:, :-1][keep].float()  # (t, V)
            found.append(torch.log_softmax(rows, dim=-1).cpu())
            targets.append(batch["input_ids"][:, 1:][keep.to("cpu")].cpu())
    return torch.cat(found), torch.cat(targets)  # (T, V), (T,)


@dataclass(frozen=True)
class HeldOut:
    """The held-out batches and the unquantized model's view of them.

    Attributes:
        batches: the tokenized held-out texts.
        reference: `(N, H)` float64 embeddings (task "embedding"), or
            `(T, V)` float32 next-token log-probabilities ("causal_lm").
        task: `quantobs.report.tasks.EMBEDDING` or `CAUSAL_LM`.
        targets: `(T,)` the next tokens (causal LMs), else None.
    """

    batches: Sequence[dict[str, Any]]
    reference: torch.Tensor
    task: str = EMBEDDING
    targets: torch.Tensor | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, batches: Sequence[dict[str, Any]]) -> HeldOut:
        """Run `batches` through the (unquantized) `model`, by its task.

        Raises:
            ValueError: fewer than 3 held-out texts (the pairwise ranking
                needs three), or, for a causal LM, no text of two tokens
                (no next token to score).
        """
        if task_of(model) == CAUSAL_LM:
            texts = sum(int(batch["input_ids"].shape[0]) for batch in batches)
            if texts < 3:
                raise ValueError(
                    f"{texts} held-out text(s): the metrics need at least 3"
                )
            logprobs, targets = next_token_logprobs(model, batches)
            if logprobs.shape[0] == 0:
                raise ValueError(
                    "no held-out text has two tokens: no next token to score; "
                    "give longer texts"
                )
            return cls(batches, logprobs, CAUSAL_LM, targets)
        reference = embed(model, batches)
        if reference.shape[0] < 3:
            raise ValueError(
                f"{reference.shape[0]} held-out text(s): the metrics need at least 3"
            )
        return cls(batches=batches, reference=reference)


@dataclass(frozen=True)
class Evaluation:
    """The metrics of one calibrated model (see `quantobs.report.metrics`
    and `quantobs.report.causal`); those of the other task are None.

    Attributes:
        task: the model's task (`quantobs.report.tasks`).
        weight_sqnr: `{layer: dB}`, each quantized weight.
        input_sqnr: `{layer: dB}`, each quantized input on held-out data.
        cosine_mean, cosine_worst, neighbours, spearman: the embedding
            metrics.
        kl_divergence: mean next-token KL divergence to the reference (nats).
        token_agreement: fraction of positions with the same top-1 token.
        perplexity: the quantized model's held-out perplexity.
        reference_perplexity: the unquantized model's.
    """

    task: str
    weight_sqnr: dict[str, float]
    input_sqnr: dict[str, float]
    cosine_mean: float | None = None
    cosine_worst: float | None = None
    neighbours: float | None = None
    spearman: float | None = None
    kl_divergence: float | None = None
    token_agreement: float | None = None
    perplexity: float | None = None
    reference_perplexity: float | None = None

    def summary(self) -> str:
        """One line for the console."""
        if self.task == CAUSAL_LM:
            return (
                f"held-out: next-token KL {self.kl_divergence:.4f} nats, top-1 "
                f"token agreement {self.token_agreement:.3f}, perplexity "
                f"{self.perplexity:.2f} (unquantized {self.reference_perplexity:.2f})"
            )
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


def _weight_sqnr(
    parts: list[tuple[str, torch.nn.Module, Any]],
) -> dict[str, float]:
    """`{layer: weight SQNR dB}`: each weight fake-quantized as its forward
    does (compressed-tensors' `forward_quantize`), one module at a time (an
    offloaded one onloaded for it alone), nothing kept."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    found = {}
    with torch.no_grad():
        for name, module, scheme in parts:
            if scheme.weights is None:
                continue
            with onloaded(module):  # an offloaded module's, for this layer only
                weight = _tensor(module, "weight")
                fake = forward_quantize(module, weight, "weight", scheme.weights)
                signal = float(weight.double().square().sum())
                noise = float((weight.double() - fake.double()).square().sum())
            del fake
            found[name] = sqnr_db_from_energies(signal, noise)
    return found


class _InputEnergies:
    """Forward pre-hooks summing each quantized input's signal and noise
    energies (compressed-tensors' own fake quantization of the input), on
    the layers with a weight (an attention module whose states a kv-cache
    scheme quantizes takes its inputs by keyword: not measured here)."""

    def __init__(self, parts: list[tuple[str, torch.nn.Module, Any]]) -> None:
        self.sums: dict[str, list[float]] = {}
        self.handles = [
            module.register_forward_pre_hook(self._hook(name, scheme.input_activations))
            for name, module, scheme in parts
            if scheme.input_activations is not None
            and isinstance(getattr(module, "weight", None), torch.Tensor)
        ]

    def _hook(self, name: str, args: Any) -> Any:
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        def hook(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
            if not inputs or not isinstance(inputs[0], torch.Tensor):
                return
            x = inputs[0]
            with onloaded(module):  # before accelerate's hook loads it
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
        ValueError: the quantized model's embeddings or log-probabilities
            are not finite.
    """
    quantized = compressed_tensors_view(model)  # the model's tensors, shared
    try:
        parts = _quantized_parts(quantized)
        weight_sqnr = _weight_sqnr(parts)
        energies = _InputEnergies(parts)
        try:
            if held_out.task == CAUSAL_LM:
                test, _ = next_token_logprobs(quantized, held_out.batches)
            else:
                test = embed(quantized, held_out.batches)
        finally:
            input_sqnr = energies.sqnr()
    finally:  # the view's qparams under offload_folder/quantobs
        release_written(quantized)
        del quantized
    if held_out.task == CAUSAL_LM:
        targets = held_out.targets
        if targets is None:  # pragma: no cover - HeldOut.of sets them
            raise RuntimeError("a causal LM's held-out data has no targets")
        return Evaluation(
            task=CAUSAL_LM,
            weight_sqnr=weight_sqnr,
            input_sqnr=input_sqnr,
            kl_divergence=next_token_kl(held_out.reference, test),
            token_agreement=token_agreement(held_out.reference, test),
            perplexity=perplexity(test, targets),
            reference_perplexity=perplexity(held_out.reference, targets),
        )
    cosine_mean, cosine_worst = cosine_to_reference(held_out.reference, test)
    return Evaluation(
        task=EMBEDDING,
        weight_sqnr=weight_sqnr,
        input_sqnr=input_sqnr,
        cosine_mean=cosine_mean,
        cosine_worst=cosine_worst,
        neighbours=neighbour_agreement(held_out.reference, test),
        spearman=pairwise_spearman(held_out.reference, test),
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
