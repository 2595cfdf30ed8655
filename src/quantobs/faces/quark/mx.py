"""Block observers: OCP MX (shared e8m0 scale per 32 elements) and BFP16.

Both reduce every block at once on a view of the input
(`quantobs.faces.quark.blocks.block_minmax`: `amin` + `amax` over the block dim,
or max-pooling for BFP16's blocks of 8; no transpose or padding copy) and
keep one float32 amax per block, shape `(rows, num_blocks)` as in Quark.

MX scale modes (`scale_calculation_mode`) are tabled in
`quantobs.core.qparams.quark`; element formats fp4, fp6_e2m3, fp6_e3m2, fp8_e4m3,
fp8_e5m2 (Quark's `dtype=fp4` etc. with `scale_format="e8m0"`), and int8
(`dtype="mx", mx_element_dtype="int8"`, OCP MXINT8: scale `2**exponent(amax)`,
integer step `scale / 64`; Quark's observer rejects int8, its MX kernel uses
this scale).

BFP16: blocks of 8 share `scale = 2**(floor(log2 amax) - 6)` and int8
mantissas; where rounding the block's largest value `P` would give 128
(outside int8), the scale doubles. With `amax = m * 2**e`::

    block                          P / 2**(e - 6)   rounds to    scale
    P = amax = 1.984375 * 2**e     127.0            127          2**(e - 6)
    P = amax = 1.9921875 * 2**e    127.5            128: over    2**(e - 5)
    P = -amax (amax as above)      -127.5           -128: fits   2**(e - 6)
    all zero                                                     eps

In static mode the doubling stays in the stored amax (Quark's state), so a
later batch sees the doubled value; the scale is a function of it.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import Any

import torch

from quantobs.core.qparams import quark as qp
from quantobs.faces.quark.base import FLOAT32_EPS, ObserverBase, check_finite
from quantobs.faces.quark.blocks import block_minmax
from quantobs.faces.quark.spec import (
    MX_ELEMENT_DTYPES,
    Dtype,
    QSchemeType,
    QTensorConfig,
)

__all__ = ["PerBlockBFPObserver", "PerBlockMXObserver"]

_MX_OBSERVED = (
    Dtype.fp4, Dtype.fp6_e2m3, Dtype.fp6_e3m2, Dtype.fp8_e4m3, Dtype.fp8_e5m2,
)  # fmt: skip
_BFP_MANTISSA_EXP = 6  # int8 mantissas: |q| <= 127 -> scale 2**(e - 6)
_BFP_OVERFLOW = 127.5  # rounds to 128, outside int8


class _BlockObserver(ObserverBase, metaclass=ABCMeta):
    """Shared state of the block observers: a float32 `amax` per block."""

    qschemes = (QSchemeType.per_group,)
    amax: torch.Tensor

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        eps: float = FLOAT32_EPS,
    ) -> None:
        super().__init__(qspec, device)
        spec = self.qspec
        self.block_size = int(spec.group_size or 0)
        self.axis = int(spec.ch_axis or 0)
        self.mx_element_dtype = spec.mx_element_dtype
        self.eps = eps
        self.is_dynamic = spec.is_dynamic
        self.register_buffer("amax", torch.tensor(0.0, device=device))

    def _has_amax(self) -> bool:
        return self.amax.dim() > 0

    def _merge(self, amax: torch.Tensor) -> torch.Tensor:
        """The running amax with this batch's (static), or the batch's."""
        if self.is_dynamic or not self._has_amax():
            return amax
        if self.amax.shape != amax.shape:
            raise ValueError(
                f"{type(self).__name__}: blocks of shape {tuple(amax.shape)} but "
                f"earlier batches gave {tuple(self.amax.shape)}; a static "
                "observer needs one shape (set is_dynamic=True for inputs whose "
                "shape varies, or reset_min_max_vals() first)"
            )
        return torch.maximum(self.amax, amax.to(self.amax.dtype))

    def _stat(self, amax: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        return amax.to(dtype)

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
        self.amax = torch.tensor(0.0, device=self.amax.device)

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

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record every block's amax of `x_orig`; return it unchanged."""
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        low, high = block_minmax(x, self.axis, self.block_size, pad=True)
        amax = torch.maximum(high, -low)  # (rows, num_blocks), x's dtype
        check_finite(type(self).__name__, amax)
        self.amax = self._merge(self._stat(amax, x))
        self._remember_dtype(x)
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale per block (see the module docstring), zero points all 0.

        Returns:
            `(scale, zero_point)`, each `(rows, num_blocks)` (0-d before any
            observation); `e8m0` `even` scales are float32, `floor` / `ceil`
            ones the input's dtype (Quark's dtypes); zero point zeros of the
            scale's dtype.
        """
        scale_format = self.scale_format or "e8m0"
        scale = self.get_scale(self._model_amax(), self.eps, scale_format)
        scale = self._finish_scale(scale)
        return scale, torch.zeros_like(scale)


class PerBlockBFPObserver(_BlockObserver):
    """BFP16: blocks of 8 share an exponent, int8 mantissas (overflow doubling).

    Args:
        qspec: `dtype="bfp16"`, `ch_axis`, `group_size=8`.
        device: device of the amax.
        eps: scale of all-zero blocks.

    NaN and inf inputs count as 0 (Quark's rule for this observer).
    """

    qschemes = (QSchemeType.per_group,)

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """Only bfp16 specs."""
        if spec.dtype != Dtype.bfp16:
            raise ValueError(
                f"PerBlockBFPObserver observes dtype='bfp16', got "
                f"{spec.dtype.value!r}; use PerBlockMXObserver for MX"
            )
        super().check_spec(spec)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Record each block's amax, doubled where int8 mantissas overflow."""
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        low, high = block_minmax(x, self.axis, self.block_size, pad=True)
        amax = torch.maximum(high, -low)  # NaN / inf propagate into it
        if not bool(torch.isfinite(amax).all()):
            clean = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
            low, high = block_minmax(clean, self.axis, self.block_size, pad=True)
            amax = torch.maximum(high, -low)
        amax = self._merge(self._stat(amax, x))
        self._remember_dtype(x)
        scale = self._scale(amax.to(self._model_dtype(amax.dtype))).to(amax.dtype)
        # Rounding is monotone, so a block overflows iff its largest value
        # rounds to 128. Its smallest cannot reach -129: |x| <= amax <
        # 2**(e + 1) = 128 * scale.
        over = high.to(amax.dtype) >= _BFP_OVERFLOW * scale
        self.amax = torch.where(over, amax * 2, amax)
        return x_orig

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        """`2**(floor(log2 amax) - 6)` in `amax.dtype`, `eps` where zero."""
        exponent = qp.mx_exponent(amax, "floor", 0) - _BFP_MANTISSA_EXP
        scale = torch.exp2(exponent.float()).to(amax.dtype)
        return scale.masked_fill((amax == 0) | (scale == 0), self.eps)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale per block of 8 (input dtype) and int32 zero points.

        Returns:
            `(scale, zero_point)`, each `(rows, num_blocks)` (0-d before any
            observation).
        """
        scale = self._finish_scale(self._scale(self._model_amax()))
        return scale, torch.zeros_like(scale, dtype=torch.int32)
