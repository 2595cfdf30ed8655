"""Quark's power-of-two observers (ported from its ONNX tools): min-max and MinMSE.

Per call of `_calculate_qparams` (Quark calls it after every calibration
batch) the running range gives one power-of-two candidate
(`quantobs.core.qparams.quark_rule.QuarkPow2Rule`), and the observer returns the
most frequent `(scale, zero_point)` over all calls so far (ties: the
earliest). MinMSE observers then try `pof2 * 2**k` for `k = 2, 1, 0, -1,
-2` on the last batch (same zero point) and keep the first of least squared
error (scored by `quantobs.core.scoring`); per channel one common `k` for
all channels, chosen on the summed error (as Quark).

Differences from Quark: the arithmetic is float32 whatever the input dtype
(Quark computes in it: a bfloat16 input gives symmetric int8 the zero point
-1, and float16 per-channel inputs raise); the power of two is decided
exactly (Quark rounds a float32 `log2`); an all-zero channel gets the scale
of an empty range (Quark divides 0 by 0); a range of a few subnormals, or
one wider than float32's max, gets a finite power of two in `2**-126 ..
2**127` and an in-range zero point (Quark: scale 0 and zero point -2**31;
for the wide range the scale 2**127 with the zero point qmin, which leaves
no negative value representable).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantobs.core.qparams.quark_rule import QuarkPow2Rule, QuarkRule, most_frequent
from quantobs.core.scoring import score
from quantobs.faces.quark.base import per_channel_view
from quantobs.faces.quark.minmax import (
    PerChannelMinMaxObserver,
    PerTensorMinMaxObserver,
)
from quantobs.faces.quark.spec import Dtype, QTensorConfig, element_format
from quantobs.stats.reduce import NanPolicy

__all__ = [
    "PerChannelPowOf2MinMSEObserver",
    "PerChannelPowOf2MinMaxObserver",
    "PerTensorPowOf2MinMSEObserver",
    "PerTensorPowOf2MinMaxObserver",
]

_POW2_DTYPES = (Dtype.int8, Dtype.uint8, Dtype.int32)
_SHIFTS = (2, 1, 0, -1, -2)  # scale * 2**k, Quark's order
_POW2_MIN, _POW2_MAX = 2.0**-126, 2.0**127  # float32's normal powers of two
_F32_MAX = torch.finfo(torch.float32).max


def _check_pow2_dtype(cls: type, spec: QTensorConfig) -> None:
    if spec.dtype not in _POW2_DTYPES:
        raise ValueError(
            f"{cls.__name__} supports int8, uint8 and int32, got dtype="
            f"{spec.dtype.value!r}"
        )


class _Pow2Mixin:
    """The candidate of one range and the vote over calls."""

    quant_min: float
    quant_max: float
    symmetric: bool | None
    dtype: Dtype
    _votes: list[tuple[float, ...]]

    def _pow2_candidate(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One power-of-two `(scale, zero_point)` of a range.

        Quark's arithmetic underflows for ranges of a few subnormals (scale
        0, zero point -2**31) and overflows for spreads past float32's max
        (an infinite spread): such entries are computed on the range scaled
        by `2**64` (or `2**-64`), which scales the power of two exactly and
        leaves the zero point as it is, then scaled back and clamped to
        float32's normal powers of two, `2**-126 .. 2**127`.
        """
        rule = QuarkPow2Rule(
            self.quant_min,
            self.quant_max,
            bool(self.symmetric),
            middle_zero_point=bool(self.symmetric) and self.dtype == Dtype.uint8,
        )
        if bool((min_val < -_F32_MAX).any() or (max_val > _F32_MAX).any()):
            raise ValueError(
                f"{self.owner} computes in float32 (Quark's scales), and the "
                f"range [{float(min_val.min()):.4g}, {float(max_val.max()):.4g}] "
                "passes float32's max; scale the input down or use "
                "PerTensorMinMaxObserver / PerChannelMinMaxObserver"
            )
        min_val, max_val = min_val.float(), max_val.float()
        scale, zero_point = rule(min_val, max_val)
        low, high = min_val.double().clamp(max=0), max_val.double().clamp(min=0)
        if self.symmetric:
            low, high = -torch.maximum(-low, high), torch.maximum(-low, high)
        tiny, huge = scale < _POW2_MIN, high - low > _F32_MAX
        if not bool((tiny | huge).any()):
            return scale, zero_point
        lift = torch.where(tiny, 2.0**64, torch.where(huge, 2.0**-64, 1.0))
        lifted, zero_point = rule(min_val * lift, max_val * lift)
        scale = (lifted / lift).clamp(_POW2_MIN, _POW2_MAX)
        return scale, zero_point

    def _one_batch(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pow2_candidate(min_val, max_val)

    def _candidate(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This call's candidate; before any observation Quark's defaults,
        with its warning."""
        if min_val.dim() == 0 and bool(min_val > max_val):
            rule = QuarkRule("int", self.quant_min, self.quant_max, owner=self.owner)
            return rule(min_val, max_val)
        return self._one_batch(min_val, max_val)

    @property
    def owner(self) -> str:
        return type(self).__name__

    def _vote(self, scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[float, ...]:
        """Record this call's qparams; the most frequent so far (earliest on ties)."""
        both = torch.cat([scale.reshape(-1).float(), zero_point.reshape(-1).float()])
        self._votes.append(tuple(both.tolist()))
        return most_frequent(self._votes)

    def _init_attributes(self) -> None:
        super()._init_attributes()  # type: ignore[misc]
        self._votes = []

    def get_extra_state(self) -> dict[str, Any]:
        """Base state plus the votes."""
        return {**super().get_extra_state(), "votes": list(self._votes)}  # type: ignore[misc]

    def set_extra_state(self, state: Any) -> None:
        """Inverse of `get_extra_state`."""
        super().set_extra_state(state)  # type: ignore[misc]
        if isinstance(state, dict):
            self._votes = [tuple(v) for v in state.get("votes", [])]


class _LastBatchMixin:
    """MinMSE observers: keep the last batch (a buffer, not saved); search its
    best shift once."""

    original_tensor: torch.Tensor | None
    pos_range: int
    _pow2_candidate: Any
    register_buffer: Any

    def _init_attributes(self) -> None:
        super()._init_attributes()  # type: ignore[misc]
        self.register_buffer("original_tensor", None, persistent=False)
        self.pos_range = len(_SHIFTS)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record the range and keep the batch for the search."""
        if x_orig.numel() == 0:
            return x_orig
        super().forward(x_orig)  # type: ignore[misc]
        self.original_tensor = x_orig.detach()
        return x_orig

    def _take_batch(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(scale, zero_point)` candidate of the range, and the kept batch."""
        if self.original_tensor is None:
            raise ValueError(
                f"{type(self).__name__}: no batch to search (each forward() "
                "allows one calculation); run a batch through the observer"
            )
        scale, zero_point = self._pow2_candidate(min_val, max_val)
        data, self.original_tensor = self.original_tensor, None
        return scale, zero_point, data


class PerTensorPowOf2MinMaxObserver(_Pow2Mixin, PerTensorMinMaxObserver):
    """Power-of-two scale of the running range, most frequent over calls.

    Returns 0-d float32 scale and zero point (Quark's dtypes).
    """

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """int8, uint8, int32 per tensor."""
        super().check_spec(spec)
        _check_pow2_dtype(cls, spec)

    @property
    def record_scale(self) -> list[float]:
        """Scales of every call so far (Quark's attribute)."""
        return [vote[0] for vote in self._votes]

    @property
    def record_zp(self) -> list[float]:
        """Zero points of every call so far (Quark's attribute)."""
        return [vote[1] for vote in self._votes]

    def calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record this range's candidate; return the most frequent one."""
        scale, zero_point = self._candidate(min_val, max_val)
        best = self._vote(scale, zero_point)
        device = min_val.device
        return torch.tensor(best[0], device=device), torch.tensor(
            best[1], device=device
        )


class PerTensorPowOf2MinMSEObserver(_LastBatchMixin, PerTensorPowOf2MinMaxObserver):
    """`PerTensorPowOf2MinMaxObserver`'s scale, shifted by the least squared
    error on the last batch (module docstring)."""

    def _one_batch(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero_point, data = self._take_batch(min_val, max_val)
        best = _best_shift(
            data.reshape(1, 1, -1), scale.reshape(1), zero_point.reshape(1), self
        )
        return scale * 2.0**best, zero_point


class PerChannelPowOf2MinMaxObserver(_Pow2Mixin, PerChannelMinMaxObserver):
    """Per-channel power-of-two scales, the most frequent vector over calls.

    Returns `(C,)` float32 scales and int32 zero points.
    """

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """int8, uint8, int32 per channel."""
        super().check_spec(spec)
        _check_pow2_dtype(cls, spec)

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        *,
        nan_policy: NanPolicy = "raise",
    ) -> None:
        super().__init__(qspec, device, nan_policy=nan_policy)

    @property
    def record_scale_zp(self) -> list[torch.Tensor]:
        """Every call's `cat([scale, zero_point])` (Quark's attribute)."""
        return [torch.tensor(vote) for vote in self._votes]

    def calculate_qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record this range's candidates; return the most frequent vector."""
        scale, zero_point = self._candidate(min_val, max_val)
        best = self._vote(scale, zero_point)
        half = len(best) // 2
        device = min_val.device
        return (
            torch.tensor(best[:half], device=device),
            torch.tensor(best[half:], dtype=torch.int32, device=device),
        )


class PerChannelPowOf2MinMSEObserver(_LastBatchMixin, PerChannelPowOf2MinMaxObserver):
    """Per-channel power-of-two scales, all shifted by one `2**k` of least
    summed squared error on the last batch (module docstring)."""

    def _one_batch(
        self, min_val: torch.Tensor, max_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero_point, data = self._take_batch(min_val, max_val)
        view = per_channel_view(data, int(self.ch_axis or 0))  # (N, C, G)
        best = _best_shift(view, scale, zero_point, self)
        return scale * 2.0**best, zero_point


def _best_shift(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    owner: _Pow2Mixin,
) -> int:
    """The `k` of `_SHIFTS` whose `scale * 2**k` least distorts `data`.

    Args:
        data: `(N, C, G)` values.
        scale: `(C,)` power-of-two scales.
        zero_point: `(C,)` zero points.
        owner: the observer (its dtype's format).
    """
    shifts = torch.tensor([2.0**k for k in _SHIFTS], device=scale.device)
    data = data.float()
    top = float(data.abs().max()) if data.numel() else 0.0
    # Past 2**60 squared errors overflow float32: data and scales are scored
    # times 2**-e (exact; every error scales by its square, the order is
    # kept), scales kept above 0 (a subnormal channel's data then is 0).
    factor = 2.0 ** -math.frexp(top)[1] if top > 2.0**60 else 1.0
    data = data * factor
    scales = (scale.float()[None, :] * shifts[:, None] * factor).clamp(min=2.0**-149)
    zero_points = zero_point.float()[None, :].expand_as(scales)
    fmt = element_format(owner.dtype)
    errors = score(data, scales, zero_points, fmt, 2.0).sum(dim=1)  # (5,)
    return _SHIFTS[int(errors.argmin())]  # the first least error
