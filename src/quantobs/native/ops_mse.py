"""Wrappers of `qo_mse.c`: the MSE candidates' errors with fake-quant's float32
arithmetic fused, and the kernel's `|e| ** 2.4`.
"""

from __future__ import annotations

import math

import torch

from quantobs.core.formats import NumberFormat
from quantobs.native.runtime import loaded, threads, usable

__all__ = [
    "mse_errors",
    "mse_supported",
    "pow24",
]

_NORMS = (2.0, 2.4)  # the kernel's fast error powers; others stay eager
_MIN_GROUP = 8  # shortest group the min/max and MSE kernels take


def mse_supported(fmt: NumberFormat, norm: float) -> bool:
    """Whether `mse_errors` runs for this format and error exponent."""
    return norm in _NORMS and (fmt.signed or not fmt.is_float)


def mse_errors(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
) -> torch.Tensor | None:
    """Errors `sum |fake_quant(x) - x| ** norm` of every candidate, or None.

    Args:
        x3: `(N, Q, G)` float32 values.
        scale: `(C, Q)` effective scales (divided by any global scale).
        zero_point: `(C, Q)` zero points, or None (symmetric).
        fmt: the quantized format (ints, or signed float formats).
        norm: error exponent; only 2 and 2.4 run natively.

    Returns:
        `(C, Q)` float64 errors, or None where the kernel does not apply.
    """
    if x3.ndim != 3 or x3.shape[-1] < _MIN_GROUP:
        return None  # short groups: the kernel's per-row overhead dominates
    if not mse_supported(fmt, norm) or not usable(x3):
        return None
    n, q, g = x3.shape
    c = scale.shape[0]
    for name, given in (("scale", scale), ("zero_point", zero_point)):
        if given is not None and tuple(given.shape) != (c, q):
            raise ValueError(
                f"{name} must be (candidates, {q}), got {tuple(given.shape)}"
            )
    scale = scale.to(torch.float32).contiguous()
    if zero_point is not None:
        zero_point = zero_point.to(torch.float32).contiguous()
    out = torch.empty(c, q, dtype=torch.float64)
    # ints ignore it; float formats: the exponent of the smallest normal
    emin = math.frexp(fmt.min_normal)[1] - 1
    loaded().qo_mse_errors(
        x3.data_ptr(),
        n,
        q,
        g,
        c,
        scale.data_ptr(),
        None if zero_point is None else zero_point.data_ptr(),
        fmt.min,
        fmt.max,
        int(fmt.is_float),
        fmt.mantissa_bits,
        emin,
        norm,
        out.data_ptr(),
        threads(x3.numel() * c),
    )
    return out


def pow24(a: torch.Tensor) -> torch.Tensor | None:
    """The kernel's `a ** 2.4` for float32 `a >= 0` (for tests), or None."""
    if not usable(a):
        return None
    out = torch.empty_like(a)
    loaded().qo_pow24(a.data_ptr(), out.data_ptr(), a.numel())
    return out
