"""The statistic protocol: what an observer keeps of its batches.

A statistic is a value: a frozen dataclass of tensors (its *state*, the
fields an observer keeps in registered buffers) and of plain settings (its
*config*, from the observer's options). `update` folds a batch in and
`merge` folds in another statistic of the same config, both returning a new
value; `state()` / `from_state()` move it to and from buffers and state
dicts. Every state field declares how it combines across batches and
processes, as data (`Field`), so that one generic routine (`reduce_states`,
and the distributed sync built on it) can combine statistics without knowing
their type::

    reduce   merge of a and b                      across processes    exact
    MIN      elementwise minimum                   all-reduce MIN      yes
    MAX      elementwise maximum                   all-reduce MAX      yes
    SUM      elementwise sum (after alignment)     all-reduce SUM      yes
    GRID     recomputed from the MIN/MAX fields    (alignment)         yes
    EQUAL    must agree (a reference range)        checked             yes
    LATEST   the later statistic's value           last process wins   no
    MEAN     mean weighted by the `count` field    weighted all-reduce no

Alignment: a statistic with GRID fields (histograms) first reduces its MIN
and MAX fields, then `align`s every process's statistic to the grid of the
reduced range, and only then sums its SUM fields. `exact` says whether the
merge equals observing the concatenated batches (MEAN and LATEST fields, and
histograms whose growth re-bins approximately, are not).

Statistics compute in float32, or float64 for float64 inputs; counts are
exact integers.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, TypeVar

import torch

from quantobs.stats.reduce import drop_nonfinite, scan_range

__all__ = [
    "Batch",
    "Field",
    "Reduce",
    "Statistic",
    "reduce_states",
    "weighted_mean",
]

S = TypeVar("S", bound="Statistic")


class Reduce(str, Enum):
    """How a state field combines across batches and processes (module table)."""

    MIN = "min"
    MAX = "max"
    SUM = "sum"
    GRID = "grid"
    EQUAL = "equal"
    LATEST = "latest"
    MEAN = "mean"


@dataclass(frozen=True, slots=True)
class Field:
    """A state field and its reduction.

    Attributes:
        name: the attribute of the statistic (and default buffer name).
        reduce: how it combines (`Reduce`).
        optional: the field may be None (a derived summary an observer keeps
            only when it needs it).
    """

    name: str
    reduce: Reduce
    optional: bool = False


@dataclass(frozen=True, slots=True)
class Batch:
    """One observed batch, as a statistic's `update` receives it.

    Attributes:
        x_flat: `(N, *Q, G)` values when the statistic reads values (NaN
            where a value is to be skipped, see `has_skipped`), else None.
        min_vals: `(*Q,)` smallest finite value per qparam (`+inf` where none).
        max_vals: `(*Q,)` largest finite value per qparam (`-inf` where none).
        num_observations: `N`, the batch's observations.
        absmax: `max(-min, max, 0)` over the qparams when it came for free
            (a float from the native scan, or a one-element tensor kept on
            the device).
        has_skipped: `x_flat` holds NaN entries standing for skipped values.
        scan: what a statistic's `scan` found in the pass that produced the
            range (e.g. counts on a speculated grid), or None.
        findings: `(3,)` float64 `[qparams with a non-finite end, 0, 0]` when
            the scan counted them on the device (the GPU min/max kernel): the
            step `ObserverEngine` defers under `nan_policy="raise"` (else
            None: the engine counts them from the range).
    """

    x_flat: torch.Tensor | None
    min_vals: torch.Tensor
    max_vals: torch.Tensor
    num_observations: int = 1
    absmax: float | torch.Tensor | None = None
    has_skipped: bool = False
    scan: Any = None
    findings: torch.Tensor | None = None

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        """The shape of the batch's qparams."""
        return tuple(self.min_vals.shape)


class Statistic(ABC):
    """Base of every statistic (see the module docstring).

    Subclasses are frozen dataclasses; `fields` names their state.
    """

    fields: ClassVar[tuple[Field, ...]]
    #: Whether `merge` equals observing the concatenation of the batches.
    exact: ClassVar[bool] = True
    #: Whether `update` reads the batch's values (else only its range).
    needs_values: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def empty(cls: type[S], qparam_shape: tuple[int, ...], device: torch.device) -> S:
        """The statistic of no data (the identity of `merge`); subclasses take
        their config as keyword arguments."""

    @abstractmethod
    def update(self: S, batch: Batch) -> S:
        """This statistic with one more batch folded in."""

    @abstractmethod
    def merge(self: S, other: S) -> S:
        """This statistic with another one's data folded in (see `exact`)."""

    @property
    @abstractmethod
    def qparam_shape(self) -> tuple[int, ...]:
        """The shape of the qparams the statistic is kept for."""

    def scan(self, x_flat: torch.Tensor, *, exact_dtype: bool = False) -> Batch:
        """The batch's range, and what else this statistic finds in that pass.

        Args:
            x_flat: `(N, *Q, G)` values.
            exact_dtype: keep float64 ranges for float64 inputs.

        Returns:
            The `Batch` (without values: the observer attaches them).
        """
        keeps_absmax = bool(getattr(self, "track_absmax", False))
        low, high, absmax, findings = scan_range(
            x_flat, exact_dtype=exact_dtype, absmax=keeps_absmax
        )
        n = int(x_flat.shape[0])
        return Batch(None, low, high, n, absmax=absmax, findings=findings)

    def omit_nonfinite(self, x_flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The values `update` gets when non-finite ones are to be ignored, and
        whether they hold NaN markers (`Batch.has_skipped`). Default: 0, exact
        under any scale; statistics that count values mark them NaN."""
        return drop_nonfinite(x_flat), False

    def align(self: S, reduced: Mapping[str, torch.Tensor]) -> S:
        """This statistic moved to the grid of `reduced` MIN/MAX fields (GRID
        statistics only; others are returned unchanged)."""
        return self

    def state(self) -> dict[str, torch.Tensor]:
        """The state fields by name (optional ones only when present)."""
        found = {f.name: getattr(self, f.name) for f in self.fields}
        return {name: value for name, value in found.items() if value is not None}

    @classmethod
    def from_state(cls: type[S], state: Mapping[str, torch.Tensor], **config: Any) -> S:
        """Inverse of `state()`, with the config the statistic was made with
        (keys that are not dataclass fields, `empty`-only settings, are
        ignored).

        Raises:
            KeyError: a required field is missing from `state`.
        """
        names = _field_names(cls)
        config = {k: v for k, v in config.items() if k in names}
        values: dict[str, Any] = {}
        for f in cls.fields:
            if f.name in state:
                values[f.name] = state[f.name]
            elif f.optional:
                values[f.name] = None
            else:
                raise KeyError(
                    f"{cls.__name__} state lacks {f.name!r}; it has {sorted(state)}"
                )
        return cls(**values, **config)

    def config(self) -> dict[str, Any]:
        """The settings (non-state dataclass fields) of this statistic."""
        names = {f.name for f in self.fields}
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.name not in names
        }

    def replace(self: S, **changes: Any) -> S:
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    """The dataclass fields of a statistic class (state and config)."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def reduce_states(
    statistic: type[Statistic],
    states: Sequence[Mapping[str, torch.Tensor]],
    **config: Any,
) -> dict[str, torch.Tensor]:
    """Combine the states of several statistics as their fields declare.

    What an all-reduce across processes computes, written for a list: MIN /
    MAX fields first, then every statistic aligned to the reduced grid (GRID
    fields), then SUM fields summed, MEAN fields averaged with the `count`
    field, EQUAL fields checked, LATEST fields taken from the last state.
    For every statistic this equals folding `merge` over the list (a test of
    each statistic's declaration).

    Raises:
        ValueError: no states, or EQUAL fields that differ.
    """
    if not states:
        raise ValueError("reduce_states needs at least one state")
    kinds = {f.name: f.reduce for f in statistic.fields}
    reduced: dict[str, torch.Tensor] = {}
    for name, kind in kinds.items():
        present = [s[name] for s in states if name in s]
        if not present or kind not in (Reduce.MIN, Reduce.MAX):
            continue
        combine = torch.minimum if kind == Reduce.MIN else torch.maximum
        value = present[0]
        for other in present[1:]:
            value = combine(value, other)
        reduced[name] = value
    aligned = [statistic.from_state(s, **config).align(reduced).state() for s in states]
    weights = [s.get("count") for s in aligned]
    for name, kind in kinds.items():
        present = [s[name] for s in aligned if name in s]
        if not present or name in reduced:
            continue
        if kind == Reduce.GRID:  # aligned: every state has the same grid
            reduced[name] = present[0]
        elif kind == Reduce.SUM:
            reduced[name] = sum(present[1:], present[0])
        elif kind == Reduce.EQUAL:
            if any(not torch.equal(present[0], p) for p in present[1:]):
                raise ValueError(
                    f"{statistic.__name__}.{name} must be equal in every state "
                    "(a shared reference); set it alike before observing"
                )
            reduced[name] = present[0]
        elif kind == Reduce.LATEST:
            reduced[name] = present[-1]
        elif kind == Reduce.MEAN:
            reduced[name] = weighted_mean(present, weights)
    return reduced


def weighted_mean(
    values: Sequence[torch.Tensor], weights: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """The MEAN reduction: `sum(v * w) / sum(w)` elementwise, where a
    non-finite value (an empty range's `+-inf`) counts as absent (weight 0).

    Where every value is absent the first value is kept. Equal weights where
    any weight is missing. Computed in the values' dtype, as the distributed
    reduction's float64 where that overflows (`v * w` past float32's max for
    values near it): a mean of finite values is finite.
    """
    if any(w is None for w in weights):
        weights = [torch.ones((), device=values[0].device)] * len(values)
    mean, total = _weighted_mean(values, weights, values[0].dtype)
    overflow = (total > 0) & ~torch.isfinite(mean)
    if bool(overflow.any()):
        wide, _ = _weighted_mean(values, weights, torch.float64)
        mean = torch.where(overflow, wide.to(mean.dtype), mean)
    return mean


def _weighted_mean(
    values: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weighted_mean` computed in `dtype` (result in it), and the total
    weight of the present values."""
    total = torch.zeros_like(values[0], dtype=dtype)
    weighted = torch.zeros_like(values[0], dtype=dtype)
    for value, weight in zip(values, weights, strict=True):
        present = torch.isfinite(value)
        w = torch.where(present, weight.to(dtype), 0.0)  # type: ignore[union-attr]
        weighted = weighted + torch.where(present, value.to(dtype) * w, 0.0)
        total = total + w
    return torch.where(total > 0, weighted / total, values[0].to(dtype)), total
