# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton kernel: per-qparam min and max in one pass over the data.

`minmax3(x3)` is the GPU twin of `quantobs.stats.reduce._minmax3`: `(N, Q,
G)` values to `(Q,)` float32 minima and maxima, each value read once
(torch's `amin` and `amax` read the data twice). Min and max are exact, so
the results are torch's bit for bit (float32 holds every bf16 / fp16
value); NaN propagates as in torch (a qparam holding a NaN gets NaN for
both). In the same pass, on the device (no host read):

* the NaN policy's findings, `(3,)` float64 `[qparams with a non-finite
  end, 0, 0]` (`Batch.findings`: what `ObserverEngine` defers under
  `nan_policy="raise"`, the count `count_nonzero((min - min) + (max - max))`
  makes);
* optionally the absmax over every qparam, `(1,)` float32 `max(-min, max,
  0)` (`absmax_or_zero`'s value; NaN / inf where a value was), for NVFP4's
  global scale: each program's largest as float bits (ordered as integers
  for non-negative floats, NaN above inf), combined by an atomic max.

The kernels are untyped (Triton types their arguments at launch: mypy
allows it here). Importing this module imports Triton: callers import it
lazily.
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
    x_ptr, min_ptr, max_ptr, found_ptr, amax_ptr, Q, G, E, sxn, sxq, sxg,
    ROWS: tl.constexpr, ABSMAX: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_E: tl.constexpr,
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
    # qparams with a non-finite end (x - x: 0 exactly where finite)
    bad = ((low - low) != 0) | ((high - high) != 0)
    count = tl.sum(tl.where(q_ok & bad, 1, 0), axis=0)
    if count > 0:
        tl.atomic_add(found_ptr, count.to(tl.float64))
    if ABSMAX:  # max(-min, max, 0) as bits; NaN's above inf's
        amax = tl.maximum(tl.maximum(-low, high), 0.0)
        bits = tl.where(nan > 0, 0x7FC00000, amax.to(tl.int32, bitcast=True))
        top = tl.max(tl.where(q_ok, bits, 0), axis=0)
        if top > 0:
            tl.atomic_max(amax_ptr, top)


def minmax3(
    x3: torch.Tensor, absmax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """`(N, Q, G)` values -> `(Q,)` float32 min and max over N and G (exact),
    the `(1,)` float32 absmax (with `absmax`, else None) and the `(3,)`
    float64 findings (module docstring); or None where the kernel does not
    apply (dtypes other than float32, float16, bfloat16; no values)."""
    if x3.ndim != 3 or x3.dtype not in _DTYPES or x3.numel() == 0:
        return None
    n, num_q, g = x3.shape
    values = n * g
    block_e = triton.next_power_of_2(min(values, _MAX_TILE_E))
    block_q = max(1, min(_TILE // block_e, triton.next_power_of_2(num_q)))
    low = torch.empty(num_q, dtype=torch.float32, device=x3.device)
    high = torch.empty(num_q, dtype=torch.float32, device=x3.device)
    found = torch.zeros(3, dtype=torch.float64, device=x3.device)
    bits = torch.zeros(1, dtype=torch.int32, device=x3.device) if absmax else None
    grid = (triton.cdiv(num_q, block_q),)
    with gpu.interpreter_quiet():
        _minmax_kernel[grid](
            x3, low, high, found, found if bits is None else bits, num_q, g,
            values, *x3.stride(), ROWS=n > 1, ABSMAX=absmax, BLOCK_Q=block_q,
            BLOCK_E=block_e,
        )  # fmt: skip
    amax = None if bits is None else bits.view(torch.float32)
    return low, high, amax, found
