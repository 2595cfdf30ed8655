"""Importance-weighted MSE observers: llm-compressor 0.14's imatrix family.

==========================  ===============================================
name                        range of each qparam (latest weight observed)
==========================  ===============================================
``imatrix_mse``             shrunk range minimizing the importance-weighted
                            error `sum w * |fake_quant(x) - x| ** norm`
``nvfp4_expanded_imatrix``  the same from 1.8x the observed range down to
                            about 0.8x, 112 candidates (NVFP4 defaults)
``nvfp4_expanded_mse``      `memoryless_mse` over the same candidates,
(alias ``fouroversix``)     unweighted
==========================  ===============================================

Names, options, defaults and numbers are llm-compressor's (the search is
`quantobs.solvers.imatrix`; `nvfp4_expanded_mse` is `memoryless_mse` with
other defaults). llm-compressor loads `fouroversix` with a `UserWarning`
that it is an alias; here it is a plain registry alias.

**Importance.** The weight `w` of value `W[r, k]` is the importance of input
channel `k`, `E[x_k ** 2]` over the layer's inputs, divided by its mean. It
is gathered as llm-compressor gathers it (`quantobs.observers.importance`):

* `module=` at construction, or `attach(module)` (what llm-compressor calls
  on its observers): a forward pre-hook on the module sums `x ** 2` per
  input channel over every token in float32; llm-compressor keeps these on
  its observer as `_imatrix_sum` / `_imatrix_count`, here they are the
  buffers of the `importance` child (`ImportanceObserver`), same names,
  same bits. Observe the weight *after* the calibration data has run;
* `update_importance(x)`: fold a batch of the layer's inputs in by hand;
* `set_importance(importance)`: an `Importance` (e.g. from an
  `ImportanceGatherer`) or `E[x ** 2]` as a `(in_features,)` tensor.

**No usable importance** (llm-compressor's rules, in its order): a base name
other than `weight`, the `tensor` strategy, no data, non-finite, negative or
all-zero values, the `block` strategy, or a size other than the weight's
columns. Then the search runs unweighted (uniform importance: the same
search, same options), logging one warning per observer and cause on the
`quantobs` logger; with `strict=True` it raises instead
(`NotImplementedError` for an unsupported base name or strategy,
`ValueError` for the data).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from pydantic import Field

from quantobs.core.args import QuantizationArgs
from quantobs.core.scoring import DEFAULT_CHUNK_ELEMS
from quantobs.observers.base import Arithmetic, Observer, ObserverOptions
from quantobs.observers.engine import ObserverEngine
from quantobs.observers.importance import ImportanceObserver
from quantobs.observers.mse import MemorylessMSEObserver, MSEOptions
from quantobs.observers.needs import Need
from quantobs.observers.observed_search import OBSERVED_DTYPES, observed_grid_search
from quantobs.solvers.imatrix import imatrix_search, normalize_importance
from quantobs.stats.base import Batch
from quantobs.stats.importance import Importance
from quantobs.stats.minmax import LatestRange
from quantobs.stats.reduce import range_or_zero

__all__ = [
    "IMatrixMSEObserver",
    "IMatrixMSEOptions",
    "NVFP4ExpandedIMatrixObserver",
    "NVFP4ExpandedIMatrixOptions",
    "NVFP4ExpandedMSEObserver",
    "NVFP4ExpandedMSEOptions",
]

_LOG = logging.getLogger("quantobs")
# llm-compressor's NVFP4 expansion: from 1.8x the range down to 0.8x.
_EXPAND = 1.8
_MAXSHRINK = 1 - 0.8 / 1.8
_WEIGHTED_STRATEGIES = ("channel", "group", "tensor_group")
_NO_DATA = (
    "no importance data available; attach(module) (or module=) and run "
    "calibration data before observing the weight, or call "
    "update_importance / set_importance"
)


class IMatrixMSEOptions(ObserverOptions):
    """Options of `imatrix_mse` (llm-compressor's names and defaults).

    Attributes:
        maxshrink: largest fraction the range shrinks by, in [0, 1].
        patience: stop after this many consecutive candidates that improve
            no qparam (0: score every candidate).
        grid: candidates per unit of shrink (`max(1, int(maxshrink * grid))
            + 1` in all), at least 1.
        norm: exponent of the absolute error, finite and positive.
        expand: the search starts at `expand` times the observed range
            (finite, positive).
        strict: raise instead of falling back to uniform importance.
        chunk_elems: elements per temporary tensor (bounds memory).
        search_arithmetic: `"float32"` (default) or `"observed"`, as
            `MSEOptions.search_arithmetic`.
    """

    maxshrink: float = Field(0.95, ge=0.0, le=1.0)
    patience: int = Field(5, ge=0)
    grid: float = Field(20.0, ge=1.0, allow_inf_nan=False)
    norm: float = Field(3.0, gt=0.0, allow_inf_nan=False)
    expand: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    strict: bool = False
    chunk_elems: int = Field(DEFAULT_CHUNK_ELEMS, ge=1024)
    search_arithmetic: Arithmetic = "float32"


class NVFP4ExpandedIMatrixOptions(IMatrixMSEOptions):
    """`IMatrixMSEOptions` with llm-compressor's NVFP4 expansion defaults."""

    maxshrink: float = Field(_MAXSHRINK, ge=0.0, le=1.0)
    patience: int = Field(1000, ge=0)
    grid: float = Field(200.0, ge=1.0, allow_inf_nan=False)
    norm: float = Field(2.4, gt=0.0, allow_inf_nan=False)
    expand: float = Field(_EXPAND, gt=0.0, allow_inf_nan=False)


class NVFP4ExpandedMSEOptions(MSEOptions):
    """`MSEOptions` with llm-compressor's NVFP4 expansion defaults."""

    maxshrink: float = Field(_MAXSHRINK, gt=0.0, le=1.0)
    grid: float = Field(200.0, gt=0.0)
    patience: int | None = Field(1000, ge=0)
    expand: float = Field(_EXPAND, ge=1.0)
    triton_error_buffer: float | None = Field(1.0, ge=0.0)


class _Unusable(Exception):
    """Why the importance cannot weight the search (with the strict error)."""

    def __init__(self, problem: str, error: type[Exception]) -> None:
        super().__init__(problem)
        self.problem, self.error = problem, error


@Observer.register("imatrix_mse")
class IMatrixMSEObserver(Observer):
    """MSE range weighted by the importance of each input channel.

    Args:
        base_name, args, **observer_kwargs: as `Observer`'s
            (`IMatrixMSEOptions`).
        module: optional layer: its inputs' importance is gathered from now
            on (`attach`), and its `g_idx` / global scale are used.

    Attributes:
        importance: the `ImportanceObserver` holding the importance.
    """

    statistic_cls = LatestRange
    Options = IMatrixMSEOptions
    options: IMatrixMSEOptions
    needs_values = True
    needs = frozenset({Need.INPUT_IMPORTANCE})

    def gathered(self) -> list[ObserverEngine]:
        """The importance its hook gathers during the batches."""
        return [self.importance]

    def __init__(
        self,
        base_name: str,
        args: QuantizationArgs,
        module: torch.nn.Module | None = None,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__(base_name, args, module, **observer_kwargs)
        self.importance = ImportanceObserver()
        self._warned: set[str] = set()
        if module is not None:
            self.attach(module)

    def statistic_config(self) -> dict[str, Any]:
        return {"track_absmax": self._tracks_global()}

    # ---------------------------------------------------------- importance

    def attach(self, module: torch.nn.Module) -> None:
        """Gather the importance of `module`'s inputs with a forward pre-hook,
        from zero (llm-compressor's `attach`; no hook without `in_features`)."""
        self.importance.attach(module)

    def detach(self, module: torch.nn.Module | None = None) -> None:
        """Stop gathering (llm-compressor's `detach`); the importance is kept."""
        self.importance.detach()

    def update_importance(self, x: torch.Tensor) -> None:
        """Fold a batch of the layer's inputs `(..., in_features)` in."""
        self.importance.update(x)

    def set_importance(self, importance: torch.Tensor | Importance) -> None:
        """Use this importance: an `Importance`, or `E[x ** 2]` as a
        `(in_features,)` tensor (replaces what was gathered)."""
        self.importance.set(importance)

    def _gathered(self) -> Importance:
        """The importance, where the host alone can tell it is there and may
        weight this observer's search (else `_Unusable`)."""
        if self.base_name != "weight":
            raise _Unusable(
                f"only weights have an input importance, not {self.base_name!r}",
                NotImplementedError,
            )
        if self.args.strategy == "tensor":
            raise _Unusable(
                "the 'tensor' strategy is not supported", NotImplementedError
            )
        stat = self.importance.importance()
        if stat is None:
            raise _Unusable(_NO_DATA, ValueError)
        return stat

    def _late_problems(self, x_flat: torch.Tensor, num_k: int) -> list[_Unusable]:
        """The host's checks llm-compressor makes after the data's: the
        strategy, and the importance's size against the weight's columns."""
        strategy = self.args.strategy
        if strategy not in _WEIGHTED_STRATEGIES:
            return [
                _Unusable(
                    f"the {strategy!r} strategy is not supported", NotImplementedError
                )
            ]
        # channel (1, rows, 1, cols), group (1, rows, groups, group_size)
        cols = x_flat.shape[-1] * (x_flat.shape[2] if strategy != "channel" else 1)
        if num_k != cols:
            return [
                _Unusable(
                    f"the importance has {num_k} input channels, the weight "
                    f"{cols} columns",
                    ValueError,
                )
            ]
        return []

    def _weights(self, x_flat: torch.Tensor) -> torch.Tensor | None:
        """`(1, 1, *Q[1:], G)` normalized importance of each value (broadcasts
        over rows), or None / uniform weights (1) when it cannot weight the
        search. What the data decides (no tokens, non-finite, negative or
        all-zero values) is decided on the device; its warning or strict
        error waits for qparams time (`_raise_deferred`), as llm-compressor's
        order of checks says."""
        try:
            stat = self._gathered()
        except _Unusable as why:
            self._fall_back(why)
            return None
        mean = stat.sum / stat.count.float()  # (K,); NaN without tokens
        late = self._late_problems(x_flat, mean.numel())
        device = mean.device
        found = torch.stack(
            [
                stat.count == 0,
                ~torch.isfinite(mean).all(),
                (mean < 0).any(),
                ~mean.any(),
                torch.full((), bool(late), device=device),
            ]
        )  # (5,) llm-compressor's checks in order; the first that holds counts
        first = found & (found.cumsum(0) == 1)
        self._record_problems(first, late)
        if late:
            return None
        weights = normalize_importance(mean.to(x_flat.device))
        row = torch.where(found.any().to(weights.device), 1.0, weights)
        return self.flatten(row.reshape(1, -1))  # the weight's columns (g_idx)

    def _fall_back(self, why: _Unusable) -> None:
        """The strict error, or one warning per cause (uniform MSE then)."""
        message = f"observer {self.name!r}: {why.problem}"
        if self.options.strict:
            raise why.error(
                f"{message} (strict=True; strict=False falls back to uniform MSE)"
            ) from None
        if why.problem not in self._warned:
            self._warned.add(why.problem)
            _LOG.warning("%s; falling back to uniform MSE", message)

    # ------------------------------------------------ deferred problems

    def _clear_deferred(self) -> None:
        super()._clear_deferred()
        self._problems: torch.Tensor | None = None  # (5,) counts, on the device
        self._late: list[_Unusable] = []  # the last late problem (slot 4)
        self._seen: list[_Unusable] = []  # problems read, in the checks' order

    def _record_problems(self, first: torch.Tensor, late: list[_Unusable]) -> None:
        if late:
            self._late = late
        counts = first.to(torch.float64)
        self._problems = counts if self._problems is None else self._problems + counts

    def _extra_pending(self) -> torch.Tensor | None:
        return self._problems

    def _settle_extra(self, values: list[float]) -> None:
        self._problems = None
        data = (
            _NO_DATA,
            "the importance has non-finite values",
            "the importance has negative values",
            "the importance is all zeros",
        )
        known = {why.problem for why in self._seen}
        for slot, count in enumerate(values):
            if not count:
                continue
            why = _Unusable(data[slot], ValueError) if slot < 4 else self._late[0]
            if why.problem not in known:
                self._seen.append(why)
                known.add(why.problem)

    def _raise_deferred(self) -> None:
        super()._raise_deferred()
        for why in self._seen:
            self._fall_back(why)

    # -------------------------------------------------------------- search

    def _prepare_batch(self, batch: Batch) -> Batch:
        if batch.x_flat is None:  # pragma: no cover - needs_values
            raise RuntimeError("imatrix observers score values; none were given")
        opts = self.options
        if (
            opts.arithmetic == "observed"
            and opts.search_arithmetic == "observed"
            and batch.x_flat.dtype in OBSERVED_DTYPES
        ):
            # llm-compressor's candidates and fake-quant in the observed dtype
            low, high = observed_grid_search(
                batch.x_flat, self.args, maxshrink=opts.maxshrink, grid=opts.grid,
                norm=opts.norm, patience=opts.patience, expand=opts.expand,
                imatrix=True, importance=self._weights(batch.x_flat),
            )  # fmt: skip
            return replace(batch, min_vals=low, max_vals=high, absmax=None)
        low, high = imatrix_search(
            batch.x_flat,
            self.args,
            self._weights(batch.x_flat),
            maxshrink=opts.maxshrink,
            grid=opts.grid,
            norm=opts.norm,
            patience=opts.patience,
            expand=opts.expand,
            chunk_elems=opts.chunk_elems,
            batch_range=range_or_zero(batch.min_vals, batch.max_vals),
        )
        # the global scale follows the selected ranges, as llm-compressor's
        return replace(batch, min_vals=low, max_vals=high, absmax=None)

    # ------------------------------------------------------ engine hooks

    def reset(self) -> None:
        """Forget the range, the importance and the counts."""
        super().reset()
        self.importance.reset()

    def _merged(self, other: ObserverEngine) -> None:
        super()._merged(other)
        if isinstance(other, IMatrixMSEObserver):
            self.importance.merge(other.importance)


@Observer.register("nvfp4_expanded_imatrix")
class NVFP4ExpandedIMatrixObserver(IMatrixMSEObserver):
    """`imatrix_mse` from 1.8x the observed range down to about 0.8x (112
    candidates, norm 2.4, no early stop in practice)."""

    Options = NVFP4ExpandedIMatrixOptions
    options: NVFP4ExpandedIMatrixOptions


@Observer.register("nvfp4_expanded_mse", alias="fouroversix")
class NVFP4ExpandedMSEObserver(MemorylessMSEObserver):
    """`memoryless_mse` from 1.8x the observed range down to about 0.8x (111
    candidates, no early stop in practice)."""

    Options = NVFP4ExpandedMSEOptions
    options: NVFP4ExpandedMSEOptions
