"""Running ranges per `tensor_id`, each an engine whose statistic is in buffers.

A `RangeObserver` keeps one `TensorRange` child per `tensor_id` (and one for
`GROUPS_ID`, the `(rows, num_groups)` range of group strategies) in an
`nn.ModuleList`; the ids, in the order they were first seen, travel in the
extra state and are restored before the children load, so `load_state_dict`
into a fresh observer recreates them. `min_val` / `max_val` are read-only
mappings `tensor_id -> range` over the children::

    state_dict key          holds
    _extra_state            tensor ids, token count
    ranges.{i}.min_vals     running minima of the i-th tensor id
    ranges.{i}.max_vals     running maxima
    ranges.{i}.count        observations (moving averages: the merge weight)

Ranges are kept in the input's dtype (a bf16 input gives bf16 ranges and
scales), as the legacy code computed them.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from quantobs.faces.llmcompressor_legacy.base import (
    GROUPS_ID,
    Observer,
    QParams,
    check_observed,
    normalize_dim,
)
from quantobs.observers.engine import ObserverEngine
from quantobs.stats.base import Batch, Reduce, Statistic
from quantobs.stats.reduce import Range, count_nonfinite, range_or_zero

__all__ = ["RangeObserver", "RangeSelector", "RangeView", "TensorRange"]

_DEFAULT_ID = "default"

RangeSelector = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Range]
"""`(x_flat, min_vals, max_vals) -> (min_vals, max_vals)`: a batch's range
chosen from its `(N, *Q, G)` values and min/max (e.g. an MSE search)."""


def _reduce_layout(
    observed: torch.Tensor, reduce_dims: Iterable[int] | None
) -> torch.Tensor:
    """`observed` as `(1, *keepdims shape, reduced)` for a legacy reduction."""
    if not reduce_dims:  # legacy: None or () reduce every dim (torch.aminmax)
        return observed.reshape(1, -1)  # (1, numel): qparam shape ()
    dims = [normalize_dim(d, observed.ndim, "reduce_dims") for d in reduce_dims]
    if len(set(dims)) != len(dims):
        raise ValueError(f"reduce_dims {tuple(reduce_dims)} repeats a dim")
    kept = [d for d in range(observed.ndim) if d not in dims]
    keepdims = [1 if d in dims else observed.shape[d] for d in range(observed.ndim)]
    # (1, *keepdims, prod(reduced sizes)): the kept dims in order, 1s between
    return observed.permute(*kept, *sorted(dims)).reshape(1, *keepdims, -1)


def _range(stat: Statistic) -> Range:
    return stat.min_vals, stat.max_vals  # type: ignore[attr-defined]


class TensorRange(ObserverEngine):
    """The running range of one `tensor_id`.

    Args:
        statistic: `MinMax` (static), `LatestRange` or `MovingAverage`
            (`form="step"`, the legacy arithmetic).
        config: the statistic's settings (e.g. the averaging constant).
        owner: the observer's registry name, for messages.
        tensor_id: the key, for messages.
        select: optional `RangeSelector` turning a batch's min/max into the
            range folded in (the MSE search); it reads the batch's values.
    """

    exact_dtype = True  # float64 inputs keep float64 ranges

    def __init__(
        self,
        statistic: type[Statistic],
        config: dict[str, Any],
        owner: str,
        tensor_id: Hashable,
        select: RangeSelector | None = None,
    ) -> None:
        super().__init__(nan_policy="raise")
        self._statistic = statistic
        self._config = config
        self.owner = owner
        self.tensor_id = tensor_id
        self.select = select
        #: dtype of the ranges: the latest input's (legacy arithmetic).
        self.dtype = torch.float32

    def statistic_type(self) -> type[Statistic]:
        return self._statistic

    def statistic_config(self) -> dict[str, Any]:
        return {**self._config, "dtype": self.dtype}

    def _needs_values(self) -> bool:
        return self.select is not None

    def _current_for(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> Statistic:
        # A statistic of LATEST fields keeps no history: any shape may follow.
        if all(f.reduce is Reduce.LATEST for f in self._statistic.fields):
            return self._new_statistic(qparam_shape, device)
        return super()._current_for(qparam_shape, device)

    def observe(self, x_flat: torch.Tensor) -> Range:
        """Fold a batch `(1, *Q, G)` in and return the running range (in
        `x_flat.dtype`).

        Raises:
            ValueError: nothing observed yet and this batch has no finite
                value (`nan_policy="omit"` skips such a batch).
        """
        self.dtype = x_flat.dtype
        stat = self._observe(x_flat) or self.statistic()
        if stat is None:
            raise ValueError(
                f"observer {self.owner!r}: every value observed for tensor_id "
                f"{self.tensor_id!r} was NaN or inf (nan_policy='omit' skipped "
                "them all), so there is no range yet; observe finite values"
            )
        return _range(stat)

    def _prepare_batch(self, batch: Batch) -> Batch:
        low, high = batch.min_vals, batch.max_vals
        if self.select is not None:
            assert batch.x_flat is not None  # _needs_values
            # qparams without a finite value (nan_policy="omit") stay empty
            empty = low > high
            found = self.select(batch.x_flat, *range_or_zero(low, high))
            low = torch.where(empty, low, found[0].to(low.dtype))
            high = torch.where(empty, high, found[1].to(high.dtype))
        return replace(batch, min_vals=low.to(self.dtype), max_vals=high.to(self.dtype))

    def _shape_error(
        self, before: tuple[int, ...], after: tuple[int, ...]
    ) -> Exception:
        return ValueError(
            f"observer {self.owner!r}: the range of tensor_id {self.tensor_id!r} "
            f"changed shape from {before} to {after}; call reset() before "
            "observing a differently shaped tensor"
        )

    def _nonfinite_error(self, x_flat: torch.Tensor) -> Exception:
        return ValueError(
            f"observer {self.owner!r} got {count_nonfinite(x_flat)} non-finite "
            "value(s) (NaN or inf); clean the input, or pass nan_policy='omit' "
            "to ignore them"
        )

    def extra_repr(self) -> str:
        return f"tensor_id={self.tensor_id!r}, statistic={self._statistic.__name__}"

    def range(self) -> Range:
        """The running `(min_vals, max_vals)` (the buffers themselves).

        Raises:
            KeyError: nothing observed (a range saved empty).
        """
        stat = self.statistic()
        if stat is None:
            raise KeyError(self.tensor_id)
        return _range(stat)


class RangeView(Mapping[Hashable, torch.Tensor]):
    """Read-only `tensor_id -> running minima` (or maxima) of an observer."""

    def __init__(self, observer: RangeObserver, side: int) -> None:
        self._observer, self._side = observer, side

    def __getitem__(self, tensor_id: Hashable) -> torch.Tensor:
        return self._observer.range_of(tensor_id)[self._side]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._observer.tensor_ids))

    def __len__(self) -> int:
        return len(self._observer.tensor_ids)

    def __repr__(self) -> str:
        return repr(dict(self))


class RangeObserver(Observer, metaclass=ABCMeta):
    """Observer keeping one running range per `tensor_id` (module docstring).

    Subclasses say which statistic a range keeps and how a batch's range is
    chosen (`_new_range`).
    """

    def __init__(self, quantization_args: Any, **observer_kwargs: Any) -> None:
        super().__init__(quantization_args, **observer_kwargs)
        self.ranges = torch.nn.ModuleList()
        self.tensor_ids: list[Hashable] = []  # the key of each of `ranges`

    @abstractmethod
    def _new_range(self, tensor_id: Hashable) -> TensorRange:
        """A fresh running range for `tensor_id`."""

    @property
    def has_statistics(self) -> bool:
        """Whether any range is kept (something observed since reset)."""
        return bool(self.tensor_ids)

    @property
    def min_val(self) -> Mapping[Hashable, torch.Tensor]:
        """Running minima by `tensor_id` (keepdims shape; `(rows, num_groups)`
        under `GROUPS_ID`)."""
        return RangeView(self, 0)

    @property
    def max_val(self) -> Mapping[Hashable, torch.Tensor]:
        """Running maxima by `tensor_id` (as `min_val`)."""
        return RangeView(self, 1)

    def range_of(self, tensor_id: Hashable) -> Range:
        """The running range of `tensor_id`.

        Raises:
            KeyError: no range is kept under `tensor_id`.
        """
        if tensor_id not in self.tensor_ids:
            raise KeyError(tensor_id)
        child = self.ranges[self.tensor_ids.index(tensor_id)]
        assert isinstance(child, TensorRange)
        return child.range()

    def _range_for(self, tensor_id: Hashable) -> TensorRange:
        """The range of `tensor_id`, created empty (on this observer's device:
        a state dict loads there) when new."""
        if tensor_id not in self.tensor_ids:
            self.tensor_ids.append(tensor_id)
            fresh = self._new_range(tensor_id).to(self._device_marker.device)
            fresh.nan_policy = self.nan_policy  # the observer's, validated
            self.ranges.append(fresh)
        child = self.ranges[self.tensor_ids.index(tensor_id)]
        assert isinstance(child, TensorRange)
        return child

    def _clear_ranges(self) -> None:
        self.ranges = torch.nn.ModuleList()
        self.tensor_ids = []

    def calculate_qparams(
        self,
        observed: torch.Tensor,
        reduce_dims: tuple[int, ...] | None = None,
        tensor_id: Hashable | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QParams:
        """Update the running range of `tensor_id` and return its qparams.

        Args: as `Observer.calculate_qparams`.
        """
        x_flat = _reduce_layout(check_observed(observed), reduce_dims)
        return self._observe_range(x_flat, tensor_id or _DEFAULT_ID, global_scale)

    def _calculate_group_qparams(
        self, x_flat: torch.Tensor, global_scale: torch.Tensor | None
    ) -> QParams:
        return self._observe_range(x_flat, GROUPS_ID, global_scale)

    @torch.no_grad()
    def _observe_range(
        self,
        x_flat: torch.Tensor,
        tensor_id: Hashable,
        global_scale: torch.Tensor | None,
    ) -> QParams:
        # x_flat: (1, *Q, G); the running range: (*Q,)
        min_vals, max_vals = self._range_for(tensor_id).observe(x_flat)
        rule = self.rule
        if self.options.arithmetic == "observed":  # the input dtype's rounding
            rule = replace(rule, observed_dtype=min_vals.dtype)
        return rule(min_vals, max_vals, global_scale)

    def reset(self) -> None:
        """Forget the cached qparams, the token count and every running range."""
        super().reset()
        self._clear_ranges()

    # -------------------------------------------------------- engine, state

    def _merged(self, other: ObserverEngine) -> None:
        """Merge range by range as their statistics declare (a static range
        exactly; a moving average weighted by counts; the latest: `other`'s)."""
        super()._merged(other)
        assert isinstance(other, RangeObserver)
        for tensor_id, theirs in zip(other.tensor_ids, other.ranges, strict=True):
            assert isinstance(theirs, TensorRange)
            self._range_for(tensor_id).merge(theirs)

    def get_extra_state(self) -> dict[str, Any]:
        """The base's state and the tensor ids, in the children's order."""
        return {**super().get_extra_state(), "tensor_ids": list(self.tensor_ids)}

    def set_extra_state(self, state: Any) -> None:
        """Restore the base's state and recreate an empty range per tensor id
        (`load_state_dict` fills them next: children load after the parent)."""
        super().set_extra_state(state)
        self._clear_ranges()
        for tensor_id in state.get("tensor_ids", []):
            self._range_for(tensor_id)
