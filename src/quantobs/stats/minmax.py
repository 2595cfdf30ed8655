"""Range statistics: running min/max, the latest batch's, a moving average,
and the block absolute maximum of MX formats.

==================  ===========================  =========================
statistic           state (reduce)               merge
==================  ===========================  =========================
`MinMax`            min_vals (MIN),              exact
                    max_vals (MAX)
`LatestRange`       min_vals, max_vals (LATEST)  the later one wins
`MovingAverage`     min_vals, max_vals (MEAN),   count-weighted mean
                    count (SUM)                  (approximate)
`AbsMax`            amax (MAX)                   exact
`LatestAbsMax`      amax (LATEST)                the later one wins
==================  ===========================  =========================

`MinMax` and `LatestRange` may also keep `absmax`, the largest `|value|`
over all qparams (the NVFP4 global scale's input), when the observer needs
it: it merges exactly (MAX) and often comes for free with the batch's range.

Moving averages are written in one of two forms, bit for bit as the peers
write them::

    form     new average                     used by
    blend    old * (1 - c) + new * c         llm-compressor (current)
    step     old + c * (new - old)           torch.ao, llm-compressor (legacy)

A qparam with no data on one side (the empty range `(+inf, -inf)`) takes the
other side's range unchanged. A step of finite ranges never overflows: where
the form's float32 arithmetic would (ends of opposite signs near float32's
max: `new - old` is infinite), that step is redone in float64; merges
likewise (`weighted_mean`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from quantobs.stats.base import Batch, Field, Reduce, Statistic, weighted_mean
from quantobs.stats.reduce import absmax_or_zero

__all__ = [
    "AbsMax",
    "AverageForm",
    "LatestAbsMax",
    "LatestRange",
    "MinMax",
    "MovingAverage",
    "lerp",
    "lerp_ranges",
]

AverageForm = Literal["blend", "step"]


def _empty_range(
    qparam_shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    low = torch.full(qparam_shape, math.inf, dtype=dtype, device=device)
    return low, torch.full_like(low, -math.inf)


def _batch_absmax(batch: Batch) -> torch.Tensor:
    """`(1,)` float32 absmax of the batch's ranges (free when the scan knew it)."""
    if isinstance(batch.absmax, torch.Tensor):
        found = batch.absmax.to(torch.float32)
        return found if found.shape == (1,) else found.reshape(1)
    if batch.absmax is not None:
        return torch.tensor([batch.absmax], dtype=torch.float32)
    return absmax_or_zero(batch.min_vals, batch.max_vals)


@dataclass(frozen=True)
class MinMax(Statistic):
    """Min and max over every batch (exact merge).

    Attributes:
        min_vals: `(*Q,)` smallest value per qparam (`+inf` where none).
        max_vals: `(*Q,)` largest value per qparam (`-inf` where none).
        absmax: `(1,)` largest `|value|` overall (kept if `track_absmax`).
        track_absmax: keep `absmax` (config).
    """

    min_vals: torch.Tensor
    max_vals: torch.Tensor
    absmax: torch.Tensor | None = None
    track_absmax: bool = False

    fields: ClassVar[tuple[Field, ...]] = (
        Field("min_vals", Reduce.MIN),
        Field("max_vals", Reduce.MAX),
        Field("absmax", Reduce.MAX, optional=True),
    )

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        track_absmax: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> MinMax:
        """No data: `(+inf, -inf)` everywhere (absmax 0)."""
        low, high = _empty_range(qparam_shape, device, dtype)
        absmax = torch.zeros(1, device=device) if track_absmax else None
        return cls(low, high, absmax, track_absmax)

    @classmethod
    def starting(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        track_absmax: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> MinMax:
        """`empty`'s value for a first `update` only, made without a tensor
        per qparam: its ranges are broadcast views of one `+inf` / `-inf`,
        and `update` takes the batch's own range (what `minimum(+inf, v)`
        gives: the same bits, a NaN still NaN) instead of reading them.
        Never stored (the views are read-only); the observer's first batch
        starts from it."""
        low = torch.full((), math.inf, dtype=dtype, device=device)
        high = torch.full((), -math.inf, dtype=dtype, device=device)
        absmax = torch.zeros(1, device=device) if track_absmax else None
        stat = cls(
            low.expand(qparam_shape), high.expand(qparam_shape), absmax, track_absmax
        )
        object.__setattr__(stat, "_starting", True)  # not state, not config
        return stat

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.min_vals.shape)

    def _takes_batch(self, batch: Batch) -> bool:
        """Whether `update` from this statistic is the batch's own range: a
        `starting` one whose `minimum` / `maximum` would return the batch's
        ranges unchanged (same shape, device, and dtype after promotion)."""
        low = batch.min_vals
        return (
            getattr(self, "_starting", False)
            and low.shape == self.min_vals.shape
            and low.device == self.min_vals.device
            and torch.promote_types(self.min_vals.dtype, low.dtype) == low.dtype
            and batch.max_vals.dtype == low.dtype
        )

    def update(self, batch: Batch) -> MinMax:
        absmax = self.absmax
        if self.track_absmax:
            found = _batch_absmax(batch).to(self.min_vals.device)
            absmax = found if absmax is None else torch.maximum(absmax, found)
        if self._takes_batch(batch):  # a first batch: no pass per qparam
            return MinMax(batch.min_vals, batch.max_vals, absmax, self.track_absmax)
        return MinMax(
            torch.minimum(self.min_vals, batch.min_vals),
            torch.maximum(self.max_vals, batch.max_vals),
            absmax,
            self.track_absmax,
        )

    def merge(self, other: MinMax) -> MinMax:
        absmax = None
        if self.absmax is not None and other.absmax is not None:
            absmax = torch.maximum(self.absmax, other.absmax)
        return MinMax(
            torch.minimum(self.min_vals, other.min_vals),
            torch.maximum(self.max_vals, other.max_vals),
            absmax,
            self.track_absmax,
        )


@dataclass(frozen=True)
class LatestRange(MinMax):
    """The latest batch's range (memoryless observers; dynamic quantization).

    Attributes: as `MinMax`'s, each the latest batch's.
    """

    fields: ClassVar[tuple[Field, ...]] = (
        Field("min_vals", Reduce.LATEST),
        Field("max_vals", Reduce.LATEST),
        Field("absmax", Reduce.LATEST, optional=True),
    )
    exact: ClassVar[bool] = False

    def update(self, batch: Batch) -> LatestRange:
        absmax = _batch_absmax(batch) if self.track_absmax else None
        return LatestRange(batch.min_vals, batch.max_vals, absmax, self.track_absmax)

    def merge(self, other: MinMax) -> LatestRange:
        # Nothing accumulates: the later statistic wins.
        if isinstance(other, LatestRange):
            return other
        return LatestRange(
            other.min_vals, other.max_vals, other.absmax, self.track_absmax
        )


def lerp(old: torch.Tensor, new: torch.Tensor, weight: float) -> torch.Tensor:
    """Moving-average step in the `blend` form, `old * (1 - weight) + new * weight`."""
    return (old * (1.0 - weight)) + (new * weight)


def _step(old: torch.Tensor, new: torch.Tensor, weight: float) -> torch.Tensor:
    """Moving-average step in the `step` form, `old + weight * (new - old)`."""
    return old + weight * (new - old)


def lerp_ranges(
    old: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    weight: float,
    form: AverageForm = "blend",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A moving-average step of two ranges where an empty range is no data.

    A qparam empty on one side takes the other side's range unchanged.
    """
    step = lerp if form == "blend" else _step
    old_empty, new_empty = old[0] > old[1], new[0] > new[1]
    out = []
    for before, after in zip(old, new, strict=True):
        mixed = step(before, after, weight)
        mixed = torch.where(old_empty, after, mixed)
        mixed = torch.where(new_empty, before, mixed)
        out.append(_redo_overflow(mixed, before, after, weight))
    return out[0], out[1]


def _redo_overflow(
    mixed: torch.Tensor, before: torch.Tensor, after: torch.Tensor, weight: float
) -> torch.Tensor:
    """`mixed` where it is finite or its ends are not; steps of finite ends
    that overflowed (`new - old` of opposite signs near the dtype's max in
    the `step` form, a rounding past it in `blend`) redone in float64 as
    `old * (1 - w) + new * w`, a weighted mean: finite, between the ends.
    Ordinary steps keep their bits (elementwise, nothing read on the host)."""
    bad = ~torch.isfinite(mixed) & torch.isfinite(before) & torch.isfinite(after)
    top = torch.finfo(mixed.dtype).max
    exact = before.double() * (1.0 - weight) + after.double() * weight
    return torch.where(bad, exact.clamp(-top, top).to(mixed.dtype), mixed)


@dataclass(frozen=True)
class MovingAverage(Statistic):
    """Moving average of per-batch ranges (approximate merge).

    Attributes:
        min_vals: `(*Q,)` averaged minima (`+inf` before any data).
        max_vals: `(*Q,)` averaged maxima.
        count: `()` int64 observations folded in (the merge weight), kept
            when the observer tracks it.
        constant: weight of the newest batch, in (0, 1] (config).
        form: `blend` or `step` (config, module table).
        rounding: bfloat16 / float16: each step computed in that dtype, as
            llm-compressor averages the ranges of values of that dtype (the
            average stays a value of it); None: in the statistic's dtype
            (config).
    """

    min_vals: torch.Tensor
    max_vals: torch.Tensor
    count: torch.Tensor | None = None
    constant: float = 0.01
    form: AverageForm = "blend"
    rounding: torch.dtype | None = None

    fields: ClassVar[tuple[Field, ...]] = (
        Field("min_vals", Reduce.MEAN),
        Field("max_vals", Reduce.MEAN),
        Field("count", Reduce.SUM, optional=True),
    )
    exact: ClassVar[bool] = False

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        constant: float = 0.01,
        form: AverageForm = "blend",
        counted: bool = True,
        dtype: torch.dtype = torch.float32,
        rounding: torch.dtype | None = None,
    ) -> MovingAverage:
        """No data: `(+inf, -inf)` everywhere, count 0."""
        low, high = _empty_range(qparam_shape, device, dtype)
        count = torch.zeros((), dtype=torch.int64, device=device) if counted else None
        return cls(low, high, count, constant, form, rounding)

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.min_vals.shape)

    def update(self, batch: Batch) -> MovingAverage:
        old = (self.min_vals, self.max_vals)
        new = (batch.min_vals, batch.max_vals)
        if self.rounding is not None:  # (*Q,) ranges of values of `rounding`
            old = (old[0].to(self.rounding), old[1].to(self.rounding))
            new = (new[0].to(self.rounding), new[1].to(self.rounding))
        low, high = lerp_ranges(old, new, self.constant, self.form)
        if self.rounding is not None:  # kept in the statistic's dtype (exact)
            low, high = low.to(self.min_vals.dtype), high.to(self.min_vals.dtype)
        count = None if self.count is None else self.count + batch.num_observations
        return MovingAverage(low, high, count, self.constant, self.form, self.rounding)

    def merge(self, other: MovingAverage) -> MovingAverage:
        """The count-weighted mean of the two averages.

        A moving average depends on the order of its batches, so no merge can
        be exact; this one equals the average over both when the batches are
        alike, and is what an all-reduce with `AVG` gives for equal counts.
        """
        if self.count is None or other.count is None:
            raise ValueError("moving averages merge by their counts; none is kept")
        counts = (self.count, other.count)
        low = weighted_mean((self.min_vals, other.min_vals), counts)
        high = weighted_mean((self.max_vals, other.max_vals), counts)
        return MovingAverage(
            low, high, counts[0] + counts[1], self.constant, self.form, self.rounding
        )


@dataclass(frozen=True)
class AbsMax(Statistic):
    """Largest `|value|` per qparam over every batch (exact merge).

    Attributes:
        amax: `(*Q,)` absolute maxima (0 before any data).
    """

    amax: torch.Tensor

    fields: ClassVar[tuple[Field, ...]] = (Field("amax", Reduce.MAX),)

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> AbsMax:
        """No data: zeros."""
        return cls(torch.zeros(qparam_shape, dtype=dtype, device=device))

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.amax.shape)

    def update(self, batch: Batch) -> AbsMax:
        found = torch.maximum(-batch.min_vals, batch.max_vals)
        return AbsMax(torch.maximum(self.amax, found))  # float64 inputs keep float64

    def merge(self, other: AbsMax) -> AbsMax:
        return AbsMax(torch.maximum(self.amax, other.amax))


@dataclass(frozen=True)
class LatestAbsMax(AbsMax):
    """The latest batch's `|value|` maximum per qparam.

    Attributes:
        amax: `(*Q,)` absolute maxima of the latest batch.
    """

    fields: ClassVar[tuple[Field, ...]] = (Field("amax", Reduce.LATEST),)
    exact: ClassVar[bool] = False

    def update(self, batch: Batch) -> LatestAbsMax:
        return LatestAbsMax(torch.maximum(-batch.min_vals, batch.max_vals))

    def merge(self, other: AbsMax) -> LatestAbsMax:
        # Nothing accumulates: the later statistic wins.
        return other if isinstance(other, LatestAbsMax) else LatestAbsMax(other.amax)
