"""Moving histogram counts onto coarser nested grids: `Histogram`'s re-binning.

Power-of-two grids anchored at 0 nest (`quantobs.stats.histogram`): old
cell `c` lies inside new cell `c >> shift`, so counts move whole, exactly.
`rebin_counts` is a kernel: on a device every row moves (a row whose grid
did not change moves onto itself) with no host read; on the CPU only the
changed rows move.
"""

from __future__ import annotations

import torch

from quantobs.native.dispatch import kernel

__all__ = ["rebin_counts"]


def _moved(
    counts: torch.Tensor,
    old_offset: torch.Tensor,
    shift: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """`counts` `(R, bins)` on the new grids: old cell `c` goes to new bin
    `(c >> shift) - offset` (`(R,)` each; shift 0 and the same offset: in place)."""
    bins = counts.shape[-1]
    old_cells = old_offset[:, None] + torch.arange(
        bins, device=counts.device
    )  # (R, bins) cell numbers on the old grid
    new_index = (old_cells >> shift.clamp(0, 63)[:, None]) - offset[:, None]
    # Bins outside the new window are empty (the window covers the data).
    new_index.clamp_(0, bins - 1)
    return torch.zeros_like(counts).scatter_add_(1, new_index, counts)


# Rows re-binned per step of the device path (int64 temporaries of this size).
_REBIN_ELEMS = 1 << 22


@kernel
def rebin_counts(
    counts: torch.Tensor,
    changed: torch.Tensor,
    old_offset: torch.Tensor,
    shift: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """`counts` `(Q, bins)` with the `changed` `(Q,)` rows moved (`_moved`).

    The reference moves every row (an unchanged one onto itself: shift 0,
    the same offset), in blocks of bounded memory, with no host read: the
    path of device tensors. The CPU registration reads which rows changed
    (free on the host) and moves only those, returning `counts` itself
    where none did.
    """
    bins = counts.shape[-1]
    # unchanged rows: shift 0 onto their own offset (empty rows stay empty)
    shift = torch.where(changed, shift, 0)
    offset = torch.where(changed, offset, old_offset)
    step = max(1, _REBIN_ELEMS // max(1, bins))
    if counts.numel() == 0:
        return counts.clone()
    return torch.cat(
        [
            _moved(
                counts[r : r + step],
                old_offset[r : r + step],
                shift[r : r + step],
                offset[r : r + step],
            )
            for r in range(0, counts.shape[0], step)
        ]
    )


def _rebin_counts_cpu(
    counts: torch.Tensor,
    changed: torch.Tensor,
    old_offset: torch.Tensor,
    shift: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor | None:
    if not bool(changed.any()):
        return counts
    rows = changed.nonzero().squeeze(1)
    moved = _moved(counts[rows], old_offset[rows], shift[rows], offset[rows])
    return counts.index_copy(0, rows, moved)


rebin_counts.register("cpu", _rebin_counts_cpu)
