"""What a model is evaluated on: its task and the task's quality metrics.

Two tasks, told apart by the model's class (`task_of`):

===============  =========================  ==================================
task             models                     quality metrics (held-out text)
===============  =========================  ==================================
`"causal_lm"`    transformers' causal LMs   next-token KL divergence to the
                 (`*ForCausalLM`,           unquantized model (lower is
                 `GPT2LMHeadModel`, ...)    better), top-1 next-token
                                            agreement, perplexity (lower is
                                            better); `quantobs.report.causal`
`"embedding"`    every other model          cosine of the mean-pooled
                 (`BertModel`, ...)         embeddings (mean, worst), top-1
                                            neighbour agreement, pairwise
                                            Spearman; `quantobs.report.metrics`
===============  =========================  ==================================

The first metric of a task is its main one: the verdict picks the observer
by it and the quality-against-time plot draws it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CAUSAL_LM",
    "CAUSAL_METRICS",
    "EMBEDDING",
    "EMBEDDING_METRICS",
    "TASKS",
    "Metric",
    "main_metric",
    "output_head",
    "quality_metrics",
    "task_of",
]

EMBEDDING = "embedding"
CAUSAL_LM = "causal_lm"
TASKS = (EMBEDDING, CAUSAL_LM)


@dataclass(frozen=True)
class Metric:
    """An end-to-end quality metric of a `Cell`.

    Attributes:
        key: the `Cell` (and `Evaluation`) attribute.
        title: the table's column title.
        decimals: digits shown after the point.
        lower_is_better: the best value is the smallest.
    """

    key: str
    title: str
    decimals: int
    lower_is_better: bool = False


EMBEDDING_METRICS = (
    Metric("cosine_mean", "cos mean", 4),
    Metric("cosine_worst", "cos worst", 4),
    Metric("neighbours", "top-1 agree", 2),
    Metric("spearman", "spearman", 4),
)
CAUSAL_METRICS = (
    Metric("kl_divergence", "KL nats", 4, lower_is_better=True),
    Metric("token_agreement", "top-1 token", 3),
    Metric("perplexity", "perplexity", 2, lower_is_better=True),
)
_METRICS = {EMBEDDING: EMBEDDING_METRICS, CAUSAL_LM: CAUSAL_METRICS}


def quality_metrics(task: str) -> tuple[Metric, ...]:
    """The end-to-end metrics of `task`, in table order.

    Raises:
        ValueError: an unknown task.
    """
    if task not in _METRICS:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")
    return _METRICS[task]


def main_metric(task: str) -> Metric:
    """The metric the verdict and the quality-against-time plot use."""
    return quality_metrics(task)[0]


def _causal_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def task_of(model: Any) -> str:
    """`CAUSAL_LM` for a class transformers maps as a causal LM, else
    `EMBEDDING`."""
    return CAUSAL_LM if type(model).__name__ in _causal_class_names() else EMBEDDING


def output_head(model: Any) -> str | None:
    """The module name of the model's output embeddings (`"lm_head"`), or
    None when it has none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((name for name, m in model.named_modules() if m is head), None)
