"""Weights whose groups of 32 hold zeros, subnormal and tiny normal maxima.

The inputs on which MX scales are decided by a dtype's bits rather than by
its value (issue 25): compressed-tensors rounds a block maximum's own bits
to one mantissa bit (three for FP6 e2m3), so a float16 subnormal maximum
(below 2**-14) becomes 2**-14 from `0.75 * 2**-14` up (`0.9375 * 2**-14`)
and 0 below, and a scale below float16's least subnormal rounds to 0 in it.
"""

from __future__ import annotations

import torch

GROUP = 32


def tiny_maxima(dtype: torch.dtype) -> list[float]:
    """Block maxima of `dtype` around its subnormal rounding thresholds:
    0, its least subnormal, both sides of `0.75 * tiny` and `0.9375 * tiny`
    (`tiny`: its least normal), `tiny` itself and tiny normal values (and
    for float16 1e-6 and 1e-4 as LLM weights hold them)."""
    info = torch.finfo(dtype)
    tiny, least = info.tiny, info.tiny * info.eps
    found = [
        0.0,
        least,
        0.75 * tiny - least,
        0.75 * tiny,
        0.9375 * tiny - least,
        0.9375 * tiny,
        tiny,
        1.25 * tiny,
        1.75 * tiny,
        3.5 * tiny,
    ]
    if dtype == torch.float16:
        found += [1e-6, 1e-4]
    return [float(torch.tensor(m).to(dtype)) for m in found]


def tiny_groups(
    rows: int, cols: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """A `(rows, cols)` weight of `dtype` (cols a multiple of 32): every
    other group of 32 columns has one of `tiny_maxima(dtype)` as its
    absolute maximum (the maximum itself among values below it, either
    sign), the rest are ordinary values (std 0.05)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.05
    maxima = tiny_maxima(dtype)
    flat = x.view(-1, GROUP)  # (rows * cols / 32, 32): the groups
    for i in range(0, flat.shape[0], 2):
        top = maxima[(i // 2) % len(maxima)]
        spread = torch.rand(GROUP, generator=gen, dtype=torch.float64) * 2 - 1
        flat[i] = spread * top
        flat[i, (i // 2) % GROUP] = top if (i // 2) % 3 else -top
    out = x.to(dtype)
    assert bool(torch.isfinite(out).all())
    return out
