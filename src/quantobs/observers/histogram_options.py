"""Options of the histogram observers, and the automatic bin count.

Every option is validated by name (pydantic, `extra="forbid"`). The
`"auto"` settings keep per-tensor observers exactly as they were and size
per-channel / per-group ones to their data::

    setting                 one qparam (per tensor)   several qparams
    bins="auto"             2048 (torch.ao, ModelOpt) auto_bins(values per
                                                      qparam per observation)
    entropy start_bin=None  128 (TensorRT, ModelOpt)  bins // 16 (the same
                                                      fraction of the range)
    entropy search="auto"   "exhaustive"              "coarse_to_fine"
    histogram search="auto" "certified"               "batched"
    histogram_mse
      objective="auto"      "bin_centers"             "uniform_bins" (int
                                                      formats, norm 2), else
                                                      "bin_centers"
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from quantobs.observers.base import ObserverOptions
from quantobs.stats.histogram import DEFAULT_BINS, DEFAULT_MAX_COUNTS, MIN_BINS

__all__ = [
    "AUTO_BINS_MAX",
    "AUTO_BINS_MIN",
    "EntropyOptions",
    "HistogramL2Options",
    "HistogramMSEOptions",
    "HistogramOptions",
    "PercentileOptions",
    "auto_bins",
    "resolve_bins",
]

AUTO_BINS_MIN = 64
AUTO_BINS_MAX = 256


def auto_bins(values_per_qparam: int) -> int:
    """Bins of a per-channel / per-group histogram of `values_per_qparam`
    values per observation (the canonical layout's last dim, `G`).

    Half the next power of two of `G`, within `[64, 256]`: one or two values
    per bin in the bulk of a small group (64 bins for 128 values), a few
    hundred bins for a channel of thousands. A function of `G` only, so every
    batch and every process of the same tensor gets the same grid size, and
    statistics keep merging exactly.
    """
    if values_per_qparam < 1:
        raise ValueError(f"values_per_qparam must be >= 1, got {values_per_qparam}")
    power = 1 << (int(values_per_qparam) - 1).bit_length()
    return min(AUTO_BINS_MAX, max(AUTO_BINS_MIN, power // 2))


def resolve_bins(
    bins: int | Literal["auto"], num_qparams: int, values_per_qparam: int | None
) -> int | None:
    """The bins of a new histogram (None: `"auto"` with the values per
    qparam not known yet, several qparams)."""
    if bins != "auto":
        return int(bins)
    if num_qparams == 1:
        return DEFAULT_BINS
    return None if values_per_qparam is None else auto_bins(values_per_qparam)


class HistogramOptions(ObserverOptions):
    """Options of every histogram observer.

    Attributes:
        bins: bins per qparam: an int (at least 8), or `"auto"` (default):
            2048 per tensor (torch.ao and ModelOpt), `auto_bins` of the
            values per qparam otherwise.
        max_counts: largest `bins * num_qparams` kept (memory budget, 8 bytes
            a count); beyond it the first observation raises `ValueError`.
    """

    bins: int | Literal["auto"] = "auto"
    max_counts: int = Field(DEFAULT_MAX_COUNTS, ge=1)

    @field_validator("bins", mode="before")
    @classmethod
    def _check_bins(cls, value: object) -> object:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < MIN_BINS:
            raise ValueError(f"bins must be 'auto' or an int >= {MIN_BINS}")
        return value


class HistogramL2Options(HistogramOptions):
    """Options of `histogram`.

    Attributes:
        mode: `"global"` (default): the least L2 error over all candidate
            ranges; `"torch"`: torch.ao's greedy search, same steps.
        search: how `mode="global"` searches: `"certified"`
            (`quantobs.solvers.global_l2.l2_search`: descent and, asymmetric
            up to 64 qparams, a proof of the exhaustive minimum;
            milliseconds per qparam), `"batched"`
            (`quantobs.solvers.l2_batched.l2_search_batched`: every qparam at
            once), or `"auto"` (default): certified per tensor, batched for
            several qparams.
    """

    mode: Literal["global", "torch"] = "global"
    search: Literal["auto", "certified", "batched"] = "auto"


class PercentileOptions(HistogramOptions):
    """Options of `percentile`.

    Attributes:
        percentile: in (0, 100]; each kept tail holds this percent of values.
        symmetric_abs: histogram |x| (one-sided); default: `args.symmetric`.
    """

    percentile: float = Field(99.99, gt=0.0, le=100.0)
    symmetric_abs: bool | None = None


class EntropyOptions(HistogramOptions):
    """Options of `entropy` (TensorRT / ModelOpt defaults per tensor).

    Attributes:
        start_bin: the smallest clipping candidate, in bins; None (default):
            128 per tensor, `bins // 16` for several qparams.
        stride: candidate spacing, in bins.
        num_quantized_bins: levels of the quantized |x| (default: see
            `quantobs.observers.histogram`; 128 for int8).
        search: `"exhaustive"` (every candidate, TensorRT / ModelOpt),
            `"coarse_to_fine"` (`quantobs.solvers.entropy`), or `"auto"`
            (default): exhaustive per tensor, coarse-to-fine for several
            qparams.
    """

    start_bin: int | None = Field(None, ge=1)
    stride: int = Field(1, ge=1)
    num_quantized_bins: int | None = Field(None, ge=1)
    search: Literal["auto", "exhaustive", "coarse_to_fine"] = "auto"


class HistogramMSEOptions(HistogramOptions):
    """Options of `histogram_mse`.

    Attributes:
        norm: exponent of the absolute error (2: mean squared error).
        maxshrink: largest fraction the observed range shrinks by, (0, 1].
        grid: candidates per unit of shrink (`int(maxshrink * grid)` in all).
        symmetric_abs: histogram |x| (scores positive values only).
        objective: how the expected error is computed:
            `"bin_centers"` (each bin's values at its center, the format's
            real rounding: ModelOpt's histogram MSE, any norm and format),
            `"uniform_bins"` (values spread evenly within their bins, the
            squared error of the candidate's integer levels in closed form:
            integer formats, `norm=2`), or `"auto"` (default): bin centers
            per tensor, uniform bins for several qparams where it applies.
    """

    norm: float = Field(2.0, gt=0.0)
    maxshrink: float = Field(0.8, gt=0.0, le=1.0)
    grid: float = Field(100.0, gt=0.0)
    symmetric_abs: bool = False
    objective: Literal["auto", "bin_centers", "uniform_bins"] = "auto"
