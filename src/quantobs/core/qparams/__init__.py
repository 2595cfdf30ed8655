"""Ranges to quantization parameters: named rules under one signature.

A rule turns per-qparam ranges into `(scale, zero_point)`; each peer's
arithmetic is one named, pure rule, configured once and called as
`rule(min_vals, max_vals, global_scale=None)`::

    rule                   arithmetic of                      module
    CompressedTensorsRule  compressed-tensors / llm-compressor  compressed_tensors
    TorchAORule            torch.ao.quantization.observer     torch_rule
    QuarkRule              AMD Quark (int, FP8, FP4 / FP6 with  quark_rule
                           float32, e4m3 or e8m0 scales)
    QuarkPow2Rule          AMD Quark's power-of-two observers   quark_rule
                           (its ONNX tools' candidate)

`range_to_qparams(min_vals, max_vals, rule)` is the one entry point;
`calculate_qparams(min_vals, max_vals, args)` is compressed-tensors' own
signature for its rule. Power-of-two exponents (MX e8m0 scales, `pof2`
scales) with their named roundings are in `pow2`.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from quantobs.core.qparams.compressed_tensors import (
    CompressedTensorsRule,
    all_finite,
    amax_to_global_scale,
    calculate_qparams,
    calculate_range,
    check_global_scale,
    generate_gparam,
    in_observed_dtype,
    range_or_zero,
    scale_to_storage,
    storage_to_scale,
)
from quantobs.core.qparams.pow2 import Pow2Rounding, pow2_exponent
from quantobs.core.qparams.quark_rule import QuarkPow2Rule, QuarkRule
from quantobs.core.qparams.torch_rule import TorchAORule

__all__ = [
    "QPARAMS_RULES",
    "CompressedTensorsRule",
    "Pow2Rounding",
    "QParamsRule",
    "QuarkPow2Rule",
    "QuarkRule",
    "TorchAORule",
    "all_finite",
    "amax_to_global_scale",
    "calculate_qparams",
    "calculate_range",
    "check_global_scale",
    "generate_gparam",
    "in_observed_dtype",
    "pow2_exponent",
    "range_or_zero",
    "range_to_qparams",
    "scale_to_storage",
    "storage_to_scale",
]


class QParamsRule(Protocol):
    """A named range -> qparams rule (the one signature)."""

    name: ClassVar[str]

    def __call__(
        self,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        global_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


QPARAMS_RULES: dict[str, type] = {
    rule.name: rule
    for rule in (CompressedTensorsRule, TorchAORule, QuarkRule, QuarkPow2Rule)
}


def range_to_qparams(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    rule: QParamsRule,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scale, zero_point)` of per-qparam ranges under a named rule.

    Args:
        min_vals: `(*Q,)` minima.
        max_vals: `(*Q,)` maxima.
        rule: a configured rule (`QPARAMS_RULES` lists them by name).
        global_scale: optional `(1,)` global scale (rules that have one).
    """
    return rule(min_vals, max_vals, global_scale)
