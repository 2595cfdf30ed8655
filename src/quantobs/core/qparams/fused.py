"""An observer's qparams from its ranges in one call (one kernel on a GPU).

`observer_qparams` is what `Observer.get_qparams` computes once it has the
statistic's ranges: the range made finite where a solver's end overflowed
(`finite_range`), the NVFP4 global scale from the kept amax
(`amax_to_global_scale`), compressed-tensors' rule with empty ranges as
`(0, 0)` (`calculate_qparams`) and the scale in the dtype llm-compressor
returns it in (`in_observed_dtype`). On the torch path that is 30 to 65
small torch ops (each a kernel launch on a GPU); with Triton on a CUDA
tensor it is one launch (`quantobs.native.triton_qparams`: the same float32
operations in the same order, so the same bits) and one host read of the
rule's checks, raised here in the torch path's order.
"""

from __future__ import annotations

import struct

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.checks import Checks
from quantobs.core.qparams.compressed_tensors import (
    _global_overflow_error,
    _global_scale_error,
    _nonfinite_amax_error,
    _nonfinite_range_error,
    _rounded_dtype,
    _warn_float16_overflow,
    _zero_scale_replacement,
    amax_to_global_scale,
    calculate_qparams,
    in_observed_dtype,
)
from quantobs.core.syncs import on_host
from quantobs.native.dispatch import kernel
from quantobs.stats.reduce import Range, finite_range

__all__ = ["observer_qparams"]

_NVFP4_PRODUCT = 448.0 * 6.0  # amax_to_global_scale's default formats


@kernel
def observer_qparams(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    observed_dtype: torch.dtype | None,
    observed: Range | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scale, zero_point)` of an observer's selected ranges.

    Args:
        min_vals: `(*Q,)` selected minima (`+inf` where a qparam saw nothing).
        max_vals: `(*Q,)` selected maxima.
        args: the quantization args.
        global_scale: the module's `(1,)` global scale (tensor_group), or None.
        amax: `(1,)` amax to compute the global scale from when
            `global_scale` is None (tensor_group), else None.
        observed_dtype: the arithmetic's dtype (`Observer.arithmetic_dtype`:
            bfloat16 / float16 round as compressed-tensors computes in them).
        observed: the data's own range where `min_vals` / `max_vals` are a
            solver's: those are made finite where it was (`finite_range`).

    Returns:
        `calculate_qparams(..., empty_as_zero=True)`, the scale in the
        dtype compressed-tensors returns (`in_observed_dtype`).

    Raises:
        ValueError: what `calculate_qparams` and `amax_to_global_scale`
            raise (non-finite ranges, an invalid or overflowing global scale).
    """
    if observed is not None:
        min_vals, max_vals = finite_range((min_vals, max_vals), observed)
    checks = Checks()  # the rule's checks, read at once at the end
    if global_scale is None and amax is not None:
        global_scale = amax_to_global_scale(
            amax, observed_dtype=observed_dtype, checks=checks
        )
    scale, zero_point = calculate_qparams(
        min_vals,
        max_vals,
        args,
        global_scale,
        empty_as_zero=True,
        observed_dtype=observed_dtype,
        checks=checks,
    )
    checks.raise_first()
    rounding = _rounded_dtype(observed_dtype)
    return in_observed_dtype(scale, rounding, global_scale), zero_point


def _observer_qparams_gpu(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    observed_dtype: torch.dtype | None,
    observed: Range | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Triton kernel (`triton_qparams`), None where it does not apply."""
    if not isinstance(min_vals, torch.Tensor) or not isinstance(max_vals, torch.Tensor):
        return None
    if global_scale is not None and not isinstance(global_scale, torch.Tensor):
        return None  # the torch path raises the TypeError
    from quantobs.native import triton_qparams  # imports Triton

    rounded = _rounded_dtype(observed_dtype)
    gs = global_scale if global_scale is not None else amax
    symmetric_plain = args.symmetric and not args.is_mx
    scale_dtype = None if args.is_mx else args.scale_dtype
    eps = _zero_scale_replacement(scale_dtype or rounded or torch.float32)
    launch = triton_qparams.Launch.of(args, rounded, gs, eps)
    if launch is None or (gs is not None and not symmetric_plain):
        return None
    out_dtype = torch.float32  # in_observed_dtype's (gs: float32, bf16, fp16)
    if rounded is not None and (gs is None or gs.dtype == rounded):
        out_dtype = rounded
    found = triton_qparams.range_qparams(
        launch,
        min_vals,
        max_vals,
        out_dtype,
        args.zp_dtype or torch.int8,
        global_scale=global_scale,
        amax=amax if global_scale is None else None,
        observed=observed,
    )
    if found is None:
        return None
    scale, zero_point, flags = found
    _raise_flags(flags.tolist(), warn_fp16=rounded == torch.float16)
    return scale, zero_point


def _float_of(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<i", int(bits)))[0])


def _raise_flags(flags: list[int], warn_fp16: bool) -> None:
    """The torch path's warning and first failed check, from the kernel's
    flags (`triton_qparams.FLAG_*`, read once)."""
    from quantobs.native import triton_qparams as tq

    if warn_fp16 and flags[tq.FLAG_FP16_GS]:
        with on_host():  # a host copy of the read flags: no device read
            amax = torch.tensor([_float_of(flags[tq.FLAG_AMAX_BITS])])
            _warn_float16_overflow(amax, _NVFP4_PRODUCT)
    if flags[tq.FLAG_AMAX]:
        raise _nonfinite_amax_error(flags[tq.FLAG_AMAX])
    if flags[tq.FLAG_GS]:
        raise _global_scale_error(1.0, _float_of(flags[tq.FLAG_GS_BITS]))
    if flags[tq.FLAG_RANGE]:
        raise _nonfinite_range_error(float(flags[tq.FLAG_RANGE]))
    if flags[tq.FLAG_OVERFLOW]:
        raise _global_overflow_error(1.0)


observer_qparams.register("cuda", _observer_qparams_gpu)
