"""Summed candidate errors: the statistic of `static_mse`.

For every qparam and every candidate range `p * [ref_min, ref_max]` (the
shrink factors of `quantobs.core.scoring.shrink_factors`) it keeps the error
`sum |fake_quant(x) - x| ** norm` summed over every batch, so the chosen
candidate minimizes the error over all the calibration data. The reference
range is the first batch's (times `expand`) or one given with
`with_reference` (e.g. a min-max pass all-reduced across processes);
statistics with the same reference merge exactly (sums; EQUAL references),
and data beyond the reference is scored as clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.checks import Checks
from quantobs.core.qparams import generate_gparam
from quantobs.core.scoring import (
    DEFAULT_CHUNK_ELEMS,
    candidate_errors,
    search_args,
    shrink_factors,
)
from quantobs.stats.base import Batch, Field, Reduce, Statistic
from quantobs.stats.reduce import Range, range_or_zero

__all__ = ["CandidateErrors"]


@dataclass(frozen=True)
class CandidateErrors(Statistic):
    """Errors of every candidate range, summed over batches.

    Attributes:
        ref_min: `(*Q,)` reference minima (`+inf` before a reference is set).
        ref_max: `(*Q,)` reference maxima (`-inf` before).
        errors: `(C, *Q)` float64 summed errors, one row per shrink factor.
        global_scale: `(1,)` NVFP4 global scale the candidates are scored
            under (with `round_scales`).
        args: the quantization args (config).
        maxshrink, grid, norm, expand, chunk_elems, round_scales: the search
            options (config, as `static_mse`'s).
    """

    ref_min: torch.Tensor
    ref_max: torch.Tensor
    errors: torch.Tensor
    global_scale: torch.Tensor | None = None
    args: QuantizationArgs | None = None
    maxshrink: float = 0.2
    grid: float = 100.0
    norm: float = 2.4
    expand: float = 1.0
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    round_scales: bool = False

    fields: ClassVar[tuple[Field, ...]] = (
        Field("ref_min", Reduce.EQUAL),
        Field("ref_max", Reduce.EQUAL),
        Field("errors", Reduce.SUM),
        Field("global_scale", Reduce.EQUAL, optional=True),
    )
    needs_values: ClassVar[bool] = True

    @classmethod
    def empty(
        cls,
        qparam_shape: tuple[int, ...],
        device: torch.device,
        **config: object,
    ) -> CandidateErrors:
        """No reference and no errors yet."""
        empty = cls(
            torch.full(qparam_shape, math.inf, device=device),
            torch.full(qparam_shape, -math.inf, device=device),
            torch.zeros(0, device=device),
            **config,  # type: ignore[arg-type]
        )
        return empty.replace(errors=empty._zeros(qparam_shape, device))

    def _zeros(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        num_c = self.factors().numel()
        return torch.zeros(num_c, *qparam_shape, dtype=torch.float64, device=device)

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.ref_min.shape)

    @property
    def has_reference(self) -> bool:
        """Whether the reference range is set."""
        return bool((self.ref_min <= self.ref_max).all())

    def factors(self) -> torch.Tensor:
        """`(C,)` shrink factors of the candidate ranges."""
        return shrink_factors(self.maxshrink, self.grid)

    def with_reference(
        self, min_vals: torch.Tensor, max_vals: torch.Tensor
    ) -> CandidateErrors:
        """A fresh statistic (no errors) whose candidates shrink this range
        (times `expand`, saturated to float32's finite range).

        Raises:
            ValueError: non-finite values, or `min_vals > max_vals`.
        """
        min_vals, max_vals = min_vals.float(), max_vals.float()
        if not (torch.isfinite(min_vals).all() and torch.isfinite(max_vals).all()):
            raise ValueError("set_reference() needs finite min_vals and max_vals")
        if min_vals.shape != max_vals.shape or (min_vals > max_vals).any():
            raise ValueError(
                "set_reference() needs min_vals <= max_vals of the same shape"
            )
        return self._referenced(min_vals, max_vals, Checks())

    def _referenced(
        self, min_vals: torch.Tensor, max_vals: torch.Tensor, checks: Checks
    ) -> CandidateErrors:
        """`with_reference` of float32 ranges without their checks (those of
        the global scale go to `checks`)."""
        # `expand` past float32's max saturates (the candidates stay finite)
        top = torch.finfo(min_vals.dtype).max
        ref_min = (min_vals * self.expand).clamp(-top, top)
        ref_max = (max_vals * self.expand).clamp(-top, top)
        global_scale = None
        tensor_group = self.args is not None and self.args.strategy == "tensor_group"
        if self.round_scales and tensor_group:
            global_scale = generate_gparam(ref_min.min(), ref_max.max(), checks=checks)
        errors = self._zeros(tuple(ref_min.shape), ref_min.device)
        return self.replace(
            ref_min=ref_min, ref_max=ref_max, errors=errors, global_scale=global_scale
        )

    def _batch_referenced(self, batch: Batch) -> CandidateErrors:
        """This statistic, or where it has no reference yet (decided on the
        device, nothing read on the host) one with the batch's range as its
        reference. The batch's data is the observer's to check: its checks
        are not read here."""
        low, high = range_or_zero(batch.min_vals, batch.max_vals)
        fresh = self._referenced(low.float(), high.float(), Checks())
        has = (self.ref_min <= self.ref_max).all()  # () bool
        global_scale = fresh.global_scale
        if self.global_scale is not None and global_scale is not None:
            global_scale = torch.where(has, self.global_scale, global_scale)
        elif self.global_scale is not None:
            global_scale = self.global_scale
        return self.replace(
            ref_min=torch.where(has, self.ref_min, fresh.ref_min),
            ref_max=torch.where(has, self.ref_max, fresh.ref_max),
            global_scale=global_scale,
        )

    def update(self, batch: Batch) -> CandidateErrors:
        if batch.x_flat is None or self.args is None:
            raise ValueError("candidate errors score values under args; none given")
        stat = self._batch_referenced(batch)
        values = batch.x_flat
        found = candidate_errors(
            values,
            search_args(self.args, self.round_scales),
            stat.ref_min,
            stat.ref_max,
            stat.factors().to(values.device),
            self.norm,
            self.chunk_elems,
            stat.global_scale,
        )
        return stat.replace(errors=stat.errors + found)

    def merge(self, other: CandidateErrors) -> CandidateErrors:
        """Sums of errors (exact) of statistics with the same reference.

        Raises:
            ValueError: the references differ.
        """
        if not other.has_reference:
            return self
        if not self.has_reference:
            return other
        if not (
            torch.equal(self.ref_min, other.ref_min)
            and torch.equal(self.ref_max, other.ref_max)
        ):
            raise ValueError(
                "static_mse observers with different reference ranges cannot "
                "merge; give both the same set_reference(min_vals, max_vals) "
                "before observing"
            )
        return self.replace(errors=self.errors + other.errors)

    def best_range(self) -> Range:
        """The candidate of least summed error per qparam (first minimum wins)."""
        best = self.factors().to(self.errors.device)[self.errors.argmin(dim=0)]
        return self.ref_min * best, self.ref_max * best
