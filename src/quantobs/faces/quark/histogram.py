"""Histogram observers: plain, percentile and MSE (the Pro one: `histogram_pro`).

Per tensor (Quark's qscheme) each keeps Quark's growing fixed-width
histogram (`quantobs.stats.quark_histogram`: 2048 bins; percentile: 4200
bins, zeros skipped), bounded (`quantobs.faces.quark.bounded_histogram`: at
most 4 times those bins, merged beyond), in the buffers `calib_hist` (int64,
exact) and `calib_bin_edges`, and searches it when qparams are asked for,
once (Quark searches after every calibration batch). Symmetric specs
histogram `|x|`.

Beyond Quark, `per_channel` and `per_group` specs work too: one exact-count
histogram per channel / group (`quantobs.stats.histogram`, power-of-two bin
widths, `bins` = Quark's bin count per qparam, buffers `hist_*`), with the
same searches vectorized over qparams (percentile:
`quantobs.solvers.percentile`, whose boundary is the right edge; MSE:
Quark's candidates `lo + (hi - lo) * (i + 0.5) / bins` for `i` from
`start_bin` on, scored on the histogram).

Fixes of Quark's bugs (the tests assert the correct numbers):

* `PerTensorHistogramObserver` never sets its range, so its qparams are
  always `(1.0, 0)`; here they are the observed range's (min-max).
* The asymmetric percentile returns the data minimum and the lower tail's
  percentile (both ends at the bottom of the data; with Quark's default
  percentile both are the data minimum); here both tails are cut
  (`quantobs.solvers.quark_histogram`).
* Growing a histogram to the left adds the old counts at the wrong bins.
* Growing to the right, Quark's bin count (a float32 `ceil`) can disagree
  with its edges (a float64 `arange`) by one: it then bins with the wrong
  width (and its MSE search fails on the shapes). Here the bins are the
  edges'.
* Percentile counts are exact: past 2**24 values Quark's float32 CDF reaches
  1.0 early and cuts the top values even at p = 99.99999999.
* The asymmetric MSE search fixes the minimum at 0 (negative values all
  quantize to 0); here the minimum is the histogram's left edge per tensor
  (the data minimum, or less than one bin below it once the histogram grew
  to the left) and the data minimum per channel / group.
* A batch much wider than the first grows Quark's histogram by whole bins
  of the first width without limit (a 10x wider batch: ~16,000 bins and a
  search quadratic in them; 1e17x: a loop that never ends; other growths
  raise `OverflowError` or try to allocate petabytes), and ranges near
  float32's max give infinite edges. Here the histogram holds at most 4
  times its first bin count (merging whole bins beyond), and edges, centres
  and binning go to float64 where float32 would overflow
  (`quantobs.faces.quark.bounded_histogram`); the MSE search scores only
  the non-empty bins (the same sums) and values past `2**60` scaled by a
  power of two (the same order). Past 4 times the first bins, the MSE
  candidates (bins from `start_bin` on) are bins of the merged grid.

Also: `min_val` / `max_val` hold the observed data range (Quark overwrites
them with the searched range; per channel / group with zeros skipped, the
range of the counted values); qparams before any observation raise
`ValueError` (Quark raises `AttributeError` or `ValueError`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import torch

from quantobs.core.layout import group_view
from quantobs.core.qparams.quark_rule import int_qparams
from quantobs.core.scoring import score
from quantobs.faces.quark.base import (
    UniformScalingObserver,
    per_channel_view,
)
from quantobs.faces.quark.bounded_histogram import (
    BoundedQuarkHistogram,
    safe_centers,
)
from quantobs.faces.quark.spec import Dtype, QSchemeType, QTensorConfig, element_format
from quantobs.solvers.percentile import percentile_range, percentile_upper
from quantobs.solvers.quark_histogram import mse_candidates, percentile_bounds
from quantobs.stats.base import Batch, Statistic
from quantobs.stats.histogram import Histogram
from quantobs.stats.reduce import NanPolicy, minmax_omit_nonfinite

__all__ = [
    "PerTensorHistogramObserver",
    "PerTensorMSEObserver",
    "PerTensorPercentileObserver",
]

_ALL_QSCHEMES = (QSchemeType.per_tensor, QSchemeType.per_channel, QSchemeType.per_group)
_FP8 = (Dtype.fp8_e4m3, Dtype.fp8_e5m2)
_LINEAR_BUFFERS = {"counts": "calib_hist", "edges": "calib_bin_edges"}
_EXACT_BUFFERS = {
    "counts": "hist_counts",
    "exponent": "hist_exponent",
    "offset": "hist_offset",
}
_RANGE_BUFFERS = {"min_vals": "min_val", "max_vals": "max_val"}
_F32_MAX = torch.finfo(torch.float32).max
Range = tuple[torch.Tensor, torch.Tensor]


class PerTensorHistogramObserver(UniformScalingObserver):
    """Histogram of the input; qparams of its range (Quark: always `(1, 0)`).

    Args:
        qspec: a symmetric spec (`ValueError` in `forward` otherwise, as
            Quark's documentation says); per_tensor (Quark), per_channel or
            per_group.
        device: device of the buffers.

    Attributes:
        calib_hist: per tensor: `(bins,)` int64 counts.
        calib_bin_edges: per tensor: `(bins + 1,)` float32 edges.
    """

    qschemes = _ALL_QSCHEMES
    _symmetric_only: ClassVar[bool] = True
    _skip_zeros: ClassVar[bool] = False
    _default_bins: ClassVar[int] = 2048
    #: The grown histogram holds at most this many times `_default_bins`.
    _max_bins_factor: ClassVar[int] = 4
    calib_hist: torch.Tensor
    calib_bin_edges: torch.Tensor

    def __init__(
        self,
        qspec: Any,
        device: torch.device | None = None,
        *,
        nan_policy: NanPolicy = "raise",
    ) -> None:
        super().__init__(qspec, device, nan_policy=nan_policy)
        self._num_bins = self._default_bins
        self.device = device
        self._register_empty(device)

    @property
    def _per_tensor(self) -> bool:
        return self.qscheme in (None, QSchemeType.per_tensor)

    @property
    def _absolute(self) -> bool:
        return self.symmetric is not False

    def _register_empty(self, device: torch.device | str | None) -> None:
        """Quark's buffers before any data: the range (inf, -inf), no bins."""
        self.register_buffer("min_val", torch.tensor(math.inf, device=device))
        self.register_buffer("max_val", torch.tensor(-math.inf, device=device))
        names = _LINEAR_BUFFERS if self._per_tensor else _EXACT_BUFFERS
        for name in names.values():
            dtype = torch.int64 if name in ("calib_hist", "hist_counts") else None
            empty = torch.tensor([], dtype=dtype, device=device)
            self.register_buffer(name, empty)

    # -- the statistic ---------------------------------------------------------

    def statistic_type(self) -> type[Statistic]:
        return BoundedQuarkHistogram if self._per_tensor else Histogram

    @property
    def buffer_names(self) -> Mapping[str, str]:  # type: ignore[override]
        names = _LINEAR_BUFFERS if self._per_tensor else _EXACT_BUFFERS
        return {**names, **_RANGE_BUFFERS}

    def statistic_config(self) -> dict[str, Any]:
        if self._per_tensor:
            return {
                "bins": self._num_bins,
                "absolute": self._absolute,
                "skip_zeros": self._skip_zeros,
                "max_bins": self._max_bins_factor * self._default_bins,
            }
        return {
            "bins": self._num_bins,
            "absolute": self._absolute,
            "owner": type(self).__name__,
        }

    def _read_state(
        self, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        return None if state["counts"].numel() == 0 else state

    def reset(self) -> None:
        """Forget the range and the histograms."""
        self._register_empty(self.eps.device)
        self._num_bins = self._default_bins

    def _prepare_batch(self, batch: Batch) -> Batch:
        if self._per_tensor or not self._skip_zeros or batch.x_flat is None:
            return batch
        # Per channel / group, zeros are left out: NaN, which binning skips.
        values = torch.where(batch.x_flat == 0, math.nan, batch.x_flat)
        low, high = minmax_omit_nonfinite(values, exact_dtype=True)
        return replace(
            batch, x_flat=values, min_vals=low, max_vals=high, has_skipped=True
        )

    # -- recording -----------------------------------------------------------

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Add `x_orig` to the histogram; return it unchanged.

        Raises:
            ValueError: an asymmetric spec (plain histogram observer only),
                NaN / inf values, or a qparam shape that changed.
        """
        if self._symmetric_only and self.symmetric is False:
            raise ValueError(
                "PerTensorHistogramObserver is symmetric only (symmetric=False "
                "given); use PerTensorPercentileObserver or PerTensorMSEObserver "
                "for asymmetric ranges"
            )
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        self.device = x.device
        self._observe_view(self._flatten(x), x)
        if self._per_tensor and self.calib_hist.numel():  # 0: batch skipped
            self._num_bins = self.calib_hist.numel()
        return x_orig

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        """`x` in the canonical `(N, *Q, G)` layout of the qscheme."""
        spec = self.qspec
        if self._per_tensor:
            return x.reshape(1, -1)  # 0-d qparams, as Quark's
        if self.qscheme == QSchemeType.per_channel:
            return per_channel_view(x, int(spec.ch_axis or 0))  # (N, C, G)
        group = -1 if spec.group_size is None else int(spec.group_size)
        return group_view(x, int(spec.ch_axis or 0), group)  # (1, R, G#, g)

    def _histogram(self) -> Statistic:
        stat = self.statistic()
        if stat is None:
            raise ValueError(
                f"{type(self).__name__}: no data observed yet; run calibration "
                "batches through the observer before asking for qparams"
            )
        return stat

    # -- qparams -------------------------------------------------------------

    def _search_range(self) -> Range:
        """The range the qparams come from: here the observed one."""
        stat = self._histogram()
        return stat.min_vals, stat.max_vals  # type: ignore[attr-defined]

    def _calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Search the histogram once, then Quark's qparams of that range.

        Returns:
            `(scale, zero_point)`: 0-d per tensor, `(C,)` per channel,
            `(rows, groups)` per group.
        """
        low, high = self._search_range()
        return self.calculate_qparams(low, high)

    def reset_min_max_vals(self) -> None:
        """Forget the range and the histograms."""
        self.reset()

    def get_extra_state(self) -> dict[str, Any]:
        """Base state plus the bin count."""
        return {**super().get_extra_state(), "num_bins": self._num_bins}

    def set_extra_state(self, state: Any) -> None:
        """Inverse of `get_extra_state`."""
        super().set_extra_state(state)
        if isinstance(state, dict) and "num_bins" in state:
            self._num_bins = int(state["num_bins"])

    def _exact(self) -> tuple[Histogram, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-qparam histogram, flattened: `(hist, counts (Q, B), left
        edge (Q,), width (Q,))`."""
        hist = self._histogram()
        assert isinstance(hist, Histogram)
        lo, width = hist.edges()
        return (
            hist,
            hist.counts.reshape(-1, hist.bins),
            lo.reshape(-1),
            width.reshape(-1),
        )


class PerTensorPercentileObserver(PerTensorHistogramObserver):
    """Range at a percentile of the histogram (zeros left out).

    Attributes:
        percentile: 99.99999999 (Quark's); change it before the qparams.
    """

    _symmetric_only = False
    _skip_zeros = True
    _default_bins = 4200

    def _init_attributes(self) -> None:
        super()._init_attributes()
        self.percentile = 99.99999999

    def get_min_max_by_percentile(
        self, histogram: torch.Tensor, bin_edges: torch.Tensor, percentile: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Range of a `(bins,)` histogram over `(bins + 1,)` edges at `percentile`.

        Returns:
            `(min, max)` 0-d tensors (see `quantobs.solvers.quark_histogram`);
            an empty histogram gives `(zeros(1), zeros(1))` with a warning, as
            Quark.

        Raises:
            ValueError: `percentile` outside 0..100, or edges and counts that
                do not match.
        """
        if not 0 <= percentile <= 100:
            raise ValueError(
                f"percentile={percentile} must be between 0 and 100 (e.g. 99.99)"
            )
        if bin_edges.numel() != histogram.numel() + 1:
            raise ValueError(
                f"bin_edges needs one more element than histogram, got "
                f"{bin_edges.numel()} edges for {histogram.numel()} bins"
            )
        found = percentile_bounds(histogram, bin_edges, percentile, self._absolute)
        if found is None:
            warnings.warn(
                f"{type(self).__name__}: the histogram is empty (all observed "
                "values were zero); returning the range (0, 0)",
                UserWarning,
                stacklevel=2,
            )
            zero = torch.zeros(1, device=bin_edges.device)
            return zero, zero
        return found

    def _search_range(self) -> Range:
        if self._per_tensor:
            self._histogram()
            return self.get_min_max_by_percentile(
                self.calib_hist, self.calib_bin_edges, self.percentile
            )
        hist, counts, lo, width = self._exact()
        if self._absolute:
            amax = torch.maximum(-hist.min_vals, hist.max_vals).reshape(-1)
            upper = percentile_upper(counts, lo, width, self.percentile, amax)
            upper = upper.to(torch.float32).reshape(hist.qparam_shape)
            return torch.zeros_like(upper), upper
        low, high = percentile_range(
            counts,
            lo,
            width,
            self.percentile,
            hist.min_vals.reshape(-1),
            hist.max_vals.reshape(-1),
        )
        return low.reshape(hist.qparam_shape), high.reshape(hist.qparam_shape)


class PerTensorMSEObserver(PerTensorHistogramObserver):
    """Range whose qparams give the least squared error over the histogram.

    Integer dtypes and fp8 (Quark: int4, uint4, int8, uint8, fp8 only).
    """

    _symmetric_only = False

    #: Quark's defaults of `get_min_max_by_mse`, also used per channel / group.
    start_bin: ClassVar[int] = 2045
    stride: ClassVar[int] = 1

    @classmethod
    def check_spec(cls, spec: QTensorConfig) -> None:
        """Integer and fp8 dtypes only (the search fake-quantizes)."""
        super().check_spec(spec)
        try:
            is_float = element_format(spec.dtype).is_float
        except ValueError:
            is_float = True
        if is_float and spec.dtype not in _FP8:
            raise ValueError(
                f"PerTensorMSEObserver searches integer and fp8 dtypes, got "
                f"{spec.dtype.value!r}; use a min-max observer"
            )

    def get_min_max_by_mse(
        self,
        calib_hist: torch.Tensor,
        calib_bin_edges: torch.Tensor,
        stride: int = 1,
        start_bin: int = 2045,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Range of least squared error among the bin centers from `start_bin` on.

        Returns:
            `(min, max)` 0-d float32 tensors: min is 0 (symmetric) or the
            histogram's left edge; max is the chosen bin center.

        Raises:
            ValueError: fewer than 2 edges, or edges and counts that differ.
        """
        edges = calib_bin_edges.to(torch.float32)
        if edges.numel() < 2 or edges.numel() != calib_hist.numel() + 1:
            raise ValueError(
                f"need bin edges (at least 2) for every bin: got {edges.numel()} "
                f"edges for {calib_hist.numel()} bins"
            )
        centers = safe_centers(edges)  # Quark's (e[1:] + e[:-1]) / 2, no overflow
        index = mse_candidates(centers.numel(), start_bin, stride).to(edges.device)
        low = edges[:1] * 0 if self._absolute else edges[:1]
        counted = calib_hist != 0  # empty bins add nothing: not scored
        errors = self._errors(
            centers[counted][None], calib_hist[counted][None], low, centers[index][None]
        )
        best = centers[index[int(errors[0].argmin())]]
        return low[0], best

    def _search_range(self) -> Range:
        if self._per_tensor:
            self._histogram()
            return self.get_min_max_by_mse(self.calib_hist, self.calib_bin_edges)
        hist, counts, lo, width = self._exact()
        bins = counts.shape[1]
        index = torch.arange(bins, dtype=torch.float64, device=lo.device) + 0.5
        centers = lo[:, None] + index * width[:, None]  # (Q, bins) float64
        # Empty bins past float32's max (a grid ending above it) count 0.
        centers = centers.clamp(-_F32_MAX, _F32_MAX).float()
        if self._absolute:
            low = torch.zeros_like(hist.min_vals.reshape(-1))
            high = torch.maximum(-hist.min_vals, hist.max_vals).reshape(-1)
        else:
            low, high = hist.min_vals.reshape(-1), hist.max_vals.reshape(-1)
        # Quark's candidates relative to the range: centers of `bins` equal
        # bins over [low, high], from start_bin on.
        picks = mse_candidates(bins, self.start_bin, self.stride).to(lo.device)
        fraction = (picks.to(torch.float64) + 0.5) / bins
        spread = high.double() - low.double()  # float32's overflows
        candidates = (low[:, None].double() + spread[:, None] * fraction).float()
        errors = self._errors(centers, counts, low, candidates)
        best = candidates.gather(1, errors.argmin(dim=1, keepdim=True))
        shape = hist.qparam_shape
        return low.reshape(shape), best.reshape(shape)

    def _errors(
        self,
        centers: torch.Tensor,
        counts: torch.Tensor,
        low: torch.Tensor,
        candidates: torch.Tensor,
    ) -> torch.Tensor:
        """`(Q, C)` count-weighted squared errors of the candidate ranges
        `[low, candidate]` over the bin centers `(Q, B)` (Quark's objective,
        fake-quantized by the one scorer).

        A qparam whose values pass `2**60` is scored scaled by a power of two
        (its errors then scale by its square, exactly, so their order is
        Quark's): its squared errors, and an asymmetric `max - min`, would
        overflow float32."""
        top = torch.stack(
            [centers.abs().amax(1), low.abs(), candidates.abs().amax(1)]
        ).amax(0)  # (Q,)
        exponent = torch.frexp(top)[1].to(top.dtype)
        shift = torch.where(top > 2.0**60, torch.exp2(-exponent), 1.0)  # (Q,)
        centers, candidates = centers * shift[:, None], candidates * shift[:, None]
        low = low * shift
        fmt = element_format(self.dtype)
        high = candidates.T  # (C, Q)
        if self.dtype in _FP8:
            scale, zero_point = high / fmt.max, None
        else:
            scale, zero_point = int_qparams(
                low[None].expand_as(high),
                high,
                self.quant_min,
                self.quant_max,
                self._absolute,
                self.eps,
            )
            zero_point = None if self._absolute else zero_point.float()
        found = score(centers[None], scale, zero_point, fmt, 2.0, weights=counts)
        return found.T  # (Q, C)
