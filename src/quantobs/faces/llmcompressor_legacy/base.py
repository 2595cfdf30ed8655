"""`Observer`: the legacy base class (registry, strategy dispatch, tokens).

`get_qparams(x)` turns each strategy into `calculate_qparams` calls as the
legacy base class did (the package docstring's table); subclasses say how a
call becomes qparams. The base keeps no statistic of its own: the running
ranges of `RangeObserver` live in its per-`tensor_id` children.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import flatten_for_calibration, normalize_axis
from quantobs.core.qparams import CompressedTensorsRule
from quantobs.core.registry import Registered, Registry, validate_options
from quantobs.observers.base import Arithmetic
from quantobs.observers.engine import ObserverEngine
from quantobs.stats.reduce import NanPolicy

__all__ = ["GROUPS_ID", "Observer", "ObserverOptions", "QParams", "check_observed"]

GROUPS_ID = "__groups__"
"""Key of the `(rows, num_groups)` running range of group strategies."""

_SUPPORTED = ("tensor", "channel", "group", "tensor_group", "token")
_STATE_VERSION = 1
QParams = tuple[torch.Tensor, torch.Tensor]


class ObserverOptions(BaseModel):
    """Options every legacy observer takes (subclasses add their own).

    Attributes:
        nan_policy: what a batch's NaN / inf values do, as for
            `quantobs.Observer` (`quantobs.stats.reduce`'s table):
            `"raise"` (default, beyond the legacy code, whose scales became
            NaN) raises `ValueError`; `"omit"` ignores them (a batch with no
            finite value is skipped; `get_qparams` of a first such batch
            raises); `"propagate"` lets them reach the ranges, whose qparams
            then raise `ValueError`.
        arithmetic: `"observed"` (default) computes on bfloat16 / float16
            inputs as the legacy code did, in their dtype: asymmetric scales
            and zero points (compressed-tensors' rule), and the MSE search's
            candidates, fake-quantized values and error sums, rounded in it;
            `"float32"` computes them in float32 (the scales are returned in
            the input's dtype either way). float32 / float64 inputs give the
            same either way.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    nan_policy: NanPolicy = "raise"
    arithmetic: Arithmetic = "observed"


def _to_args(quantization_args: Any) -> QuantizationArgs:
    if isinstance(quantization_args, QuantizationArgs):
        return quantization_args
    if isinstance(quantization_args, (BaseModel, dict)):
        return QuantizationArgs.from_compressed_tensors(quantization_args)
    raise TypeError(
        "quantization_args must be a quantobs or compressed-tensors "
        f"QuantizationArgs, got {type(quantization_args).__name__}"
    )


def check_observed(observed: Any) -> torch.Tensor:
    """`observed` if it is a non-empty floating tensor.

    Raises:
        TypeError: not a tensor, or not floating.
        ValueError: an empty tensor.
    """
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


def normalize_dim(dim: Any, ndim: int, what: str) -> int:
    """`dim` in `0 .. ndim - 1` (legacy dims are plain ints).

    Raises:
        TypeError: `dim` is not an int.
        ValueError: out of range.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what} must be ints, got {dim!r}")
    return normalize_axis(dim, ndim, what)


class Observer(ObserverEngine, Registered):
    """Base legacy observer: caches the latest `(scale, zero_point)`.

    Subclasses implement `calculate_qparams`; `get_qparams` dispatches on the
    strategy as the legacy base class did (see the package's table). The
    cached qparams are non-persistent buffers (they move with `.to()`; a
    loaded observer has none until it observes).

    Args:
        quantization_args: quantobs or compressed-tensors `QuantizationArgs`.
        **observer_kwargs: options of this observer (merged over
            `quantization_args.observer_kwargs`), validated by `Options`;
            every observer takes `nan_policy` (`ObserverOptions`).

    Raises:
        TypeError: `quantization_args` is not a QuantizationArgs.
        ValueError: a strategy the legacy API does not support, or an unknown
            or out-of-range option.
    """

    Options: ClassVar[type[ObserverOptions]] = ObserverOptions
    registry: ClassVar[Registry[Any]] = Registry("observer")
    name: ClassVar[str] = "observer"

    _scale: torch.Tensor | None
    _zero_point: torch.Tensor | None

    def __init__(self, quantization_args: Any, **observer_kwargs: Any) -> None:
        args = _to_args(quantization_args)
        if args.strategy not in _SUPPORTED:
            raise ValueError(
                f"strategy {args.strategy!r} is not supported by the legacy "
                f"observer API (use one of {', '.join(_SUPPORTED)}); "
                "quantobs.Observer supports 'block' and 'attn_head'"
            )
        options = validate_options(
            self.Options,
            f"observer {self.name!r}",
            args.observer_kwargs,
            observer_kwargs,
        )
        super().__init__(nan_policy=options.nan_policy)
        self.quantization_args = args
        # Qparams of no finite value (nan_policy="omit") are (0, 0), as the
        # core observers' (other policies never leave a range empty).
        self.rule = CompressedTensorsRule(args, empty_as_zero=True)
        self.options = options
        self.register_buffer("_scale", None, persistent=False)
        self.register_buffer("_zero_point", None, persistent=False)
        self._num_observed_tokens: int | None = None

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
            `(scale, zero_point)` shaped as in the package's table; the scale
            has `observed.dtype`, the zero point `quantization_args.zp_dtype`.

        Raises:
            TypeError: `observed` is not a floating tensor.
            ValueError: an empty or non-finite input, a group strategy on a
                tensor that is not 2-D or whose columns `group_size` does not
                divide, or a bad `g_idx`.
        """
        if observed is None:
            return self._scale, self._zero_point
        observed = check_observed(observed)
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
        observed = check_observed(observed)
        dims = [dim] if isinstance(dim, int) else list(dim)
        keep = {normalize_dim(d, observed.ndim, "dim") for d in dims}
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
        super().reset()
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
        return self._calculate_group_qparams(x_flat, global_scale)

    def _calculate_group_qparams(
        self, x_flat: torch.Tensor, global_scale: torch.Tensor | None
    ) -> QParams:
        """`(rows, num_groups)` qparams of `(1, rows, num_groups, group_size)`.

        A subclass that only overrides `calculate_qparams` gets one call with
        the grouped view and `reduce_dims=(2,)` under `GROUPS_ID`.
        """
        scale, zero_point = self.calculate_qparams(
            x_flat[0], reduce_dims=(2,), tensor_id=GROUPS_ID, global_scale=global_scale
        )
        return scale.squeeze(-1), zero_point.squeeze(-1)  # (rows, num_groups)

    # -------------------------------------------------------- engine, state

    def _check_merge(self, other: ObserverEngine) -> None:
        for what in ("quantization_args", "options"):
            if getattr(self, what) != getattr(other, what):
                raise ValueError(f"cannot merge observers with different {what}")

    def _merged(self, other: ObserverEngine) -> None:
        tokens = getattr(other, "_num_observed_tokens", None)
        if tokens is not None:
            self._num_observed_tokens = (self._num_observed_tokens or 0) + tokens

    def get_extra_state(self) -> dict[str, Any]:
        """Python state carried by `state_dict()` as `_extra_state`."""
        return {
            "version": _STATE_VERSION,
            "observer": self.name,
            "num_observed_tokens": self._num_observed_tokens,
        }

    def set_extra_state(self, state: Any) -> None:
        """Restore what `get_extra_state` saved (via `load_state_dict`).

        Raises:
            ValueError: the state of another version or another observer.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unrecognised legacy observer state; expected version {_STATE_VERSION}"
            )
        if state.get("observer") != self.name:
            raise ValueError(
                f"state of observer {state.get('observer')!r} cannot load into "
                f"{self.name!r}"
            )
        tokens = state["num_observed_tokens"]
        self._num_observed_tokens = None if tokens is None else int(tokens)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, strategy={self.quantization_args.strategy!r}"
