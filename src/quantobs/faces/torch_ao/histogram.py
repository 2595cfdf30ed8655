"""torch.ao's `HistogramObserver`: its histogram update rule and its greedy L2
search bit for bit, with an option for a global (non-greedy) search.

The statistic is `quantobs.stats.torch_histogram.TorchHistogram`, kept in
torch's buffers (`histogram`: float32 counts over `bins` equal bins spanning
`[min_val, max_val]`), and so is torch's update, step for step:

* first batch: `torch.histc` over the batch's own range;
* later batches: `torch.histc` over the union range; if the range grew, the
  old counts are spread uniformly over 16 sub-bins each and re-binned into
  the new range by sub-bin midpoint;
* `+-inf` values are dropped with a warning.

`torch.histc` runs as its native twin on CPU float32 (the same float32 bin
selection, counted exactly, so the same float32 counts; about 3x faster) and
as `torch.histc` itself elsewhere (`quantobs.stats.torch_histogram.histc`).
Counts, quirks included, are torch's: float32, bf16 / fp16 inputs counted in
their own dtype, a constant batch counted over `[c - 1, c + 1]` while the
range stays `[c, c]`.

Search (`search=`)::

    "torch"   torch's greedy walk (trims 1e-5 of the mass per step, stops at
              the first step whose L2 error grows), bit for bit, vectorized:
              `quantobs.solvers.torch_l2.torch_l2_search`
    "global"  the range of least L2 error over all candidate ranges, not a
              greedy walk (`quantobs.solvers.global_l2.l2_search`), with
              the level count of the real quantized range (torch always
              assumes 2**bits levels) and, for symmetric qschemes, scored with
              the symmetric quantizer the qparams will have

The searched range is cached while the histogram and range buffers are
unchanged (`quantobs.observers.solve_cache`): torch.ao's `convert` calls
`calculate_qparams` again after calibration, and the global search costs
tens of milliseconds; observing, loading a state dict or `reset` drops it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import torch

from quantobs.core.qparams import all_finite
from quantobs.core.qparams.torch_repair import unsearchable_histogram
from quantobs.core.qparams.torch_rule import (
    PER_TENSOR_QSCHEMES,
    SYMMETRIC_QSCHEMES,
    default_qparams,
    range_is_observed,
    symmetric_zero_point,
)
from quantobs.faces.torch_ao.base import (
    FLOAT32_EPS,
    UniformQuantizationObserverBase,
    reject_dynamic,
    require_qscheme,
    tensor_view,
)
from quantobs.faces.torch_ao.errors import InvalidObserverArgument
from quantobs.faces.torch_ao.overflow import cast_range
from quantobs.observers.solve_cache import SolveCache
from quantobs.solvers.global_l2 import l2_search
from quantobs.solvers.torch_l2 import torch_l2_search
from quantobs.stats.base import Batch
from quantobs.stats.torch_histogram import UPSAMPLE_RATE, TorchHistogram

__all__ = ["HistogramObserver", "HistogramSearch"]

HistogramSearch = Literal["torch", "global"]
_SEARCHES = ("torch", "global")
# The global search's exact error costs memory per level: 16-bit ranges at most.
_GLOBAL_MAX_LEVELS = 2**16


class HistogramObserver(UniformQuantizationObserverBase):
    """Histogram of every value seen, and the range of least L2 error.

    Args:
        bins: number of histogram bins.
        dtype: quantized dtype (an integer one: the search uses its bits).
        qscheme: `torch.per_tensor_affine` or `torch.per_tensor_symmetric`.
        reduce_range: drop one bit of the range.
        quant_min: custom lower end of the quantized range.
        quant_max: custom upper end.
        factory_kwargs: `device` / `dtype` of the buffers.
        eps: smallest scale.
        is_dynamic: must be False.
        search: `"torch"` (default: torch's greedy search, torch's qparams)
            or `"global"` (least L2 error over all ranges; beyond torch).
        **kwargs: `nan_policy` (`"raise"`: NaN inputs raise `ValueError`;
            `+-inf` are dropped with a warning as torch does).

    Raises:
        UnsupportedObserverConfig: a per-channel qscheme, or dynamic.
        TypeError: a non-integer dtype (float8).
        ValueError: an unknown `search`, `bins` below 1, or
            `search="global"` with more than 2**16 levels (e.g. qint32).
    """

    statistic_cls = TorchHistogram
    _allows_inf = True  # the statistic drops them (with torch's warning)

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        bins: int = 2048,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: int | None = None,
        quant_max: int | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        eps: float = FLOAT32_EPS,
        is_dynamic: bool = False,
        *,
        search: HistogramSearch = "torch",
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        require_qscheme(owner, qscheme, PER_TENSOR_QSCHEMES)
        reject_dynamic(owner, is_dynamic, "use MinMaxObserver")
        if search not in _SEARCHES:
            raise ValueError(f"search={search!r} is not one of {list(_SEARCHES)}")
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins={bins!r} must be a positive int (e.g. 2048)")
        super().__init__(
            dtype=dtype,
            qscheme=qscheme,
            reduce_range=reduce_range,
            quant_min=quant_min,
            quant_max=quant_max,
            factory_kwargs=factory_kwargs,
            eps=eps,
            is_dynamic=is_dynamic,
            **kwargs,
        )
        factory_kwargs = torch.nn.factory_kwargs(factory_kwargs)
        self.bins = bins
        self.search: HistogramSearch = search
        self.register_buffer("histogram", torch.zeros(bins, **factory_kwargs))
        self.register_buffer("min_val", torch.tensor(math.inf, **factory_kwargs))
        self.register_buffer("max_val", torch.tensor(-math.inf, **factory_kwargs))
        try:
            self.dst_nbins = 2 ** torch.iinfo(dtype).bits
        except TypeError:
            raise TypeError(
                f"{owner} needs an integer dtype (its search counts 2**bits "
                f"levels), got {dtype}; use MinMaxObserver for float8"
            ) from None
        self.upsample_rate = UPSAMPLE_RATE
        self._solved = SolveCache()
        levels = self.quant_max - self.quant_min + 1
        if search == "global" and levels > _GLOBAL_MAX_LEVELS:
            raise ValueError(
                f"{owner}(search='global') scores up to {_GLOBAL_MAX_LEVELS} "
                f"levels (16 bits); {dtype} with quant_min={self.quant_min}, "
                f"quant_max={self.quant_max} has {levels}. Use search='torch', "
                "or a narrower quant_min / quant_max."
            )

    def statistic_config(self) -> dict[str, Any]:
        return {
            "bins": self.bins,
            "dtype": self.histogram.dtype,
            "upsample_rate": self.upsample_rate,
            "owner": type(self).__name__,
        }

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Add `x_orig`'s values to the histogram; return it unchanged.

        A float16 / bfloat16 batch is counted in its own dtype, as torch
        does, unless `torch.histc` refuses to count it there (torch.ao raises
        then: a running range beyond float16's maximum, or a constant batch
        whose `[c - 1, c + 1]` rounds to one value, e.g. bf16 `1e30`); such
        a batch is counted in float32.

        Raises:
            ValueError: NaN values under `nan_policy="raise"`, or values
                beyond the buffers' dtype (a float64 batch beyond float32's
                range: torch's range would be infinite).
            RuntimeError: NaN values under `"propagate"` (torch's histc error).
        """
        if x_orig.numel() == 0:
            return x_orig
        x = tensor_view(x_orig.detach())  # (1, numel)
        try:
            self._observe(x)
        except RuntimeError:  # the update raised before storing anything
            if x.dtype not in (torch.float16, torch.bfloat16):
                raise
            self._observe(x.float())
        return x_orig

    def _prepare_batch(self, batch: Batch) -> Batch:
        # The statistic casts the range to the buffers' dtype: a float64
        # batch beyond float32 raises here (torch's range would be infinite).
        if batch.min_vals.dtype != self.min_val.dtype:
            cast_range(
                type(self).__name__, batch.min_vals, batch.max_vals, self.min_val.dtype
            )
        return batch

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """`(scale, zero_point)` of the searched range, each of shape `(1,)`.

        A range wider than the float32 maximum (`max - min` overflows) has
        no usable histogram (`torch.histc` counts nothing; torch.ao returns a
        NaN scale): its qparams are the whole observed range's, with a
        `RuntimeWarning`.

        Raises:
            InvalidObserverArgument: a histogram of other than `bins` bins
                (a loaded state), or a searched range that torch's rule
                rejects.
            ValueError: a range too wide for the quantized range (a custom
                range of very few levels: the scale exceeds float32).
        """
        if float(self.min_val) == math.inf and float(self.max_val) == -math.inf:
            range_is_observed(self.min_val, self.max_val)  # warns, as torch does
            return default_qparams(self.min_val.device)
        if self.histogram.numel() != self.bins:
            raise InvalidObserverArgument(
                f"the histogram has {self.histogram.numel()} bins but the "
                f"observer was built with bins={self.bins}; build it with "
                "the bins of the loaded state"
            )
        lo, hi = self.min_val, self.max_val
        searchable = bool(torch.isfinite(hi - lo))
        if searchable:
            lo, hi = self._solved.get(
                [self.histogram, self.min_val, self.max_val],
                (
                    self.search,
                    self.dtype,
                    self.qscheme,
                    self.quant_min,
                    self.quant_max,
                    self.dst_nbins,
                    self.has_customized_qrange,
                ),
                self._search,
            )
        if not (searchable and all_finite(lo, hi)):
            warnings.warn(self._unsearchable(), RuntimeWarning, stacklevel=2)
            lo, hi = self.min_val, self.max_val
        return self._calculate_qparams(lo, hi)

    def _search(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.search == "global":
            return self._global_search()
        # the search works on float32 state, as torch's buffers
        return torch_l2_search(
            self.histogram.float(),
            self.min_val.float(),
            self.max_val.float(),
            self.dst_nbins,
        )

    def _unsearchable(self) -> str:
        return unsearchable_histogram(
            type(self).__name__, float(self.min_val), float(self.max_val)
        )

    def _global_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        width = (self.max_val - self.min_val) / self.bins
        if self.qscheme not in SYMMETRIC_QSCHEMES:
            levels = self.quant_max - self.quant_min + 1
            return l2_search(self.histogram, self.min_val, width, levels)
        # The symmetric grid is (q - zero_point) * scale for q in qmin..qmax.
        zero_point = symmetric_zero_point(
            self.dtype, self.quant_min, self.quant_max, self.has_customized_qrange
        )
        signed = (self.quant_min - zero_point, self.quant_max - zero_point)
        return l2_search(
            self.histogram,
            self.min_val,
            width,
            signed[1] - signed[0] + 1,
            symmetric=signed,
        )

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        version = local_metadata.get("version")
        if version is None or version < 3:
            # Before version 3 an unobserved range was an empty tensor.
            for name, empty in (("min_val", math.inf), ("max_val", -math.inf)):
                saved = state_dict.get(prefix + name)
                if isinstance(saved, torch.Tensor) and saved.shape == (0,):
                    state_dict[prefix + name] = torch.tensor(empty)
        # The buffers take the saved shapes (the engine's load).
        super()._load_from_state_dict(
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"
