"""Token counting over the observers attached to a model (llm-compressor's helper).

llm-compressor attaches an observer to a module as `{base_name}_observer`
(e.g. `model.layers.0.mlp.experts.3.input_observer`). Each observer counts the
tokens it saw under the seed's rule: only 2-D inputs `(tokens, features)`, as
MoE experts receive, are counted; others leave the count `None`. An expert
with a count of 0 or None saw no calibration data, and its qparams should not
be trusted.
"""

from __future__ import annotations

from collections import Counter

import torch

__all__ = ["get_observer_token_count"]


def get_observer_token_count(
    model: torch.nn.Module, base_name: str = "input"
) -> Counter[str]:
    """Tokens seen by each `{base_name}_observer` in `model`, by module name.

    Works with `quantobs.Observer` (`num_observed_tokens`) and the legacy face
    (`_num_observed_tokens`).

    Args:
        model: a model with observers attached as submodules.
        base_name: which observers to read (`input` by default, as
            llm-compressor's helper does).

    Returns:
        `Counter` mapping the observed module's name to its token count
        (0 where the observer counted nothing).
    """
    suffix = f"{base_name}_observer"
    counts: Counter[str] = Counter()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf != suffix:
            continue
        tokens = getattr(module, "num_observed_tokens", None)
        if tokens is None:
            tokens = getattr(module, "_num_observed_tokens", None)
        counts[name[: -len(suffix)].rstrip(".")] = int(tokens or 0)
    return counts
