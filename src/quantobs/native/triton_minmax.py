# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton kernel: per-qparam min and max in one pass over the data.

`minmax3(x3)` is the GPU twin of `quantobs.stats.reduce._minmax3`: `(N, Q,
G)` values to `(Q,)` minima and maxima in the input's dtype, each value read
once (torch's `amin` and `amax` read the data twice). Min and max are exact,
so the results are torch's bit for bit; NaN propagates as in torch (a qparam
holding a NaN gets NaN for both). The absmax over every qparam is left to
`absmax_or_zero` on these small results (a host float here would be a host
read). The kernels are untyped (Triton types their arguments at launch:
mypy allows it here). Importing this module imports Triton: callers import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantobs.native import gpu

__all__ = ["minmax3"]

_TILE = 4096  # values per program tile
_MAX_TILE_E = 1024  # values of one qparam per tile row
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _minmax_kernel(
    x_ptr, min_ptr, max_ptr, Q, G, E, sxn, sxq, sxg,
    ROWS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Program `i`: min and max of qparams `i * BLOCK_Q ..` over their `E`
    values (`N * G`, tile by tile)."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BQ,)
    q_ok = q < Q
    q64 = q.to(tl.int64)[:, None]
    lanes = tl.arange(0, BLOCK_E)[None, :].to(tl.int64)
    low = tl.full([BLOCK_Q], float("inf"), dtype=tl.float32)
    high = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    nan = tl.zeros([BLOCK_Q], dtype=tl.int32)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + lanes
        ok = q_ok[:, None] & (e < E)
        if ROWS:
            n = e // G
            off = n * sxn + q64 * sxq + (e - n * G) * sxg
        else:
            off = q64 * sxq + e * sxg
        x = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
        low = tl.minimum(low, tl.min(tl.where(ok, x, float("inf")), axis=1))
        high = tl.maximum(high, tl.max(tl.where(ok, x, float("-inf")), axis=1))
    low = tl.where(nan > 0, float("nan"), low)
    high = tl.where(nan > 0, float("nan"), high)
    tl.store(min_ptr + q, low, mask=q_ok)
    tl.store(max_ptr + q, high, mask=q_ok)


def minmax3(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None] | None:
    """`(N, Q, G)` values -> `(Q,)` min and max over N and G in `x3`'s dtype
    (exact: converted through float32), and None for the absmax; or None
    where the kernel does not apply (dtypes other than float32, float16,
    bfloat16; no values)."""
    if x3.ndim != 3 or x3.dtype not in _DTYPES or x3.numel() == 0:
        return None
    n, num_q, g = x3.shape
    values = n * g
    block_e = triton.next_power_of_2(min(values, _MAX_TILE_E))
    block_q = max(1, min(_TILE // block_e, triton.next_power_of_2(num_q)))
    low = torch.empty(num_q, dtype=torch.float32, device=x3.device)
    high = torch.empty(num_q, dtype=torch.float32, device=x3.device)
    grid = (triton.cdiv(num_q, block_q),)
    with gpu.interpreter_quiet():
        _minmax_kernel[grid](
            x3, low, high, num_q, g, values, *x3.stride(),
            ROWS=n > 1, BLOCK_Q=block_q, BLOCK_E=block_e,
        )  # fmt: skip
    # exact: the extremes are values of x3
    return low.to(x3.dtype), high.to(x3.dtype), None
