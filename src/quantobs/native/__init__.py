"""Optional native kernels: min/max, MSE candidate errors, histogram counts.

The Python wrappers of the kernels (the ops). The library they call is built
when quantobs is installed and loaded with ctypes by
`quantobs.native.loader` (how it is built: `quantobs.native.build`; its C
sources: `qo_*.c` next to this file). Nothing requires it: without it (no C
compiler at install: one `RuntimeWarning` says so), with
`QUANTOBS_NATIVE=0`, or after `set_enabled(False)`, every caller runs its
eager torch twin, which gives the same min/max bit for bit and the same MSE
errors to float32 rounding (the kernel's `|e| ** 2.4` is within 3e-7
relative of `powf`, and sums are float64). `backend_info()` says which runs.

The kernels take contiguous float32 CPU tensors (the canonical layout
`(N, Q, G)` where they reduce per qparam); each function returns None (or
False) where it does not apply, and the caller falls back to torch.
`histc` is `torch.histc`'s twin for the torch.ao face, exact where it runs.
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import TYPE_CHECKING

import torch

from quantobs.core.formats import NumberFormat

if TYPE_CHECKING:
    from quantobs.native.loader import BackendInfo

__all__ = [
    "add_counts",
    "all_finite",
    "available",
    "backend_info",
    "entropy",
    "histc",
    "histogram_pass",
    "l2_errors",
    "l2_survivors",
    "minmax",
    "minmax_absmax",
    "mse_errors",
    "mse_supported",
    "pow24",
    "range_absmax",
    "set_enabled",
    "symmetric_scales",
    "torch_l2_terms",
]

_NORMS = (2.0, 2.4)  # the kernel's fast error powers; others stay eager
_MIN_GROUP = 8  # shortest group the min/max and MSE kernels take
_LOG_TABLE = 1 << 20  # entropy: level masses below this get their log from a table
_EXACT_QUOTIENT = 1 << 28  # torch_l2_terms: bins * dst_nbins below this
_SERIAL_ELEMS = 1 << 13  # torch_l2_terms runs this much work on one thread
# Below this many values a kernel runs on one thread: waking the others costs
# more than it saves (~10 us idle, milliseconds on a loaded machine).
_PARALLEL_MIN = 1 << 15

_enabled = os.environ.get("QUANTOBS_NATIVE", "1") != "0"


def _threads(work: int) -> int:
    """Threads for `work` values: torch's count, or one for small work."""
    return torch.get_num_threads() if work >= _PARALLEL_MIN else 1


def set_enabled(enabled: bool) -> bool:
    """Turn the native kernels on or off; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def _library() -> ctypes.CDLL | None:
    # Imported late: `python -m quantobs.native.build` runs build.py, which
    # must not be imported before (the loader imports it).
    from quantobs.native import loader

    return loader.library()


def _loaded() -> ctypes.CDLL:
    lib = _library()
    if lib is None:  # callers check available() first
        raise RuntimeError("quantobs native kernels are not available")
    return lib


def available() -> bool:
    """Whether the native kernels are enabled and loaded.

    The first call loads the library; if it is missing, fails to load or is
    stale, that call issues one `RuntimeWarning` (per process) and the
    callers run torch. No warning while the kernels are turned off.
    """
    return _enabled and _library() is not None


def backend_info() -> BackendInfo:
    """Which implementation runs the ops (native: the library and its build;
    torch: why). Loads the library if enabled; never warns."""
    from quantobs.native import loader

    return loader.backend_info(_enabled)


def _usable(x: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x.numel() > 0
        and available()
    )


def minmax_absmax(
    x3: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, float | None] | None:
    """`(N, Q, G)` float32 -> `(Q,)` min and max over N and G, and the largest
    `|value|` when every value was finite (else None); or None (not run).

    Equal to `torch.amin` / `torch.amax` over dims `(0, 2)` (NaN propagates).
    Groups shorter than 8 values stay with torch, which vectorizes across
    qparams there.
    """
    if x3.ndim != 3 or x3.shape[-1] < _MIN_GROUP or not _usable(x3):
        return None
    n, q, g = x3.shape
    mins, maxs = torch.empty(2, q, dtype=torch.float32)  # one allocation
    absmax = ctypes.c_float()
    finite = _loaded().qo_minmax(
        x3.data_ptr(),
        n,
        q,
        g,
        mins.data_ptr(),
        maxs.data_ptr(),
        ctypes.byref(absmax),
        _threads(x3.numel()),
    )
    return mins, maxs, absmax.value if finite else None


def minmax(
    x3: torch.Tensor, shape: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`minmax_absmax` without the absmax, as `(Q,)` (or `shape`) tensors."""
    found = minmax_absmax(x3)
    if found is None:
        return None
    mins, maxs, _ = found
    if shape is not None:
        mins, maxs = mins.reshape(shape), maxs.reshape(shape)
    return mins, maxs


def _ranges_usable(min_vals: torch.Tensor, max_vals: torch.Tensor) -> bool:
    return min_vals.shape == max_vals.shape and _usable(min_vals) and _usable(max_vals)


def all_finite(x: torch.Tensor) -> bool | None:
    """Whether every value of a float32 tensor is finite, or None (not run:
    small tensors too, where torch's one reduction is cheaper than a call)."""
    if x.numel() < _PARALLEL_MIN or not _usable(x):
        return None
    return bool(_loaded().qo_all_finite(x.data_ptr(), x.numel(), _threads(x.numel())))


def symmetric_scales(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    divisor: float,
    global_scale: float | None,
    scale_fp8: bool,
    eps: float,
    empty_as_zero: bool,
) -> torch.Tensor | None:
    """Scales of symmetric (non-MX) args from float32 ranges, or None.

    `calculate_qparams`' float32 arithmetic in its order: `max(-min, max, 0)
    / divisor`, times the global scale, rounded to FP8 e4m3 (saturating)
    where `scale_fp8`, zeros replaced by `eps`. None (take the torch path,
    which raises the right error) for a non-finite value, `min > max` unless
    `empty_as_zero` (then such a range counts as `(0, 0)`), or an overflow.
    """
    if not _ranges_usable(min_vals, max_vals):
        return None
    out = torch.empty_like(min_vals)
    bad = _loaded().qo_symmetric_scales(
        min_vals.data_ptr(),
        max_vals.data_ptr(),
        min_vals.numel(),
        divisor,
        1.0 if global_scale is None else global_scale,
        global_scale is not None,
        scale_fp8,
        eps,
        empty_as_zero,
        out.data_ptr(),
        _threads(min_vals.numel()),
    )
    return None if bad else out


def range_absmax(min_vals: torch.Tensor, max_vals: torch.Tensor) -> float | None:
    """`max(-min, max, 0)` over the non-empty (`min <= max`) float32 ranges.

    None where the kernels do not apply or a non-empty range is not finite.
    """
    if not _ranges_usable(min_vals, max_vals):
        return None
    out = ctypes.c_float()
    bad = _loaded().qo_range_absmax(
        min_vals.data_ptr(),
        max_vals.data_ptr(),
        min_vals.numel(),
        ctypes.byref(out),
        _threads(min_vals.numel()),
    )
    return None if bad else out.value


def add_counts(
    x3: torch.Tensor,
    inv: torch.Tensor,
    offset: torch.Tensor,
    counts: torch.Tensor,
    absolute: bool,
) -> bool:
    """Add the histogram counts of `x3` into `counts`; False if not run.

    Args:
        x3: `(N, Q, G)` float32 values; NaN entries are skipped.
        inv: `(Q,)` float32 inverse bin widths (powers of two).
        offset: `(Q,)` float32 integer offsets of each grid's bin 0.
        counts: `(Q, bins)` contiguous int64 counts, updated in place.
        absolute: count `abs(x)`.

    Bin of x: `floor(x * inv) - offset`, clamped to `[0, bins)` (see
    `quantobs.stats.histogram`, whose torch path computes the same).
    """
    if x3.ndim != 3 or not _usable(x3):
        return False
    if counts.dtype != torch.int64 or not counts.is_contiguous():
        return False
    n, q, g = x3.shape
    if (
        counts.ndim != 2
        or counts.shape[0] != q
        or inv.numel() != q
        or offset.numel() != q
    ):
        raise ValueError(
            f"counts must be ({q}, bins) and inv, offset ({q},) for {q} qparams"
        )
    inv = inv.to(torch.float32).contiguous()
    offset = offset.to(torch.float32).contiguous()
    _loaded().qo_histogram(
        x3.data_ptr(),
        n,
        q,
        g,
        inv.data_ptr(),
        offset.data_ptr(),
        counts.shape[-1],
        int(absolute),
        counts.data_ptr(),
        _threads(x3.numel()),
    )
    return True


def histogram_pass(
    x: torch.Tensor, inv: float, offset: float, bins: int, absolute: bool, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Min/max and counts on a known grid in one pass over float32 `x`.

    Args:
        x: the values (any shape, contiguous float32).
        inv, offset: the grid, as in `add_counts` (one qparam).
        bins: number of bins.
        absolute: count `abs(x)`.
        cap: most values each thread may set aside.

    Returns:
        None where the kernels do not apply, else `(ends, counts, side)`:
        `(2,)` min and max of the non-NaN values, `(bins,)` int64 counts of
        the values whose bin lies in `[0, bins)`, and the other values
        (outside the window, NaN, or negative and below 2**-100 in
        magnitude: a NaN input shows up here), or None if a thread found more
        than `cap` of them.
    """
    if not _usable(x):
        return None
    threads = torch.get_num_threads()
    ends = torch.empty(2, dtype=torch.float32)
    counts = torch.zeros(bins, dtype=torch.int64)
    side = torch.empty(threads * cap, dtype=torch.float32)
    side_count = torch.zeros(threads, dtype=torch.int64)
    overflow = _loaded().qo_histogram_pass(
        x.data_ptr(),
        x.numel(),
        inv,
        offset,
        bins,
        int(absolute),
        counts.data_ptr(),
        ends.data_ptr(),
        side.data_ptr(),
        cap,
        side_count.data_ptr(),
        threads,
    )
    if overflow:
        return ends, counts, None
    pieces = [side[t * cap : t * cap + k] for t, k in enumerate(side_count.tolist())]
    return ends, counts, torch.cat(pieces)


# float32 counts are exact integers up to here; past it torch.histc rounds
_EXACT_FLOAT_COUNT = 1 << 24


def histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor | None:
    """`torch.histc(x, bins, min=lo, max=hi)` bit for bit, or None.

    Same float32 bin selection as torch (`int(((v - lo) * bins) / (hi - lo))`,
    the last bin closed, values outside `[lo, hi]` and NaN skipped), counted
    exactly; returns None (use torch.histc) for non-float32 input, `lo >= hi`,
    `(hi - lo) * bins` beyond float32 (torch's own binning overflows there),
    or a bin reaching 2**24, where torch's float32 counts stop being exact.
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or not available():
        return None
    lo32, hi32 = torch.tensor([lo, hi], dtype=torch.float32).tolist()
    # (v - lo) * bins must not overflow float32 (torch then bins by UB casts)
    if not (lo32 < hi32 and (hi32 - lo32) * bins < 1e38):
        return None
    if x.numel() == 0 or bins < 1 or bins >= 1 << 30:
        return None
    values = x.reshape(-1).contiguous()
    counts = torch.zeros(bins, dtype=torch.int64)
    _loaded().qo_histc(
        values.data_ptr(),
        values.numel(),
        lo32,
        hi32,
        bins,
        counts.data_ptr(),
        _threads(values.numel()),
    )
    if int(counts.max()) >= _EXACT_FLOAT_COUNT:
        return None
    return counts.to(torch.float32)


def torch_l2_terms(
    histogram: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    bin_width: torch.Tensor,
    dst_nbins: int,
) -> torch.Tensor | None:
    """The `(P, bins)` float32 terms of torch.ao's histogram L2 error, or None.

    `solvers.torch_l2.torch_l2_errors`' arithmetic (torch's
    `_compute_quantization_error` before its sum) for P proposals: `(P,)`
    start and end bins and float64 source bin widths; `histogram` is
    `(P, bins)` or `(1, bins)` float32. None also where a destination width
    rounds to a float32 zero (torch divides by it; the eager twin follows).
    """
    if not _usable(histogram) or histogram.ndim != 2:
        return None
    count, bins = starts.numel(), histogram.shape[1]
    if bins * dst_nbins >= _EXACT_QUOTIENT:  # the kernel's fmod needs q < 2**29
        return None
    if histogram.shape[0] not in (1, count) or {ends.numel(), bin_width.numel()} != {
        count
    }:
        raise ValueError(
            "histogram must be (1 or P, bins) and starts, ends, widths (P,)"
        )
    starts = starts.to(torch.int64).contiguous()
    ends = ends.to(torch.int64).contiguous()
    bin_width = bin_width.to(torch.float64).contiguous()
    out = torch.empty(count, bins, dtype=torch.float32)
    bad = _loaded().qo_torch_l2_terms(
        histogram.data_ptr(),
        bins,
        int(histogram.shape[0] == 1),
        count,
        starts.data_ptr(),
        ends.data_ptr(),
        bin_width.data_ptr(),
        dst_nbins,
        out.data_ptr(),
        # small blocks: waking a second thread costs more than it saves
        1 if count * bins <= _SERIAL_ELEMS else torch.get_num_threads(),
    )
    return None if bad else out


def l2_errors(
    table: torch.Tensor, lo_u: torch.Tensor, hi_u: torch.Tensor, levels: int
) -> torch.Tensor | None:
    """Exact L2 errors of ranges `[lo_u, hi_u]` `(K,)` over one histogram.

    `table`: its `(bins, 4)` float64 `_prefix_moments` rows. The same
    arithmetic as `solvers.l2_error.exact_errors` (the level sums in order);
    None where the kernels are not available.
    """
    if table.device.type != "cpu" or not available():
        return None
    if table.ndim != 2 or table.shape[1] != 4 or lo_u.numel() != hi_u.numel():
        raise ValueError("table must be (bins, 4) and lo_u, hi_u of one length")
    table = table.to(torch.float64).contiguous()
    lo_u = lo_u.to(torch.float64).contiguous()
    hi_u = hi_u.to(torch.float64).contiguous()
    out = torch.empty(lo_u.numel(), dtype=torch.float64)
    _loaded().qo_l2_errors(
        table.data_ptr(),
        table.shape[0],
        lo_u.data_ptr(),
        hi_u.data_ptr(),
        lo_u.numel(),
        levels,
        out.data_ptr(),
        _threads(lo_u.numel() * levels),
    )
    return out


def l2_survivors(
    at: torch.Tensor,
    start: torch.Tensor,
    total: torch.Tensor,
    jumps: torch.Tensor,
    jump_weight: float,
    levels: int,
    na: int,
    b0: int,
    limit: float,
    cap: int,
) -> torch.Tensor | None:
    """Bin-edge ranges left in the running by `solvers.l2_bounds.L2Bounds`.

    For one histogram of `bins` bins: `at` `(3, bins + 1)` moments at each
    edge, `start` and `total` `(3,)` the moments at 0 and at `bins`, `jumps`
    `(bins + 1,)` and their weight in the bound. Returns the `(K, 2)` int64
    pairs `(a, b - b0)`, `a < na`, `b0 <= b <= bins`, `b > a`, whose bound
    is below `limit`, in `(a, b)` order (as `nonzero` lists them); an empty
    `(0, 2)` tensor for none; None where the kernels are not available or
    more than `cap` pairs remain.
    """
    if at.device.type != "cpu" or not available():
        return None
    bins = at.shape[-1] - 1
    if at.shape != (3, bins + 1) or jumps.numel() != bins + 1 or start.numel() != 3:
        raise ValueError("at must be (3, bins + 1), jumps (bins + 1,), start (3,)")
    tables = [t.to(torch.float64).contiguous() for t in (at, start, total, jumps)]
    out = torch.empty(cap, 2, dtype=torch.int64)
    found = _loaded().qo_l2_survivors(
        *(t.data_ptr() for t in tables),
        jump_weight,
        bins,
        levels,
        na,
        b0,
        limit,
        out.data_ptr(),
        cap,
        torch.get_num_threads(),
    )
    return None if found > cap else out[:found].clone()


def entropy(h: torch.Tensor, cands: torch.Tensor, levels: int) -> torch.Tensor | None:
    """KL divergence `(Q, C)` of clip bins `cands` for histograms `h` `(Q, B)`.

    `solvers.entropy._divergences` over its `_prefixes`, in float64 (each
    row's prefix sums made in the kernel); None where the kernels are not
    available.
    """
    if h.device.type != "cpu" or not available():
        return None
    if h.ndim != 2:
        raise ValueError(f"h must be (Q, B), got shape {tuple(h.shape)}")
    num_q, bins = h.shape
    h = h.to(torch.float64).contiguous()
    cands = cands.to(torch.int64).contiguous()
    if cands.numel() and not (int(cands.min()) >= 1 and int(cands.max()) <= bins):
        raise ValueError(f"candidate bins must lie in [1, {bins}]")
    out = torch.full((num_q, cands.numel()), math.nan, dtype=torch.float64)
    # integer counts: the logs of level masses come from a table
    total = float(h.sum(dim=1).max()) if num_q else 0.0
    integral = total < _LOG_TABLE and bool((h == h.floor()).all())
    _loaded().qo_entropy(
        h.data_ptr(),
        num_q,
        bins,
        cands.data_ptr(),
        cands.numel(),
        levels,
        int(total) + 1 if integral else 0,
        out.data_ptr(),
        _threads(num_q * cands.numel() * levels),
    )
    return None if bool(torch.isnan(out).any()) else out  # NaN: out of memory


def mse_supported(fmt: NumberFormat, norm: float) -> bool:
    """Whether `mse_errors` runs for this format and error exponent."""
    return norm in _NORMS and (fmt.signed or not fmt.is_float)


def mse_errors(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
) -> torch.Tensor | None:
    """Errors `sum |fake_quant(x) - x| ** norm` of every candidate, or None.

    Args:
        x3: `(N, Q, G)` float32 values.
        scale: `(C, Q)` effective scales (divided by any global scale).
        zero_point: `(C, Q)` zero points, or None (symmetric).
        fmt: the quantized format (ints, or signed float formats).
        norm: error exponent; only 2 and 2.4 run natively.

    Returns:
        `(C, Q)` float64 errors, or None where the kernel does not apply.
    """
    if x3.ndim != 3 or x3.shape[-1] < _MIN_GROUP:
        return None  # short groups: the kernel's per-row overhead dominates
    if not mse_supported(fmt, norm) or not _usable(x3):
        return None
    n, q, g = x3.shape
    c = scale.shape[0]
    for name, given in (("scale", scale), ("zero_point", zero_point)):
        if given is not None and tuple(given.shape) != (c, q):
            raise ValueError(
                f"{name} must be (candidates, {q}), got {tuple(given.shape)}"
            )
    scale = scale.to(torch.float32).contiguous()
    if zero_point is not None:
        zero_point = zero_point.to(torch.float32).contiguous()
    out = torch.empty(c, q, dtype=torch.float64)
    # ints ignore it; float formats: the exponent of the smallest normal
    emin = math.frexp(fmt.min_normal)[1] - 1
    _loaded().qo_mse_errors(
        x3.data_ptr(),
        n,
        q,
        g,
        c,
        scale.data_ptr(),
        None if zero_point is None else zero_point.data_ptr(),
        fmt.min,
        fmt.max,
        int(fmt.is_float),
        fmt.mantissa_bits,
        emin,
        norm,
        out.data_ptr(),
        _threads(x3.numel() * c),
    )
    return out


def pow24(a: torch.Tensor) -> torch.Tensor | None:
    """The kernel's `a ** 2.4` for float32 `a >= 0` (for tests), or None."""
    if not _usable(a):
        return None
    out = torch.empty_like(a)
    _loaded().qo_pow24(a.data_ptr(), out.data_ptr(), a.numel())
    return out
