"""Layers that store their weight transposed: transformers' `Conv1D`.

GPT-2 (and its relatives) compute `x @ W + b` with `W` of shape
`(in_features, out_features)`, the transpose of `nn.Linear`'s. quantobs
observes such a weight as the Linear it is equivalent to, `W.T`
`(out_features, in_features)` (a view, no copy): channels are output
features, groups run along the input features, as for any Linear.

Targets match a module by its class name, as compressed-tensors matches
them: `"Linear"` does not match `Conv1D` layers (llm-compressor 0.14
quantizes none of them either way: compressed-tensors initializes only
`Linear` and `Embedding`); target `"Conv1D"` (or their names) to calibrate
them. Neither compressed-tensors nor transformers loads a quantized `Conv1D`,
so the compressed-tensors copy used for evaluation holds the equivalent
`nn.Linear` (`as_linear`: the same function) and `save_compressed` refuses
them.
"""

from __future__ import annotations

import torch

__all__ = [
    "as_linear",
    "is_transposed",
    "linear_targets",
    "linear_weight",
    "transposed_layers",
]


def is_transposed(module: torch.nn.Module) -> bool:
    """Whether `module` stores a 2-D weight as `(in_features, out_features)`
    (transformers' `Conv1D`, `nf` output features)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and int(getattr(module, "nf", -1)) == weight.shape[1]
    )


def linear_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The module's weight as a Linear holds it, `(out_features,
    in_features)`: a view of `Conv1D`'s transpose, or the weight itself;
    None without a tensor weight."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    return weight.t() if is_transposed(module) else weight


def transposed_layers(model: torch.nn.Module) -> list[str]:
    """Names of the model's `Conv1D` layers."""
    return [n for n, m in model.named_modules() if is_transposed(m)]


def linear_targets(model: torch.nn.Module) -> list[str]:
    """The targets reaching every linear layer of `model`: `["Linear"]`, and
    `"Conv1D"` too where the model keeps its layers transposed (GPT-2)."""
    return ["Linear", "Conv1D"] if transposed_layers(model) else ["Linear"]


def as_linear(module: torch.nn.Module) -> torch.nn.Linear:
    """An `nn.Linear` computing what the `Conv1D` `module` computes (its
    weight transposed and made contiguous, the same bias, device and dtype).

    Raises:
        TypeError: `module` is not a `Conv1D` layer.
    """
    if not is_transposed(module):
        raise TypeError(f"expected a Conv1D layer, got {type(module).__name__}")
    weight = linear_weight(module)  # (out, in): a view
    bias = getattr(module, "bias", None)
    if weight is None:  # pragma: no cover - is_transposed checked it
        raise TypeError("the Conv1D layer has no weight")
    linear = torch.nn.Linear(
        int(weight.shape[1]),
        int(weight.shape[0]),
        bias=isinstance(bias, torch.Tensor),
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        linear.weight.copy_(weight.detach())
        if isinstance(bias, torch.Tensor):
            linear.bias.copy_(bias.detach())
    return linear.train(module.training)
