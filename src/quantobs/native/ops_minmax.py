"""Wrappers of `qo_minmax.c`: per-qparam min/max, finiteness, symmetric scales
and the ranges' absmax.
"""

from __future__ import annotations

import ctypes

import torch

from quantobs.native.runtime import PARALLEL_MIN, loaded, threads, usable

__all__ = [
    "all_finite",
    "minmax",
    "minmax_absmax",
    "range_absmax",
    "symmetric_scales",
]

_MIN_GROUP = 8  # shortest group the min/max and MSE kernels take


def minmax_absmax(
    x3: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, float | None] | None:
    """`(N, Q, G)` float32 -> `(Q,)` min and max over N and G, and the largest
    `|value|` when every value was finite (else None); or None (not run).

    Equal to `torch.amin` / `torch.amax` over dims `(0, 2)` (NaN propagates).
    Groups shorter than 8 values stay with torch, which vectorizes across
    qparams there.
    """
    if x3.ndim != 3 or x3.shape[-1] < _MIN_GROUP or not usable(x3):
        return None
    n, q, g = x3.shape
    mins, maxs = torch.empty(2, q, dtype=torch.float32)  # one allocation
    absmax = ctypes.c_float()
    finite = loaded().qo_minmax(
        x3.data_ptr(),
        n,
        q,
        g,
        mins.data_ptr(),
        maxs.data_ptr(),
        ctypes.byref(absmax),
        threads(x3.numel()),
    )
    return mins, maxs, absmax.value if finite else None


def minmax(
    x3: torch.Tensor, shape: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`minmax_absmax` without the absmax, as `(Q,)` (or `shape`) tensors."""
    found = minmax_absmax(x3)
    if found is None:
        return None
    mins, maxs, _ = found
    if shape is not None:
        mins, maxs = mins.reshape(shape), maxs.reshape(shape)
    return mins, maxs


def _rangesusable(min_vals: torch.Tensor, max_vals: torch.Tensor) -> bool:
    return min_vals.shape == max_vals.shape and usable(min_vals) and usable(max_vals)


def all_finite(x: torch.Tensor) -> bool | None:
    """Whether every value of a float32 tensor is finite, or None (not run:
    small tensors too, where torch's one reduction is cheaper than a call)."""
    if x.numel() < PARALLEL_MIN or not usable(x):
        return None
    return bool(loaded().qo_all_finite(x.data_ptr(), x.numel(), threads(x.numel())))


def symmetric_scales(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    divisor: float,
    global_scale: float | None,
    scale_fp8: bool,
    eps: float,
    empty_as_zero: bool,
    floor: float = 0.0,
) -> torch.Tensor | None:
    """Scales of symmetric (non-MX) args from float32 ranges, or None.

    `calculate_qparams`' float32 arithmetic in its order: `max(-min, max, 0)
    / divisor`, times the global scale, rounded to FP8 e4m3 (saturating)
    where `scale_fp8`, zeros replaced by `eps`, then raised to `floor` (the
    smallest normal number: no subnormal scale). None (take the torch path,
    which raises the right error) for a non-finite value, `min > max` unless
    `empty_as_zero` (then such a range counts as `(0, 0)`), or an overflow.
    """
    if not _rangesusable(min_vals, max_vals):
        return None
    out = torch.empty_like(min_vals)
    bad = loaded().qo_symmetric_scales(
        min_vals.data_ptr(),
        max_vals.data_ptr(),
        min_vals.numel(),
        divisor,
        1.0 if global_scale is None else global_scale,
        global_scale is not None,
        scale_fp8,
        eps,
        floor,
        empty_as_zero,
        out.data_ptr(),
        threads(min_vals.numel()),
    )
    return None if bad else out


def range_absmax(min_vals: torch.Tensor, max_vals: torch.Tensor) -> float | None:
    """`max(-min, max, 0)` over the non-empty (`min <= max`) float32 ranges.

    None where the kernels do not apply or a non-empty range is not finite.
    """
    if not _rangesusable(min_vals, max_vals):
        return None
    out = ctypes.c_float()
    bad = loaded().qo_range_absmax(
        min_vals.data_ptr(),
        max_vals.data_ptr(),
        min_vals.numel(),
        ctypes.byref(out),
        threads(min_vals.numel()),
    )
    return None if bad else out.value
