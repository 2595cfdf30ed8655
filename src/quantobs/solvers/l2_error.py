"""The closed-form L2 error of a histogram quantized to a uniform grid.

The L2 error of torch's closed form, for any range: the histogram is a
piecewise-uniform density (bin j holds counts[j] spread evenly over it); the
candidate range [lo, hi] is cut into `levels` equal destination bins of
width D = (hi - lo) / levels whose centers are the quantized values; values
below lo (above hi) go to the first (last) center. torch's
`_compute_quantization_error` is this integral for bin-edge ranges and
`dst_nbins` levels (`quantobs.solvers.torch_l2` reproduces torch's float32
arithmetic of it; this module computes it exactly, in float64).

Positions are in bin units, u = (x - lo_edge) / width, and moments are taken
about the histogram's middle (fewer digits lost in float64). A prefix table
(`prefix_moments`) gives the moments up to any position in one gather, so
the error of a range is O(levels) (`exact_errors`, and its kernel for one
histogram, `row_errors`) or O(1) when the density is taken as uniform within
each destination bin (`approx_errors`); `l2_candidate_errors` is the kernel of
either over many small histograms, each with its own candidates.
`quantobs.solvers.global_l2` searches with them; `quantobs.solvers.l2_bounds`
bounds them from below. `quantobs.solvers.l2_batched` and
`quantobs.solvers.histogram_mse` use the exact form only for formats of at
most `EXACT_LEVELS` levels (int4 and narrower), each in its own way.
"""

from __future__ import annotations

import torch

from quantobs import native
from quantobs.core.exact import divide
from quantobs.native.dispatch import kernel

__all__ = [
    "EXACT_LEVELS",
    "approx_errors",
    "as_rows",
    "exact_errors",
    "l2_candidate_errors",
    "l2_errors",
    "moments_at",
    "prefix_moments",
    "region_error",
    "row_errors",
]

_EXACT_ELEMS = 1 << 21  # float64 elements per exact-error temporary
EXACT_LEVELS = 32  # the searches' exact form: formats of at most this many levels


def prefix_moments(counts: torch.Tensor) -> torch.Tensor:
    """`(Q, bins, 4)` table: moments at position u in bin j are affine in u.

    With `P_p[j]` the prefix sums of `counts[i] * int_i^{i+1} x^p dx` (x
    centered on the histogram's middle) and `h = counts[j]`::

        int_0^u x^p rho = P_p[j] + h * (u^(p+1) - j^(p+1)) / (p + 1)
                        = A_p[j] + h * u^(p+1) / (p + 1)

    The table holds `A_0, A_1, A_2, h` per bin: one gather per position.
    """
    num_q, bins = counts.shape
    left = torch.arange(bins + 1, dtype=torch.float64, device=counts.device)
    left = left - bins / 2  # centered bin edges
    table = torch.empty(num_q, bins, 4, dtype=torch.float64, device=counts.device)
    for p in range(3):
        power = divide(left ** (p + 1), p + 1)
        prefix = torch.cumsum(counts * (power[1:] - power[:-1]), dim=1)
        prefix = torch.nn.functional.pad(prefix[:, :-1], (1, 0))  # P_p[j]
        table[..., p] = prefix - counts * power[:-1]
    table[..., 3] = counts
    return table


def moments_at(
    prefix: torch.Tensor, counts: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """`(3, Q, K)` moments `int_0^u x^p rho(x) dx` at positions `u` `(Q, K)`."""
    bins = counts.shape[1]
    u = u.clamp(0, bins)
    j = u.to(torch.int64).clamp(max=bins - 1)  # floor: u >= 0
    found = torch.gather(prefix, 1, j[..., None].expand(*j.shape, 4))
    a0, a1, a2, h = found.unbind(-1)
    uc = u - bins / 2
    hu = h * uc
    out = torch.empty(3, *u.shape, dtype=torch.float64, device=u.device)
    out[0] = a0 + hu
    hu = hu * uc
    out[1] = a1 + hu / 2
    out[2] = a2 + divide(hu * uc, 3)
    return out


def region_error(
    moments_hi: torch.Tensor, moments_lo: torch.Tensor, center: torch.Tensor
) -> torch.Tensor:
    """`int (x - center)^2 rho` over a region, from its end moments."""
    d0, d1, d2 = (moments_hi - moments_lo).unbind(0)
    return d2 - 2 * center * d1 + center * center * d0


def exact_errors(
    prefix: torch.Tensor,
    counts: torch.Tensor,
    lo_u: torch.Tensor,
    hi_u: torch.Tensor,
    levels: int,
) -> torch.Tensor:
    """Exact L2 errors `(Q, C)` of ranges `[lo_u, hi_u]` (bin units)."""
    num_q, num_c = lo_u.shape
    bins = counts.shape[1]
    out = torch.empty(num_q, num_c, dtype=torch.float64, device=lo_u.device)
    k = torch.arange(levels + 1, dtype=torch.float64, device=lo_u.device)
    step = max(1, _EXACT_ELEMS // max(1, num_q * (levels + 1)))
    for c0 in range(0, num_c, step):
        lo, hi = lo_u[:, c0 : c0 + step, None], hi_u[:, c0 : c0 + step, None]
        width = (hi - lo) / levels
        edges = lo + k * width  # (Q, Cc, levels + 1)
        edges[..., 0], edges[..., -1] = 0.0, float(bins)  # tails clip to the ends
        moments = moments_at(prefix, counts, edges.reshape(num_q, -1)).reshape(
            3, *edges.shape
        )
        centers = lo + (k[:-1] + 0.5) * width - bins / 2
        errors = region_error(moments[..., 1:], moments[..., :-1], centers)
        out[:, c0 : c0 + step] = errors.sum(dim=-1)
    return out


@kernel
def row_errors(
    table: torch.Tensor, lo_u: torch.Tensor, hi_u: torch.Tensor, levels: int
) -> torch.Tensor:
    """Exact L2 errors `(K,)` of ranges `[lo_u, hi_u]` `(K,)` over one histogram.

    `exact_errors` of one row (its `(bins, 4)` float64 `prefix_moments`
    table, whose last column is the counts); a kernel: the native pass
    (registered for "cpu") sums the levels in the same order.
    """
    return exact_errors(table[None], table[None, :, 3], lo_u[None], hi_u[None], levels)[
        0
    ]


row_errors.register("cpu", native.l2_errors)


def approx_errors(
    prefix: torch.Tensor,
    counts: torch.Tensor,
    lo_u: torch.Tensor,
    hi_u: torch.Tensor,
    levels: int,
) -> torch.Tensor:
    """O(1) errors `(Q, C)`: exact clipping, `D**2 / 12` per unit mass inside.

    The inside term is exact when the density is uniform within each
    destination bin, and close when it is smooth on that scale.
    """
    bins = counts.shape[1]
    width = (hi_u - lo_u) / levels
    zero = torch.zeros_like(lo_u)
    ends = torch.stack([zero, lo_u, hi_u, torch.full_like(lo_u, float(bins))], 1)
    m = moments_at(prefix, counts, ends.reshape(lo_u.shape[0], -1)).reshape(
        3, *ends.shape
    )  # (3, Q, 4, C)
    first = lo_u + width / 2 - bins / 2
    last = hi_u - width / 2 - bins / 2
    left = region_error(m[:, :, 1], m[:, :, 0], first)
    right = region_error(m[:, :, 3], m[:, :, 2], last)
    inside = divide((m[0, :, 2] - m[0, :, 1]) * width * width, 12)
    return left + right + inside


@kernel
def l2_candidate_errors(
    counts: torch.Tensor,
    lo_u: torch.Tensor,
    hi_u: torch.Tensor,
    levels: int,
    exact: bool,
) -> torch.Tensor:
    """L2 errors `(Q, C)` of each row's candidate ranges.

    Args:
        counts: `(Q, bins)` float64 counts (one small histogram per row).
        lo_u: `(Q, C)` lower ends, in bin units.
        hi_u: `(Q, C)` upper ends, in bin units.
        levels: destination bins.
        exact: `exact_errors` (O(levels) each) rather than `approx_errors`.

    Returns:
        `(Q, C)` float64 errors in squared bin units, `+inf` where
        `hi_u <= lo_u`. A kernel: the native pass (registered for "cpu")
        builds each row's prefix table itself, with the same arithmetic.
    """
    prefix = prefix_moments(counts)
    score = exact_errors if exact else approx_errors
    errors = score(prefix, counts, lo_u, hi_u, levels)
    return torch.where(hi_u > lo_u, errors, torch.inf)


l2_candidate_errors.register("cpu", native.l2_candidates)


def as_rows(
    counts: torch.Tensor, lo: torch.Tensor, width: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bins = counts.shape[-1]
    return (
        counts.reshape(-1, bins).to(torch.float64),
        lo.reshape(-1).to(torch.float64),
        width.reshape(-1).to(torch.float64),
    )


def l2_errors(
    counts: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    levels: int,
) -> torch.Tensor:
    """torch's closed-form L2 error of candidate ranges, in float64.

    Args:
        counts: `(*Q, bins)` counts.
        lo: `(*Q,)` left edge of bin 0.
        width: `(*Q,)` bin width.
        min_vals: `(*Q, C)` candidate lower ends (any real value).
        max_vals: `(*Q, C)` candidate upper ends, `> min_vals`.
        levels: destination bins (torch's `dst_nbins`).

    Returns:
        `(*Q, C)` errors `int (x - Q(x))**2 rho(x) dx` in squared input units;
        for bin-edge ranges and `levels = dst_nbins` this is what
        `HistogramObserver._compute_quantization_error` computes in float32.
    """
    rows, lo64, width64 = as_rows(counts, lo, width)
    point = width64 <= 0  # one value (torch: min_val == max_val): no error
    width64 = torch.where(point, 1.0, width64)
    num_q = rows.shape[0]
    lo_u = (min_vals.reshape(num_q, -1).to(torch.float64) - lo64[:, None]) / width64[
        :, None
    ]
    hi_u = (max_vals.reshape(num_q, -1).to(torch.float64) - lo64[:, None]) / width64[
        :, None
    ]
    errors = exact_errors(prefix_moments(rows), rows, lo_u, hi_u, levels)
    errors = torch.where(point[:, None], 0.0, errors * width64[:, None] ** 2)
    return errors.reshape(min_vals.shape)
