# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton kernel of the histogram family: exact per-qparam counting.

`add_counts` is `quantobs.stats.binning._add_counts`'s "cuda" registration
(`quantobs.native.dispatch`): the counts of `(N, Q, G)` values on each
qparam's power-of-two grid, added to `(Q, bins)` int64 counts, with the
torch reference's arithmetic (bin `floor(x * inv) - off` in float32, of
`|x|` when absolute, clamped to `[0, bins)`, NaN skipped), so the counts are
the same integers, exactly.

One program counts one qparam's values, or a slice of them where a qparam
has many (per tensor), into a histogram kept on chip (`tl.histogram`,
int32: a slice holds fewer than 2**31 values) and adds it to the qparam's
row: a plain add where one program owns the row, an int64 atomic add where
slices share it (integer adds: the order does not change the sum). Memory:
the input is read once; nothing is allocated besides the counts.

The kernel is untyped (Triton types its arguments at launch: mypy allows
it here). Importing this module imports Triton (optional: the `gpu` extra):
`quantobs.stats.binning` imports it lazily, for a CUDA tensor, where
`quantobs.native.gpu` says Triton imports. Tests run the kernel on CPU
tensors under Triton's interpreter (`TRITON_INTERPRET=1`, read when the
kernel is decorated, i.e. when this module is first imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantobs.native import gpu

__all__ = ["add_counts", "plan"]

_BLOCK = 1024  # values per step of a program
_PROGRAMS = 1024  # programs to aim for where qparams are few (slices)
_SLICE_MAX = 1 << 30  # values per program (int32 counts on chip)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _count_kernel(
    x_ptr,
    inv_ptr,
    off_ptr,
    out_ptr,
    num_q,
    group,
    per_q,
    chunk,
    bins,
    ABSOLUTE: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
):
    # x: (N, Q, G) contiguous; inv, off: (Q,) float32; out: (Q, bins) int64.
    # Program (q, s) counts values s * chunk .. of qparam q (n * G + g order).
    q = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * chunk
    inv = tl.load(inv_ptr + q)
    off = tl.load(off_ptr + q)
    top = (bins - 1).to(tl.float32)
    acc = tl.zeros([NB], dtype=tl.int32)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    for k in range(0, chunk, BLOCK):
        i = start + k + lane  # the qparam's value i: observation n, column g
        inside = (i < per_q) & (k + lane < chunk)
        n = i // group
        g = i - n * group
        x = tl.load(x_ptr + (n * num_q + q) * group + g, mask=inside, other=0.0)
        v = x.to(tl.float32) * inv  # exact: a power of two
        if ABSOLUTE:
            v = tl.abs(v)
        b = tl.floor(v) - off
        b = tl.minimum(tl.maximum(b, 0.0), top)  # infinities: the end bins
        valid = inside & (v == v)  # NaN: skipped
        index = tl.where(valid, b, 0.0).to(tl.int32)
        acc += tl.histogram(index, NB, mask=valid)
    cols = tl.arange(0, NB)
    ptrs = out_ptr + q * bins + cols
    keep = cols < bins
    if ATOMIC:
        tl.atomic_add(ptrs, acc.to(tl.int64), mask=keep)
    else:
        row = tl.load(ptrs, mask=keep, other=0)
        tl.store(ptrs, row + acc.to(tl.int64), mask=keep)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def plan(n: int, q: int, g: int, bins: int) -> tuple[int, int, int, int]:
    """`(slices, chunk, block, histogram size)` of a launch: each qparam's
    `n * g` values split in `slices` of `chunk` values (a multiple of the
    `block` a step reads: at most `_BLOCK`, at least 16) so that about
    `_PROGRAMS` programs run where qparams are few; the on-chip histogram
    has the next power of two of `bins` bins (32 at least)."""
    per_q = n * g
    block = min(_BLOCK, max(16, _pow2(per_q)))
    steps = -(-per_q // block)  # blocks of one qparam's values
    slices = max(1, min(steps, -(-_PROGRAMS // q)))
    chunk = -(-steps // slices) * block
    while chunk > _SLICE_MAX:
        slices *= 2
        chunk = -(-steps // slices) * block
    slices = -(-per_q // chunk)
    # at least a warp's width of bins: the NVIDIA lowering splits them by lane
    return slices, chunk, block, max(32, _pow2(bins))


def add_counts(
    x3: torch.Tensor,
    inv: torch.Tensor,
    off: torch.Tensor,
    out: torch.Tensor,
    absolute: bool,
    has_nonfinite: bool,
) -> torch.Tensor | None:
    """`_add_counts` on the GPU (module docstring), or None to decline: a
    CPU tensor outside the interpreter, float64 values, or counts that are
    not contiguous int64."""
    if not (x3.is_cuda or gpu.interpreted()):
        return None
    if x3.dtype not in _DTYPES or out.dtype != torch.int64:
        return None
    if not out.is_contiguous() or x3.numel() == 0:
        return out if x3.numel() == 0 else None
    n, q, g = x3.shape
    bins = out.shape[-1]
    slices, chunk, block, size = plan(n, q, g, bins)
    _count_kernel[(q, slices)](
        x3.contiguous(),
        inv.to(torch.float32).contiguous(),
        off.to(torch.float32).contiguous(),
        out,
        q,
        g,
        n * g,
        chunk,
        bins,
        ABSOLUTE=bool(absolute),
        ATOMIC=slices > 1,
        BLOCK=block,
        NB=size,
    )
    return out
