"""Pure statistics over the canonical layout `(N, *qparam_shape, group_size)`.

Each function reduces `x_flat` over dims `(0, -1)` in float32 and returns one
value per quantization parameter. Merging is part of each statistic's contract:
min/max merge exactly (`merge_minmax`), a moving average merges approximately
(`merge_moving_average`, a count-weighted mean of the two averages).

NaN policy (what an observer does with non-finite inputs)::

    policy   NaN / +-inf in the batch
    raise    ValueError naming the observer, the base name and the count
    omit     ignored: min/max skip them, errors count them as exact (x = 0)
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from quantobs import native
from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import block_view, flatten_for_calibration
from quantobs.core.qparams import range_or_zero

__all__ = [
    "NanPolicy",
    "Range",
    "absmax_or_zero",
    "count_nonfinite",
    "drop_nonfinite",
    "lerp",
    "lerp_ranges",
    "merge_minmax",
    "merge_moving_average",
    "minmax",
    "minmax_of",
    "minmax_omit_nonfinite",
    "range_or_zero",
]

NanPolicy = Literal["raise", "omit"]
Range = tuple[torch.Tensor, torch.Tensor]  # (min_vals, max_vals)


def minmax(x_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-qparam min and max: `(N, *Q, G) -> (*Q,), (*Q,)` in float32.

    NaN propagates (any NaN in a group gives NaN there), so callers can test
    the small result for non-finite values instead of the whole input.
    """
    qshape = x_flat.shape[1:-1]
    if math.prod(qshape) == 1:  # one qparam: a single pass, the floor
        min_vals, max_vals = torch.aminmax(x_flat)
        return min_vals.float().reshape(qshape), max_vals.float().reshape(qshape)
    n, g = x_flat.shape[0], x_flat.shape[-1]
    # contiguous only: a strided layout would be copied first (a second pass)
    found = (
        native.minmax(x_flat.reshape(n, -1, g), tuple(qshape))
        if x_flat.is_contiguous()
        else None
    )
    if found is not None:  # one pass, however small the groups
        return found
    min_vals = torch.amin(x_flat, dim=(0, -1)).to(torch.float32)
    max_vals = torch.amax(x_flat, dim=(0, -1)).to(torch.float32)
    return min_vals, max_vals


def minmax_of(
    value: torch.Tensor,
    base_name: str,
    args: QuantizationArgs,
    g_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`minmax(flatten_for_calibration(value, ...))`, skipping layout copies.

    Block weights are reduced on their 4-D block view (the canonical layout
    would copy the whole weight first); everything else uses the layout view.
    """
    if base_name == "weight" and args.strategy == "block":
        blocks = block_view(value, args)  # (BR, block_rows, BC, block_cols)
        min_vals = blocks.amin(dim=-1).amin(dim=1).to(torch.float32)
        max_vals = blocks.amax(dim=-1).amax(dim=1).to(torch.float32)
        return min_vals, max_vals
    return minmax(flatten_for_calibration(value, base_name, args, g_idx))


def minmax_omit_nonfinite(x_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`minmax` ignoring NaN and +-inf.

    A qparam with no finite value gets the empty range `(+inf, -inf)`, the
    identity of `merge_minmax`; `range_or_zero` turns it into `(0, 0)`.
    """
    finite = torch.isfinite(x_flat)
    inf = torch.tensor(float("inf"), dtype=x_flat.dtype, device=x_flat.device)
    min_vals = torch.where(finite, x_flat, inf).amin(dim=(0, -1))
    max_vals = torch.where(finite, x_flat, -inf).amax(dim=(0, -1))
    return min_vals.to(torch.float32), max_vals.to(torch.float32)


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN and +-inf elements of `x`."""
    return int((~torch.isfinite(x)).sum().item())


def drop_nonfinite(x_flat: torch.Tensor) -> torch.Tensor:
    """`x_flat` with NaN and +-inf replaced by 0 (exact under any scale)."""
    return torch.where(torch.isfinite(x_flat), x_flat, torch.zeros_like(x_flat))


def merge_minmax(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two min/max statistics (associative, commutative)."""
    return torch.minimum(a[0], b[0]), torch.maximum(a[1], b[1])


def lerp(old: torch.Tensor, new: torch.Tensor, weight: float) -> torch.Tensor:
    """Moving-average step `old * (1 - weight) + new * weight`.

    Written as llm-compressor writes it, so the numbers match bit for bit.
    """
    return (old * (1.0 - weight)) + (new * weight)


def lerp_ranges(
    old: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lerp` of two ranges where an empty range `(+inf, -inf)` is no data.

    A qparam empty on one side takes the other side's range unchanged.
    """
    old_empty, new_empty = old[0] > old[1], new[0] > new[1]
    out = []
    for before, after in zip(old, new, strict=True):
        mixed = lerp(before, after, weight)
        mixed = torch.where(old_empty, after, mixed)
        out.append(torch.where(new_empty, before, mixed))
    return out[0], out[1]


def merge_moving_average(
    a: torch.Tensor, count_a: int, b: torch.Tensor, count_b: int
) -> torch.Tensor:
    """Approximate merge of two moving averages: their count-weighted mean.

    A moving average depends on the order of its batches, so no merge can be
    exact; this one equals the average over both when the batches are alike,
    and is what an all-reduce with `AVG` gives for equal counts.
    """
    total = count_a + count_b
    if total == 0:
        return a
    return (a * count_a + b * count_b) / total


def absmax_or_zero(min_vals: torch.Tensor, max_vals: torch.Tensor) -> torch.Tensor:
    """`(1,)` float32 largest `|value|` of the ranges, empty ones counting 0.

    `max(-min, max, 0)` over every qparam with `min <= max` (one native pass
    where the kernels apply); a non-finite range gives a non-finite result.
    """
    amax = native.range_absmax(min_vals, max_vals)
    if amax is not None:
        return torch.tensor([amax], dtype=torch.float32)
    min_vals, max_vals = range_or_zero(min_vals, max_vals)
    low = -min_vals.float().min().clamp(max=0.0)
    return torch.maximum(low, max_vals.float().max().clamp(min=0.0)).reshape(1)
