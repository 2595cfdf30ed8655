"""Block observers: OCP MX (shared e8m0 scale per 32 elements) and BFP16.

Both keep one absolute maximum per block of a `group_view` of the input
(blocks along `ch_axis`, a trailing partial block zero-padded as Quark pads
it), in the buffer `amax`, shape `(rows, num_blocks)` as in Quark: MX an
`AbsMax` statistic, BFP16 a `BfpAbsMax` (the overflow doubling, see
`quantobs.stats.bfp`).

MX scales come from Quark's rule (`quantobs.core.qparams.quark_rule`): element
formats fp4, fp6_e2m3, fp6_e3m2, fp8_e4m3, fp8_e5m2 (Quark's `dtype=fp4`
etc. with `scale_format="e8m0"`), and int8 (`dtype="mx",
mx_element_dtype="int8"`, OCP MXINT8: scale `2**exponent(amax)`, integer
step `scale / 64`; Quark's observer rejects int8, its MX kernel uses this
scale). `scale_calculation_mode` "even" rounds the amax to the element's
mantissa width, "floor" / "ceil" as named.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from quantobs.core.layout import group_view
from quantobs.core.qparams.quark_rule import bfp_scale, finish_scale
from quantobs.faces.quark.base import FLOAT32_EPS, ObserverBase
from quantobs.faces.quark.spec import (
    MX_ELEMENT_DTYPES,
    Dtype,
    QSchemeType,
    QTensorConfig,
)
from quantobs.stats.base import Batch, Statistic
from quantobs.stats.bfp import BfpAbsMax
from quantobs.stats.minmax import AbsMax
from quantobs.stats.reduce import NanPolicy

__all__ = ["PerBlockBFPObserver", "PerBlockMXObserver"]

_MX_OBSERVED = (
    Dtype.fp4, Dtype.fp6_e2m3, Dtype.fp6_e3m2, Dtype.fp8_e4m3, Dtype.fp8_e5m2,
)  # fmt: skip


class _BlockObserver(ObserverBase):
    """Shared state of the block observers: a float32 `amax` per block."""

    qschemes = (QSchemeType.per_group,)
    amax: torch.Tensor

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        eps: float = FLOAT32_EPS,
        *,
        nan_policy: NanPolicy = "raise",
    ) -> None:
        super().__init__(qspec, device, nan_policy=nan_policy)
        spec = self.qspec
        self.block_size = int(spec.group_size or 0)
        self.axis = int(spec.ch_axis or 0)
        self.mx_element_dtype = spec.mx_element_dtype
        self.eps = eps
        self.register_buffer("amax", torch.tensor(0.0, device=device))

    def _read_state(
        self, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        return None if state["amax"].dim() == 0 else state  # 0-d: nothing yet

    def _initial_statistic(self) -> Statistic:
        return AbsMax(torch.tensor(0.0, device=self.amax.device))

    def _shape_error(
        self, before: tuple[int, ...], after: tuple[int, ...]
    ) -> Exception:
        return ValueError(
            f"{type(self).__name__}: blocks of shape {after} but earlier batches "
            f"gave {before}; a static observer needs one shape (set "
            "is_dynamic=True for inputs whose shape varies, or "
            "reset_min_max_vals() first)"
        )

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record every block's amax of `x_orig`; return it unchanged."""
        if x_orig.numel():
            x = x_orig.detach()
            view = group_view(x, self.axis, self.block_size, pad=True)
            self._observe_view(view, x)  # (1, rows, num_blocks, block)
        return x_orig

    def _model_amax(self) -> torch.Tensor:
        """The amax in the input's dtype (exact: it is one of its values)."""
        return self.amax.to(self._model_dtype(self.amax.dtype))

    def _calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.calculate_qparams()

    @abstractmethod
    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(scale, zero_point)` per block, each `(rows, num_blocks)`."""

    def reset_state(self) -> None:
        """Forget the amax."""
        self.reset_min_max_vals()

    def reset_min_max_vals(self) -> None:
        """Forget the amax (back to a 0-d zero)."""
        self.reset()

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, axis={self.axis}"


class PerBlockMXObserver(_BlockObserver):
    """OCP MX: one shared power-of-two (e8m0) scale per block of `group_size`.

    Args:
        qspec: `dtype` fp4 / fp6_e2m3 / fp6_e3m2 / fp8_e4m3 / fp8_e5m2 with
            `qscheme="per_group"` and `scale_format` (`e8m0`; also `e4m3`,
            `float32`), or `dtype="mx"` with `mx_element_dtype`; `ch_axis`,
            `group_size` (32 for OCP MX), `scale_calculation_mode`.
        device: device of the amax.
        eps: scale of all-zero blocks in `floor` / `ceil` modes.

    Raises:
        ValueError: another dtype, or missing `group_size` / `ch_axis` /
            `scale_format`.
    """

    statistic_cls = AbsMax

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """MX element dtypes, a block size, an axis and a scale format."""
        element = spec.mx_element_dtype if spec.dtype == Dtype.mx else spec.dtype
        if spec.dtype != Dtype.mx and spec.dtype not in _MX_OBSERVED:
            valid = ", ".join(d.value for d in _MX_OBSERVED)
            elements = ", ".join(d.value for d in MX_ELEMENT_DTYPES)
            raise ValueError(
                f"PerBlockMXObserver observes {valid} (or dtype='mx' with "
                f"mx_element_dtype in {elements}); got dtype={spec.dtype.value!r}"
            )
        if element not in MX_ELEMENT_DTYPES:  # pragma: no cover - spec checks
            raise ValueError(f"unsupported MX element dtype {element!r}")
        super().check_spec(spec)
        for field in ("group_size", "ch_axis"):
            if getattr(spec, field) is None:
                raise ValueError(f"PerBlockMXObserver needs {field} (e.g. 32 / -1)")
        if spec.group_size == -1:
            raise ValueError("PerBlockMXObserver needs a positive group_size (32)")
        if spec.dtype != Dtype.mx and spec.scale_format is None:
            raise ValueError(
                "PerBlockMXObserver needs scale_format: 'e8m0' (OCP MX), 'e4m3' "
                "or 'float32'"
            )

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale per block (see the module docstring), zero points all 0.

        Returns:
            `(scale, zero_point)`, each `(rows, num_blocks)` (0-d before any
            observation); `e8m0` "even" scales are float32, `floor` / `ceil`
            ones the input's dtype (Quark's dtypes); zero point zeros of the
            scale's dtype.
        """
        return self._rule(self.eps, blocks=True).block_qparams(self._model_amax())


@dataclass(frozen=True)
class _SaturatingBfpAbsMax(BfpAbsMax):
    """`BfpAbsMax` whose overflow doubling stops at the model dtype's max.

    A block whose largest value rounds to 128 at the top exponent (`>= 127.5
    * 2**121`, about 3.39e38, in float32 / bfloat16; `>= 65280` in float16)
    would double to infinity (Quark: an infinite scale; `BfpAbsMax` alone:
    the scale `2**-7`, every value clipped). Here it keeps the top
    exponent's scale, `2**121` (`2**9` in float16), the largest that makes
    sense: the doubled scale would dequantize the block's largest value
    (mantissa 64) to `2**128` (float16: 65536), past the dtype's max. The
    largest values saturate at `127 * scale`, less than 1/128 below them.
    """

    def update(self, batch: Batch) -> _SaturatingBfpAbsMax:
        doubled = super().update(batch)
        found = torch.maximum(-batch.min_vals, batch.max_vals)
        kept = torch.maximum(self.amax, found.to(self.amax.dtype))
        limit = torch.finfo(self.model_dtype).max
        return self.replace(amax=torch.where(doubled.amax > limit, kept, doubled.amax))


class PerBlockBFPObserver(_BlockObserver):
    """BFP16: blocks of 8 share an exponent, int8 mantissas (overflow doubling).

    Args:
        qspec: `dtype="bfp16"`, `ch_axis`, `group_size=8`.
        device: device of the amax.
        eps: scale of all-zero blocks.

    NaN and inf inputs count as 0 (Quark's rule for this observer): its
    `nan_policy` defaults to `"omit"` (the same amax); `"raise"` and
    `"propagate"` are as for the other observers.
    """

    statistic_cls = _SaturatingBfpAbsMax

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """Only bfp16 specs."""
        if spec.dtype != Dtype.bfp16:
            raise ValueError(
                f"PerBlockBFPObserver observes dtype='bfp16', got "
                f"{spec.dtype.value!r}; use PerBlockMXObserver for MX"
            )
        super().check_spec(spec)

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        eps: float = FLOAT32_EPS,
        *,
        nan_policy: NanPolicy = "omit",
    ) -> None:
        # "omit" by default: Quark maps NaN / inf to 0, which gives the same
        # amax as ignoring them
        super().__init__(qspec, device, eps, nan_policy=nan_policy)

    def statistic_config(self) -> dict[str, Any]:
        return {"eps": self.eps, "model_dtype": self._model_dtype(torch.float32)}

    def _initial_statistic(self) -> Statistic:
        zero = torch.tensor(0.0, device=self.amax.device)
        return _SaturatingBfpAbsMax(zero, self.eps)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale per block of 8 (input dtype) and int32 zero points.

        Returns:
            `(scale, zero_point)`, each `(rows, num_blocks)` (0-d before any
            observation).
        """
        scale = bfp_scale(self._model_amax(), self.eps)
        scale = finish_scale(scale, self._pof2(), self.scale_torch_dtype)
        return scale, torch.zeros_like(scale, dtype=torch.int32)
