"""Wrappers of `qo_mse.c`: the MSE candidates' errors with fake-quant's float32
arithmetic fused, the kernel's `|e| ** 2.4`, and the steps of llm-compressor's
grid search over one errors table (`quantobs.solvers.mse_ties`).
"""

from __future__ import annotations

import math

import torch

from quantobs.core.formats import NumberFormat
from quantobs.native.runtime import available, loaded, threads, usable

__all__ = [
    "mse_block",
    "mse_block_supported",
    "mse_errors",
    "mse_marks",
    "mse_rows",
    "mse_supported",
    "pow24",
]

_NORMS = (2.0, 2.4)  # the kernel's fast error powers; others stay eager
_MIN_GROUP = 8  # shortest group the min/max and MSE kernels take


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
    if not mse_supported(fmt, norm) or not usable(x3):
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
    loaded().qo_mse_errors(
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
        threads(x3.numel() * c),
    )
    return out


def pow24(a: torch.Tensor, fused: bool | None = None) -> torch.Tensor | None:
    """The kernel's `a ** 2.4` for float32 `a >= 0` (for tests), or None.

    `fused`: with fused multiply-adds (None where none is available) or
    without; None: as the MSE kernels compute it.
    """
    if not usable(a):
        return None
    out = torch.empty_like(a)
    how = -1 if fused is None else int(fused)
    if loaded().qo_pow24(a.data_ptr(), out.data_ptr(), a.numel(), how) < 0:
        return None
    return out


def mse_block_supported(x3: torch.Tensor, fmt: NumberFormat, norm: float) -> bool:
    """Whether `mse_block` scores `(N, Q, G)` values `x3` (any float dtype:
    the caller passes them as float32) in this format and error exponent."""
    return (
        x3.ndim == 3
        and x3.shape[-1] >= _MIN_GROUP
        and x3.device.type == "cpu"
        and x3.is_floating_point()
        and x3.numel() > 0
        and mse_supported(fmt, norm)
        and available()
    )


def _check_table(
    errors: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    exact: torch.Tensor,
) -> None:
    """The table's tensors as the kernels read them (their shapes agree)."""
    shape = tuple(errors.shape)
    tensors = [(errors, torch.float64), (scale, torch.float32), (exact, torch.bool)]
    if zero_point is not None:
        tensors.append((zero_point, torch.float32))
    for tensor, dtype in tensors:
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.is_cuda:
            raise ValueError(f"expected a contiguous {dtype} CPU tensor")
    if (
        len(shape) != 2
        or tuple(scale.shape) != shape
        or (zero_point is not None and tuple(zero_point.shape) != shape)
        or tuple(exact.shape) != shape[1:]
    ):
        raise ValueError("errors, scale, zero_point must be (C, Q) and exact (Q,)")


def mse_block(
    x3: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
    norm: float,
    exact: torch.Tensor,
    errors: torch.Tensor,
    start: int,
    stop: int,
) -> None:
    """Score candidates `[start, stop)` into the errors table, in place.

    `mse_errors`' errors, but: qparams where `exact` keep the errors the
    table has (torch's, for every candidate), and a candidate whose qparams
    equal those of the candidate before it gets exactly that one's error
    (not scored).

    Args:
        x3: `(N, Q, G)` float32 contiguous values (`mse_block_supported`).
        scale: `(C, Q)` float32 effective scales of every candidate.
        zero_point: `(C, Q)` float32 zero points, or None (symmetric).
        fmt: the quantized format.
        norm: error exponent (2 or 2.4).
        exact: `(Q,)` bool, the qparams whose errors are torch's.
        errors: `(C, Q)` float64 table; rows `[start, stop)` are written.
        start: first candidate scored.
        stop: one past the last.
    """
    _check_table(errors, scale, zero_point, exact)
    if not (mse_block_supported(x3, fmt, norm) and usable(x3)):
        raise ValueError("mse_block: values the kernel does not take")
    n, q, g = x3.shape
    if q != errors.shape[1] or not 0 <= start <= stop <= errors.shape[0]:
        raise ValueError("mse_block: candidates or qparams out of the table")
    emin = math.frexp(fmt.min_normal)[1] - 1
    loaded().qo_mse_block(
        x3.data_ptr(),
        n,
        q,
        g,
        start,
        stop,
        scale.data_ptr(),
        None if zero_point is None else zero_point.data_ptr(),
        fmt.min,
        fmt.max,
        int(fmt.is_float),
        fmt.mantissa_bits,
        emin,
        norm,
        exact.data_ptr(),
        errors.data_ptr(),
        threads(x3.numel() * (stop - start)),
    )


def mse_rows(
    errors: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    exact: torch.Tensor,
    tolerance: float,
    least: torch.Tensor,
    best: torch.Tensor,
    flags: torch.Tensor,
    start: int,
    stop: int,
) -> None:
    """llm-compressor's comparisons of candidates `[start, stop)`, in place.

    Each candidate's error against the least error of the candidates before
    it, per qparam: `least` `(Q,)` float64 holds the running least errors
    and `best` `(Q,)` int64 their candidates (`torch.argmin`'s: the first
    minimum); candidate 0 sets them. `flags` `(C,)` uint8 gets, per
    candidate, bit 0 where some qparam improves (its error is below the
    least) and bit 1 where that is decided whatever the near errors' order:
    some qparam improves clearly (its two errors not near, or torch's), or
    none is near (within `tolerance`, relative; a repeated candidate's
    comparison is exact).
    """
    _check_table(errors, scale, zero_point, exact)
    q = errors.shape[1]
    if least.dtype != torch.float64 or tuple(least.shape) != (q,):
        raise ValueError(f"least must be ({q},) float64")
    if best.dtype != torch.int64 or tuple(best.shape) != (q,):
        raise ValueError(f"best must be ({q},) int64")
    if flags.dtype != torch.uint8 or tuple(flags.shape) != (errors.shape[0],):
        raise ValueError(f"flags must be ({errors.shape[0]},) uint8")
    if not 0 <= start <= stop <= errors.shape[0]:
        raise ValueError("mse_rows: candidates out of the table")
    failed = loaded().qo_mse_rows(
        errors.data_ptr(),
        q,
        start,
        stop,
        scale.data_ptr(),
        None if zero_point is None else zero_point.data_ptr(),
        exact.data_ptr(),
        tolerance,
        least.data_ptr(),
        best.data_ptr(),
        flags.data_ptr(),
        threads(q * (stop - start) * 16),
    )
    if failed:
        raise MemoryError("mse_rows: out of memory")


def mse_marks(
    errors: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    exact: torch.Tensor,
    tolerance: float,
    flags: torch.Tensor,
    end: int,
    best: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first least error of each qparam among candidates `[0, end)`, and
    the qparams whose kernel errors may choose otherwise than torch's.

    Marked (never where `exact`): a qparam near the least error (within
    `tolerance`) at a candidate whose `flags` (of `mse_rows`) say undecided,
    and one whose least error is near that of another candidate with other
    qparams. Elsewhere the kernel's errors order the candidates as torch's
    do. `best`: the candidates of the first least errors when known (those
    of `mse_rows` over the same `end` candidates), else found here.

    Returns:
        `(Q,)` int64 candidate of the first least error (`torch.argmin`'s;
        `best` itself where given), and the `(Q,)` bool marks.
    """
    _check_table(errors, scale, zero_point, exact)
    q = errors.shape[1]
    if flags.dtype != torch.uint8 or tuple(flags.shape) != (errors.shape[0],):
        raise ValueError(f"flags must be ({errors.shape[0]},) uint8")
    if not 1 <= end <= errors.shape[0]:
        raise ValueError("mse_marks: candidates out of the table")
    known = best is not None
    if best is None:
        best = torch.empty(q, dtype=torch.int64)
    elif best.dtype != torch.int64 or tuple(best.shape) != (q,):
        raise ValueError(f"best must be ({q},) int64")
    marks = torch.zeros(q, dtype=torch.bool)
    loaded().qo_mse_marks(
        errors.data_ptr(),
        q,
        end,
        scale.data_ptr(),
        None if zero_point is None else zero_point.data_ptr(),
        exact.data_ptr(),
        tolerance,
        flags.data_ptr(),
        int(known),
        best.data_ptr(),
        marks.data_ptr(),
        threads(q * end * 16),
    )
    return best, marks
