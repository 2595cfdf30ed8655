"""llm-compressor's comparisons of MSE candidates from the native errors.

llm-compressor scores each shrink candidate with torch in float32 (`pow`,
then a float32 sum per qparam) and keeps a candidate only where its error is
strictly below the best so far; its early stop counts the candidates that
improve no qparam. The native kernel (`quantobs.native.mse_errors`) computes
`|err| ** 2.4` with its own polynomial and sums in float64: its errors differ
from torch's by about 1e-6 relative (measured on MiniLM's weights: at most
1.1e-6), so where two candidates' errors are closer than that, it may order
them the other way (1 of the 84,096 groups of MiniLM's W4A16 weights: two
candidates whose float32 errors are equal to the last bit).

`LlmCompressorErrors` makes every comparison the search makes come out as
torch's does, at little cost:

* a candidate whose qparams (scale, zero point) equal those of the candidate
  before it has the same error in every arithmetic: it gets exactly that
  error (MX's power-of-two scales repeat over most of the shrink grid);
* every other comparison of a candidate's error with the best error before
  it whose two sides lie within `tolerance` (relative) of each other marks
  its qparam; marked qparams are scored again with the torch kernels, for
  every candidate, and keep the torch errors from then on.

`tolerance` is 2**-16 (1.5e-5: 14 times the largest measured difference),
growing with the log of the values per qparam for long float32 sums. The
check runs once the kernel's errors say the search ends (`settle`), and
again only if the corrected errors let it go on. Where the native kernels
are off or the data is not on the CPU the errors are torch's already and
nothing is re-scored. Measured on MiniLM's linear weights (one thread):
0.5% of the W4A16 groups are re-scored (0.4% W4A16_ASYM, 0.1% NVFP4, 0.03%
W8A8 channels, 1 MXFP4 group of 336,384), adding 10-20% to the search's
time, which stays 5-7 times faster than llm-compressor's.
"""

from __future__ import annotations

import math

import torch

from quantobs import native
from quantobs.core.args import QuantizationArgs
from quantobs.core.scoring import (
    DEFAULT_CHUNK_ELEMS,
    candidate_qparams,
    score,
    score_with_torch,
)

__all__ = ["LlmCompressorErrors", "first_best", "patience_stop", "patience_stops"]

_TOLERANCE = 2.0**-16


def patience_stop(errors: torch.Tensor, patience: int | None) -> int | None:
    """How many candidates llm-compressor scores before its early stop.

    A candidate improves when its error is strictly below the best error of
    the candidates before it for some qparam; the search ends after
    `patience` consecutive candidates that improve none.

    Args:
        errors: `(C, Q)` errors of the candidates scored so far, in order.
        patience: the early stop (`None`: never).

    Returns:
        The number of candidates scored (the stopping one included), or None
        if the search has not stopped within these `C` candidates.
    """
    if patience is None or errors.shape[0] == 0:
        return None
    best, stale = errors[0], 0
    for i in range(1, errors.shape[0]):  # C is small: rows, each vectorized
        improved = bool((errors[i] < best).any())
        best = torch.minimum(best, errors[i])
        stale = 0 if improved else stale + 1
        if stale >= patience and not improved:
            return i + 1
    return None


def patience_stops(errors: torch.Tensor, patience: int | None) -> torch.Tensor:
    """`patience_stop` as a 0-d int64 tensor, without reading anything on
    the host: how many candidates llm-compressor scores (`C` where it does
    not stop within these).

    Row `i` improves where it is below the least error of the rows before
    it (`cummin`); it is stale since the last improving row (row 0 starts
    the count); the search stops after the first stale row `i >= patience`
    rows past the last improvement.
    """
    num_c = errors.shape[0]
    device = errors.device
    if patience is None or num_c == 0:
        return torch.full((), num_c, dtype=torch.int64, device=device)
    least = torch.cummin(errors, dim=0).values  # (C, Q): least of rows <= i
    improved = torch.cat(
        [
            torch.ones(1, dtype=torch.bool, device=device),
            (errors[1:] < least[:-1]).any(dim=1),
        ]
    )  # (C,)
    index = torch.arange(num_c, device=device)
    last = torch.cummax(torch.where(improved, index, 0), dim=0).values
    stops = (index - last >= patience) & ~improved
    first = torch.where(stops, index + 1, num_c).amin()
    return first


def first_best(errors: torch.Tensor, patience: int | None) -> torch.Tensor:
    """`(Q,)` index of the first least error per qparam among the candidates
    llm-compressor scores before its early stop (`patience_stops`), decided
    on the device: rows past the stop count as `+inf`."""
    stop = patience_stops(errors, patience)
    rows = torch.arange(errors.shape[0], device=errors.device)[:, None]
    scored = torch.where(rows < stop, errors, math.inf)
    return torch.argmin(scored, dim=0)  # first minimum wins


class LlmCompressorErrors:
    """The errors of shrunk candidate ranges, scored block by block, whose
    comparisons are llm-compressor's (module docstring).

    Args:
        x3: `(N, Q, G)` finite values.
        args: the args candidates are scored with (`search_args`).
        min_vals: `(Q,)` reference minima; candidates are `factor * min_vals`.
        max_vals: `(Q,)` reference maxima.
        factors: `(C,)` float32 shrink factors, in the order of the search.
        norm: exponent of the absolute error.
        chunk_elems: elements per temporary tensor.
        global_scale: optional `(1,)` NVFP4 global scale of the candidates.
    """

    def __init__(
        self,
        x3: torch.Tensor,
        args: QuantizationArgs,
        min_vals: torch.Tensor,
        max_vals: torch.Tensor,
        factors: torch.Tensor,
        norm: float,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        global_scale: torch.Tensor | None = None,
    ) -> None:
        self.x3, self.args = x3, args
        self.min_vals, self.max_vals = min_vals, max_vals
        self.factors = factors.to(device=x3.device, dtype=torch.float32)
        self.norm, self.chunk_elems = norm, chunk_elems
        self.global_scale = global_scale
        num_q = min_vals.numel()
        self.errors = torch.empty(0, num_q, dtype=torch.float64, device=x3.device)
        # Where the native kernel may have scored: torch decides the ties.
        self.settles = native.available() and x3.device.type == "cpu"
        values = x3.shape[0] * x3.shape[-1]
        self.tolerance = _TOLERANCE * max(1.0, math.log2(max(values, 2)) / 8)
        # Qparams whose errors are torch's, for every candidate (`_torch`).
        self._exact = torch.zeros(num_q, dtype=torch.bool, device=x3.device)
        self._torch: torch.Tensor | None = None  # (C, Q) float64
        # Every scored candidate's qparams, to find repeated ones: (c, Q) each.
        self._scales: list[torch.Tensor] = []
        self._zero_points: list[torch.Tensor] = []

    def _qparams(
        self, factors: torch.Tensor, columns: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(c, Q)` candidate scales and zero points (or `(c, k)` of `columns`)."""
        mins, maxs = self.min_vals, self.max_vals
        if columns is not None:
            mins, maxs = mins[columns], maxs[columns]
        return candidate_qparams(
            mins[None] * factors[:, None],
            maxs[None] * factors[:, None],
            self.args,
            self.global_scale,
        )

    def _score(
        self,
        qparams: tuple[torch.Tensor, torch.Tensor | None],
        columns: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`(c, Q)` float64 errors of candidate qparams (or `(c, k)` of the
        qparams `columns`)."""
        x3 = self.x3 if columns is None else self.x3[:, columns]
        scale, zero_point = qparams
        return score(
            x3, scale, zero_point, self.args.format, self.norm,
            chunk_elems=self.chunk_elems,
        )  # fmt: skip

    def _mark(self, columns: torch.Tensor) -> torch.Tensor:
        """Score `columns` for every candidate with torch, from now on;
        returns their `(C, k)` errors."""
        scored = columns
        num_q = self._exact.numel()
        if self.x3.shape[0] > 1 and columns.numel() == 1 and num_q > 1:
            # One qparam of several rows would be summed as one run of N * G
            # values (torch merges the two reduced dims); with a second one
            # the sums keep the (N, Q, G) order llm-compressor's have.
            scored = torch.cat([columns, (columns + 1) % num_q])
        scale, zero_point = self._qparams(self.factors, scored)
        found = score_with_torch(
            self.x3[:, scored], scale, zero_point, self.args.format, self.norm,
            chunk_elems=self.chunk_elems,
        )  # fmt: skip
        found = found[:, : columns.numel()]
        if self._torch is None:
            self._torch = torch.zeros(
                self.factors.numel(), self._exact.numel(), dtype=torch.float64,
                device=self.x3.device,
            )  # fmt: skip
        self._torch[:, columns] = found
        self._exact[columns] = True
        return found

    def extend(self, count: int) -> torch.Tensor:
        """Score the next `count` candidates; returns the `(C, Q)` float64
        errors of every candidate so far (`C` counts the earlier blocks),
        torch's for the qparams `settle` marked, the kernel's elsewhere."""
        c0 = self.errors.shape[0]
        factors = self.factors[c0 : c0 + count]
        qparams = self._qparams(factors)  # (c, Q) each
        errors = self._score(qparams)  # (c, Q)
        if self._torch is not None:  # marked qparams keep torch's errors
            rows = self._torch[c0 : c0 + factors.numel()]
            errors = torch.where(self._exact, rows, errors)
        if self.settles:
            self._scales.append(qparams[0])
            if qparams[1] is not None:
                self._zero_points.append(qparams[1])
        self.errors = torch.cat([self.errors, errors])
        return self.errors

    def settle(self) -> torch.Tensor:
        """The `(C, Q)` errors of every candidate so far, whose comparisons
        (each candidate's error against the least before it) are torch's:
        repeated candidates get their predecessor's error, and qparams with
        a near comparison are scored with torch (module docstring)."""
        errors = self.errors
        if not self.settles or errors.shape[0] < 2:
            return errors
        scale = torch.cat(self._scales)  # (C, Q)
        repeats = scale[1:] == scale[:-1]  # (C - 1, Q)
        if self._zero_points:
            zero_point = torch.cat(self._zero_points)
            repeats &= zero_point[1:] == zero_point[:-1]
        errors = errors.clone()
        best = errors[0]
        near = torch.zeros_like(self._exact)
        for i in range(1, errors.shape[0]):  # C is small: rows, each vectorized
            # A repeated candidate's error is exactly its predecessor's.
            row = torch.where(repeats[i - 1], errors[i - 1], errors[i])
            errors[i] = row
            # Its comparison with the least error before it, if near (that of
            # a repeated candidate is exact: equal to the one before it).
            bound = torch.maximum(row, best).mul_(self.tolerance)
            near |= ((row - best).abs_() <= bound) & ~repeats[i - 1]
            best = torch.minimum(best, row)
        marked = (near & ~self._exact).nonzero().flatten()
        if marked.numel():
            errors[:, marked] = self._mark(marked)[: errors.shape[0]]
        self.errors = errors
        return errors
