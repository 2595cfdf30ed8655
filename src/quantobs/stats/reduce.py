"""Per-qparam reductions over the canonical layout `(N, *qparam_shape, G)`.

Every statistic starts from one of these: the batch's min and max per
qparam (dims `(0, -1)` reduced), in float32 (float64 inputs may keep
float64, `exact_dtype=True`). Min and max are exact, so every path (the
native kernel, torch's reductions, any view of the data) gives the same
numbers; NaN propagates, so the small result tells whether the batch held a
non-finite value.

NaN policy (what an observer does with non-finite inputs)::

    policy      NaN / +-inf in the batch
    raise       ValueError naming the observer and the count
    omit        ignored: min/max skip them, histograms do not count them,
                errors count them as exact (x = 0); a batch with no finite
                value at all is skipped (the observer stays as it was: one
                that saw nothing still raises "no statistics")
    propagate   kept: NaN / inf reach the statistics (torch.ao's behaviour)
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from quantobs import native
from quantobs.core.args import QuantizationArgs
from quantobs.core.layout import block_view, flatten_for_calibration
from quantobs.native.dispatch import kernel

__all__ = [
    "NanPolicy",
    "Range",
    "absmax_or_zero",
    "count_nonfinite",
    "drop_nonfinite",
    "finite_range",
    "minmax",
    "minmax_of",
    "minmax_omit_nonfinite",
    "range_or_zero",
    "scan_range",
]

NanPolicy = Literal["raise", "omit", "propagate"]
Range = tuple[torch.Tensor, torch.Tensor]  # (min_vals, max_vals)

# Rows of an outer reduction reduced together on CPU: torch's amin/amax over
# dim 0 of a large (P, M) tensor run at 2-3x the aminmax floor each; over
# blocks of rows that fit in L2 (the amax pass re-reads the block from cache)
# both together take 1.1-1.5x the floor (4096x4096, 16384x1024, 65536x256).
_BLOCK_BYTES = 512 << 10
# Below this many values per group, an (N, Q, G) layout with N > 1 is reduced
# as an outer reduction over (N, Q * G) instead of short inner rows.
_MIN_INNER = 16


def _outer_minmax(x2: torch.Tensor) -> Range:
    """`(P, M) -> (M,), (M,)`: min and max over dim 0, in cache-sized blocks."""
    rows = _BLOCK_BYTES // max(1, x2.shape[1] * x2.element_size())
    if x2.device.type != "cpu" or rows < 2 or rows >= x2.shape[0]:
        return x2.amin(0), x2.amax(0)
    blocks = x2.split(rows)  # each (rows, M) fits in L2: amax re-reads from cache
    min_vals, max_vals = blocks[0].amin(0), blocks[0].amax(0)
    for block in blocks[1:]:
        torch.minimum(min_vals, block.amin(0), out=min_vals)
        torch.maximum(max_vals, block.amax(0), out=max_vals)
    return min_vals, max_vals


#: `_minmax3`'s result: `(Q,)` min and max, the absmax (a host float when
#: the native scan saw every value finite, a `(1,)` device tensor from the
#: GPU scan, or None) and the NaN policy's findings (`Batch.findings`, or None)
Scan3 = tuple[
    torch.Tensor, torch.Tensor, float | torch.Tensor | None, torch.Tensor | None
]


@kernel
def _minmax3(x3: torch.Tensor, absmax: bool = False) -> Scan3:
    """`(N, Q, G)` contiguous -> `(Q,)` min and max in x3's dtype (or
    float32: exact either way), and what came with them for free (`Scan3`;
    None here: torch's reductions do not tell). `absmax`: the caller keeps
    the absmax (a GPU scan then computes it in the same pass)."""
    n, q, g = x3.shape
    if g >= _MIN_INNER or n == 1:
        # rows of G: inner reductions, then the small (N, Q) one
        low, high = x3.amin(2), x3.amax(2)  # (N, Q)
        if n == 1:
            return low[0], high[0], None, None
        return low.amin(0), high.amax(0), None, None
    low, high = _outer_minmax(x3.reshape(n, q * g))  # (Q * G,)
    return low.view(q, g).amin(1), high.view(q, g).amax(1), None, None


def _minmax3_native(x3: torch.Tensor, absmax: bool = False) -> Scan3 | None:
    found = native.minmax_absmax(x3)
    return None if found is None else (*found, None)


def _minmax3_gpu(x3: torch.Tensor, absmax: bool = False) -> Scan3 | None:
    from quantobs.native import triton_minmax  # imports Triton

    return triton_minmax.minmax3(x3, absmax)


_minmax3.register("cpu", _minmax3_native)
_minmax3.register("cuda", _minmax3_gpu)


def _result_dtype(x: torch.Tensor, exact_dtype: bool) -> torch.dtype:
    return torch.float64 if exact_dtype and x.dtype == torch.float64 else torch.float32


def scan_range(
    x_flat: torch.Tensor, *, exact_dtype: bool = False, absmax: bool = False
) -> Scan3:
    """The batch's per-qparam min and max, and what came with them.

    Args:
        x_flat: `(N, *Q, G)` values (any float dtype, any device).
        exact_dtype: keep float64 for float64 inputs (else float32).
        absmax: the caller keeps the absmax (the GPU scan computes it).

    Returns:
        `(min_vals, max_vals, absmax, findings)`: `(*Q,)` each (NaN where a
        group holds NaN); `max(-min, max, 0)` over every qparam where the
        native kernel ran and every value was finite (a float), or where
        the GPU kernel ran with `absmax` (a `(1,)` tensor, non-finite where
        a value was), else None; the GPU kernel's NaN-policy findings
        (`Batch.findings`), else None.
    """
    qshape = tuple(x_flat.shape[1:-1])
    dtype = _result_dtype(x_flat, exact_dtype)
    if math.prod(qshape) == 1:  # one qparam: a single pass, the floor
        low, high = torch.aminmax(x_flat)
        return low.to(dtype).reshape(qshape), high.to(dtype).reshape(qshape), None, None
    if not x_flat.is_contiguous():  # strided: torch reduces it in place
        low, high = x_flat.amin(dim=(0, -1)), x_flat.amax(dim=(0, -1))
        return low.to(dtype), high.to(dtype), None, None
    x3 = x_flat
    if x_flat.ndim != 3:
        x3 = x_flat.reshape(x_flat.shape[0], -1, x_flat.shape[-1])
    low, high, found_absmax, findings = _minmax3(x3, absmax)
    low, high = low.to(dtype), high.to(dtype)  # no op where float32 already
    if low.shape != qshape:
        low, high = low.reshape(qshape), high.reshape(qshape)
    return low, high, found_absmax, findings


def minmax(x_flat: torch.Tensor, *, exact_dtype: bool = False) -> Range:
    """Per-qparam min and max: `(N, *Q, G) -> (*Q,), (*Q,)`, float32.

    NaN propagates (any NaN in a group gives NaN there), so callers can test
    the small result for non-finite values instead of the whole input.
    `exact_dtype` keeps float64 for float64 inputs.
    """
    min_vals, max_vals, _, _ = scan_range(x_flat, exact_dtype=exact_dtype)
    return min_vals, max_vals


def minmax_of(
    value: torch.Tensor,
    base_name: str,
    args: QuantizationArgs,
    g_idx: torch.Tensor | None = None,
) -> Range:
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


def minmax_omit_nonfinite(x_flat: torch.Tensor, *, exact_dtype: bool = False) -> Range:
    """`minmax` ignoring NaN and +-inf.

    A qparam with no finite value gets the empty range `(+inf, -inf)`, the
    identity of a min/max merge; `range_or_zero` turns it into `(0, 0)`.
    """
    finite = torch.isfinite(x_flat)
    inf = torch.tensor(float("inf"), dtype=x_flat.dtype, device=x_flat.device)
    min_vals = torch.where(finite, x_flat, inf).amin(dim=(0, -1))
    max_vals = torch.where(finite, x_flat, -inf).amax(dim=(0, -1))
    dtype = _result_dtype(x_flat, exact_dtype)
    return min_vals.to(dtype), max_vals.to(dtype)


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN and +-inf elements of `x`."""
    return int((~torch.isfinite(x)).sum().item())


def drop_nonfinite(x_flat: torch.Tensor) -> torch.Tensor:
    """`x_flat` with NaN and +-inf replaced by 0 (exact under any scale)."""
    return torch.where(torch.isfinite(x_flat), x_flat, torch.zeros_like(x_flat))


def range_or_zero(min_vals: torch.Tensor, max_vals: torch.Tensor) -> Range:
    """Empty ranges `(+inf, -inf)` (qparams that saw no finite value) -> `(0, 0)`.

    Elementwise, without reading anything on the host (other ranges keep
    their bits)."""
    empty = min_vals > max_vals
    zero = torch.zeros((), dtype=min_vals.dtype, device=min_vals.device)
    return torch.where(empty, zero, min_vals), torch.where(empty, zero, max_vals)


def finite_range(selected: Range, observed: Range) -> Range:
    """A solver's range made finite wherever the observed data was finite.

    A solver working near the float32 maximum can overflow: a histogram's
    last bin edge past it becomes `+-inf` when the range is cast to float32,
    and `inf - inf` in later arithmetic NaN. Per qparam whose observed range
    is finite and non-empty::

        selected end       becomes
        +inf / -inf        +max / -max of its dtype (saturated)
        NaN                the observed end
        finite             itself

    Qparams without data (an empty observed range), with non-finite data
    (`nan_policy="propagate"`) or whose selection is the empty range
    `(+inf, -inf)` (e.g. every value left out) keep the selected range; a
    finite selection keeps its bits. Elementwise, without reading anything
    on the host.

    Args:
        selected: the solver's `(*Q,)` `(min_vals, max_vals)`.
        observed: the data's `(*Q,)` `(min_vals, max_vals)`.
    """
    low, high = selected
    data_low, data_high = observed[0].to(low.dtype), observed[1].to(high.dtype)
    top = torch.finfo(low.dtype).max
    # finite and non-empty: -max <= data_low <= data_high <= max (NaN fails);
    # few ops (each a kernel launch on a GPU)
    seen = (data_low >= -top) & (data_low <= data_high) & (data_high <= top)
    seen &= (low != math.inf) | (high != -math.inf)
    out = []
    for end, data in ((low, data_low), (high, data_high)):
        fixed = torch.where(torch.isnan(end), data, end.clamp(-top, top))
        out.append(torch.where(seen, fixed, end))
    return out[0], out[1]


@kernel
def _range_absmax(min_vals: torch.Tensor, max_vals: torch.Tensor) -> torch.Tensor:
    min_vals, max_vals = range_or_zero(min_vals, max_vals)
    low = -min_vals.float().min().clamp(max=0.0)
    return torch.maximum(low, max_vals.float().max().clamp(min=0.0)).reshape(1)


def _range_absmax_native(
    min_vals: torch.Tensor, max_vals: torch.Tensor
) -> torch.Tensor | None:
    found = native.range_absmax(min_vals, max_vals)
    return None if found is None else torch.tensor([found], dtype=torch.float32)


_range_absmax.register("cpu", _range_absmax_native)


def absmax_or_zero(min_vals: torch.Tensor, max_vals: torch.Tensor) -> torch.Tensor:
    """`(1,)` float32 largest `|value|` of the ranges, empty ones counting 0.

    `max(-min, max, 0)` over every qparam with `min <= max`; a non-finite
    range gives a non-finite result.
    """
    return _range_absmax(min_vals, max_vals)
