"""Finite inputs where torch.ao's float32 arithmetic overflows, and the face's
repairs (beyond torch; everywhere else the numbers are torch's, bit for bit).

Each repair touches only the qparams (or channels) that overflowed::

    finite input                  torch.ao               the face
    affine max - min above        scale inf, zero        scale and zero point in
      float32's max (also         point from it          float64 (`repair_qparams`)
      float_qparams)
    (q)int32 affine: min / scale  zero point wraps in    zero point in float64,
      below -2**31                int32 (0 for qint32),  clamped into the range
                                  clipping the negatives
    a scale above float32's max   inf                    ValueError: too wide for
      (custom ranges of 2 levels)                        the quantized range
    moving average: new - old     running range inf,     that step in float64
      overflows                   then AssertionError    (`TorchMovingAverage`)
    float64 batch beyond the      inf range, NaN scale   ValueError (`cast_range`)
      float32 buffers
    histogram: max - min          histc counts nothing:  the observed range's
      overflows                   NaN scale              qparams, with a warning
                                                         (`HistogramObserver`)

`repair_qparams` and the histogram's warning (`unsearchable_histogram`) are
in the core (`quantobs.core.qparams.torch_repair`), shared with Quark's
`PerTensorHistogramObserverPro`; the moving average and the cast are here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantobs.stats.base import Batch
from quantobs.stats.minmax import MovingAverage

__all__ = ["TorchMovingAverage", "cast_range"]


def cast_range(
    owner: str, low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's range `(low, high)` cast to the buffers' `dtype`.

    Raises:
        ValueError: a finite end that overflows `dtype` (a float64 batch
            beyond float32 buffers: torch's range would be infinite).
    """
    cast = low.to(dtype), high.to(dtype)
    for found, to in zip((low, high), cast, strict=True):
        overflow = torch.isinf(to) & torch.isfinite(found)
        if bool(overflow.any()):
            value = float(found[overflow].flatten()[0])
            raise ValueError(
                f"{owner} got a {found.dtype} value {value:g} beyond the range "
                f"of its {dtype} buffers (+-{torch.finfo(dtype).max:g}). Build "
                "the observer with factory_kwargs={'dtype': torch.float64}, or "
                "clip or rescale the input."
            )
    return cast


def _redo_step(
    old: torch.Tensor, new: torch.Tensor, stepped: torch.Tensor, constant: float
) -> torch.Tensor:
    """`stepped` with each step of finite ends that overflowed redone in
    float64, as `old * (1 - c) + new * c` (a weighted mean: it cannot
    overflow, and its float32 value lies between the ends)."""
    bad = torch.isinf(stepped) & torch.isfinite(old) & torch.isfinite(new)
    if not bool(bad.any()):
        return stepped
    blended = old.double() * (1 - constant) + new.double() * constant
    return torch.where(bad, blended.to(stepped.dtype), stepped)


@dataclass(frozen=True)
class TorchMovingAverage(MovingAverage):
    """torch's moving average (`MovingAverage`, `form="step"`) whose steps
    do not overflow: `old + c * (new - old)` in the buffers' dtype, as torch
    computes it, except where `new - old` overflows that dtype (ends of
    opposite signs near its maximum) and torch's range becomes infinite;
    those steps are redone in float64."""

    def update(self, batch: Batch) -> TorchMovingAverage:
        stepped = super().update(batch)
        low = _redo_step(self.min_vals, batch.min_vals, stepped.min_vals, self.constant)
        high = _redo_step(
            self.max_vals, batch.max_vals, stepped.max_vals, self.constant
        )
        return TorchMovingAverage(low, high, stepped.count, self.constant, self.form)
