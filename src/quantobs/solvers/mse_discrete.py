"""MSE search over the scales a format can store (NVFP4, MX; opt-in).

llm-compressor's MSE search shrinks the range by continuous factors. For
NVFP4 it scores unrounded group scales without the global scale, and the
checkpoint then rounds the chosen scale to FP8 e4m3 under the global scale,
so the error it minimized is not the checkpoint's; for MX it scores the
stored powers of two, but only those its 20 factors reach. Here the
candidates are the stored scales themselves, each scored as fake-quant will
apply it:

======  =====================================  ================================
args    stored scale                           effective scale scored
======  =====================================  ================================
NVFP4   an e4m3 value `v` (group scale)        `v / global_scale`
MX      an e8m0 power of two `2**k`            `2**k`
======  =====================================  ================================

The candidates of a qparam are every stored value between the stored scales
of its shrunk range `(1 - maxshrink) * amax` and of `amax` (the observed
range times `expand`), both included, plus at least one value beyond each
end: every scale the default grid can store, and its neighbours (about 7
e4m3 values or 4 exponents for the defaults, all scored: no early stop;
wider spans found nothing better on MiniLM's weights). The
NVFP4 global scale is that of the observed range (as `round_scales=True`),
fixed before the search. An all-zero group keeps its zero range.

The range returned for a qparam is its observed range scaled so that the
qparams rule (`calculate_qparams`) gives back exactly the chosen stored
scale (under that global scale); the error minimized is the stored
checkpoint's, and it is never above that of the default grid's range stored
under the same global scale.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from quantobs.core.args import QuantizationArgs
from quantobs.core.checks import Checks
from quantobs.core.formats import get_format
from quantobs.core.qparams import generate_gparam
from quantobs.core.qparams.pow2 import E8M0_MAX_EXP, E8M0_MIN_EXP, pow2_exponent
from quantobs.core.scoring import DEFAULT_CHUNK_ELEMS, score
from quantobs.stats.reduce import minmax

__all__ = [
    "ScaleSearch",
    "check_discrete_args",
    "discrete_scale_search",
    "discrete_scales_supported",
    "stored_scale_candidates",
]

ScaleSearch = Literal["continuous", "discrete"]

_E4M3 = "float8_e4m3fn"


def discrete_scales_supported(args: QuantizationArgs) -> bool:
    """Whether `args` store scales the discrete search enumerates: MX (e8m0
    exponents), or symmetric args with `float8_e4m3fn` scales (NVFP4)."""
    return args.is_mx or (args.symmetric and args.scale_dtype == torch.float8_e4m3fn)


def check_discrete_args(args: QuantizationArgs) -> None:
    """Raise `ValueError` unless `discrete_scales_supported(args)`."""
    if not discrete_scales_supported(args):
        raise ValueError(
            "scale_search='discrete' needs args whose scales a format stores: "
            "MX (e8m0 scales, e.g. MXFP4) or symmetric float8_e4m3fn scales "
            f"(NVFP4); got strategy={args.strategy!r}, scale_dtype="
            f"{args.scale_dtype}, symmetric={args.symmetric}. Use "
            "scale_search='continuous'"
        )


def _positive_e4m3() -> torch.Tensor:
    """`(T,)` float32 positive e4m3 values, ascending (on the CPU)."""
    table = get_format(_E4M3).values()
    return table[table > 0].to(torch.float32)


# Built once: a search reads nothing of it on the host (issue 24).
_E4M3_TABLE = _positive_e4m3()
# The least log2 ratio of consecutive values (16/15: 1.875 -> 2).
_E4M3_LEAST_STEP = float(torch.log2(_E4M3_TABLE[1:] / _E4M3_TABLE[:-1]).min())


def _octaves(maxshrink: float) -> float:
    """log2 of the ratio of a range's ends `amax / ((1 - maxshrink) * amax)`,
    with room for float32's rounding of the two."""
    return -math.log2(1.0 - maxshrink) + 1e-6


def _e4m3_count(maxshrink: float) -> int:
    """The most candidates `_e4m3_candidates` makes for a qparam: values in
    the range's span (at least `_E4M3_LEAST_STEP` apart in log2), one more
    above and two more below, both ends; known on the host before the data."""
    if maxshrink >= 1.0:
        return _E4M3_TABLE.numel()
    inside = math.floor(_octaves(maxshrink) / _E4M3_LEAST_STEP) + 1
    return min(_E4M3_TABLE.numel(), inside + 4)


def _e4m3_candidates(
    raw_hi: torch.Tensor, raw_lo: torch.Tensor, count: int
) -> torch.Tensor:
    """`(K, Q)` e4m3 values, descending: every value `raw_lo` and `raw_hi`
    (`(Q,)` unrounded scales) and the scales between them round to, and one
    more value on each side; `count` rows (`_e4m3_count`), shorter lists
    repeating their last value."""
    table = _E4M3_TABLE.to(raw_hi.device)  # (T,) ascending
    last = table.numel() - 1
    # round(raw) is table[j - 1] or table[j], j = searchsorted(table, raw).
    hi = (torch.searchsorted(table, raw_hi) + 1).clamp(0, last)  # (Q,)
    lo = (torch.searchsorted(table, raw_lo) - 2).clamp(0, last)  # (Q,)
    steps = torch.arange(count, device=raw_hi.device)[:, None]  # (K, 1)
    index = torch.maximum(hi[None] - steps, lo[None])  # (K, Q), repeats lo
    return table[index]


def _e8m0_candidates(amax: torch.Tensor, maxshrink: float, emax: int) -> torch.Tensor:
    """`(K, Q)` power-of-two scales, descending: the MX scales of `amax *
    [1 - maxshrink, 1]` and one more exponent on each side."""
    positive = torch.where(amax > 0, amax, torch.ones_like(amax))
    top = E8M0_MAX_EXP - max(emax, 0)  # 2**(k + emax) stays finite
    hi = pow2_exponent(positive) - emax + 1
    lo = pow2_exponent(positive * (1.0 - maxshrink)) - emax - 1
    hi, lo = hi.clamp(E8M0_MIN_EXP, top), lo.clamp(E8M0_MIN_EXP, top)
    # the most exponents between the ends, known before the data (no host
    # read): exponents of values `octaves` apart differ by at most
    # ceil(octaves) + 1, and one more on each side
    count = top - E8M0_MIN_EXP + 1
    if maxshrink < 1.0:
        count = min(count, math.ceil(_octaves(maxshrink)) + 4)
    steps = torch.arange(count, device=amax.device, dtype=torch.float32)[:, None]
    exponents = torch.maximum(hi[None] - steps, lo[None])  # (K, Q)
    return torch.ldexp(torch.ones_like(exponents), exponents.int())


def stored_scale_candidates(
    amax: torch.Tensor,
    args: QuantizationArgs,
    maxshrink: float,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(K, Q)` stored scales to score for `(Q,)` amax, descending per qparam
    (short lists repeat their last value).

    Args:
        amax: `(Q,)` absolute maxima of the observed ranges (times `expand`).
        args: MX args or args with e4m3 scales (`discrete_scales_supported`).
        maxshrink: the shrunk end of the default grid's ranges.
        global_scale: the `(1,)` NVFP4 global scale (None: none).

    Raises:
        ValueError: args whose scales the search does not enumerate.
    """
    check_discrete_args(args)
    fmt = args.format
    if args.is_mx:
        return _e8m0_candidates(amax, maxshrink, fmt.emax)
    # The rule's order: amax / levels, times any global scale, then rounded.
    levels = (fmt.max - fmt.min) / 2
    raw_hi, raw_lo = amax / levels, (amax * (1.0 - maxshrink)) / levels
    if global_scale is not None:
        gscale = global_scale.float().reshape(())
        raw_hi, raw_lo = raw_hi * gscale, raw_lo * gscale
    return _e4m3_candidates(raw_hi, raw_lo, _e4m3_count(maxshrink))


def discrete_scale_search(
    x_flat: torch.Tensor,
    args: QuantizationArgs,
    *,
    maxshrink: float = 0.2,
    norm: float = 2.4,
    expand: float = 1.0,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    batch_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-qparam range whose stored scale has the least error.

    Args:
        x_flat: `(N, *Q, G)` finite values.
        args: MX args, or symmetric args with `float8_e4m3fn` scales (NVFP4).
        maxshrink: the candidates span the stored scales of `[1 - maxshrink,
            1]` times the range, plus one beyond each end.
        norm: exponent of the absolute error.
        expand: the range is `expand` times the observed one.
        chunk_elems: elements per temporary tensor.
        batch_range: `minmax(x_flat)` when the caller has it already.

    Returns:
        `(min_vals, max_vals)`, each `(*Q,)` float32: the observed range
        scaled so that `calculate_qparams` (under the global scale of the
        observed range, for NVFP4) gives the chosen stored scale exactly.

    Raises:
        ValueError: args whose scales the search does not enumerate.
    """
    check_discrete_args(args)
    min_vals, max_vals = batch_range if batch_range is not None else minmax(x_flat)
    top = torch.finfo(torch.float32).max  # `expand` past it saturates
    min_vals = (min_vals * expand).clamp(-top, top)
    max_vals = (max_vals * expand).clamp(-top, top)
    shape = min_vals.shape
    mins, maxs = min_vals.reshape(-1), max_vals.reshape(-1)
    amax = torch.maximum(-mins, maxs).clamp(min=0.0)  # (Q,)
    global_scale = None
    if args.strategy == "tensor_group":
        # the data's checks are its observer's: not read here (no host wait)
        global_scale = generate_gparam(min_vals.min(), max_vals.max(), checks=Checks())
    stored = stored_scale_candidates(amax, args, maxshrink, global_scale)  # (K, Q)
    effective = stored if global_scale is None else stored / global_scale
    n, g = x_flat.shape[0], x_flat.shape[-1]
    errors = score(
        x_flat.reshape(n, -1, g), effective, None, args.format, norm,
        chunk_elems=chunk_elems,
    )  # (K, Q)  # fmt: skip
    pick = torch.argmin(errors, dim=0)[None]  # first: the larger scale on ties
    chosen = effective.gather(0, pick)[0]  # (Q,)
    fmt = args.format
    if args.is_mx:
        # 2**(k + emax) has a mantissa of 1: the rule's exponent is k + emax.
        target = chosen * float(2**fmt.emax)
    else:
        target = chosen * ((fmt.max - fmt.min) / 2)  # (v / global) * levels
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    factor = torch.where(amax > 0, target / safe, torch.ones_like(amax))
    # one stored value beyond the range may pass float32's max: saturate
    low, high = (mins * factor).clamp(-top, top), (maxs * factor).clamp(-top, top)
    return low.reshape(shape), high.reshape(shape)
