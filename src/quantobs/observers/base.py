"""The observer engine and the llm-compressor `Observer` API.

An observer is (args, base name, statistic, solver, typed options). Subclasses
say how a batch updates the statistic (`_update_stats`), how two statistics
merge (`_merge_stats`) and which range the statistic gives (`_range`); the base
does everything else: layout, NaN policy, observation counting, qparams,
global scale, reset, merge and `state_dict`.

The public methods follow llm-compressor's `Observer` (seed 000):
`forward(observed) -> (scale, zero_point)`, `get_min_max(observed_flat)`,
`get_global_min_max(observed_flat)`, `get_global_scale(observed)`; and the
engine's own: `update`, `get_qparams`, `reset`, `merge`, `state_dict`.
"""

from __future__ import annotations

import weakref
from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import (
    check_supported,
    flatten_for_calibration,
    num_observations_of,
)
from quantobs.core.qparams import all_finite, amax_to_global_scale, calculate_qparams
from quantobs.core.registry import Registry, validate_options
from quantobs.stats.reduce import (
    NanPolicy,
    Range,
    absmax_or_zero,
    count_nonfinite,
    drop_nonfinite,
    merge_moving_average,
    minmax,
    minmax_of,
    minmax_omit_nonfinite,
    range_or_zero,
)

__all__ = ["Observer", "ObserverOptions"]

_O = TypeVar("_O", bound="type[Observer]")
Stats = dict[str, torch.Tensor]


class ObserverOptions(BaseModel):
    """Options every observer takes (subclasses add their own).

    Attributes:
        nan_policy: `"raise"` (default) raises `ValueError` on NaN/inf input;
            `"omit"` ignores non-finite values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    nan_policy: NanPolicy = "raise"


_REGISTRY: Registry[Any] = Registry("observer")


class _Memo:
    """One value computed from tensors, reused while they are the same objects
    with the same in-place version counters (weak references: the memo never
    keeps replaced statistics alive)."""

    def __init__(self) -> None:
        self._key: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self._value: torch.Tensor | None = None

    def get(
        self, tensors: tuple[torch.Tensor, ...], compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        value = self._value
        fresh = len(self._key) == len(tensors) and all(
            ref() is t and version == t._version
            for (ref, version), t in zip(self._key, tensors, strict=False)
        )
        if value is None or not fresh:
            value = self._value = compute()
            self._key = [(weakref.ref(t), t._version) for t in tensors]
        return value.clone()  # callers may modify what they get

    def __getstate__(self) -> dict[str, Any]:
        # Weak references do not pickle (torch.save of an observer): a copy
        # starts empty and recomputes on first use.
        return {"_key": [], "_value": None}


class Observer(torch.nn.Module, metaclass=ABCMeta):
    """Base observer: watches values and turns them into scale / zero point.

    Args:
        base_name: `weight`, `input`, `output`, `q`, `k` or `v`.
        args: the quantization args.
        module: optional module whose `{base_name}_g_idx` and
            `{base_name}_global_scale` are used when present (held weakly).
        **observer_kwargs: options of this observer (merged over
            `args.observer_kwargs`), validated by its `Options` model.

    Raises:
        ValueError: unknown base name, a strategy the base name does not
            support, or an unknown / out-of-range option.
    """

    Options: ClassVar[type[ObserverOptions]] = ObserverOptions
    name: ClassVar[str] = "observer"
    #: Whether `_update_stats` reads the batch's values (MSE) or only its range.
    needs_values: ClassVar[bool] = True

    def __init__(
        self,
        base_name: str,
        args: QuantizationArgs,
        module: torch.nn.Module | None = None,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__()
        if not isinstance(args, QuantizationArgs):
            raise TypeError(
                "args must be a quantobs.QuantizationArgs (convert compressed-"
                "tensors args with QuantizationArgs.from_compressed_tensors)"
            )
        check_supported(base_name, args)
        self.base_name = base_name
        self.args = args
        self.options = validate_options(
            self.Options,
            f"observer {self.name!r}",
            args.observer_kwargs,
            observer_kwargs,
        )
        self._module = weakref.ref(module) if module is not None else None
        self._stats: Stats = {}
        self.num_observations = 0
        self.num_observed_tokens: int | None = None
        self._global_scale_memo = _Memo()

    # ------------------------------------------------------------ registry

    @classmethod
    def register(
        cls, name: str, alias: str | list[str] | None = None
    ) -> Callable[[_O], _O]:
        """Class decorator: register an observer under `name` (and aliases)."""
        return _REGISTRY.register(name, alias)

    @classmethod
    def registered_names(cls) -> list[str]:
        """Every registered name and alias."""
        return _REGISTRY.names()

    @classmethod
    def get_class(cls, name: str) -> type[Observer]:
        """The observer class of a name; case, `-` and `_` are ignored."""
        return _REGISTRY.get(name)

    @classmethod
    def load_from_registry(cls, name: str, **kwargs: Any) -> Observer:
        """Construct the observer registered as `name` with `kwargs`."""
        return cls.get_class(name)(**kwargs)

    # ------------------------------------------------------- subclass hooks

    @abstractmethod
    def _update_stats(self, x_flat: torch.Tensor | None, batch_range: Range) -> None:
        """Fold one batch into `self._stats`.

        `batch_range` is the batch's finite min/max; `x_flat` its values in the
        canonical layout when `needs_values` (else None).
        """

    @abstractmethod
    def _merge_stats(self, other: Observer) -> None:
        """Fold another observer's statistics into `self._stats`."""

    def _merge_moving_average(self, other: Observer) -> None:
        """Merge moving-average ranges: their count-weighted mean (approximate)."""
        self._stats = {
            key: merge_moving_average(
                self._stats[key],
                self.num_observations,
                other._stats[key],
                other.num_observations,
            )
            for key in ("min_vals", "max_vals")
        }

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The `(*qparam_shape,)` range the statistics select."""
        return self._stats["min_vals"], self._stats["max_vals"]

    def _stats_shape(self) -> torch.Size:
        """The qparam shape of the statistics (shape checks; no solver run)."""
        return self._range()[0].shape

    def _omit_nonfinite(self, x_flat: torch.Tensor) -> torch.Tensor:
        """A batch with non-finite values as `_update_stats` gets it ("omit").

        Default: non-finite values become 0, exact under any scale. Statistics
        that count values (histograms) override this to tell them apart.
        """
        return drop_nonfinite(x_flat)

    # ---------------------------------------------------------------- engine

    @property
    def has_statistics(self) -> bool:
        """Whether anything has been observed since construction or reset."""
        return bool(self._stats)

    def _module_param(self, suffix: str) -> torch.Tensor | None:
        module = self._module() if self._module is not None else None
        value = getattr(module, f"{self.base_name}_{suffix}", None)
        return value if isinstance(value, torch.Tensor) else None

    def _g_idx(self) -> torch.Tensor | None:
        g_idx = self._module_param("g_idx")
        if g_idx is None or self.base_name != "weight":
            return None
        if self.args.strategy not in ("group", "tensor_group") or bool(
            (g_idx < 0).any()
        ):
            return None  # -1 marks an uninitialised g_idx (column order)
        return g_idx

    def flatten(self, observed: torch.Tensor) -> torch.Tensor:
        """`observed` in the canonical layout (using the module's `g_idx`)."""
        return flatten_for_calibration(
            observed, self.base_name, self.args, self._g_idx()
        )

    def _fold(
        self,
        batch_range: tuple[torch.Tensor, torch.Tensor],
        x_flat: torch.Tensor | None,
        observed: torch.Tensor,
    ) -> None:
        """Apply the NaN policy to a batch, check its shape, update the stats.

        `batch_range` is the batch's min/max (NaN propagates into it, so only
        this small result is checked); `x_flat` is the batch in the canonical
        layout when the statistic reads values (else None).
        """
        min_vals, max_vals = batch_range
        if not all_finite(min_vals, max_vals):
            if self.options.nan_policy == "raise":
                raise ValueError(
                    f"observer {self.name!r} for {self.base_name!r} got "
                    f"{count_nonfinite(observed)} non-finite value(s) (NaN or "
                    "inf); fix the input or pass nan_policy='omit' to ignore them"
                )
            values = x_flat if x_flat is not None else self.flatten(observed)
            min_vals, max_vals = minmax_omit_nonfinite(values)
            x_flat = self._omit_nonfinite(values) if self.needs_values else None
        if self._stats and self._stats_shape() != min_vals.shape:
            raise ValueError(
                f"observer {self.name!r}: qparam shape changed from "
                f"{tuple(self._stats_shape())} to {tuple(min_vals.shape)}; "
                "call reset() before observing a differently shaped tensor"
            )
        self._update_stats(x_flat, (min_vals, max_vals))

    def _count(self, observed: torch.Tensor, num_observations: int) -> None:
        self.num_observations += num_observations
        # llm-compressor's rule: only 2-D inputs (tokens, features), as MoE
        # experts receive, are counted as tokens.
        if observed.ndim == 2:
            tokens = observed.shape[0]
            self.num_observed_tokens = (self.num_observed_tokens or 0) + tokens

    @torch.no_grad()
    def update(self, observed: torch.Tensor) -> None:
        """Fold a batch into the statistics (an empty tensor is a no-op).

        Raises:
            TypeError: `observed` is not a floating tensor.
            ValueError: a bad shape for the layout, or non-finite values under
                `nan_policy="raise"`.
        """
        if (
            not isinstance(observed, torch.Tensor)
            or not observed.dtype.is_floating_point
        ):
            raise TypeError(
                f"observer {self.name!r} expects a floating torch.Tensor, got "
                f"{getattr(observed, 'dtype', type(observed).__name__)}"
            )
        if observed.numel() == 0:
            return
        if self.needs_values:
            values = self.flatten(observed)
            batch_range, x_flat = self._batch_range(values), values
            num_observations = values.shape[0]
        else:
            # Range-only statistics skip the layout copy (block) where they can.
            x_flat = None
            g_idx = self._g_idx()
            batch_range = minmax_of(observed, self.base_name, self.args, g_idx)
            num_observations = num_observations_of(
                observed.shape, self.base_name, self.args
            )
        self._fold(batch_range, x_flat, observed)
        self._count(observed, num_observations)

    def _batch_range(self, x_flat: torch.Tensor) -> Range:
        """The batch's `(*qparam_shape,)` min/max (NaN propagates); statistics
        may do more in the same pass (histograms count)."""
        return minmax(x_flat)

    def _update_flat(self, x_flat: torch.Tensor) -> None:
        self._fold(minmax(x_flat), x_flat if self.needs_values else None, x_flat)

    def _require_stats(self) -> None:
        if not self._stats:
            raise RuntimeError(
                f"observer {self.name!r} for {self.base_name!r} has no statistics; "
                "call update(x) or observer(x) with a non-empty tensor first"
            )

    def get_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected `(*qparam_shape,)` range (qparams with no data: `(0, 0)`)."""
        self._require_stats()
        return range_or_zero(*self._range())

    def get_global_scale(self, observed: torch.Tensor | None = None) -> torch.Tensor:
        """NVFP4 global scale from the absmax of the selected ranges.

        Args:
            observed: optionally, a value to `update` with first.

        Returns:
            `(1,)` float32 global scale (`generate_gparam`).
        """
        if observed is not None:
            self.update(observed)
        self._require_stats()
        ranges = self._global_range()
        return self._global_scale_memo.get(
            ranges, lambda: amax_to_global_scale(absmax_or_zero(*ranges))
        )

    def _global_range(self) -> Range:
        """The ranges the global scale is computed from (the selected ones)."""
        return self._range()

    def get_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(scale, zero_point)` from the statistics, each `(*qparam_shape,)`.

        For `tensor_group` the global scale is the module's
        `{base_name}_global_scale` when there is one, else `get_global_scale()`.
        """
        self._require_stats()
        global_scale = None
        if self.args.strategy == "tensor_group":
            global_scale = self._module_param("global_scale")
            if global_scale is None:
                global_scale = self.get_global_scale()
        min_vals, max_vals = self._range()
        return calculate_qparams(
            min_vals, max_vals, self.args, global_scale, empty_as_zero=True
        )

    def reset(self) -> None:
        """Forget every statistic and count."""
        self._stats = {}
        self.num_observations = 0
        self.num_observed_tokens = None

    def merge(self, other: Observer) -> Observer:
        """Fold `other`'s statistics into this observer (returns `self`).

        Raises:
            TypeError: `other` is a different observer class.
            ValueError: different args, base name, options or qparam shapes.
        """
        if type(other) is not type(self):
            raise TypeError(
                f"cannot merge {type(other).__name__} into {type(self).__name__}"
            )
        for what in ("base_name", "args", "options"):
            if getattr(self, what) != getattr(other, what):
                raise ValueError(f"cannot merge observers with different {what}")
        if other._stats:
            if self._stats:
                mine, theirs = self._stats_shape(), other._stats_shape()
                if mine != theirs:
                    raise ValueError(
                        f"cannot merge qparam shapes {tuple(mine)} and {tuple(theirs)}"
                    )
                self._merge_stats(other)
            else:
                self._stats = {k: v.clone() for k, v in other._stats.items()}
        self.num_observations += other.num_observations
        if other.num_observed_tokens is not None:
            self.num_observed_tokens = (
                self.num_observed_tokens or 0
            ) + other.num_observed_tokens
        return self

    # -------------------------------------------------------- serialization

    def get_extra_state(self) -> dict[str, Any]:
        """Statistics and counts, carried by `state_dict()` as `_extra_state`."""
        return {
            "version": 1,
            "observer": self.name,
            "stats": {k: v.detach().clone() for k, v in self._stats.items()},
            "num_observations": self.num_observations,
            "num_observed_tokens": self.num_observed_tokens,
        }

    def set_extra_state(self, state: Any) -> None:
        """Restore what `get_extra_state` saved (via `load_state_dict`)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("unrecognised observer state; expected version 1")
        if state.get("observer") != self.name:
            raise ValueError(
                f"state of observer {state.get('observer')!r} cannot load into "
                f"{self.name!r}"
            )
        self._stats = {k: v.clone() for k, v in state["stats"].items()}
        self.num_observations = int(state["num_observations"])
        tokens = state["num_observed_tokens"]
        self.num_observed_tokens = None if tokens is None else int(tokens)

    # ------------------------------------------- llm-compressor (seed 000)

    @torch.no_grad()
    def forward(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Observe a value and return the calibrated `(scale, zero_point)`."""
        self.update(observed)
        return self.get_qparams()

    @torch.no_grad()
    def get_min_max(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold an already flattened value in and return the selected range.

        Args:
            observed: `(num_observations, *qparam_shape, group_size)`.

        Returns:
            `(min_vals, max_vals)`, each `(*qparam_shape,)`.
        """
        if observed.numel():
            self._update_flat(observed)
            self.num_observations += observed.shape[0]
        return self.get_range()

    @torch.no_grad()
    def get_global_min_max(
        self, observed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This observer's range selection over a whole value, as one qparam.

        Uses a fresh observer of the same kind (the statistics of this one are
        untouched), as llm-compressor computes global ranges separately.

        Args:
            observed: any shape; treated as `(1, 1, numel)`.

        Returns:
            `(min_vals, max_vals)`, each of shape `(1,)`.
        """
        per_tensor = self.args.model_copy(
            update={
                "strategy": "tensor",
                "group_size": None,
                "block_structure": None,
                "dynamic": False,
            }
        )
        fresh = type(self)(self.base_name, per_tensor, **self.options.model_dump())
        fresh._update_flat(observed.reshape(1, 1, -1))
        min_vals, max_vals = fresh.get_range()
        return min_vals.reshape(1), max_vals.reshape(1)

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, base_name={self.base_name!r}, "
            f"strategy={self.args.strategy!r}"
        )
