"""Per-channel and per-block reductions in Quark's qparam layouts, on views.

Quark moves the axis with `permute` / `transpose`, copies with `reshape` and
pads with zeros before reducing. Here the input is only viewed: an axis of
size `A` split into blocks is the view `(*pre, A // block, block, *post)`,
reduced over the block dim, and only the small result is rearranged into
Quark's order. The layouts::

    per channel  (C,)                 C = x.shape[ch_axis]
    per group    (rows, A // g)       rows: x with ch_axis swapped with the
    MX / BFP     (rows, ceil(A / b))  last dim, all dims but the last flattened

A trailing partial block (MX / BFP: Quark pads it with zeros) is reduced on
its own, zeros included, so its min / max equal Quark's padded block's.

Short blocks along the last axis of a float32 / float64 tensor (BFP16's 8)
are reduced by max-pooling: an `amax` over an innermost dim of 8 runs at a
quarter of memory speed on CPU, `max_pool1d` at full speed; the minimum is
the max-pool of `-x`, negated a cache-sized chunk of rows at a time.
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_minmax", "channel_minmax", "channel_view", "normalize_axis"]

_POOL_MAX_BLOCK = 16  # blocks up to this size are max-pooled (see above)
_POOL_CHUNK = 1 << 18  # elements negated per step: stays in cache


def normalize_axis(axis: int, ndim: int, what: str = "ch_axis") -> int:
    """`axis` in `0 .. ndim - 1`.

    Raises:
        ValueError: `axis` is out of range for an `ndim`-dimensional input.
    """
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{what}={axis} is out of range for a {ndim}-D input; use an axis "
            f"in {-ndim}..{ndim - 1}"
        )
    return axis % ndim


def channel_view(x: torch.Tensor, ch_axis: int) -> torch.Tensor:
    """`x` as `(pre, C, post)` (a view when `x` is contiguous).

    A 1-D input is `(1, C, 1)`: each element is a channel.
    """
    axis = normalize_axis(ch_axis, max(x.ndim, 1))
    shape = x.shape if x.ndim else (1,)
    pre = math.prod(shape[:axis])
    post = math.prod(shape[axis + 1 :])
    return x.reshape(pre, shape[axis], post)


def channel_minmax(x: torch.Tensor, ch_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel `(min, max)`, each `(C,)` in `x.dtype`."""
    view = channel_view(x, ch_axis)  # (pre, C, post)
    return view.amin(dim=(0, 2)), view.amax(dim=(0, 2))


def block_minmax(
    x: torch.Tensor, axis: int, block: int, *, pad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of every block of `block` elements along `axis`.

    Args:
        x: any shape, at least 1-D.
        axis: the axis the blocks run along.
        block: block size, or -1 for the whole axis.
        pad: allow a trailing partial block, counted with zeros (Quark's
            zero padding); otherwise the axis must divide.

    Returns:
        `(min, max)`, each `(rows, num_blocks)` in Quark's order (module
        docstring), dtype of `x`.

    Raises:
        ValueError: `block` does not divide the axis and `pad` is False.
    """
    if x.ndim == 0:
        x = x.reshape(1)
    axis = normalize_axis(axis, x.ndim)
    size = x.shape[axis]
    block = size if block == -1 else block
    full, rem = divmod(size, block)
    if rem and not pad:
        raise ValueError(
            f"the axis {axis} of size {size} does not divide into groups of "
            f"{block}; use a group_size that divides {size}"
        )
    if (
        axis == x.ndim - 1
        and not rem
        and block <= _POOL_MAX_BLOCK
        and x.dtype in (torch.float32, torch.float64)
        and x.is_contiguous()
    ):
        return _pooled_minmax(x.reshape(-1, size), block)
    pre, post = x.shape[:axis], x.shape[axis + 1 :]
    mins, maxs = [], []
    if full:
        body = x.narrow(axis, 0, full * block).reshape(*pre, full, block, *post)
        mins.append(body.amin(dim=axis + 1))  # (*pre, full, *post)
        maxs.append(body.amax(dim=axis + 1))
    if rem:
        tail = x.narrow(axis, full * block, rem)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        mins.append(torch.minimum(tail.amin(dim=axis, keepdim=True), zero))
        maxs.append(torch.maximum(tail.amax(dim=axis, keepdim=True), zero))
    num_blocks = full + (1 if rem else 0)
    out = []
    for parts in (mins, maxs):
        reduced = parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)
        # (*pre, nb, *post) -> Quark's swap of `axis` with the last dim
        out.append(reduced.transpose(axis, -1).reshape(-1, num_blocks))
    return out[0], out[1]


def _pooled_minmax(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(min, max)` of each block of `block` along the last dim of `(R, L)`."""
    num_rows, length = rows.shape
    pool = torch.nn.functional.max_pool1d
    high = pool(rows.unsqueeze(0), block, block)[0]  # (R, L // block)
    low = torch.empty_like(high)
    step = max(1, _POOL_CHUNK // length)
    work = torch.empty(
        min(step, num_rows), length, dtype=rows.dtype, device=rows.device
    )
    for start in range(0, num_rows, step):  # chunks of rows, not blocks
        chunk = rows[start : start + step]
        negated = torch.neg(chunk, out=work[: chunk.shape[0]])
        low[start : start + step] = pool(negated.unsqueeze(0), block, block)[0]
    return low.neg_(), high
