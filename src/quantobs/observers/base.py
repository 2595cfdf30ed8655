"""`Observer`: quantobs' observers, configured by compressed-tensors' args.

An observer watches a weight, activation or attention state (`base_name`)
quantized under `QuantizationArgs`: each batch is reshaped to the canonical
layout (`flatten_for_calibration`) and folded into the observer's statistic
(`quantobs.observers.engine`); the solver turns the statistic into ranges
and compressed-tensors' rule (`calculate_qparams`) turns those into scales
and zero points. Observers are registered by name, with typed options.

The public methods are llm-compressor's current `Observer` API:
`forward(observed) -> (scale, zero_point)`, `get_min_max(observed_flat)`,
`get_global_min_max(observed_flat)`, `get_global_scale(observed)`; and the
engine's own: `update`, `get_range`, `get_qparams`, `reset`, `merge`,
`state_dict`.

(A little over 500 lines: llm-compressor's observer API, the counts and
the observed dtype's arithmetic are one class's contract.)
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import (
    check_supported,
    flatten_for_calibration,
    num_observations_of,
)
from quantobs.core.qparams import amax_to_global_scale
from quantobs.core.qparams.fused import observer_qparams
from quantobs.core.registry import Registered, Registry, validate_options
from quantobs.observers.engine import ObserverEngine
from quantobs.observers.needs import Need
from quantobs.stats.base import Batch, Statistic
from quantobs.stats.reduce import (
    NanPolicy,
    Range,
    absmax_or_zero,
    finite_range,
    minmax_of,
    range_or_zero,
)

__all__ = ["Observer", "ObserverOptions"]

_STATE_VERSION = 2

#: dtypes named in an observer's extra state (`observed_dtype`)
_DTYPES = {
    str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
}

Arithmetic = Literal["observed", "float32"]

#: observed dtypes whose arithmetic `arithmetic="observed"` keeps
_ROUNDED = (torch.bfloat16, torch.float16)


class ObserverOptions(BaseModel):
    """Options every observer takes (subclasses add their own).

    Attributes:
        nan_policy: `"raise"` (default) raises `ValueError` on NaN/inf input;
            `"omit"` ignores non-finite values.
        arithmetic: `"observed"` (default) computes as llm-compressor 0.14
            does on bfloat16 / float16 values, in their dtype: NVFP4 global
            and group scales, asymmetric scales and zero points, moving
            averages of ranges, and, with `search_arithmetic="observed"`,
            the MSE / imatrix searches (candidates, fake-quantized values,
            error sums; `observed_search`) round in it, and scales are
            returned in it (float32 under NVFP4's global
            scale), equal to llm-compressor's in dtype and bits;
            `"float32"` computes on the float32 copy and returns float32
            scales (docs/dtypes.md has the measured effect on the
            quantization error). float32 / float64 inputs give the same
            either way.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    nan_policy: NanPolicy = "raise"
    arithmetic: Arithmetic = "observed"


class Observer(ObserverEngine, Registered):
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
    registry: ClassVar[Registry[Any]] = Registry("observer")
    name: ClassVar[str] = "observer"
    defer_checks = True  # `update` reads nothing on the host (issue 24)
    #: what the calibration loop must serve (`quantobs.observers.needs`)
    needs: ClassVar[frozenset[Need]] = frozenset()

    def __init__(
        self,
        base_name: str,
        args: QuantizationArgs,
        module: torch.nn.Module | None = None,
        **observer_kwargs: Any,
    ) -> None:
        if not isinstance(args, QuantizationArgs):
            raise TypeError(
                "args must be a quantobs.QuantizationArgs (convert compressed-"
                "tensors args with QuantizationArgs.from_compressed_tensors)"
            )
        check_supported(base_name, args)
        options = validate_options(
            self.Options,
            f"observer {self.name!r}",
            args.observer_kwargs,
            observer_kwargs,
        )
        super().__init__(nan_policy=options.nan_policy)
        self.base_name = base_name
        self.args = args
        self.options = options
        self._module = weakref.ref(module) if module is not None else None
        self._clear_counts()
        #: the widest floating dtype observed so far (None: nothing yet)
        self.observed_dtype: torch.dtype | None = None
        #: the dtype of the batch being folded (None between batches)
        self._folding: torch.dtype | None = None

    def has_reference(self) -> bool:
        """Whether the reference range is fixed (observers that declare
        `Need.SHARED_REFERENCE`; True for the others, which keep none)."""
        return True

    def gathered(self) -> list[ObserverEngine]:
        """The engines its own hooks fill during the batches (observers that
        declare `Need.INPUT_IMPORTANCE`; none for the others)."""
        return []

    def begin_second_pass(self) -> None:
        """Called between the two passes (observers that declare
        `Need.SECOND_PASS`), the first pass's statistics combined across
        processes by then: take from them what the second pass needs (the
        loop then clears them on all processes but one); nothing for the
        others."""

    @classmethod
    def get_class(cls, name: str) -> type[Observer]:
        """The observer class of a name; case, `-` and `_` are ignored."""
        found: type[Observer] = cls.get_value_from_registry(name)
        return found

    # ----------------------------------------------------- subclass hooks

    def _range(self, stat: Statistic) -> Range:
        """The `(*qparam_shape,)` range the statistic selects (the solver);
        default: the statistic's own range."""
        return stat.min_vals, stat.max_vals  # type: ignore[attr-defined]

    def _selected_range(self, stat: Statistic) -> Range:
        """`_range`, made finite where the statistic's data was
        (`finite_range`: a solver's end past float32's max saturates, a NaN
        end falls back to the observed one); finite ranges unchanged."""
        selected, observed = self._ranges(stat)
        return selected if observed is None else finite_range(selected, observed)

    def _ranges(self, stat: Statistic) -> tuple[Range, Range | None]:
        """`_range` and the statistic's data range it is made finite by
        (None where there is none, or `_range` is that range: the data's own
        range is finite where the data was)."""
        selected = self._range(stat)
        observed = (getattr(stat, "min_vals", None), getattr(stat, "max_vals", None))
        if observed[0] is None or observed[1] is None:
            return selected, None
        if selected[0] is observed[0] and selected[1] is observed[1]:
            return selected, None
        return selected, (observed[0], observed[1])

    def _global_amax(self, stat: Statistic) -> torch.Tensor:
        """`(1,)` largest |value| the global scale derives from: the one the
        statistic keeps, else that of the selected ranges."""
        kept = getattr(stat, "absmax", None)
        if isinstance(kept, torch.Tensor):
            return kept
        return absmax_or_zero(*self._selected_range(stat))

    def _tracks_global(self) -> bool:
        """Whether the args need a global scale (NVFP4's tensor_group)."""
        return self.args.strategy == "tensor_group"

    # ---------------------------------------------------------------- engine

    def _describe(self) -> str:
        return f"observer {self.name!r} for {self.base_name!r}"

    def _shape_error(
        self, before: tuple[int, ...], after: tuple[int, ...]
    ) -> Exception:
        return ValueError(
            f"observer {self.name!r}: qparam shape changed from {before} to "
            f"{after}; call reset() before observing a differently shaped tensor"
        )

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

    def _note_dtype(self, dtype: torch.dtype) -> None:
        self.observed_dtype = (
            dtype
            if self.observed_dtype is None
            else torch.promote_types(self.observed_dtype, dtype)
        )

    @property
    def arithmetic_dtype(self) -> torch.dtype | None:
        """The dtype compressed-tensors' rule rounds in (`observed_dtype`
        under `arithmetic="observed"`), None for float32 arithmetic."""
        if self.options.arithmetic == "float32":
            return None
        return self.observed_dtype

    def rounding_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype | None:
        """The bfloat16 / float16 llm-compressor keeps this observer's
        statistic and scales in (the dtype observed so far, promoted with
        `dtype` or the batch being folded), under `arithmetic="observed"`;
        None where that is float32 or wider, or under `"float32"`."""
        if self.options.arithmetic == "float32":
            return None
        found = self.observed_dtype
        for other in (dtype, self._folding):
            if other is not None:
                found = other if found is None else torch.promote_types(found, other)
        return found if found in _ROUNDED else None

    # ---------------------------------------------------------------- counts

    def _clear_counts(self) -> None:
        # Counted on the host as batches come; batches that nan_policy="omit"
        # skips (known on the device only) are subtracted when read.
        self._observations = 0
        self._tokens = 0
        self._token_batches = 0  # 2-D batches counted: tokens are None without
        self._skipped: torch.Tensor | None = None  # (3,) float64, as the above

    def _settle_counts(self) -> None:
        if self._skipped is None:
            return
        observations, tokens, token_batches = self._skipped.tolist()
        self._skipped = None
        self._observations -= int(observations)
        self._tokens -= int(tokens)
        self._token_batches -= int(token_batches)

    @property
    def num_observations(self) -> int:
        """Observations (dim 0 of the canonical layout) folded in."""
        self._settle_counts()
        return self._observations

    @num_observations.setter
    def num_observations(self, value: int) -> None:
        self._settle_counts()
        self._observations = value

    @property
    def num_observed_tokens(self) -> int | None:
        """Tokens of the 2-D batches folded in (None: no 2-D batch)."""
        self._settle_counts()
        return self._tokens if self._token_batches else None

    @num_observed_tokens.setter
    def num_observed_tokens(self, value: int | None) -> None:
        self._settle_counts()
        self._tokens = value or 0
        self._token_batches = 0 if value is None else 1

    def _count(self, observed: torch.Tensor | None, num_observations: int) -> None:
        """Count a folded batch (`observed`: as given, None for one already
        in the canonical layout); one the last fold may have skipped
        (`_last_keep`) is subtracted on the device where it was."""
        if observed is not None:
            self._note_dtype(observed.dtype)
        # llm-compressor's rule: only 2-D inputs (tokens, features), as MoE
        # experts receive, are counted as tokens.
        tokens = observed.shape[0] if observed is not None and observed.ndim == 2 else 0
        token_batches = int(observed is not None and observed.ndim == 2)
        self._observations += num_observations
        self._tokens += tokens
        self._token_batches += token_batches
        keep = self._last_keep
        if keep is None:
            return
        drop = (~keep).to(torch.float64)  # no host-to-device copy either
        skipped = torch.stack(
            [drop * num_observations, drop * tokens, drop * token_batches]
        )
        self._skipped = skipped if self._skipped is None else self._skipped + skipped

    def observe_flat(self, x_flat: torch.Tensor) -> None:
        """Fold a batch already in the canonical layout `(N, *Q, G)` in and
        count its observations (no tokens); an empty one is a no-op."""
        if not x_flat.numel():
            return
        self._folding = x_flat.dtype
        try:
            kept = self._observe(x_flat)
        finally:
            self._folding = None
        if kept is not None:
            self._note_dtype(x_flat.dtype)
            self._count(None, x_flat.shape[0])

    @torch.no_grad()
    def update(self, observed: torch.Tensor) -> None:
        """Fold a batch into the statistics (an empty tensor is a no-op).

        Under `nan_policy="omit"` a batch without any finite value is
        skipped: neither the statistic nor the counts change.

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
        self._folding = observed.dtype
        try:
            kept, n = self._fold_observed(observed)
        finally:
            self._folding = None
        if kept is not None:  # None: skipped, no finite value (nan_policy="omit")
            self._count(observed, n)

    def _fold_observed(self, observed: torch.Tensor) -> tuple[Statistic | None, int]:
        """`update`'s fold: the new statistic (None: skipped) and the
        batch's observations."""
        if self.args.strategy == "block" and not self._needs_values():
            # Range-only statistics skip the block layout's copy.
            low, high = minmax_of(observed, self.base_name, self.args)
            n = num_observations_of(observed.shape, self.base_name, self.args)
            stat = self._current_for(tuple(low.shape), observed.device)
            batch = Batch(None, low, high, n)
            kept = self._fold(
                stat, batch, lambda: self.flatten(observed), observed.dtype
            )
        else:
            x_flat = self.flatten(observed)
            kept = self._observe(x_flat)
            n = x_flat.shape[0]
        return kept, n

    def _require(self) -> Statistic:
        """The statistic, after the checks `update` deferred (one host read
        where any are pending).

        Raises:
            RuntimeError: nothing observed.
            ValueError: what observing deferred (`_raise_deferred`).
        """
        stat = self.statistic()
        if stat is None or not self._observed_any():
            skipped = (
                " (under nan_policy='omit' a batch with no finite value is skipped)"
                if self.nan_policy == "omit"
                else ""
            )
            raise RuntimeError(
                f"observer {self.name!r} for {self.base_name!r} has no statistics"
                f"{skipped}; call update(x) or observer(x) with a non-empty tensor "
                "of finite values first"
            )
        self._raise_deferred()
        return stat

    def get_range(self) -> Range:
        """The selected `(*qparam_shape,)` range (qparams with no data: `(0, 0)`)."""
        return range_or_zero(*self._selected_range(self._require()))

    def global_amax(self) -> torch.Tensor:
        """`(1,)` float32 largest |value| the NVFP4 global scale derives from
        (fused layers share the largest of theirs).

        Raises:
            RuntimeError: nothing observed yet.
        """
        return self._global_amax(self._require()).float().reshape(1)

    def get_global_scale(self, observed: torch.Tensor | None = None) -> torch.Tensor:
        """NVFP4 global scale from the absmax of the selected ranges.

        Args:
            observed: optionally, a value to `update` with first.

        Returns:
            `(1,)` float32 global scale (`generate_gparam`; rounded as
            compressed-tensors rounds it for bfloat16 / float16 values).
        """
        if observed is not None:
            self.update(observed)
        return amax_to_global_scale(
            self._global_amax(self._require()), observed_dtype=self.arithmetic_dtype
        )

    def get_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(scale, zero_point)` from the statistics, each `(*qparam_shape,)`.

        For `tensor_group` the global scale is the module's
        `{base_name}_global_scale` when there is one, else `get_global_scale()`.

        The scale is in the dtype llm-compressor returns it in: the observed
        bfloat16 / float16 under `arithmetic="observed"` (float32 where a
        float32 global scale multiplied it, as NVFP4's), else float32.
        """
        stat = self._require()
        global_scale = amax = None
        if self.args.strategy == "tensor_group":
            global_scale = self._module_param("global_scale")
            if global_scale is None:
                amax = self._global_amax(stat)
        (min_vals, max_vals), observed = self._ranges(stat)
        # one kernel on a GPU (quantobs.core.qparams.fused)
        return observer_qparams(
            min_vals,
            max_vals,
            self.args,
            global_scale,
            amax,
            self.arithmetic_dtype,
            observed,
        )

    def reset(self) -> None:
        """Forget every statistic and count."""
        super().reset()
        self._clear_counts()
        self.observed_dtype = None

    def _check_merge(self, other: ObserverEngine) -> None:
        for what in ("base_name", "args", "options"):
            if getattr(self, what) != getattr(other, what):
                raise ValueError(f"cannot merge observers with different {what}")

    def _merged(self, other: ObserverEngine) -> None:
        if not isinstance(other, Observer):  # pragma: no cover - same type
            return
        self.num_observations += other.num_observations
        if other.observed_dtype is not None:
            self._note_dtype(other.observed_dtype)
        if other.num_observed_tokens is not None:
            self.num_observed_tokens = (
                self.num_observed_tokens or 0
            ) + other.num_observed_tokens

    # -------------------------------------------------------- serialization

    def get_extra_state(self) -> dict[str, Any]:
        """Counts, the deferred checks' findings and the observer's name,
        carried by `state_dict()` as `_extra_state` (the statistic itself is
        in the buffers): a restored observer raises what the saved one would
        have (non-finite values seen, float64 values past float32)."""
        self._settle()  # the pending findings: one host read, saving only
        return {
            "version": _STATE_VERSION,
            "observer": self.name,
            "num_observations": self.num_observations,
            "num_observed_tokens": self.num_observed_tokens,
            "observed_dtype": (
                None if self.observed_dtype is None else str(self.observed_dtype)
            ),
            "deferred": {
                "nonfinite": self._nonfinite,
                "beyond": self._beyond,
                "kept": self._kept,
            },
        }

    def set_extra_state(self, state: Any) -> None:
        """Restore what `get_extra_state` saved (via `load_state_dict`)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unrecognised observer state; expected version {_STATE_VERSION}"
            )
        if state.get("observer") != self.name:
            raise ValueError(
                f"state of observer {state.get('observer')!r} cannot load into "
                f"{self.name!r}"
            )
        self.num_observations = int(state["num_observations"])
        tokens = state["num_observed_tokens"]
        self.num_observed_tokens = None if tokens is None else int(tokens)
        dtype = state.get("observed_dtype")  # absent in states saved before it
        self.observed_dtype = None if dtype is None else _DTYPES.get(dtype)
        deferred = state.get("deferred")  # absent in states saved before it
        self._clear_deferred()
        if isinstance(deferred, dict):
            self._nonfinite = int(deferred.get("nonfinite") or 0)
            self._beyond = float(deferred.get("beyond") or 0.0)
            kept = deferred.get("kept")
            self._kept = None if kept is None else int(kept)

    # ------------------------------------------ llm-compressor's Observer API

    @torch.no_grad()
    def forward(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Observe a value and return the calibrated `(scale, zero_point)`."""
        self.update(observed)
        return self.get_qparams()

    @torch.no_grad()
    def get_min_max(self, observed: torch.Tensor) -> Range:
        """Fold an already flattened value in and return the selected range.

        Args:
            observed: `(num_observations, *qparam_shape, group_size)`.

        Returns:
            `(min_vals, max_vals)`, each `(*qparam_shape,)`.
        """
        self.observe_flat(observed)
        return self.get_range()

    @torch.no_grad()
    def get_global_min_max(self, observed: torch.Tensor) -> Range:
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
        fresh._observe(observed.reshape(1, 1, -1))
        min_vals, max_vals = fresh.get_range()
        return min_vals.reshape(1), max_vals.reshape(1)

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, base_name={self.base_name!r}, "
            f"strategy={self.args.strategy!r}"
        )
