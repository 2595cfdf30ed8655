"""`PerTensorHistogramObserverPro`: torch.ao's histogram observer inside Quark.

Quark wraps torch's `HistogramObserver` with 256 bins; here the same three
parts of the core do it: torch's histogram statistic
(`quantobs.stats.torch_histogram`), torch's greedy L2 search
(`quantobs.solvers.torch_l2`) and torch's qparams rule
(`quantobs.core.qparams.torch_rule`), bit for bit.

One difference, the policy of quantobs' torch.ao `HistogramObserver`: a
range wider than float32's max (`max - min > 3.4e38`, e.g. `[-3e38, 3e38]`)
leaves torch's float32 histogram without usable counts (torch and Quark: NaN
or inf scales). Its qparams then cover the whole observed range, as a
min-max observer's would, with a `RuntimeWarning` that says so; an affine
scale or zero point that overflows float32 is computed in float64
(`quantobs.core.qparams.torch_repair`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from quantobs.core.qparams.torch_repair import repair_qparams, unsearchable_histogram
from quantobs.core.qparams.torch_rule import TorchAORule, torch_quant_range
from quantobs.faces.quark.base import FLOAT32_EPS, UniformScalingObserver
from quantobs.faces.quark.spec import Dtype, QSchemeType, QTensorConfig
from quantobs.solvers.torch_l2 import torch_l2_search
from quantobs.stats.base import Statistic
from quantobs.stats.reduce import NanPolicy
from quantobs.stats.torch_histogram import TorchHistogram

__all__ = ["PerTensorHistogramObserverPro"]


class PerTensorHistogramObserverPro(UniformScalingObserver):
    """torch.ao's `HistogramObserver` (L2 search) with 256 bins, per tensor.

    torch's histogram (`quantobs.stats.torch_histogram.TorchHistogram`, in the
    buffers `histogram`, `min_val`, `max_val`), its greedy L2 search
    (`torch_l2_search`) and its qparams (`TorchAORule`: 128 for symmetric
    uint8, int64 / int32 zero points): torch's numbers bit for bit.

    Args:
        qspec: per_tensor, dtype uint4, int8 or uint8.
        device: device of the buffers.
        bins: histogram bins.
        reduce_range: drop one bit of the range.
        upsample_rate: kept for Quark's signature (torch >= 2.5 ignores it).

    Raises:
        ValueError: another qscheme or dtype, or `bins` not a positive int.
    """

    statistic_cls = TorchHistogram
    buffer_names: ClassVar[Mapping[str, str]] = {
        "histogram": "histogram",
        "min_vals": "min_val",
        "max_vals": "max_val",
    }
    qschemes = (QSchemeType.per_tensor,)
    _TORCH_DTYPES: ClassVar[dict[Dtype, torch.dtype]] = {
        Dtype.uint4: torch.quint4x2,
        Dtype.int8: torch.qint8,
        Dtype.uint8: torch.quint8,
    }
    histogram: torch.Tensor

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """per_tensor, uint4 / int8 / uint8."""
        if spec.qscheme != QSchemeType.per_tensor:
            raise ValueError(
                "PerTensorHistogramObserverPro only supports qscheme='per_tensor', "
                f"got {spec.qscheme!r}"
            )
        if spec.dtype not in cls._TORCH_DTYPES:
            raise ValueError(
                "PerTensorHistogramObserverPro supports dtype uint4, int8 and "
                f"uint8, got {spec.dtype.value!r}"
            )

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        bins: int = 256,
        reduce_range: bool = False,
        upsample_rate: int = 384,
        *,
        nan_policy: NanPolicy = "raise",
    ) -> None:
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins={bins!r} must be a positive int (e.g. 256)")
        super().__init__(qspec, device, FLOAT32_EPS, nan_policy=nan_policy)
        self.bins = bins
        self.reduce_range = reduce_range
        self.upsample_rate = upsample_rate
        self.register_buffer("histogram", torch.zeros(bins, device=device))
        torch_dtype = self._TORCH_DTYPES[self.dtype]
        qmin, qmax = torch_quant_range(
            torch_dtype, int(self.quant_min), int(self.quant_max), reduce_range
        )
        symmetric = torch.per_tensor_symmetric if self.symmetric else None
        self.torch_rule = TorchAORule(
            dtype=torch_dtype,
            qscheme=symmetric or torch.per_tensor_affine,
            quant_min=qmin,
            quant_max=qmax,
            eps=FLOAT32_EPS,
            custom_range=True,
        )
        self.dst_nbins = 2 ** torch.iinfo(torch_dtype).bits

    def statistic_config(self) -> dict[str, Any]:
        return {"bins": self.bins, "owner": type(self).__name__}

    def _read_state(
        self, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        return None if bool(state["min_vals"] == math.inf) else state

    def _initial_statistic(self) -> Statistic:
        return TorchHistogram.empty((), self.eps.device, bins=self.bins)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Add `x_orig` to torch's histogram; return it unchanged.

        Raises:
            ValueError: NaN / inf values (under `nan_policy="raise"`).
        """
        if x_orig.numel():
            x = x_orig.detach()
            self._observe_view(x.reshape(1, -1), x)
        return x_orig

    def _calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's greedy L2 search and qparams, each `(1,)`."""
        low, high = self.min_val, self.max_val
        if self.statistic() is None:
            return self.torch_rule(low, high)  # torch's warning, (1, 0)
        if bool(torch.isfinite(high.float() - low.float())):
            low, high = torch_l2_search(
                self.histogram.float(), low.float(), high.float(), self.dst_nbins
            )
        else:  # the module docstring's one difference
            owner = type(self).__name__
            warnings.warn(
                unsearchable_histogram(owner, float(low), float(high)),
                RuntimeWarning,
                stacklevel=2,
            )
        scale, zero_point = self.torch_rule(low, high)
        return repair_qparams(
            self.torch_rule, low, high, scale, zero_point, type(self).__name__
        )
