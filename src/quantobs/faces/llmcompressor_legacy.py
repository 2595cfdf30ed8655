"""llm-compressor's legacy (<= 0.7) observer API on quantobs' vectorized core.

A drop-in for `llmcompressor.observers.Observer` and its subclasses
`MinMaxObserver` ("minmax") and `MovingAverageMSEObserver` ("mse") as they
were up to llm-compressor 0.7: change the import, keep the calls. The numbers
are those of the legacy loops (per-group calls, a running range per
`tensor_id`), with every range turned into qparams by
`quantobs.calculate_qparams`.

What each strategy reduces in `get_qparams(x)` (the legacy rules)::

    strategy        x               reduced            scale / zero point
    tensor          any             every dim          (1,)
    channel         (rows, ...)     all dims but 0     (rows, 1, ...)
    token           (B, T, ...)     all dims but 0, 1  (B, T, 1, ...)
    token           2-D (T, H)      every dim          (1,)  [legacy quirk]
    group           (rows, cols)    each group         (rows, cols // group_size)
    tensor_group    as group, group scales multiplied by `global_scale`

Differences from the legacy code, each deliberate:

* Groups are computed in one pass over the canonical layout
  (`flatten_for_calibration`, with `g_idx` for activation ordering), and the
  running range of all groups is one `(rows, num_groups)` tensor stored under
  `min_val[GROUPS_ID]` / `max_val[GROUPS_ID]` (legacy: one entry per group).
  A custom subclass that only overrides `calculate_qparams` gets one call
  with the grouped view `(rows, num_groups, group_size)` and `reduce_dims=(2,)`.
* The MSE observer keys its running range by `tensor_id or "default"` on
  read and write (llm-compressor 0.5 - 0.7 read `tensor_id` but wrote
  `tensor_id or "default"`, so group 0 and every non-group strategy never
  averaged), and reduces token strategies per token like the base class.
* Errors instead of silent garbage: a group size that does not divide the
  columns, `g_idx` groups of unequal size, a range whose shape changes while
  a moving average is kept, non-finite or empty inputs, unknown options, and
  the strategies the legacy API cannot express (`block`, `attn_head`).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from typing import Annotated, Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import flatten_for_calibration
from quantobs.core.qparams import calculate_qparams
from quantobs.core.registry import Registry, validate_options
from quantobs.solvers.mse import candidate_errors, search_args, shrink_factors

__all__ = [
    "GROUPS_ID",
    "MSEOptions",
    "MinMaxObserver",
    "MinMaxOptions",
    "MovingAverageMSEObserver",
    "Observer",
    "ObserverOptions",
]

GROUPS_ID = "__groups__"
"""Key of the `(rows, num_groups)` running range of group strategies."""

_DEFAULT_ID = "default"
_SUPPORTED = ("tensor", "channel", "group", "tensor_group", "token")
_O = TypeVar("_O", bound="type[Observer]")
QParams = tuple[torch.Tensor, torch.Tensor]


class ObserverOptions(BaseModel):
    """Options of an observer; the base class takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _to_args(quantization_args: Any) -> QuantizationArgs:
    if isinstance(quantization_args, QuantizationArgs):
        return quantization_args
    if isinstance(quantization_args, (BaseModel, dict)):
        return QuantizationArgs.from_compressed_tensors(quantization_args)
    raise TypeError(
        "quantization_args must be a quantobs or compressed-tensors "
        f"QuantizationArgs, got {type(quantization_args).__name__}"
    )


def _check_observed(observed: Any) -> torch.Tensor:
    if not isinstance(observed, torch.Tensor):
        raise TypeError(
            f"observed must be a torch.Tensor, got {type(observed).__name__}"
        )
    if not observed.dtype.is_floating_point:
        raise TypeError(
            f"observed must be a floating tensor, got {observed.dtype}; "
            "cast it with .float()"
        )
    if observed.numel() == 0:
        raise ValueError(
            f"observed is empty (shape {tuple(observed.shape)}); observe a "
            "tensor with at least one value"
        )
    return observed


def _normalize_dim(dim: Any, observed: torch.Tensor, what: str) -> int:
    ndim = observed.ndim
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what} must be ints, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{what} {dim} is out of range for a tensor of shape "
            f"{tuple(observed.shape)}; use -{ndim}..{ndim - 1}"
        )
    return dim % ndim


def _reduce_layout(
    observed: torch.Tensor, reduce_dims: Iterable[int] | None
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`observed` as `(1, *kept, reduced)` and the keepdims shape of its range."""
    if not reduce_dims:  # legacy: None or () reduce every dim (torch.aminmax)
        return observed.reshape(1, -1), ()  # (1, numel)
    dims = [_normalize_dim(d, observed, "reduce_dims") for d in reduce_dims]
    if len(set(dims)) != len(dims):
        raise ValueError(f"reduce_dims {tuple(reduce_dims)} repeats a dim")
    kept = [d for d in range(observed.ndim) if d not in dims]
    sizes = [observed.shape[d] for d in kept]
    out_shape = tuple(
        1 if d in dims else observed.shape[d] for d in range(observed.ndim)
    )
    # (1, *kept sizes, prod(reduced sizes))
    x_flat = observed.permute(*kept, *sorted(dims)).reshape(1, *sizes, -1)
    return x_flat, out_shape


_REGISTRY: Registry[Any] = Registry("observer")


class Observer(torch.nn.Module):
    """Base legacy observer: caches the latest `(scale, zero_point)`.

    Subclasses implement `calculate_qparams`; `get_qparams` dispatches on the
    strategy as the legacy base class did (see the module's table).

    Args:
        quantization_args: quantobs or compressed-tensors `QuantizationArgs`.
        **observer_kwargs: options of this observer (merged over
            `quantization_args.observer_kwargs`), validated by `Options`.

    Raises:
        TypeError: `quantization_args` is not a QuantizationArgs.
        ValueError: a strategy the legacy API does not support, or an unknown
            or out-of-range option.
    """

    Options: ClassVar[type[ObserverOptions]] = ObserverOptions
    name: ClassVar[str] = "observer"

    def __init__(self, quantization_args: Any, **observer_kwargs: Any) -> None:
        super().__init__()
        args = _to_args(quantization_args)
        if args.strategy not in _SUPPORTED:
            raise ValueError(
                f"strategy {args.strategy!r} is not supported by the legacy "
                f"observer API (use one of {', '.join(_SUPPORTED)}); "
                "quantobs.Observer supports 'block' and 'attn_head'"
            )
        self.quantization_args = args
        self.options = validate_options(
            self.Options,
            f"observer {self.name!r}",
            args.observer_kwargs,
            observer_kwargs,
        )
        self._scale: torch.Tensor | None = None
        self._zero_point: torch.Tensor | None = None
        self._num_observed_tokens: int | None = None

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
    def get_value_from_registry(cls, name: str) -> type[Observer]:
        """The observer class registered as `name` (case, `-`, `_` ignored).

        Raises:
            KeyError: no observer has that name; the message lists them all.
        """
        return _REGISTRY.get(name)

    @classmethod
    def load_from_registry(cls, name: str, **constructor_kwargs: Any) -> Observer:
        """Construct the observer registered as `name` with `constructor_kwargs`.

        Example: `Observer.load_from_registry("minmax", quantization_args=args)`.
        """
        return cls.get_value_from_registry(name)(**constructor_kwargs)

    # ---------------------------------------------------------- legacy API

    @torch.no_grad()
    def forward(
        self,
        observed: torch.Tensor,
        g_idx: torch.Tensor | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Count tokens (2-D inputs only), then `get_qparams(observed, g_idx)`."""
        self.record_observed_tokens(observed)
        return self.get_qparams(observed, g_idx=g_idx, global_scale=global_scale)

    def calculate_qparams(
        self,
        observed: torch.Tensor,
        reduce_dims: tuple[int, ...] | None = None,
        tensor_id: Hashable | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QParams:
        """Scale and zero point of `observed`, reduced over `reduce_dims`.

        Args:
            observed: the tensor.
            reduce_dims: dims to reduce (kept as size 1); None or `()`
                reduces every dim and gives `(1,)` qparams.
            tensor_id: key of the running range (falsy ids share "default").
            global_scale: optional `(1,)` scale multiplying the local scales.

        Returns:
            `(scale, zero_point)` in the keepdims shape of the reduction.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement calculate_qparams"
        )

    def post_calculate_qparams(self) -> None:
        """Hook run by callers after `calculate_qparams` (no-op by default)."""

    def get_qparams(
        self,
        observed: torch.Tensor | None = None,
        g_idx: torch.Tensor | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Observe `observed` (if given) and return the latest qparams.

        Args:
            observed: optional tensor; None returns the cached qparams, which
                are `(None, None)` before the first observation.
            g_idx: optional `(cols,)` group of each column for group
                strategies (activation ordering); ignored for other strategies
                and when it holds -1 (uninitialized), as the legacy code did.
            global_scale: optional `(1,)` global scale, used by group
                strategies (NVFP4's `tensor_group`) and ignored by others.

        Returns:
            `(scale, zero_point)` shaped as in the module's table; the scale
            has `observed.dtype`, the zero point `quantization_args.zp_dtype`.

        Raises:
            TypeError: `observed` is not a floating tensor.
            ValueError: an empty or non-finite input, a group strategy on a
                tensor that is not 2-D or whose columns `group_size` does not
                divide, or a bad `g_idx`.
        """
        if observed is None:
            return self._scale, self._zero_point
        observed = _check_observed(observed)
        strategy = self.quantization_args.strategy
        if strategy == "tensor":
            qparams = self.calculate_qparams(observed)
        elif strategy == "channel":
            # the legacy assumption: output channels are dim 0
            qparams = self.get_qparams_along_dim(observed, 0)
        elif strategy == "token":
            # (batch, token, hidden): one range per (batch, token)
            qparams = self.get_qparams_along_dim(observed, {0, 1})
        else:
            qparams = self._group_qparams(observed, g_idx, global_scale)
        self._scale, self._zero_point = qparams
        return qparams

    def get_qparams_along_dim(
        self,
        observed: torch.Tensor,
        dim: int | Iterable[int],
        tensor_id: Hashable | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QParams:
        """`calculate_qparams` reducing every dim except `dim` (int or ints)."""
        observed = _check_observed(observed)
        dims = [dim] if isinstance(dim, int) else list(dim)
        keep = {_normalize_dim(d, observed, "dim") for d in dims}
        reduce_dims = tuple(d for d in range(observed.ndim) if d not in keep)
        return self.calculate_qparams(
            observed,
            reduce_dims=reduce_dims,
            tensor_id=tensor_id,
            global_scale=global_scale,
        )

    def record_observed_tokens(self, batch_tensor: torch.Tensor) -> None:
        """Add the rows of a 2-D `(tokens, features)` input to the token count.

        Inputs with another number of dims are not counted (the legacy rule:
        only MoE experts see flattened 2-D activations).

        Raises:
            ValueError: `batch_tensor` is not a tensor (legacy exception type).
        """
        if not isinstance(batch_tensor, torch.Tensor):
            raise ValueError(
                f"expected a torch.Tensor to observe, got {type(batch_tensor).__name__}"
            )
        if batch_tensor.ndim != 2:
            return
        self._num_observed_tokens = (self._num_observed_tokens or 0) + int(
            batch_tensor.shape[0]
        )

    def reset(self) -> None:
        """Forget the cached qparams and the token count."""
        self._num_observed_tokens = None
        self._scale = None
        self._zero_point = None

    # ------------------------------------------------------------ internals

    def _group_qparams(
        self,
        observed: torch.Tensor,
        g_idx: torch.Tensor | None,
        global_scale: torch.Tensor | None,
    ) -> QParams:
        args = self.quantization_args
        if observed.ndim != 2:
            raise ValueError(
                f"strategy {args.strategy!r} needs a 2-D (rows, columns) tensor, "
                f"got shape {tuple(observed.shape)}; flatten activations to "
                "(tokens, hidden)"
            )
        if g_idx is not None:
            if not isinstance(g_idx, torch.Tensor):
                raise TypeError(f"g_idx must be a tensor, got {type(g_idx).__name__}")
            if bool((g_idx == -1).any()):
                g_idx = None  # -1 marks an uninitialized g_idx: column order
        # (1, rows, num_groups, group_size), columns sorted by group
        x_flat = flatten_for_calibration(observed, "weight", args, g_idx)
        return self._calculate_group_qparams(x_flat[0], global_scale)

    def _calculate_group_qparams(
        self, x_grouped: torch.Tensor, global_scale: torch.Tensor | None
    ) -> QParams:
        """`(rows, num_groups)` qparams of `(rows, num_groups, group_size)`."""
        scale, zero_point = self.calculate_qparams(
            x_grouped, reduce_dims=(2,), tensor_id=GROUPS_ID, global_scale=global_scale
        )
        return scale.squeeze(-1), zero_point.squeeze(-1)  # (rows, num_groups)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, strategy={self.quantization_args.strategy!r}"


class _RangeObserver(Observer, metaclass=ABCMeta):
    """Observer keeping one running `(min, max)` per `tensor_id`.

    Subclasses choose the batch range (`_select_range`) and how it updates the
    running one (`_update_range`).
    """

    def __init__(self, quantization_args: Any, **observer_kwargs: Any) -> None:
        super().__init__(quantization_args, **observer_kwargs)
        self.min_val: dict[Hashable, torch.Tensor] = {}
        self.max_val: dict[Hashable, torch.Tensor] = {}

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
        observed = _check_observed(observed)
        x_flat, out_shape = _reduce_layout(observed, reduce_dims)
        key = tensor_id or _DEFAULT_ID
        return self._observe(x_flat, out_shape, key, False, global_scale)

    def _calculate_group_qparams(
        self, x_grouped: torch.Tensor, global_scale: torch.Tensor | None
    ) -> QParams:
        x_flat = x_grouped.unsqueeze(0)  # (1, rows, num_groups, group_size)
        out_shape = tuple(x_grouped.shape[:2])  # (rows, num_groups)
        return self._observe(x_flat, out_shape, GROUPS_ID, True, global_scale)

    @torch.no_grad()
    def _observe(
        self,
        x_flat: torch.Tensor,
        out_shape: tuple[int, ...],
        key: Hashable,
        per_group: bool,
        global_scale: torch.Tensor | None,
    ) -> QParams:
        # x_flat: (N, *Q, G); ranges: (*Q,) in x_flat.dtype, as the legacy code
        min_vals = torch.amin(x_flat, dim=(0, -1))
        max_vals = torch.amax(x_flat, dim=(0, -1))
        if not (torch.isfinite(min_vals).all() and torch.isfinite(max_vals).all()):
            bad = int((~torch.isfinite(x_flat)).sum())
            raise ValueError(
                f"observer {self.name!r} got {bad} non-finite value(s) (NaN or "
                "inf); clean the input, or use quantobs.Observer with "
                "nan_policy='omit'"
            )
        min_vals, max_vals = self._select_range(x_flat, min_vals, max_vals, per_group)
        min_vals, max_vals = self._update_range(
            key, min_vals.reshape(out_shape), max_vals.reshape(out_shape)
        )
        return calculate_qparams(
            min_vals, max_vals, self.quantization_args, global_scale
        )

    def _select_range(
        self,
        x_flat: torch.Tensor,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        per_group: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's range from its `(N, *Q, G)` values and min/max `(*Q,)`."""
        return min_vals, max_vals

    @abstractmethod
    def _update_range(
        self, key: Hashable, min_vals: torch.Tensor, max_vals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold a batch's range into the running range under `key`."""

    def _running(
        self, key: Hashable, new_shape: torch.Size
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        old_min, old_max = self.min_val.get(key), self.max_val.get(key)
        if old_min is None or old_max is None:
            return None
        if old_min.shape != new_shape:
            raise ValueError(
                f"observer {self.name!r}: the range of tensor_id {key!r} changed "
                f"shape from {tuple(old_min.shape)} to {tuple(new_shape)}; call "
                "reset() before observing a differently shaped tensor"
            )
        return old_min, old_max

    def _store(
        self, key: Hashable, min_vals: torch.Tensor, max_vals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.min_val[key], self.max_val[key] = min_vals, max_vals
        return min_vals, max_vals

    def reset(self) -> None:
        """Forget the cached qparams, the token count and every running range."""
        super().reset()
        self.min_val = {}
        self.max_val = {}


def _moving_average(
    running: torch.Tensor, new: torch.Tensor, constant: float
) -> torch.Tensor:
    # Written as the legacy code wrote it (not `old * (1 - c) + new * c`), so
    # the numbers match bit for bit.
    return running + constant * (new - running)


AveragingConstant = Annotated[float, Field(gt=0.0, le=1.0)]


class MinMaxOptions(ObserverOptions):
    """Options of `MinMaxObserver`.

    Attributes:
        averaging_constant: weight of the newest batch in `(0, 1]`: the range
            is `running + c * (batch - running)`. 1.0 keeps the latest batch
            only; None keeps the running min and max over every batch (the
            static behaviour of llm-compressor 0.6's `averaging_constant=None`).
    """

    averaging_constant: AveragingConstant | None = 0.01


@Observer.register("minmax")
class MinMaxObserver(_RangeObserver):
    """Moving average (default 0.01) of each batch's min and max."""

    Options = MinMaxOptions
    options: MinMaxOptions

    def _update_range(
        self, key: Hashable, min_vals: torch.Tensor, max_vals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        constant = self.options.averaging_constant
        if constant == 1.0:  # latest batch only; no shape bookkeeping
            return self._store(key, min_vals, max_vals)
        running = self._running(key, min_vals.shape)
        if running is None:
            return self._store(key, min_vals, max_vals)
        if constant is None:
            return self._store(
                key,
                torch.minimum(min_vals, running[0]),
                torch.maximum(max_vals, running[1]),
            )
        return self._store(
            key,
            _moving_average(running[0], min_vals, constant),
            _moving_average(running[1], max_vals, constant),
        )


class MSEOptions(ObserverOptions):
    """Options of `MovingAverageMSEObserver` (llm-compressor 0.7's defaults).

    Attributes:
        averaging_constant: weight of the newest batch's range, in `(0, 1]`.
        maxshrink: largest fraction the range shrinks by, in `(0, 1]`.
        patience: stop a search after this many candidates that improve no
            range of the call (of the group, for group strategies); None
            scores every candidate. 0 behaves as 1, as in the legacy loop.
        grid: candidates per unit of shrink; `int(maxshrink * grid)` in all.
        norm: exponent of the absolute error.
    """

    averaging_constant: AveragingConstant = 0.01
    maxshrink: float = Field(0.2, gt=0.0, le=1.0)
    patience: int | None = Field(5, ge=0)
    grid: float = Field(100.0, gt=0.0)
    norm: float = Field(2.4, gt=0.0)

    @model_validator(mode="after")
    def _at_least_one_candidate(self) -> MSEOptions:
        if int(self.maxshrink * self.grid) < 1:
            raise ValueError(
                f"maxshrink * grid = {self.maxshrink * self.grid} gives no "
                "candidate range; make it at least 1 (e.g. grid=100)"
            )
        return self


def _legacy_stop_mask(
    errors: torch.Tensor, patience: int | None, per_group: bool
) -> torch.Tensor:
    """Which candidates the legacy loop scores before its early stop.

    The loop runs once per call (once per group in the group path) and stops
    after `patience` consecutive candidates that improve no range of it.

    Args:
        errors: `(C, *Q)` errors; `(C, rows, num_groups)` when `per_group`.
        patience: the early-stop patience, None for none.
        per_group: one loop per column of `(rows, num_groups)`.

    Returns:
        `(C, *Q)`-broadcastable bool mask of the scored candidates.
    """
    num_c = errors.shape[0]
    if patience is None:
        return torch.ones_like(errors, dtype=torch.bool)
    inf = torch.full_like(errors[:1], float("inf"))
    best_before = torch.cat([inf, errors.cummin(dim=0).values[:-1]])  # (C, *Q)
    improved = errors < best_before
    if per_group:
        improved = improved.any(dim=1)  # (C, num_groups)
    else:
        improved = improved.reshape(num_c, -1).any(dim=1, keepdim=True)  # (C, 1)
    stale = (~improved).to(torch.int64).cumsum(dim=0)  # (C, U)
    streak = max(patience, 1)
    window = stale.clone()  # non-improving candidates among the last `streak`
    window[streak:] -= stale[:-streak]
    hit = window >= streak
    stop = torch.where(
        hit.any(dim=0), hit.to(torch.int64).argmax(dim=0) + 1, num_c
    )  # (U,)
    scored = torch.arange(num_c, device=errors.device)[:, None] < stop  # (C, U)
    if per_group:
        return scored[:, None, :]  # (C, 1, num_groups)
    return scored.reshape(num_c, *[1] * (errors.ndim - 1))  # (C, 1, ..., 1)


@Observer.register("mse")
class MovingAverageMSEObserver(_RangeObserver):
    """Moving average of the per-batch range minimizing `|fq(x) - x| ** norm`.

    Candidate ranges are `p * (min, max)` for `p = 1 - i / grid`; all
    candidates, rows and groups are scored at once (`quantobs.solvers.mse`), and the
    legacy early stop is applied afterwards per call or per group.
    """

    Options = MSEOptions
    options: MSEOptions

    def _select_range(
        self,
        x_flat: torch.Tensor,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        per_group: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        opts = self.options
        factors = shrink_factors(opts.maxshrink, opts.grid).to(x_flat.device)  # (C,)
        min32, max32 = min_vals.float(), max_vals.float()
        # The legacy search passes no global scale: NVFP4 scores unrounded
        # group scales (`search_args`).
        errors = candidate_errors(
            x_flat,
            search_args(self.quantization_args),
            min32,
            max32,
            factors,
            opts.norm,
        )  # (C, *Q)
        scored = _legacy_stop_mask(errors, opts.patience, per_group)
        masked = torch.where(scored, errors, torch.full_like(errors, float("inf")))
        best = factors[torch.argmin(masked, dim=0)]  # (*Q,), first minimum wins
        return (min32 * best).to(min_vals.dtype), (max32 * best).to(max_vals.dtype)

    def _update_range(
        self, key: Hashable, min_vals: torch.Tensor, max_vals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        running = self._running(key, min_vals.shape)
        if running is None:
            return self._store(key, min_vals, max_vals)
        constant = self.options.averaging_constant
        return self._store(
            key,
            _moving_average(running[0], min_vals, constant),
            _moving_average(running[1], max_vals, constant),
        )
