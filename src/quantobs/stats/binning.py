"""Counting values on given histogram grids: the binning of `Histogram`.

Bin of a value `x` on the grid `(exponent, offset)` of its qparam:
`floor(x * 2**-exponent) - offset` (of `|x|` for absolute histograms),
exact in float32: a power-of-two scaling and a floor (see
`quantobs.stats.histogram` for the one documented exception). One kernel:
torch ops in blocks of bounded memory with no host read, one native pass on
CPU, or the Triton kernel on CUDA (`quantobs.native.triton_histogram`); all
three skip NaN and clamp other values to the window, and count the same
integers.
"""

from __future__ import annotations

import torch

from quantobs import native
from quantobs.native.dispatch import kernel

__all__ = ["bin_counts"]

# Elements binned per step: one float32 and one int32 workspace of this size.
_CHUNK_ELEMS = 1 << 18
# Largest dense bincount output per step (qparams x bins), 2 MiB of int64.
_CHUNK_COUNTS = 1 << 18


def _chunks(n: int, q: int, g: int, stride: int) -> list[tuple[slice, slice, slice]]:
    """Blocks of the `(n, q, g)` layout of at most `_CHUNK_ELEMS` elements.

    Each block also keeps its dense `bincount` output (qparams x stride) under
    `_CHUNK_COUNTS`. Blocks run along the slowest dim that fits.
    """
    q_step = max(1, min(q, _CHUNK_COUNTS // stride, _CHUNK_ELEMS // max(1, g)))
    if q_step == q and q * g <= _CHUNK_ELEMS:
        n_step = max(1, _CHUNK_ELEMS // max(1, q * g))
        return [
            (slice(n0, min(n, n0 + n_step)), slice(0, q), slice(0, g))
            for n0 in range(0, n, n_step)
        ]
    g_step = g if g <= _CHUNK_ELEMS else _CHUNK_ELEMS
    return [
        (
            slice(n0, n0 + 1),
            slice(q0, min(q, q0 + q_step)),
            slice(g0, min(g, g0 + g_step)),
        )
        for n0 in range(n)
        for q0 in range(0, q, q_step)
        for g0 in range(0, g, g_step)
    ]


def bin_counts(
    x_flat: torch.Tensor,
    exponent: torch.Tensor,
    offset: torch.Tensor,
    out: torch.Tensor,
    absolute: bool,
    has_nonfinite: bool,
) -> None:
    """Add the counts of `x_flat` on the given grids to `out` `(Q, bins)` int64.

    Args:
        x_flat: `(N, *Q, G)` values; NaN entries are skipped (infinities,
            from a batch whose NaN policy raises later, clamp to the ends).
        exponent: `(Q,)` int64 grid exponents (bin width `2**exponent`).
        offset: `(Q,)` int64 cell number of each grid's bin 0.
        out: `(Q, bins)` int64 counts, updated in place.
        absolute: count `|x|`.
        has_nonfinite: `x_flat` holds NaN entries to skip (NaN is skipped
            either way; kept for the kernels' signature).
    """
    n, g = x_flat.shape[0], x_flat.shape[-1]
    x3 = x_flat.reshape(n, -1, g)  # (N, Q, G)
    q = x3.shape[1]
    device = x_flat.device
    inv = torch.ldexp(torch.ones(q, dtype=torch.float64, device=device), -exponent)
    inv = inv.to(torch.float32)  # exact powers of two
    off = offset.to(torch.float32)  # exact: a float32 floor
    _add_counts(x3, inv, off, out, absolute, has_nonfinite)


def _add_counts_native(
    x3: torch.Tensor,
    inv: torch.Tensor,
    off: torch.Tensor,
    out: torch.Tensor,
    absolute: bool,
    has_nonfinite: bool,
) -> torch.Tensor | None:
    """One native pass (NaN skipped); declines float64 inputs."""
    if x3.dtype == torch.float64:
        return None
    done = native.add_counts(x3.to(torch.float32).contiguous(), inv, off, out, absolute)
    return out if done else None


@kernel
def _add_counts(
    x3: torch.Tensor,
    inv: torch.Tensor,
    off: torch.Tensor,
    out: torch.Tensor,
    absolute: bool,
    has_nonfinite: bool,
) -> torch.Tensor:
    """Counts of `(N, Q, G)` values added to `out` `(Q, bins)`: bin
    `floor(x * inv) - off` (of `|x|` when `absolute`), clamped to `[0, bins)`.

    NaN entries are counted in a trash bin that is dropped (every path skips
    them: under a deferred NaN policy they may reach here unannounced, and
    the counts of such a batch are discarded when its error is raised).
    Each block is scaled, floored, shifted and clamped in one float32
    workspace (exact: a power-of-two scaling and a float32 floor), converted
    to int64 and counted by one `index_add_` over `qparam * stride + bin`:
    no host read (a CUDA `bincount` reads the largest index first).
    """
    n, q, g = x3.shape
    bins = out.shape[-1]
    device = x3.device
    inv, off = inv.reshape(1, q, 1), off.reshape(1, q, 1)  # dim > 0: float32 math
    stride = bins + 1  # bin `bins`: the trash
    blocks = _chunks(n, q, g, stride)
    size = max(
        (b[0].stop - b[0].start) * (b[1].stop - b[1].start) * (b[2].stop - b[2].start)
        for b in blocks
    )
    work = torch.empty(size, dtype=torch.float32, device=device)
    index = torch.empty(size, dtype=torch.int64, device=device)
    ones = torch.ones(1, dtype=torch.int64, device=device).expand(size)
    q_base = torch.arange(q, dtype=torch.int64, device=device).reshape(1, q, 1) * stride
    convert = x3.dtype == torch.float64  # bin float32 roundings, as min/max do
    one = q == 1  # one qparam: the counts summed once, over every block
    total = torch.zeros(stride, dtype=torch.int64, device=device) if one else None
    for ns, qs, gs in blocks:
        block = x3[ns, qs, gs]
        shape = block.shape
        buf = work[: block.numel()].view(shape)
        block_scale = inv[:, qs]
        if convert:
            buf.copy_(block).mul_(block_scale)
        else:
            torch.mul(block, block_scale, out=buf)
        if absolute:
            buf.abs_()
        # The only finite index outside [0, bins) comes from the underflow
        # exception of `quantobs.stats.histogram` (cell 0 instead of -1);
        # infinities (a deferred NaN policy) clamp too. NaN: the trash.
        buf.floor_().sub_(off[:, qs]).clamp_(0, bins - 1)
        buf.nan_to_num_(nan=float(bins))
        idx = index[: block.numel()].view(shape)
        idx.copy_(buf)
        num_q = shape[1]
        if num_q > 1:
            idx.add_(q_base[:, :num_q])  # qparam (within the block) * stride
        flat = idx.reshape(-1)
        if total is not None:
            total.index_add_(0, flat, ones[: flat.numel()])
            continue
        found = torch.zeros(num_q * stride, dtype=torch.int64, device=device)
        found.index_add_(0, flat, ones[: flat.numel()])
        out[qs] += found.view(num_q, stride)[:, :bins]
    if total is not None:
        out += total[:bins]
    return out


def _add_counts_gpu(
    x3: torch.Tensor,
    inv: torch.Tensor,
    off: torch.Tensor,
    out: torch.Tensor,
    absolute: bool,
    has_nonfinite: bool,
) -> torch.Tensor | None:
    """The Triton kernel (`quantobs.native.triton_histogram`), imported here,
    for the first CUDA tensor: the dispatch calls it only where Triton
    imports."""
    from quantobs.native import triton_histogram  # imports Triton

    return triton_histogram.add_counts(x3, inv, off, out, absolute, has_nonfinite)


_add_counts.register("cpu", _add_counts_native)
_add_counts.register("cuda", _add_counts_gpu)
