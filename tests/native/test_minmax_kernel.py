"""`qo_minmax` against torch: the ranges, and their summary (whether every
value was finite, the absmax) folded in as the ranges are found.

Rows of 16 values (NVFP4's groups) have their own loop: AVX2 where the CPU
has it (8 rows folded at a time; a block holding a NaN redone by the scalar
loop), streaming stores for the outputs past 2**17 rows when both are
32-byte aligned.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from quantobs import native
from quantobs.native.runtime import loaded

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: the native kernels are not built"
)

STREAM_ROWS = 1 << 17  # QO_STREAM_ROWS in qo_minmax.c


def _rows(q: int, seed: int) -> torch.Tensor:
    """`(q, 16)` values over many binades, with zeros of both signs."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.randint(-140, 120, (q, 16), generator=gen).float())
    x = torch.randn(q, 16, generator=gen) * mags  # subnormals to ~1e36
    x[::5, 3] = 0.0
    x[::5, 11] = -0.0
    x[::7] = torch.where(x[::7] < 0, -0.0, 0.0)  # all-zero rows
    return x


def _plant(x: torch.Tensor, specials: dict[tuple[int, int], float]) -> torch.Tensor:
    x = x.clone()
    for (row, col), value in specials.items():
        if row < x.shape[0]:
            x[row, col] = value
    return x


def _run(
    x: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, threads: int
) -> float | None:
    """`qo_minmax` of `(q, 16)` rows into the given outputs (any alignment);
    the absmax, or None where some value was not finite."""
    absmax = ctypes.c_float()
    finite = loaded().qo_minmax(
        x.data_ptr(),
        1,
        x.shape[0],
        16,
        mins.data_ptr(),
        maxs.data_ptr(),
        ctypes.byref(absmax),
        threads,
    )
    return absmax.value if finite else None


def _check(
    x: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, absmax: object
) -> None:
    for ours, theirs in ((mins, x.amin(dim=1)), (maxs, x.amax(dim=1))):
        nan = torch.isnan(theirs)
        assert torch.equal(torch.isnan(ours), nan)
        assert torch.equal(ours[~nan], theirs[~nan])  # +0 == -0
    if bool(torch.isfinite(x).all()):
        assert absmax == float(x.abs().max())
    else:
        assert absmax is None


SPECIALS = {
    "finite": {},
    "nan first row": {(0, 0): math.nan},
    "nan in a block": {(12, 15): math.nan, (13, 0): math.nan},
    "nan in the tail": {(36, 7): math.nan},
    "inf": {(9, 4): math.inf, (20, 8): -math.inf},
    "extremes": {(2, 2): 3.4e38, (3, 3): -3.4e38, (4, 4): 1e-45},
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q", [1, 5, 8, 13, 37, 1027])
@pytest.mark.parametrize("case", SPECIALS, ids=list(SPECIALS))
def test_rows16_equal_torch(case: str, q: int, threads: int) -> None:
    x = _plant(_rows(q, seed=q), SPECIALS[case])
    mins, maxs = torch.empty(2, q)
    absmax = _run(x, mins, maxs, threads)
    _check(x, mins, maxs, absmax)
    found = native.minmax_absmax(x.reshape(1, q, 16))  # the wrapper's call
    assert found is not None
    _check(x, *found)


@pytest.mark.parametrize(
    "layout", ["stream", "stream with a tail", "misaligned", "wrapper"]
)
def test_rows16_past_the_streaming_size_equal_torch(layout: str) -> None:
    q = STREAM_ROWS + (5 if layout == "stream with a tail" else 8)
    x = _rows(q, seed=1)
    x[STREAM_ROWS // 2 + 3, 9] = math.nan  # a NaN block amid streamed ones
    if layout == "wrapper":  # one (2, q) allocation, as the observers make
        mins, maxs, absmax = native.minmax_absmax(x.reshape(1, q, 16))  # type: ignore[misc]
        _check(x, mins, maxs, absmax)
        return
    # separate allocations: 64-byte aligned; one float in: 4 bytes off
    offset = 1 if layout == "misaligned" else 0
    low, high = torch.empty(q + offset), torch.empty(q + offset)
    mins, maxs = low[offset:], high[offset:]
    absmax = _run(x, mins, maxs, threads=2)
    _check(x, mins, maxs, absmax)
    x[STREAM_ROWS // 2 + 3, 9] = 1.0  # finite: the absmax is reported
    _check(x, mins, maxs, _run(x, mins, maxs, threads=2))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("n", "q", "g"), [(1, 37, 8), (1, 300, 128), (1, 3, 100), (3, 37, 24)]
)
@pytest.mark.parametrize("special", [None, math.nan, math.inf, -math.inf])
def test_any_layout_reports_its_summary(
    n: int, q: int, g: int, special: float | None, threads: int
) -> None:
    gen = torch.Generator().manual_seed(q + g)
    x = torch.randn(n, q, g, generator=gen) * 1e3
    if special is not None:
        x[n - 1, q // 2, g - 1] = special
    mins, maxs = torch.empty(2, q)
    absmax = ctypes.c_float()
    finite = loaded().qo_minmax(
        x.data_ptr(), n, q, g, mins.data_ptr(), maxs.data_ptr(),
        ctypes.byref(absmax), threads,
    )  # fmt: skip
    flat = x.transpose(0, 1).reshape(q, n * g)
    _check(flat, mins, maxs, absmax.value if finite else None)
