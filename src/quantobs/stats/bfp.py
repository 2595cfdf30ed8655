"""BFP16 block statistic: the block absolute maximum, doubled on overflow.

BFP16 blocks of 8 share `scale = 2**(floor(log2 amax) - 6)` and int8
mantissas (`quantobs.core.qparams.quark_rule.bfp_scale`); where rounding the
block's largest value `P` would give 128 (outside int8), the scale doubles.
As in Quark, the doubling is kept in the statistic (the stored amax doubles),
so a later batch sees the doubled value. With `amax = m * 2**e`::

    block                          P / 2**(e - 6)   rounds to    scale
    P = amax = 1.984375 * 2**e     127.0            127          2**(e - 6)
    P = amax = 1.9921875 * 2**e    127.5            128: over    2**(e - 5)
    P = -amax (amax as above)      -127.5           -128: fits   2**(e - 6)
    all zero                                                     eps

The doubling depends on the order of the batches, so the merge (the larger
amax) is approximate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from quantobs.core.qparams.quark_rule import bfp_scale
from quantobs.stats.base import Batch, Field, Reduce, Statistic

__all__ = ["BfpAbsMax"]

_BFP_OVERFLOW = 127.5  # rounds to 128, outside int8


@dataclass(frozen=True)
class BfpAbsMax(Statistic):
    """Block absolute maxima with Quark's overflow doubling.

    Attributes:
        amax: `(*Q,)` absolute maxima (0 before any data).
        eps: scale of all-zero blocks (config).
        model_dtype: dtype the scales are computed in, the input's (config).
    """

    amax: torch.Tensor
    eps: float = torch.finfo(torch.float32).eps
    model_dtype: torch.dtype = torch.float32

    fields: ClassVar[tuple[Field, ...]] = (Field("amax", Reduce.MAX),)
    exact: ClassVar[bool] = False

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        eps: float = torch.finfo(torch.float32).eps,
        model_dtype: torch.dtype = torch.float32,
    ) -> BfpAbsMax:
        """No data: zeros."""
        return cls(torch.zeros(qparam_shape, device=device), eps, model_dtype)

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.amax.shape)

    def update(self, batch: Batch) -> BfpAbsMax:
        found = torch.maximum(-batch.min_vals, batch.max_vals)
        amax = torch.maximum(self.amax, found)  # float64 inputs keep float64
        scale = bfp_scale(amax.to(self.model_dtype), self.eps).to(amax.dtype)
        # Rounding is monotone, so a block overflows iff its largest value
        # rounds to 128. Its smallest cannot reach -129: |x| <= amax <
        # 2**(e + 1) = 128 * scale.
        over = batch.max_vals.to(amax.dtype) >= _BFP_OVERFLOW * scale
        return self.replace(amax=torch.where(over, amax * 2, amax))

    def merge(self, other: BfpAbsMax) -> BfpAbsMax:
        return self.replace(amax=torch.maximum(self.amax, other.amax))
