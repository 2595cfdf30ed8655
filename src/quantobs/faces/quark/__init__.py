"""The AMD Quark face: `quark.torch.quantization.observer`'s observers, drop-in.

Change the import, keep the code::

    from quantobs.faces.quark import (
        Dtype,
        PerBlockMXObserver,
        QSchemeType,
        QTensorConfig,
        RoundType,
        ScaleType,
    )

    spec = QTensorConfig(
        dtype=Dtype.fp4,
        qscheme=QSchemeType.per_group,
        ch_axis=-1,
        group_size=32,
        observer_cls=PerBlockMXObserver,
        scale_format="e8m0",
        scale_calculation_mode="even",
        is_dynamic=False,
    )
    observer = PerBlockMXObserver(spec)
    observer(weight)
    scale, zero_point = observer._calculate_qparams()

Same class names and constructor signatures as Quark 0.13, configured by a
Quark-style spec (`QTensorConfig`, alias `QuantizationSpec`, with Quark's
enums `Dtype`, `QSchemeType`, `ScaleType`, `RoundType`, `ZeroPointType`;
plain strings and Quark's own specs and enums are accepted too). `forward(x)`
records statistics and returns `x`; `_calculate_qparams()` returns
`(scale, zero_point)` with Quark's values, dtypes and shapes.

Faster: every per-channel / per-group / per-block reduction is one `amin` /
`amax` over a view (no permute, pad or abs copy, no Python loop over blocks);
histograms count in chunks; searches run once, when qparams are asked for.

Beyond Quark: statistics survive `state_dict` (Quark's buffers are not
persistent); the histogram, percentile and MSE observers also work per
channel and per group (`quantobs.stats.histogram`); `scale_type="pof2"` rounds
scales to powers of two (Quark's observers ignore it); fp6 per-tensor /
per-channel specs and int2 / int3 / int16 / int32 MSE searches work.

Deliberate differences from Quark 0.13 (each instead of a bug, or stricter):

* NaN / inf inputs raise `ValueError` (Quark: NaN / inf scales), except in
  `PerBlockBFPObserver`, which maps them to 0 as Quark does; the keyword
  `nan_policy` (`"raise"`, `"omit"`, `"propagate"`, as every face's) chooses
  otherwise.
* Exponents of MX `floor` / `ceil` scales and of BFP16 scales are exact;
  Quark floors a `log2` computed in the input's dtype, which rounds up for
  an amax just below a power of two: in bfloat16 a mantissa of 1.9921875
  (or 1.984375 from exponent 4; about 1 block in 128), in float16 about 1
  block in 500, in float32 practically never (the tests compare float32).
  MX `floor` / `ceil` scales are clamped to the e8m0 range `2**-127 ..
  2**127` (Quark: subnormal or infinite scales for extreme amax); two-level
  `e4m3` scales of all-zero blocks are `eps` (Quark: 0). MX `even` scales
  are Quark's bit for bit, including the mantissa-width-dependent rounding
  of the amax (`quantobs.core.qparams.pow2_exponent`'s `even` is
  compressed-tensors' fixed 1.75 threshold, equal for fp4 only).
* `PerTensorHistogramObserver` returns the qparams of the observed range
  (Quark: always `(1.0, 0)`, it never sets its range); the asymmetric
  percentile cuts both tails (Quark: both ends at the bottom of the data,
  the data minimum at its default percentile); a histogram growing left
  keeps its old counts at their bins (Quark: at offset 0); growing right it
  bins with its edges' count (Quark's float32 count can be one off its
  edges); the asymmetric MSE search keeps the data minimum (Quark: 0).
  Histogram counts and percentile CDFs are exact int64 (Quark: float32,
  which past 2**24 values cuts the top values). `min_val` / `max_val` of
  histogram observers stay the observed range.
* Extreme finite inputs give finite positive scales and in-range zero
  points (Quark: inf / NaN / zero scales, errors or an endless loop):
  per-tensor histograms stay within 4 times their first bin count however
  far the range grows, merging whole bins (Quark grows by bins of the first
  batch's width without limit), and compute in float64 where float32
  overflows; asymmetric int ranges wider than their dtype holds (`[-3e38,
  3e38]`, float16 `[-4e4, 4e4]`) are computed in float64; power-of-two
  scales of subnormal or over-wide ranges are clamped to `2**-126 ..
  2**127`; a BFP16 block past `127.5 * 2**121` keeps the scale `2**121`
  (its values saturate; Quark doubles the amax to inf: an infinite
  scale); `PerTensorHistogramObserverPro` raises `ValueError` for a range
  wider than float32's max (torch's histogram cannot bin it), and so do
  the per-tensor histogram and power-of-two observers for float64 values
  past float32's max (their edges and arithmetic are float32, as Quark's).
* Static observers raise `ValueError` when the channel count or block layout
  changes between batches (Quark silently restarts from the new batch).
* The power-of-two observers compute in float32 whatever the input dtype
  (Quark's bfloat16 arithmetic gives symmetric int8 the zero point -1;
  float16 per-channel inputs raise); an all-zero channel gets scale 1.
* Specs reject what Quark accepts but cannot compute: asymmetric float
  formats, fp4 / fp6 without `scale_format`, `per_block`, `e5m3` scales,
  `PlaceholderObserver` for dtypes other than float16 / bfloat16, BFP16
  blocks other than 8.
* qparams before any observation: min-max observers return Quark's
  defaults with a `UserWarning` (Quark logs); histogram observers raise
  `ValueError` (Quark: `AttributeError` / `ValueError`).
"""

from __future__ import annotations

from quantobs.faces.quark.base import ObserverBase, UniformScalingObserver
from quantobs.faces.quark.histogram import (
    PerTensorHistogramObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
)
from quantobs.faces.quark.histogram_pro import PerTensorHistogramObserverPro
from quantobs.faces.quark.minmax import (
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
    PlaceholderObserver,
)
from quantobs.faces.quark.mx import PerBlockBFPObserver, PerBlockMXObserver
from quantobs.faces.quark.pow2 import (
    PerChannelPowOf2MinMaxObserver,
    PerChannelPowOf2MinMSEObserver,
    PerTensorPowOf2MinMaxObserver,
    PerTensorPowOf2MinMSEObserver,
)
from quantobs.faces.quark.spec import (
    Dtype,
    QSchemeType,
    QTensorConfig,
    QuantizationSpec,
    RoundType,
    ScaleType,
    ZeroPointType,
)

__all__ = [
    "Dtype",
    "ObserverBase",
    "PerBlockBFPObserver",
    "PerBlockMXObserver",
    "PerChannelMinMaxObserver",
    "PerChannelPowOf2MinMSEObserver",
    "PerChannelPowOf2MinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerTensorHistogramObserver",
    "PerTensorHistogramObserverPro",
    "PerTensorMSEObserver",
    "PerTensorMinMaxObserver",
    "PerTensorPercentileObserver",
    "PerTensorPowOf2MinMSEObserver",
    "PerTensorPowOf2MinMaxObserver",
    "PlaceholderObserver",
    "QSchemeType",
    "QTensorConfig",
    "QuantizationSpec",
    "RoundType",
    "ScaleType",
    "UniformScalingObserver",
    "ZeroPointType",
]
