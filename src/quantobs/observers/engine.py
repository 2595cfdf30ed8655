"""The observer engine: the one base class of every observer, in every face.

An observer is (statistic, solver, qparams rule, typed options). The engine
owns what all of them share, once:

* the statistic, kept in registered buffers (named by the face: torch.ao's
  `min_val` / `max_val`, ...), so `.to()`, `.cuda()`, `state_dict()` /
  `load_state_dict()` (buffers take the saved shapes), `copy.deepcopy` and
  `torch.save` just work;
* observing a batch in the canonical layout `(N, *qparam_shape, G)`: the
  statistic's scan (range, and what else it finds in that pass), the NaN
  policy (`quantobs.stats.reduce`'s table), the qparam-shape check, the
  update;
* merging another observer's statistic (exact where the statistic is) and
  resetting.

Deferred checks (`defer_checks`, quantobs' own observers): observing a batch
reads nothing on the host, so on a GPU `update` never waits for the device
(issue 24). The NaN policy's decisions become tensor operations and what
would have raised is counted in tensors, read once when qparams are
computed (`_raise_deferred`)::

    policy     per batch (on the device)             at qparams time
    raise      count qparams with a non-finite       ValueError naming the
               value (NaN and inf reach the stat)    count (same fix)
    omit       min/max and values without them;      "no statistics" when
               a batch without any finite value      every batch was
               leaves the statistic as it was        skipped
               (`torch.where` over its fields)
    propagate  nothing                               nothing
    (float64)  finite values past float32's max      ValueError "beyond the
                                                     float32 range"

Faces raise at once, as their peers do (`defer_checks = False`).

A subclass says which statistic it keeps (`statistic_type`,
`statistic_config`), turns its inputs into the canonical layout, and turns
the statistic into a range (its solver) and the range into qparams (its
rule). Hooks let a face keep its peer's state-dict layout (`buffer_names`,
`_write_state`, `_read_state`) and exception types (`_shape_error`,
`_nonfinite_error`).

(Over 500 lines: one base class; the deferred NaN policy (issue 24) is part
of observing a batch and has no other caller.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, ClassVar, TypeVar, get_args

import torch

from quantobs.core.qparams import all_finite
from quantobs.stats.base import Batch, Reduce, Statistic
from quantobs.stats.reduce import (
    NanPolicy,
    count_nonfinite,
    finite_range,
    minmax,
    minmax_omit_nonfinite,
)

__all__ = ["ObserverEngine"]

E = TypeVar("E", bound="ObserverEngine")
S = TypeVar("S", bound=Statistic)


def _float64_findings(x_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(N, *Q, G)` float64 values -> the number of qparams holding a
    non-finite value, and a finite value past float32's range (the largest
    in magnitude; 0 where none), as 0-d tensors read later."""
    low, high = minmax(x_flat, exact_dtype=True)  # (*Q,) float64
    nonfinite = (~torch.isfinite(low) | ~torch.isfinite(high)).sum()
    ends = torch.stack([low.reshape(-1), high.reshape(-1)])  # (2, Q)
    top = torch.finfo(torch.float32).max
    past = torch.isfinite(ends) & (ends.abs() > top)
    ends = torch.where(past, ends, 0.0).reshape(-1)
    return nonfinite, ends[ends.abs().argmax()]


def _select(keep: torch.Tensor, new: S, old: S) -> S:
    """`new` where `keep` (a 0-d bool tensor), else `old`, field by field
    with `torch.where` (no host read); statistics whose fields changed
    shape (a grown histogram) are chosen on the host."""
    new_state, old_state = new.state(), old.state()
    same = new_state.keys() == old_state.keys() and all(
        value.shape == old_state[name].shape and value.dtype == old_state[name].dtype
        for name, value in new_state.items()
    )
    if not same:
        return new if bool(keep) else old
    chosen = {
        name: torch.where(keep.to(value.device), value, old_state[name])
        for name, value in new_state.items()
    }
    return type(new).from_state(chosen, **new.config())


def clone_statistic(stat: Statistic) -> Statistic:
    """A copy of a statistic whose tensors are its own."""
    state = {name: value.clone() for name, value in stat.state().items()}
    return type(stat).from_state(state, **stat.config())


class ObserverEngine(torch.nn.Module):
    """Base of every observer: a statistic in buffers, observed and merged.

    Args:
        nan_policy: `"raise"`, `"omit"` or `"propagate"` (see
            `quantobs.stats.reduce`).

    Raises:
        ValueError: an unknown NaN policy.
    """

    #: The statistic kept (`statistic_type()` may choose per instance).
    statistic_cls: ClassVar[type[Statistic] | None] = None
    #: Statistic field -> buffer name, where a face keeps its peer's names.
    buffer_names: ClassVar[Mapping[str, str]] = {}
    #: Keep float64 statistics for float64 inputs (faces computing in the
    #: input's dtype); else float32.
    exact_dtype: ClassVar[bool] = False
    #: Whether the observer reads a batch's values beyond what its statistic
    #: needs (e.g. a per-batch MSE search).
    needs_values: ClassVar[bool] = False
    #: Whether the NaN policy's checks wait for qparams time (module
    #: docstring): `update` then makes no host-device synchronisation.
    defer_checks: ClassVar[bool] = False

    _device_marker: torch.Tensor

    def __init__(self, *, nan_policy: NanPolicy = "raise") -> None:
        super().__init__()
        if nan_policy not in get_args(NanPolicy):
            raise ValueError(
                f"nan_policy={nan_policy!r} is not one of {list(get_args(NanPolicy))}"
            )
        self.nan_policy: NanPolicy = nan_policy
        # Where statistics loaded into an observer without any go (moves
        # with `.to()`; not saved).
        self.register_buffer("_device_marker", torch.empty(0), persistent=False)
        self._clear_deferred()

    # ------------------------------------------------------- deferred checks

    def _clear_deferred(self) -> None:
        # settled (Python) values: qparams with non-finite values, a float64
        # value past float32 (0: none), batches kept (None: not counted, the
        # statistic's presence tells)
        self._nonfinite = 0
        self._beyond = 0.0
        self._kept: int | None = None
        # (3,) float64 increments of the same, on the device, not yet read
        self._pending: torch.Tensor | None = None
        # (): whether the last folded batch was kept (None: certainly)
        self._last_keep: torch.Tensor | None = None

    def _defer(
        self,
        nonfinite: torch.Tensor,
        beyond: torch.Tensor,
        keep: torch.Tensor | None,
    ) -> None:
        """Add one batch's deferred findings (0-d tensors) to `_pending`."""
        if keep is not None and self._kept is None:
            self._kept = 0
        kept = torch.zeros_like(beyond) if keep is None else keep.to(beyond.dtype)
        step = torch.stack([nonfinite.to(beyond.dtype), beyond, kept])
        if self._pending is None:
            self._pending = step
            return
        pending = self._pending.to(step.device)
        first = torch.where(pending[1] != 0, pending[1], step[1])
        self._pending = torch.stack([pending[0] + step[0], first, pending[2] + step[2]])

    def _defer_step(self, step: torch.Tensor) -> None:
        """`_defer` of a ready `(3,)` step whose float64 value past float32
        is 0 and that keeps its batch (`Batch.findings`): one addition."""
        if self._pending is None:
            self._pending = step
            return
        self._pending = self._pending.to(step.device) + step

    def _settle(self) -> None:
        """Read the pending findings, the engine's and a subclass's
        (`_extra_pending`), in one host read (none when nothing is pending)
        into the settled values."""
        extra = self._extra_pending()
        if self._pending is None and extra is None:
            return
        own = self._pending
        if own is None:
            own = torch.zeros(3, dtype=torch.float64, device=extra.device)  # type: ignore[union-attr]
        if extra is not None:
            own = torch.cat([own, extra.to(own.device, own.dtype)])
        nonfinite, beyond, kept, *rest = own.tolist()
        self._pending = None
        if extra is not None:
            self._settle_extra(rest)
        self._nonfinite += int(nonfinite)
        if self._beyond == 0.0:
            self._beyond = beyond
        if self._kept is not None:
            self._kept += int(kept)

    def _extra_pending(self) -> torch.Tensor | None:
        """Hook: a subclass's own deferred findings, a 1-D tensor read with
        the engine's (`_settle_extra` gets its values)."""
        return None

    def _settle_extra(self, values: list[float]) -> None:
        """Hook: take the values of `_extra_pending`'s tensor (then clear it)."""

    def _observed_any(self) -> bool:
        """Whether a batch was kept since the statistic began (settles)."""
        self._settle()
        return self._kept is None or self._kept > 0

    def _raise_deferred(self) -> None:
        """Raise what observing deferred (settles): non-finite values under
        `nan_policy="raise"`, then float64 values past float32's range."""
        self._settle()
        if self._nonfinite:
            raise self._deferred_nonfinite_error(self._nonfinite)
        if self._beyond != 0.0:
            raise self._beyond_error(self._beyond)

    # ------------------------------------------------------------ statistic

    def statistic_type(self) -> type[Statistic] | None:
        """The statistic this observer keeps (default: the class's `Statistic`)."""
        return self.statistic_cls

    def statistic_config(self) -> dict[str, Any]:
        """Settings of the statistic (its `empty` / `from_state` config)."""
        return {}

    def _buffer_name(self, field: str) -> str:
        return self.buffer_names.get(field, field)

    def _read_state(
        self, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """The statistic's state from the buffers' values, or None for "no
        statistic" (a face's own convention for it, e.g. empty buffers)."""
        return state

    def _write_state(self, field: str, value: torch.Tensor) -> torch.Tensor:
        """A state field as its buffer keeps it (a face may pin dtype/shape)."""
        return value

    def statistic(self) -> Statistic | None:
        """The current statistic, from the buffers (None before any data)."""
        stype = self.statistic_type()
        if stype is None:
            return None
        state: dict[str, torch.Tensor] = {}
        for field in stype.fields:
            value = self._buffers.get(self._buffer_name(field.name))
            if value is None:
                if field.optional:
                    continue
                return None
            state[field.name] = value
        found = self._read_state(state)
        return (
            None
            if found is None
            else stype.from_state(found, **self.statistic_config())
        )

    def _store(self, stat: Statistic | None) -> None:
        """Write a statistic (or none) into the buffers."""
        stype = self.statistic_type()
        if stype is None:
            return
        state = {} if stat is None else stat.state()
        for field in stype.fields:
            name = self._buffer_name(field.name)
            value = state.get(field.name)
            if value is not None:
                value = self._write_state(field.name, value)
            if name in self._buffers:
                self._buffers[name] = value
            elif value is not None:
                self.register_buffer(name, value)

    @property
    def has_statistics(self) -> bool:
        """Whether anything has been observed since construction or reset
        (reads the deferred checks' counts: a host read where any wait)."""
        return self.statistic() is not None and self._observed_any()

    # --------------------------------------------------------------- observe

    def _needs_values(self) -> bool:
        stype = self.statistic_type()
        return self.needs_values or (stype is not None and stype.needs_values)

    def _new_statistic(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> Statistic:
        stype = self.statistic_type()
        if stype is None:
            raise TypeError(f"{type(self).__name__} keeps no statistic")
        return stype.empty(qparam_shape, device, **self.statistic_config())

    def _starting_statistic(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> Statistic:
        """What the first batch updates (`_current_for` before any data):
        `_new_statistic`'s; a subclass may return an equal one that is
        cheaper to make and update (e.g. `MinMax.starting`), never stored."""
        return self._new_statistic(qparam_shape, device)

    def _current_for(
        self, qparam_shape: tuple[int, ...], device: torch.device
    ) -> Statistic:
        """The statistic to fold a batch of `qparam_shape` into (a new empty
        one before any data).

        Raises:
            the face's `_shape_error`: the qparam shape changed.
        """
        current = self.statistic()
        if current is None:
            return self._starting_statistic(qparam_shape, device)
        if current.qparam_shape != qparam_shape:
            raise self._shape_error(current.qparam_shape, qparam_shape)
        return current

    def _observe(self, x_flat: torch.Tensor) -> Statistic | None:
        """Fold one batch in the canonical layout `(N, *Q, G)` in.

        Returns:
            The new statistic (also in the buffers), or None where the batch
            was skipped (`nan_policy="omit"` and no finite value).
        """
        qshape = tuple(x_flat.shape[1:-1])
        stat = self._current_for(qshape, x_flat.device)
        batch = stat.scan(x_flat, exact_dtype=self.exact_dtype)
        return self._fold(stat, batch, lambda: x_flat, x_flat.dtype)

    def _fold(
        self,
        stat: Statistic,
        batch: Batch,
        values: Callable[[], torch.Tensor],
        dtype: torch.dtype | None = None,
    ) -> Statistic | None:
        """Apply the NaN policy to a scanned batch and update `stat` with it.

        Args:
            stat: the statistic to update (`_current_for` the batch).
            batch: the batch's range (and scan).
            values: the batch in the canonical layout (called only when the
                values are needed: a value-reading statistic, or non-finite
                values to count or drop).
            dtype: the batch's dtype (float64 batches are checked for values
                past float32's range).

        Returns:
            The new statistic, or None: a batch without any finite value
            under `nan_policy="omit"` is skipped (nothing stored, see
            `_apply_nan_policy`). With `defer_checks` it is never None:
            `_last_keep` then says whether the batch was kept.
        """
        self._last_keep = None
        if self.defer_checks:
            batch = self._deferred_nan_policy(stat, batch, values, dtype)
        else:
            kept = self._apply_nan_policy(stat, batch, values)
            if kept is None:
                return None
            batch = kept
        if batch.x_flat is None and self._needs_values():
            batch = replace(batch, x_flat=values())
        new = stat.update(self._finite_prepared(batch))
        if self._last_keep is not None:
            new = _select(self._last_keep, new, stat)
        self._store(new)
        return new

    def _deferred_nan_policy(
        self,
        stat: Statistic,
        batch: Batch,
        values: Callable[[], torch.Tensor],
        dtype: torch.dtype | None,
    ) -> Batch:
        """`_apply_nan_policy` without reading anything on the host: what
        would raise is counted (`_defer`) and raised at qparams time; under
        `"omit"` the batch's values and range leave non-finite values out,
        and `_last_keep` says whether it had any finite value (module
        docstring)."""
        if self.nan_policy == "propagate" or isinstance(batch.absmax, float):
            if self._kept is not None:  # counting kept batches: this one is
                self._kept += 1
            return batch
        plain = dtype != torch.float64 or self.exact_dtype
        if self.nan_policy == "raise" and plain and batch.findings is not None:
            self._defer_step(batch.findings)  # counted by the scan, on chip
            return batch
        low, high = batch.min_vals, batch.max_vals
        # qparams with a non-finite end (x - x: 0 if finite, else NaN)
        nonfinite = torch.count_nonzero((low - low) + (high - high))
        beyond = torch.zeros((), dtype=torch.float64, device=low.device)
        if dtype == torch.float64 and not self.exact_dtype:
            nonfinite, beyond = _float64_findings(values())
        keep = None
        if self.nan_policy == "omit":
            x_flat = values()
            low, high = minmax_omit_nonfinite(x_flat, exact_dtype=self.exact_dtype)
            keep = (low <= high).any()  # some finite value anywhere
            kept, skipped = None, False
            if self._needs_values():
                kept, skipped = stat.omit_nonfinite(x_flat)
            batch = Batch(kept, low, high, batch.num_observations, has_skipped=skipped)
            nonfinite = torch.zeros_like(nonfinite)
        self._defer(nonfinite, beyond, keep)
        self._last_keep = keep
        return batch

    def _finite_prepared(self, batch: Batch) -> Batch:
        """`_prepare_batch(batch)`, its range made finite where the batch's
        data was (`finite_range`: a searched range scaled past float32's max,
        e.g. `expand` times data near it, saturates); else unchanged."""
        prepared = self._prepare_batch(batch)
        if prepared is batch or prepared.min_vals.shape != batch.min_vals.shape:
            return prepared
        low, high = finite_range(
            (prepared.min_vals, prepared.max_vals), (batch.min_vals, batch.max_vals)
        )
        if low is prepared.min_vals and high is prepared.max_vals:
            return prepared
        return replace(prepared, min_vals=low, max_vals=high)

    def _prepare_batch(self, batch: Batch) -> Batch:
        """Hook: what the statistic gets of a batch (e.g. a searched range)."""
        return batch

    def _apply_nan_policy(
        self, stat: Statistic, batch: Batch, values: Callable[[], torch.Tensor]
    ) -> Batch | None:
        """The batch the statistic gets under the NaN policy, or None to skip
        it: under `"omit"` a batch with no finite value at all leaves the
        observer as it was (nothing observed stays nothing observed, and
        `get_qparams` then raises, rather than a qparam of the empty range,
        `(0, 0)`, getting the smallest scale). A batch with some finite
        values is kept; its qparams without one keep the empty range."""
        # NaN and inf propagate into the range, so only it is checked; a
        # range that came with a host absmax (the native scan's) was seen
        # whole and finite.
        if self.nan_policy == "propagate" or isinstance(batch.absmax, float):
            return batch
        if all_finite(batch.min_vals, batch.max_vals):
            return batch
        x_flat = values()
        if x_flat.dtype == torch.float64 and count_nonfinite(x_flat) == 0:
            raise self._float32_overflow_error(x_flat)  # finite, past float32
        if self.nan_policy == "raise":
            raise self._nonfinite_error(x_flat)
        low, high = minmax_omit_nonfinite(x_flat, exact_dtype=self.exact_dtype)
        if not bool((low <= high).any()):  # no finite value anywhere
            return None
        kept, skipped = None, False
        if self._needs_values():
            kept, skipped = stat.omit_nonfinite(x_flat)
        return Batch(kept, low, high, batch.num_observations, has_skipped=skipped)

    # ---------------------------------------------------------------- errors

    def _describe(self) -> str:
        return type(self).__name__

    def _shape_error(
        self, before: tuple[int, ...], after: tuple[int, ...]
    ) -> Exception:
        return ValueError(
            f"{self._describe()}: qparam shape changed from {before} to {after}; "
            "call reset() before observing a differently shaped tensor"
        )

    def _nonfinite_error(self, x_flat: torch.Tensor) -> Exception:
        return ValueError(
            f"{self._describe()} got {count_nonfinite(x_flat)} non-finite "
            "value(s) (NaN or inf); fix the input or pass nan_policy='omit' to "
            "ignore them"
        )

    def _float32_overflow_error(self, x_flat: torch.Tensor) -> Exception:
        beyond = x_flat[x_flat.abs() > torch.finfo(torch.float32).max]
        return self._beyond_error(float(beyond[0]))

    def _beyond_error(self, value: float) -> Exception:
        return ValueError(
            f"{self._describe()} got the float64 value {value:g}, "
            f"beyond the float32 range (+-{torch.finfo(torch.float32).max:g}) "
            "of its statistics: the range is too wide to keep. Rescale the "
            "input (e.g. by a power of two) or clip it to float32's range"
        )

    def _deferred_nonfinite_error(self, count: int) -> Exception:
        """The NaN policy's error when it was deferred to qparams time: the
        values are gone by then, so it counts the qparams they reached."""
        return ValueError(
            f"{self._describe()} got non-finite value(s) (NaN or inf) in "
            f"{count} qparam range(s) since its last reset (checked when qparams "
            "are computed); fix the input or pass nan_policy='omit' to ignore them"
        )

    # ----------------------------------------------------------- merge, reset

    def _check_merge(self, other: ObserverEngine) -> None:
        """Hook: raise if `other`'s settings differ (args, options, ...)."""

    def _merged(self, other: ObserverEngine) -> None:
        """Hook: fold `other`'s counts in after the statistics merged."""

    def merge(self: E, other: E) -> E:
        """Fold `other`'s statistic into this observer's (returns `self`).

        Exact for exact statistics (`Statistic.exact`): the result equals
        observing both observers' batches.

        Raises:
            TypeError: `other` is a different observer class.
            ValueError: different settings or qparam shapes.
        """
        if type(other) is not type(self):
            raise TypeError(
                f"cannot merge {type(other).__name__} into {type(self).__name__}"
            )
        self._check_merge(other)
        mine = self.statistic() if self.has_statistics else None
        theirs = other.statistic() if other.has_statistics else None
        self._nonfinite += other._nonfinite
        self._beyond = self._beyond or other._beyond
        if theirs is not None:
            self._kept = None  # data from both: the statistic tells
            if mine is None:
                self._store(clone_statistic(theirs))
            elif mine.qparam_shape != theirs.qparam_shape:
                raise ValueError(
                    f"cannot merge qparam shapes {mine.qparam_shape} and "
                    f"{theirs.qparam_shape}"
                )
            else:
                self._store(mine.merge(theirs))
        self._merged(other)
        return self

    @torch.no_grad()
    def clear_data(self) -> None:
        """Forget the observed data but keep what processes must share (the
        statistic's EQUAL fields, e.g. `static_mse`'s reference range): the
        identity of a merge under the same settings. Without a statistic,
        the same as `reset()`."""
        stat = self.statistic()
        self.reset()
        if stat is None:
            return
        device = next(iter(stat.state().values())).device
        fresh = self._new_statistic(stat.qparam_shape, device).state()
        state = stat.state()
        for field in type(stat).fields:
            if field.reduce == Reduce.EQUAL and field.name in state:
                fresh[field.name] = state[field.name]
        self._store(type(stat).from_state(fresh, **self.statistic_config()))

    def _initial_statistic(self) -> Statistic | None:
        """The statistic after `reset()` (None: no buffers at all)."""
        return None

    def reset(self) -> None:
        """Forget every statistic (and what observing deferred)."""
        self._store(self._initial_statistic())
        self._clear_deferred()

    # ----------------------------------------------------------- state dicts

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Statistic buffers take the saved shapes and dtypes (per-channel
        # ranges, grown histograms, statistics of an observer that had
        # none); an observer saved without statistics loads as one.
        self._clear_deferred()
        stype = self.statistic_type()
        if stype is not None:
            names = [self._buffer_name(f.name) for f in stype.fields]
            saved = {n: state_dict.get(prefix + n) for n in names}
            required = [
                self._buffer_name(f.name) for f in stype.fields if not f.optional
            ]
            if not any(isinstance(saved[n], torch.Tensor) for n in required):
                for name in names:
                    if name in self._buffers and self._may_drop(name):
                        self._buffers[name] = None
            for name, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    continue
                current = self._buffers.get(name)
                device = (
                    current if current is not None else self._device_marker
                ).device
                fresh = torch.empty_like(value, device=device)
                if name in self._buffers:
                    self._buffers[name] = fresh
                else:
                    self.register_buffer(name, fresh)
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )

    def _may_drop(self, name: str) -> bool:
        """Whether a statistic buffer may be absent (None): faces whose peer
        always has its buffers say no."""
        return True
