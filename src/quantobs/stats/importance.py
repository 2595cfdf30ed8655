"""Input importance of a linear layer: llm-compressor's "imatrix" statistic.

For a layer `y = x @ W.T`, the importance of input channel `k` is the mean
of `x_k ** 2` over every token the layer has seen: `E[x_k ** 2]`, the
diagonal of the inputs' second-moment matrix (llama.cpp's importance
matrix). llm-compressor 0.14 (`llmcompressor.observers.imatrix`) gathers it
with a forward pre-hook on the module, in float32::

    sum   += x.float().pow(2).sum(dim=all but the last)   # (in_features,)
    count += number of tokens (all dims but the last)    # int64
    importance = sum / count.float()

`Importance` keeps exactly that (same ops, same bits): a sum and a count,
both summed across batches and processes (exact up to float32 summation
order). In the canonical layout its batches are `(N, in_features, 1)`:
one qparam per input channel, `N` tokens (`of_inputs` reshapes a layer's
`(..., in_features)` inputs so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantobs.stats.base import Batch, Field, Reduce, Statistic

__all__ = ["IMATRIX_DTYPE", "Importance"]

#: The dtype importance sums are gathered in (llm-compressor's `IMATRIX_PRECISION`).
IMATRIX_DTYPE = torch.float32


@dataclass(frozen=True)
class Importance(Statistic):
    """Sum of squared inputs per input channel, and the token count.

    Attributes:
        sum: `(in_features,)` float32 sum over tokens of `x ** 2`.
        count: `()` int64 number of tokens.
    """

    sum: torch.Tensor
    count: torch.Tensor

    fields: ClassVar[tuple[Field, ...]] = (
        Field("sum", Reduce.SUM),
        Field("count", Reduce.SUM),
    )
    needs_values: ClassVar[bool] = True

    @classmethod
    def empty(cls, qparam_shape: tuple[int, ...], device: torch.device) -> Importance:
        """No tokens: zero sums of shape `qparam_shape` (`(in_features,)`)."""
        return cls(
            torch.zeros(qparam_shape, dtype=IMATRIX_DTYPE, device=device),
            torch.zeros((), dtype=torch.int64, device=device),
        )

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.sum.shape)

    def update(self, batch: Batch) -> Importance:
        """Fold in a batch of `(N, in_features, 1)` values (`N` tokens)."""
        if batch.x_flat is None:  # pragma: no cover - needs_values
            raise RuntimeError("Importance reads values; none were given")
        return self._add(batch.x_flat.reshape(batch.x_flat.shape[0], -1))

    def of_inputs(self, x: torch.Tensor) -> Importance:
        """Fold in a layer's inputs `(..., in_features)` (every leading dim is a
        token), as llm-compressor's hook does.

        Raises:
            ValueError: the last dim is not `in_features`.
        """
        if x.ndim == 0 or x.shape[-1] != self.sum.shape[0]:
            raise ValueError(
                f"inputs of shape {tuple(x.shape)} do not end with the "
                f"{self.sum.shape[0]} input features the importance is gathered for"
            )
        return self._add(x.reshape(-1, x.shape[-1]))

    def _add(self, x2: torch.Tensor) -> Importance:
        # (tokens, in_features): float32 squares summed over the tokens
        x_f = x2.detach().to(IMATRIX_DTYPE)
        tokens = math.prod(x2.shape[:-1])
        device = x_f.device
        total = self.sum.to(device) + x_f.pow(2).sum(dim=0)
        return Importance(total, self.count.to(device) + tokens)

    def merge(self, other: Importance) -> Importance:
        return Importance(
            self.sum + other.sum.to(self.sum.device),
            self.count + other.count.to(self.count.device),
        )

    def mean(self) -> torch.Tensor | None:
        """`(in_features,)` float32 `E[x ** 2]` (`sum / count`), None before any
        token."""
        if int(self.count) == 0:
            return None
        return self.sum / self.count.float()
