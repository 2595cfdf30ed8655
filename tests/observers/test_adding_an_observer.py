"""The worked example of docs/adding_an_observer.md, run as a test.

A new observer in one small file: a statistic (running moments, which merge
exactly by sums), a solver (mean +- k standard deviations, within the data),
registered under a name with typed options, and its tests (the protocol's
laws; the observer end to end). Keep this file and the document in step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import pytest
import torch
from pydantic import Field as OptionField

from quantobs import Observer, QuantizationArgs
from quantobs.observers import ObserverOptions
from quantobs.stats.base import Batch, Field, Reduce, Statistic, reduce_states

# --------------------------------------------------------------- statistic


@dataclasses.dataclass(frozen=True)
class Moments(Statistic):
    """Count, sum and sum of squares per qparam, and the data range.

    Attributes:
        count: `(*Q,)` float64 number of values.
        total: `(*Q,)` float64 sum of the values.
        squares: `(*Q,)` float64 sum of their squares.
        min_vals: `(*Q,)` smallest value (`+inf` before any data).
        max_vals: `(*Q,)` largest value (`-inf` before any data).
    """

    count: torch.Tensor
    total: torch.Tensor
    squares: torch.Tensor
    min_vals: torch.Tensor
    max_vals: torch.Tensor

    fields: ClassVar[tuple[Field, ...]] = (
        Field("count", Reduce.SUM),
        Field("total", Reduce.SUM),
        Field("squares", Reduce.SUM),
        Field("min_vals", Reduce.MIN),
        Field("max_vals", Reduce.MAX),
    )
    needs_values: ClassVar[bool] = True  # update reads the values

    @classmethod
    def empty(
        cls, qparam_shape: tuple[int, ...], device: torch.device, **config: Any
    ) -> Moments:
        zeros = torch.zeros(qparam_shape, dtype=torch.float64, device=device)
        inf = torch.full(qparam_shape, math.inf, device=device)
        return cls(zeros, zeros.clone(), zeros.clone(), inf, -inf)

    @property
    def qparam_shape(self) -> tuple[int, ...]:
        return tuple(self.count.shape)

    def update(self, batch: Batch) -> Moments:
        assert batch.x_flat is not None  # needs_values: the engine attaches them
        x = batch.x_flat.double()  # (N, *Q, G)
        return Moments(
            self.count + x.shape[0] * x.shape[-1],
            self.total + x.sum(dim=(0, -1)),
            self.squares + x.square().sum(dim=(0, -1)),
            torch.minimum(self.min_vals, batch.min_vals),
            torch.maximum(self.max_vals, batch.max_vals),
        )

    def merge(self, other: Moments) -> Moments:
        return Moments(
            self.count + other.count,
            self.total + other.total,
            self.squares + other.squares,
            torch.minimum(self.min_vals, other.min_vals),
            torch.maximum(self.max_vals, other.max_vals),
        )


# ------------------------------------------------------------ the observer


class SigmaOptions(ObserverOptions):
    """Options of `sigma`.

    Attributes:
        k: half-width of the range in standard deviations.
    """

    k: float = OptionField(3.0, gt=0.0)


@Observer.register("sigma")
class SigmaObserver(Observer):
    """Range `mean +- k * std` per qparam, within the observed min / max."""

    statistic_cls = Moments
    Options = SigmaOptions
    options: SigmaOptions

    def _range(self, stat: Statistic) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(stat, Moments)
        count = stat.count.clamp(min=1)
        mean = stat.total / count
        std = (stat.squares / count - mean.square()).clamp(min=0).sqrt()
        low = torch.maximum(mean - self.options.k * std, stat.min_vals.double())
        high = torch.minimum(mean + self.options.k * std, stat.max_vals.double())
        return low.float(), high.float()


# ------------------------------------------------------------------- tests


def _moments(x_flat: torch.Tensor) -> Moments:
    stat = Moments.empty(tuple(x_flat.shape[1:-1]), x_flat.device)
    batch = dataclasses.replace(stat.scan(x_flat), x_flat=x_flat)
    return stat.update(batch)


def test_moments_merge_exactly() -> None:
    a, b = torch.randn(4, 3, 16), torch.randn(2, 3, 16) * 5
    merged = _moments(a).merge(_moments(b))
    reduced = reduce_states(Moments, [_moments(a).state(), _moments(b).state()])
    for name, value in _moments(torch.cat([a, b])).state().items():
        torch.testing.assert_close(merged.state()[name], value)
        torch.testing.assert_close(reduced[name], value)


def test_sigma_observer_end_to_end() -> None:
    args = QuantizationArgs(num_bits=8, strategy="channel")
    observer = Observer.load_from_registry("sigma", base_name="weight", args=args, k=2)
    w = torch.randn(16, 256)
    observer.update(w)
    low, high = observer.get_range()
    mean, std = w.double().mean(dim=1), w.double().std(dim=1, correction=0)
    torch.testing.assert_close(high, (mean + 2 * std).float()[:, None])  # (16, 1)
    assert (low >= w.amin(dim=1, keepdim=True)).all()
    scale, zero_point = observer.get_qparams()
    assert scale.shape == zero_point.shape == (16, 1) and (scale > 0).all()
    with pytest.raises(ValueError, match="k"):
        Observer.load_from_registry("sigma", base_name="weight", args=args, k=-1)
