"""Ranges to quantization parameters: the one place a range becomes a scale.

(One concept, a little over 500 lines: the overflow and subnormal guards
below are part of turning a range into a scale and have no other caller;
split out they would be a module of one caller.)

`calculate_qparams` and `generate_gparam` give compressed-tensors' numbers
(0.19) on every preset, with these deliberate differences, each to avoid a
non-finite or out-of-range result:

* Non-finite ranges raise `ValueError` (compressed-tensors returns NaN scales).
* An asymmetric all-zero range gets the zero point `qmin` (compressed-tensors
  computes `0 / 0` and casts the NaN to an integer).
* An asymmetric range wider than the float32 maximum gets a finite scale
  (compressed-tensors overflows `max - min` to `inf`).
* An MX amax near the float32 maximum gets the scale `2**(128 - emax)`
  (compressed-tensors rounds it to `inf` in float32 bits and returns an
  infinite scale); exponents are clamped to the e8m0 range, code 255 is NaN.
  Likewise in float16 arithmetic an amax that rounds past 65504 (57344 and
  up; FP6 e2m3: 63488) gets `2**(16 - emax)`, and in bfloat16 `2**(128 -
  emax)`, where compressed-tensors' scale is infinite.
* A (non-MX, non-power-of-two) scale below the smallest normal number of the
  dtype it is returned in (`finfo(dtype).tiny`: 2**-126 for float32) is
  raised to it. compressed-tensors keeps the subnormal scale, rounded to the
  nearest subnormal: relative errors up to 1/2 (e.g. `9.06e-45` becomes
  `8.41e-45`), so the levels drift off the range and in-range values miss by
  more than half a step (int4 asymmetric over `[-9.67e-44, 3.92e-44]`: 1.67
  steps). With the floor every in-range value dequantizes within half a step
  (all of them to 0, the nearest level). A `scale_dtype` rounds the scale
  afterwards with its own precision (FP8 group scales keep their subnormals,
  as compressed-tensors stores them).

Observed dtype. compressed-tensors computes in the dtype of the values
observed (llm-compressor keeps bfloat16 / float16 statistics in it): a
symmetric scale `amax / ((qmax - qmin) / 2)` is rounded to that dtype, and
so is NVFP4's global scale `448 * 6 / amax` (twice: torch divides a number
by a tensor as `reciprocal(amax) * 2688`), before `.to(float32)`; an
asymmetric scale and zero point are rounded at every step (`max - min`, the
quotient, `min / scale`, `qmin - min / scale`). With
`observed_dtype=torch.bfloat16` or `torch.float16` the rule does the same
(`observed_dtype=None`, float32 or float64: float32 arithmetic, unchanged),
so the scales and zero points of bfloat16 / float16 models equal
llm-compressor's once stored (float32 arithmetic stores a different
asymmetric scale in about 20% of int4 / int8 groups and channels, zero point
in 1-30%). Measured on random 1024x1024 weights: the rounding moves a
bfloat16 global scale by up to 3.9e-3 relative (e.g. 6255.709 -> 6272.0), a
float16 one by up to 4.5e-4, and with it the e4m3 group scales it multiplies
(one e4m3 step in about 3% of the groups); the squared error of the
fake-quantized weights changes by less than 0.05% either way. In float16 a
global scale above 65504 (an absmax below 448 * 6 / 65504, about 0.041)
overflows and becomes 1.0, as in llm-compressor (with a `RuntimeWarning`
here): the group scales are then the bare `amax / 6` in e4m3, whose
subnormals lose precision: 2x the squared error at an absmax of 0.025, 100x
at 0.01. An observer's `arithmetic="float32"` option keeps float32
arithmetic instead.

MX scales (and optional power-of-two scales of other args) use
`quantobs.core.qparams.pow2`: compressed-tensors rounds the amax to one
mantissa bit (`round`, `mantissa_bits=1`: a mantissa of 1.75 or more goes up)
for FP4 and FP8 elements, and (0.20) to the element's three for FP6 e2m3
(`mantissa_bits=3`: 1.9375 or more goes up, so a block whose amax rounds to
7.5 keeps the exponent that maps it to e2m3's largest value).

MX in the observed dtype. compressed-tensors rounds the amax's own bits in
that dtype: a float16 subnormal amax (below 2**-14) becomes 2**-14 from
`0.75 * 2**-14` up (e2m3: `0.9375 * 2**-14`) and 0 below it; `log2(0)` is
`-inf`, clamped to the uint8 code 0, whose `2**-127` (computed in float32)
is cast back to float16 like every scale: below 2**-24 it is 0 there, and a
zero scale becomes the eps of its uint8 scale dtype, 1.0. With
`observed_dtype=torch.float16` the rule does the same (`_mx_scales`), so an
all-zero or tiny float16 block gets compressed-tensors' 1.0 and no float16
MX scale is ever 0; bfloat16 holds every e8m0 scale, and there (as in
float32) the clamp to `2**-127` already gives compressed-tensors' numbers.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantobs import native
from quantobs.core.args import QuantizationArgs
from quantobs.core.checks import Checks
from quantobs.core.exact import divide, rounded_to
from quantobs.core.formats import NumberFormat, get_format
from quantobs.core.qparams.pow2 import (
    E8M0_BIAS,
    E8M0_MAX_EXP,
    Pow2Rounding,
    e8m0_scale,
    pow2_exponent,
)
from quantobs.native.dispatch import kernel

__all__ = [
    "CompressedTensorsRule",
    "all_finite",
    "amax_to_global_scale",
    "calculate_qparams",
    "calculate_range",
    "check_global_scale",
    "generate_gparam",
    "in_observed_dtype",
    "range_or_zero",
    "scale_to_storage",
    "storage_to_scale",
]

_SMALL = 1 << 12  # elements checked by one elementwise test
_E8M0_MAX_BIASED = E8M0_MAX_EXP + E8M0_BIAS  # 254; 255 is NaN in float8_e8m0fnu


def calculate_range(args: QuantizationArgs) -> tuple[float, float]:
    """`(qmin, qmax)` of the quantized values, e.g. `(-8.0, 7.0)` for int4."""
    fmt = args.format
    return fmt.min, fmt.max


@kernel
def _finite(x: torch.Tensor) -> bool:
    """Whether every element is finite: one value is read as a float; large
    tensors by `aminmax` (NaN and +-inf propagate into it, so only its two
    ends are tested, without an elementwise temporary)."""
    if x.numel() <= 1:
        return not x.numel() or math.isfinite(float(x))
    if x.numel() <= _SMALL:
        return bool(torch.isfinite(x).all())
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


_finite.register("cpu", native.all_finite)


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite (one small reduction
    per tensor; float32 ones in one native pass where the kernels are built;
    one-element ones in one host read together)."""
    if len(tensors) > 1 and all(t.numel() == 1 for t in tensors):
        joined = torch.cat([t.reshape(1).to(torch.float64) for t in tensors])
        return bool(torch.isfinite(joined).all())
    return all(
        math.isfinite(float(t)) if t.numel() == 1 else _finite(t) for t in tensors
    )


def range_or_zero(
    min_vals: torch.Tensor, max_vals: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ranges `(+inf, -inf)` (qparams that saw no finite value) -> `(0, 0)`.

    Elementwise, without reading anything on the host (other ranges keep
    their bits)."""
    empty = min_vals > max_vals
    zero = torch.zeros((), dtype=min_vals.dtype, device=min_vals.device)
    return torch.where(empty, zero, min_vals), torch.where(empty, zero, max_vals)


def _check_range(
    min_vals: torch.Tensor, max_vals: torch.Tensor, checks: Checks | None = None
) -> None:
    """Raise on non-finite ranges or `min > max`; with `checks`, the two
    data checks are added to it (raised on its one read) instead."""
    _check_range_types(min_vals, max_vals)
    own = checks is None
    checks = Checks() if checks is None else checks
    # x - x is 0 for finite x, NaN for NaN and +-inf: two ops a tensor
    bad = torch.count_nonzero(min_vals - min_vals) + torch.count_nonzero(
        max_vals - max_vals
    )
    checks.add(bad, _nonfinite_range_error)
    checks.add((min_vals > max_vals).any(), _reversed_range_error)
    if own:
        checks.raise_first()


def _nonfinite_range_error(bad: float) -> ValueError:
    return ValueError(
        f"{int(bad)} non-finite range value(s) (NaN or inf) in min_vals/"
        "max_vals; drop non-finite inputs before observing (e.g. an "
        "observer with nan_policy='omit')"
    )


def _reversed_range_error(_: float) -> ValueError:
    return ValueError("min_vals > max_vals somewhere; pass the range as (min, max)")


def _check_range_types(min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
    for name, vals in (("min_vals", min_vals), ("max_vals", max_vals)):
        if not isinstance(vals, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(vals).__name__}")
        if not vals.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {vals.dtype}")
    if min_vals.shape != max_vals.shape:
        raise ValueError(
            f"min_vals {tuple(min_vals.shape)} and max_vals "
            f"{tuple(max_vals.shape)} must have the same shape"
        )


#: MX element formats whose block maxima compressed-tensors rounds to their
#: own mantissa width (0.20); the others are rounded to FP4's one bit.
_MX_OWN_MANTISSA = frozenset({"float6_e2m3fn"})


def _mx_scales(
    amax: torch.Tensor,
    fmt: NumberFormat,
    rounding: Pow2Rounding,
    rounded: torch.dtype | None = None,
) -> torch.Tensor:
    """`(*Q,)` MX scales `2 ** (exponent(amax) - emax)` (e8m0 values) of a
    `(*Q,)` amax, in its dtype.

    With `rounded` (bfloat16 / float16 arithmetic) the amax is a value of
    that dtype (saturating), its own bits are rounded (`pow2_exponent`'s
    `bits_of`: a float16 subnormal becomes 2**-14 or 0), and a scale that
    the dtype cannot hold (below its smallest subnormal, 2**-24 in float16:
    it rounds to 0 there) is 1.0, compressed-tensors' replacement of a zero
    scale of its uint8 scale dtype. So a float16 all-zero block gets 1.0, as
    in compressed-tensors, and no scale is 0 once cast to the dtype.
    """
    bits = fmt.mantissa_bits if fmt.name in _MX_OWN_MANTISSA else 1
    if rounded is None:
        return e8m0_scale(pow2_exponent(amax, rounding, bits), fmt.emax)
    info = torch.finfo(rounded)
    amax = amax.clamp(max=info.max).to(rounded).to(amax.dtype)
    exponent = pow2_exponent(amax, rounding, bits, bits_of=rounded)
    scale = e8m0_scale(exponent, fmt.emax)
    # (*Q,) scales below the dtype's least subnormal round to 0 in it
    return scale.masked_fill_(scale < info.tiny * info.eps, _MX_ZERO_SCALE)


#: compressed-tensors' replacement of a zero MX scale (its eps of uint8)
_MX_ZERO_SCALE = 1.0


def _round_to_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the nearest value of `dtype` (saturating), keep `values.dtype`."""
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return values.clamp(info.min, info.max).to(dtype).to(values.dtype)
    iinfo = torch.iinfo(dtype)
    return torch.round(values.clamp(iinfo.min, iinfo.max)).to(values.dtype)


def _zero_scale_replacement(dtype: torch.dtype) -> float:
    # compressed-tensors' eps: a zero scale becomes the smallest step of the
    # dtype the scale is stored in.
    if dtype == torch.float8_e4m3fn:
        return 0.125
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).eps)
    return 1.0


def calculate_qparams(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None = None,
    *,
    pow2: Pow2Rounding | None = None,
    empty_as_zero: bool = False,
    observed_dtype: torch.dtype | None = None,
    checks: Checks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point from a range, per quantization parameter.

    The range is first extended to contain 0. Symmetric: `scale = amax /
    ((qmax - qmin) / 2)` (int8 divides by 127.5, FP8 by 448, FP4 by 6), zero
    point 0. Asymmetric: `scale = (max - min) / (qmax - qmin)`, `zero_point =
    round(qmin - min / scale)` clamped to `[qmin, qmax]`. MX args (float, group
    32, e8m0 `scale_dtype`) get `2 ** (exponent(amax) - emax)`. A global scale
    (NVFP4) multiplies the scale before it is rounded to `scale_dtype`.

    Args:
        min_vals: `(*qparam_shape,)` minima.
        max_vals: `(*qparam_shape,)` maxima.
        args: the quantization args.
        global_scale: optional `(1,)` global scale (tensor_group / NVFP4).
        pow2: power-of-two rounding of the exponent (`floor`, `ceil`, or
            `round` to one mantissa bit; see `quantobs.core.qparams.pow2`): MX
            scales use it (default `"round"`, compressed-tensors' rule); for
            other args it rounds the scale itself to a power of two (`None`:
            no rounding).
        empty_as_zero: treat a range with `min > max` (an observer's qparam
            that saw no value: `(+inf, -inf)`) as `(0, 0)` instead of raising.
        observed_dtype: dtype of the values the range came from; bfloat16 /
            float16 round symmetric (non-MX) scales to it before the global
            scale multiplies them, and asymmetric scales and zero points at
            each step, as compressed-tensors computes in it (the zero-scale
            replacement is then its eps); MX scales from the amax's bits in
            it, 1.0 where the dtype cannot hold the scale (module
            docstring); None: float32.
        checks: where the checks of the data go (`quantobs.core.checks`):
            the caller raises them. Without it they are read at the end,
            all at once (one host-device synchronisation).

    Returns:
        `(scale, zero_point)`, each `(*qparam_shape,)` (`(1,)` for a 0-d
        range). `scale` has the dtype of `min_vals` and values representable
        in `args.scale_dtype`; it is finite and positive. `zero_point` has
        dtype `args.zp_dtype` and lies in `[qmin, qmax]`.

    Raises:
        TypeError: non-tensor or non-float ranges.
        ValueError: shapes differ, non-finite values, `min > max`, or a
            global scale that is not one finite positive number.
    """
    _check_range_types(min_vals, max_vals)
    own = checks is None
    checks = Checks() if checks is None else checks
    if global_scale is not None:
        _check_global_scale(global_scale, checks)
    rounded = _rounded_dtype(observed_dtype)
    if args.symmetric and not args.is_mx and pow2 is None:
        floor = _may_be_subnormal(args.scale_dtype, min_vals.dtype)
        if rounded is not None:
            scale = _rounded_symmetric_scales(
                min_vals, max_vals, args, global_scale, empty_as_zero, rounded, checks
            )
            scale = _floor_positive(scale) if floor else scale
        else:  # floored in the same pass
            scale = _symmetric_scales(
                min_vals, max_vals, args.format, args.scale_dtype, global_scale,
                empty_as_zero, floor, checks,
            )  # fmt: skip
        if own:
            checks.raise_first()
        return _with_zero_point(scale, None, args)
    if empty_as_zero:
        min_vals, max_vals = range_or_zero(min_vals, max_vals)
    _check_range(min_vals, max_vals, checks)
    out_dtype = min_vals.dtype
    work = _work_dtype(out_dtype)
    fmt = args.format
    qmin, qmax = fmt.min, fmt.max

    zero_point: torch.Tensor | None
    if args.symmetric:  # MX, or power-of-two scales
        amax = _amax(min_vals, max_vals, work)
        if args.is_mx:
            scale = _mx_scales(amax, fmt, pow2 or "round", rounded)
        else:
            scale = divide(amax, (qmax - qmin) / 2)
        zero_point = None  # all zeros, made in zp_dtype below
    elif rounded is not None and pow2 is None:
        scale, zero_point = _rounded_asymmetric(min_vals, max_vals, qmin, qmax, rounded)
    else:
        min_vals = torch.clamp(min_vals.to(work), max=0.0)
        max_vals = torch.clamp(max_vals.to(work), min=0.0)
        scale = divide(max_vals - min_vals, qmax - qmin)
        wide = ~torch.isfinite(scale)  # max - min overflowed
        scale = torch.where(
            wide, divide(max_vals, qmax - qmin) - divide(min_vals, qmax - qmin), scale
        )
        if pow2 is None:  # powers of two are exact, subnormal or not
            scale = _floor_subnormal(scale, out_dtype)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        # min == 0 wherever scale == 0, so the zero point is qmin there.
        zero_point = torch.clamp(qmin - min_vals / safe, qmin, qmax)

    if pow2 is not None and not args.is_mx:
        scale = torch.where(scale > 0, torch.exp2(pow2_exponent(scale, pow2)), scale)
    scale_dtype = None if args.is_mx else args.scale_dtype
    global_work = None if global_scale is None else global_scale.to(work)
    scale = _finish_scale(scale, global_work, scale_dtype, out_dtype, checks, rounded)
    if own:
        checks.raise_first()
    return _with_zero_point(scale, zero_point, args)


def _rounded_asymmetric(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    qmin: float,
    qmax: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric `(scale, zero_point)` in compressed-tensors' arithmetic on
    values of `dtype` (bfloat16 / float16): `max - min`, its quotient by
    `qmax - qmin`, `min / scale` and `qmin - min / scale` each rounded to
    `dtype`. The guards of the float32 path stay: an overflowing `max - min`
    is divided term by term, a subnormal scale floored to float32's tiny, an
    all-zero range gets the zero point `qmin`.

    Returns:
        `(scale, zero_point)`: `(*Q,)` float32 scales (values of `dtype`)
        and `(*Q,)` zero points in `dtype`, in `[qmin, qmax]`, unrounded.
    """
    work, info = _work_dtype(min_vals.dtype), torch.finfo(dtype)
    # (*Q,) range ends of values of `dtype` (a searched range past it saturates)
    low = min_vals.to(work).clamp(info.min, 0.0).to(dtype)
    high = max_vals.to(work).clamp(0.0, info.max).to(dtype)
    span = rounded_to(qmax - qmin, dtype)  # as torch.tensor(.., dtype) holds it
    scale = divide(high - low, span)
    wide = ~torch.isfinite(scale)  # max - min overflowed
    scale = torch.where(wide, divide(high, span) - divide(low, span), scale)
    scale = _floor_subnormal(scale.to(work), work).to(dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    # low == 0 wherever scale == 0, so the zero point is qmin there.
    zero_point = torch.clamp(qmin - low / safe, qmin, qmax)
    return scale.to(work), zero_point


def _may_be_subnormal(scale_dtype: torch.dtype | None, dtype: torch.dtype) -> bool:
    """Whether a scale rounded to `scale_dtype` (None: not rounded) can be a
    positive number below `dtype`'s smallest normal: not when `scale_dtype`'s
    smallest subnormal (`tiny * eps`, e.g. 2**-9 for FP8 e4m3) is above it."""
    if scale_dtype is None or not scale_dtype.is_floating_point:
        return True
    info = torch.finfo(scale_dtype)
    return info.tiny * info.eps < torch.finfo(dtype).tiny


def _floor_subnormal(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive scales below `dtype`'s smallest normal number raised to it
    (module docstring); zeros (replaced later) and normal scales unchanged."""
    tiny = torch.finfo(dtype).tiny
    small = (scale > 0) & (scale < tiny)
    return torch.where(small, tiny, scale)


def _floor_positive(scale: torch.Tensor) -> torch.Tensor:
    """`_floor_subnormal` of finished scales (all positive): a clamp."""
    return scale.clamp(min=torch.finfo(scale.dtype).tiny)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


#: observed dtypes whose rounding compressed-tensors' arithmetic keeps
_ROUNDED_DTYPES = (torch.bfloat16, torch.float16)


def _rounded_dtype(observed_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype compressed-tensors' arithmetic rounds to for values observed
    in `observed_dtype`: bfloat16 / float16; None (float32 arithmetic) for
    None and wider dtypes."""
    return observed_dtype if observed_dtype in _ROUNDED_DTYPES else None


def _amax(
    min_vals: torch.Tensor, max_vals: torch.Tensor, work: torch.dtype
) -> torch.Tensor:
    """max(|min|, |max|) of the range extended to contain 0: max(-min, max, 0),
    the same number in three passes instead of five (a fresh tensor)."""
    return torch.maximum(-min_vals.to(work), max_vals.to(work)).clamp_(min=0.0)


def _finish_scale(
    scale: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    scale_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    checks: Checks,
    rounded: torch.dtype | None = None,
) -> torch.Tensor:
    """Times the global scale, rounded to `scale_dtype`, in `out_dtype`, zeros
    replaced by the smallest step (compressed-tensors' eps) of `scale_dtype`,
    else of the dtype the arithmetic `rounded` to, else of `out_dtype`."""
    if global_scale is not None:
        scale = global_scale * scale
        # scale >= 0: its amax is finite where every scale is
        checks.add(~torch.isfinite(scale.amax()), _global_overflow_error)
    if scale_dtype is not None:
        scale = _round_to_dtype(scale, scale_dtype)
    scale = scale.to(out_dtype)
    eps = _zero_scale_replacement(scale_dtype or rounded or out_dtype)
    return scale.masked_fill_(scale <= 0, eps)  # scale is a fresh tensor here


def _global_overflow_error(_: float) -> ValueError:
    return ValueError(
        "global_scale * scale overflowed; the global scale is too large "
        "for this range (compute it with generate_gparam)"
    )


@kernel
def _symmetric_scales(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    fmt: NumberFormat,
    scale_dtype: torch.dtype | None,
    global_scale: torch.Tensor | None,
    empty_as_zero: bool,
    floor: bool,
    checks: Checks,
) -> torch.Tensor:
    """Symmetric (non-MX) scales: `max(-min, max, 0) / ((qmax - qmin) / 2)`,
    times the global scale (its float32 value), rounded to `scale_dtype`,
    zeros -> eps, subnormals raised to the smallest normal where `floor`."""
    if empty_as_zero:
        min_vals, max_vals = range_or_zero(min_vals, max_vals)
    _check_range(min_vals, max_vals, checks)
    work = _work_dtype(min_vals.dtype)
    scale = divide(_amax(min_vals, max_vals, work), (fmt.max - fmt.min) / 2)
    gscale = None
    if global_scale is not None:
        gscale = global_scale.float().to(work).reshape(())
    scale = _finish_scale(scale, gscale, scale_dtype, min_vals.dtype, checks)
    return _floor_positive(scale) if floor else scale


def _rounded_symmetric_scales(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None,
    empty_as_zero: bool,
    dtype: torch.dtype,
    checks: Checks,
) -> torch.Tensor:
    """Symmetric (non-MX) scales in compressed-tensors' arithmetic on values
    of `dtype` (bfloat16 / float16): `amax / ((qmax - qmin) / 2)` computed in
    `dtype` (one rounding), then in float32 times the global scale, rounded
    to `scale_dtype`, zeros -> the eps of `scale_dtype`, else of `dtype`."""
    if empty_as_zero:
        min_vals, max_vals = range_or_zero(min_vals, max_vals)
    _check_range(min_vals, max_vals, checks)
    fmt, work = args.format, _work_dtype(min_vals.dtype)
    # (*Q,) amax of values of `dtype`: exact in it (a searched range past its
    # max saturates)
    amax = _amax(min_vals, max_vals, work).clamp_(max=torch.finfo(dtype).max)
    amax = amax.to(dtype)
    half_range = rounded_to((fmt.max - fmt.min) / 2, dtype)
    scale = divide(amax, half_range).to(work)
    gscale = None
    if global_scale is not None:
        gscale = global_scale.float().to(work).reshape(())
    return _finish_scale(scale, gscale, args.scale_dtype, min_vals.dtype, checks, dtype)


def _symmetric_scales_native(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    fmt: NumberFormat,
    scale_dtype: torch.dtype | None,
    global_scale: torch.Tensor | None,
    empty_as_zero: bool,
    floor: bool,
    checks: Checks,
) -> torch.Tensor | None:
    """The float32 arithmetic in one pass (NVFP4's 1M group scales), the
    floor included; declines (None) for other dtypes, and where the torch
    path must raise (CPU only: reading the global scale costs no device
    synchronisation there)."""
    scale_dtype = scale_dtype or torch.float32
    if min_vals.dtype != torch.float32 or scale_dtype not in (
        torch.float32,
        torch.float8_e4m3fn,
    ):
        return None
    return native.symmetric_scales(
        min_vals,
        max_vals,
        (fmt.max - fmt.min) / 2,
        None if global_scale is None else float(global_scale.float()),
        scale_dtype == torch.float8_e4m3fn,
        _zero_scale_replacement(scale_dtype),
        empty_as_zero,
        floor=torch.finfo(torch.float32).tiny if floor else 0.0,
    )


_symmetric_scales.register("cpu", _symmetric_scales_native)


def _with_zero_point(
    scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scale, zero_point)` as returned: the zero point rounded to
    `zp_dtype` (zeros where None), 0-d results as shape `(1,)`."""
    zp_dtype = args.zp_dtype or torch.int8
    if zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=zp_dtype, device=scale.device)
    else:
        zero_point = _round_to_dtype(zero_point, zp_dtype).to(zp_dtype)
    if scale.ndim == 0:
        scale, zero_point = scale.reshape(1), zero_point.reshape(1)
    return scale, zero_point


def in_observed_dtype(
    scale: torch.Tensor,
    observed_dtype: torch.dtype | None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A scale of `calculate_qparams(..., observed_dtype=...)` in the dtype
    compressed-tensors returns it in: the observed bfloat16 / float16,
    promoted with the global scale's dtype where one multiplied it (NVFP4's
    float32 global scale gives float32 scales); unchanged for other observed
    dtypes (None: float32 arithmetic).

    The cast is exact: the rule rounded the scale in that dtype already (a
    `scale_dtype` such as FP8 e4m3, and MX's powers of two, are values of
    it too, as compressed-tensors casts them back).
    """
    if observed_dtype not in _ROUNDED_DTYPES:
        return scale
    dtype = observed_dtype
    if global_scale is not None:
        dtype = torch.promote_types(dtype, global_scale.dtype)
    return scale.to(dtype)


@dataclass(frozen=True)
class CompressedTensorsRule:
    """compressed-tensors' rule (0.19): `calculate_qparams` under `args`.

    Attributes:
        args: the quantization args.
        pow2: power-of-two rounding (see `calculate_qparams`).
        empty_as_zero: ranges with `min > max` count as `(0, 0)`.
        observed_dtype: dtype of the observed values (bfloat16 / float16:
            compressed-tensors' rounding in it; None: float32 arithmetic).
    """

    name: ClassVar[str] = "compressed_tensors"
    args: QuantizationArgs
    pow2: Pow2Rounding | None = None
    empty_as_zero: bool = False
    observed_dtype: torch.dtype | None = None

    def __call__(
        self,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        global_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(scale, zero_point)` of the ranges (see `calculate_qparams`)."""
        return calculate_qparams(
            min_vals,
            max_vals,
            self.args,
            global_scale,
            pow2=self.pow2,
            empty_as_zero=self.empty_as_zero,
            observed_dtype=self.observed_dtype,
        )


def check_global_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """Validate a global scale: one finite, positive number."""
    checks = Checks()
    _check_global_scale(global_scale, checks)
    checks.raise_first()
    return global_scale


def _on_host(x: torch.Tensor) -> bool:
    """Whether `x` is read on the host at once: a CPU tensor with the native
    (CPU) kernels on, where a read waits for nothing. The torch path (the one
    a CUDA tensor takes; `QUANTOBS_NATIVE=0`) reads nothing (issue 24)."""
    return x.device.type == "cpu" and native.available()


def _check_global_scale(global_scale: torch.Tensor, checks: Checks) -> None:
    """`check_global_scale`: its type and shape at once, its value added to
    `checks`."""
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(
            f"global_scale must be a torch.Tensor, got {type(global_scale).__name__}"
        )
    if global_scale.numel() != 1:
        raise ValueError(
            f"global_scale must hold one value (shape (1,)), got shape "
            f"{tuple(global_scale.shape)}"
        )
    top = torch.finfo(torch.float32).max  # finite and positive; NaN fails
    if _on_host(global_scale):  # read at once: no synchronisation
        found = float(global_scale)
        if not 0 < found <= top:  # only a failed check is queued, in order
            value = torch.tensor(found, dtype=torch.float32)
            checks.add(torch.ones(()), _global_scale_error, value)
        return
    value = global_scale.detach().float().reshape(())
    checks.add(~((value > 0) & (value <= top)), _global_scale_error, value)


def _global_scale_error(_: float, value: float) -> ValueError:
    return ValueError(f"global_scale must be finite and positive, got {value}")


def amax_to_global_scale(
    amax: torch.Tensor,
    scale_format: str | NumberFormat = "float8_e4m3fn",
    quant_format: str | NumberFormat = "float4_e2m1fn",
    dtype: torch.dtype = torch.float32,
    *,
    observed_dtype: torch.dtype | None = None,
    checks: Checks | None = None,
) -> torch.Tensor:
    """NVFP4 global scale `scale_max * quant_max / amax` (448 * 6 / amax).

    Chosen so that the largest group scale, `global_scale * amax / 6`, is
    exactly the FP8 maximum 448. An all-zero tensor (`amax == 0`) gets 1.0, as
    does an `amax` so small that the quotient overflows.

    Args:
        amax: absolute maximum of the whole tensor, any shape with one element.
        scale_format: format of the local (group) scales.
        quant_format: format of the quantized values.
        dtype: dtype of the result.
        observed_dtype: dtype of the values `amax` came from; bfloat16 /
            float16 compute the quotient in it as compressed-tensors does
            (`reciprocal(amax) * 2688`, each rounded; float16 overflows to
            1.0 below an amax of about 0.041); None: float32.
        checks: where the finiteness check of `amax` goes (the caller
            raises it, `quantobs.core.checks`); without it, it is read here.

    Returns:
        `(1,)` global scale in `dtype`.
    """
    scale_fmt = (
        get_format(scale_format) if isinstance(scale_format, str) else scale_format
    )
    quant_fmt = (
        get_format(quant_format) if isinstance(quant_format, str) else quant_format
    )
    work = _rounded_dtype(observed_dtype) or torch.float32
    product = scale_fmt.max * quant_fmt.max
    if work == torch.float32:
        found = _global_scale_on_host(amax, product)
        if found is not None:
            return torch.tensor([found], dtype=torch.float32).to(dtype)
    own = checks is None
    checks = Checks() if checks is None else checks
    # non-finite values: amax - amax is NaN there, 0 elsewhere
    checks.add(torch.count_nonzero(amax - amax), _nonfinite_amax_error)
    if own:
        checks.raise_first()
    # a (1,)-like amax of values of `work` (exact in it; a searched range
    # past its max saturates)
    amax = amax.to(torch.float32).abs()
    info = torch.finfo(work)
    rounded = amax.clamp(info.tiny, info.max).to(work)
    global_scale = product / rounded
    finite = torch.isfinite(global_scale)
    if work == torch.float16 and not bool(finite.all()):
        _warn_float16_overflow(amax, product)
    global_scale = torch.where(finite, global_scale, torch.ones_like(global_scale))
    return global_scale.to(dtype).reshape(1)


#: the largest amax whose float32 reciprocal `_global_scale_on_host` takes
#: (a normal number: `rounded_to` rounds normal numbers only)
_HOST_AMAX_MAX = 2.0**100


def _global_scale_on_host(amax: torch.Tensor, product: float) -> float | None:
    """`amax_to_global_scale`'s float32 arithmetic for one finite CPU value,
    on the host (no torch op per step; no synchronisation on the CPU): the
    amax in float32, clamped to `[tiny, max]`, `1 / amax` rounded (what
    `product / tensor` computes first: a reciprocal), times `product`
    rounded, 1.0 where that overflows. A float64 quotient of float32 numbers
    rounded to float32 is the float32 quotient (53 >= 2 * 24 + 2 bits), and
    the product of a float32 number and `product` (a float32 constant with
    few bits) is exact in float64. None (the tensor path) off the host
    (`_on_host`), for a non-finite or huge amax, or a `product` that float32
    rounds."""
    if not _on_host(amax) or amax.numel() != 1:
        return None
    value = abs(float(amax))
    if not value <= _HOST_AMAX_MAX or rounded_to(product, torch.float32) != product:
        return None  # NaN and inf fail the first test
    tiny = torch.finfo(torch.float32).tiny
    value = tiny if value < tiny else rounded_to(value, torch.float32)
    reciprocal = rounded_to(1.0 / value, torch.float32)
    found = rounded_to(reciprocal * product, torch.float32)
    return found if math.isfinite(found) else 1.0


def _warn_float16_overflow(amax: torch.Tensor, product: float) -> None:
    """Warn where float16 arithmetic, not the data, made the global scale 1.0."""
    exact = product / amax.clamp(min=torch.finfo(torch.float32).tiny)
    if bool(torch.isfinite(exact).all()):
        warnings.warn(
            f"NVFP4 global scale {product:g} / {float(amax.max()):.4g} overflows "
            "float16 and becomes 1.0, as compressed-tensors computes it; its "
            "group scales then lose precision (measured: 2x the squared error "
            "at an absmax of 0.025, 100x at 0.01). Observer option "
            "arithmetic='float32' computes it in float32",
            RuntimeWarning,
            stacklevel=3,
        )


def _nonfinite_amax_error(_: float) -> ValueError:
    return ValueError(
        "amax is not finite (NaN or inf); drop non-finite inputs before "
        "computing a global scale"
    )


def generate_gparam(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    scale_format: str | NumberFormat = "float8_e4m3fn",
    quant_format: str | NumberFormat = "float4_e2m1fn",
    dtype: torch.dtype = torch.float32,
    *,
    observed_dtype: torch.dtype | None = None,
    checks: Checks | None = None,
) -> torch.Tensor:
    """Global scale from a tensor's range (compressed-tensors' `generate_gparam`).

    Args:
        min_vals: the tensor's minimum (one element).
        max_vals: the tensor's maximum (one element).
        scale_format: format of the local scales (FP8 e4m3 for NVFP4).
        quant_format: format of the values (FP4 e2m1 for NVFP4).
        dtype: dtype of the result.
        observed_dtype: dtype of the observed values (see
            `amax_to_global_scale`).
        checks: where the checks of the range go (the caller raises them,
            `quantobs.core.checks`); without it, they are read here at once.

    Returns:
        `(1,)` global scale, see `amax_to_global_scale`.
    """
    own = checks is None
    checks = Checks() if checks is None else checks
    _check_range(min_vals, max_vals, checks)
    amax = torch.maximum(
        torch.clamp(min_vals.float(), max=0.0).abs(),
        torch.clamp(max_vals.float(), min=0.0),
    )
    if amax.numel() != 1:
        amax = amax.max()
    found = amax_to_global_scale(
        amax,
        scale_format,
        quant_format,
        dtype,
        observed_dtype=observed_dtype,
        checks=checks,
    )
    if own:
        checks.raise_first()
    return found


def scale_to_storage(scale: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """Cast float scales to the dtype a checkpoint stores them in.

    MX scales become biased e8m0 exponents (`uint8`, or `float8_e8m0fnu` when
    that is the `scale_dtype`); other scales are cast to `scale_dtype` when set.
    """
    if args.is_mx:
        exponent = torch.log2(scale.float()).round() + E8M0_BIAS
        codes = exponent.clamp(0, _E8M0_MAX_BIASED).to(torch.uint8)
        if args.scale_dtype == torch.float8_e8m0fnu:
            return codes.view(torch.float8_e8m0fnu)
        return codes
    if args.scale_dtype is not None:
        return scale.to(args.scale_dtype)
    return scale


def storage_to_scale(
    scale: torch.Tensor, args: QuantizationArgs, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `scale_to_storage`: stored scales back to float `dtype`."""
    if args.is_mx and scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        codes = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
        return torch.exp2(codes.to(torch.float32) - E8M0_BIAS).to(dtype)
    if scale.dtype.is_floating_point and scale.dtype.itemsize == 1:
        return scale.to(dtype)
    return scale
