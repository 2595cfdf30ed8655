"""llm-compressor's comparisons of MSE candidates from the native errors.

llm-compressor scores each shrink candidate with torch in float32 (`pow`,
then a float32 sum per qparam) and keeps a candidate only where its error is
strictly below the best so far; its early stop counts the candidates that
improve no qparam. The native kernel (`quantobs.native.mse_block`) computes
`|err| ** 2.4` with its own polynomial, `x * (1 / scale)` and its own sums:
its errors differ from torch's by about 1e-6 relative (measured on MiniLM's
weights: at most 1.1e-6), so where two candidates' errors are closer than
that, it may order them the other way (1 of the 84,096 groups of MiniLM's
W4A16 weights: two candidates whose float32 errors are equal to the last
bit).

`LlmCompressorErrors` makes the choice and the early stop torch's, at little
cost. It keeps one `(C, Q)` errors table, filled block by block by the C
kernels (`quantobs.native.mse_block`, `mse_rows`, `mse_marks`):

* a candidate whose qparams (scale, zero point) equal those of the candidate
  before it has the same error in every arithmetic: it gets exactly that
  error, unscored (MX's power-of-two scales repeat over most of the grid);
* two errors are *near* where they lie within `tolerance` (relative) of each
  other; only then may the kernel order them otherwise than torch;
* a qparam is scored again with torch, for every candidate (and keeps those
  errors), only where a near comparison can change an outcome: its first
  least error is near another candidate's (among those scored before the
  early stop), or it compares near the least error before it at a candidate
  whose "improves some qparam" (the early stop's count) no clear comparison
  of another qparam decides. Elsewhere every comparison is clear, so the
  kernel's order is torch's.

`tolerance` is 2**-16 (1.5e-5: 14 times the largest measured difference),
growing with the log of the values per qparam for long float32 sums. The
marks are made once the kernel's errors say the search ends (`settle`), and
again after each re-scoring, until none is left. Where the native kernels
are off, the data is not on the CPU or the kernel does not take the format
or norm, the errors are torch's already and nothing is re-scored. Measured
on MiniLM's linear weights: 0.24% of the W4A16 groups are re-scored (0.19%
W4A16_ASYM, 0.06% NVFP4, 0.03% W8A8 channels, 1 MXFP4 group of 336,384).
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
        num_q, num_c = min_vals.numel(), self.factors.numel()
        self.errors = torch.empty(0, num_q, dtype=torch.float64, device=x3.device)
        # Where the native kernel scores: its near ties are settled (torch's
        # errors for the qparams they touch); elsewhere errors are torch's.
        self.settles = native.mse_block_supported(x3, args.format, norm)
        values = x3.shape[0] * x3.shape[-1]
        self.tolerance = _TOLERANCE * max(1.0, math.log2(max(values, 2)) / 8)
        # Qparams whose errors are torch's, for every candidate (`_mark`).
        self._exact = torch.zeros(num_q, dtype=torch.bool, device=x3.device)
        # `settle`'s choice: the candidate per qparam, and the early stop.
        self.chosen: torch.Tensor | None = None
        self.stopped: int | None = None
        if not self.settles:
            return
        # The kernel's table, filled block by block: the (C, Q) qparams and
        # errors of the candidates, each candidate's comparisons (bit 0: it
        # improves some qparam, bit 1: decided), the running least errors.
        self._values = x3.to(torch.float32).contiguous()
        self._scale = torch.empty(num_c, num_q, dtype=torch.float32)
        self._zero_point = None
        if not args.symmetric:
            self._zero_point = torch.empty(num_c, num_q, dtype=torch.float32)
        self._table = torch.empty(num_c, num_q, dtype=torch.float64)
        self._flags = torch.zeros(num_c, dtype=torch.uint8)
        self._least = torch.empty(num_q, dtype=torch.float64)
        self._best = torch.zeros(num_q, dtype=torch.int64)
        self._done = 0

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
        if self.settles:
            self._table[:, columns] = found
        self._exact[columns] = True
        return found

    def extend(self, count: int) -> torch.Tensor:
        """Score the next `count` candidates; returns the `(C, Q)` float64
        errors of every candidate so far (`C` counts the earlier blocks),
        torch's for the qparams `settle` marked, the kernel's elsewhere."""
        if not self.settles:
            c0 = self.errors.shape[0]
            factors = self.factors[c0 : c0 + count]
            scale, zero_point = self._qparams(factors)  # (c, Q) each
            errors = score(
                self.x3, scale, zero_point, self.args.format, self.norm,
                chunk_elems=self.chunk_elems,
            )  # fmt: skip
            self.errors = torch.cat([self.errors, errors])
            return self.errors
        c0 = self._done
        c1 = min(self.factors.numel(), c0 + count)
        # a block's qparams at a time: small temporaries (no page faults)
        scale, zero_point = self._qparams(self.factors[c0:c1])
        self._scale[c0:c1] = scale
        if self._zero_point is not None and zero_point is not None:
            self._zero_point[c0:c1] = zero_point
        table = (self._scale, self._zero_point, self._exact)
        native.mse_block(
            self._values, *table[:2], self.args.format, self.norm,
            self._exact, self._table, c0, c1,
        )  # fmt: skip
        native.mse_rows(
            self._table, *table, self.tolerance, self._least, self._best,
            self._flags, c0, c1,
        )  # fmt: skip
        self._done = c1
        self.errors = self._table[:c1]
        return self.errors

    def stop(self, patience: int | None) -> int | None:
        """`patience_stop` of the errors so far (the kernel's comparisons,
        torch's for the marked qparams); None before any candidate."""
        if not self.settles:
            return patience_stop(self.errors, patience)
        if patience is None or self._done == 0:
            return None
        stale = 0
        for i, flags in enumerate(self._flags[: self._done].tolist()):
            if i == 0:
                continue
            improved = bool(flags & 1)
            stale = 0 if improved else stale + 1
            if stale >= patience and not improved:
                return i + 1
        return None

    def settle(self, patience: int | None = None) -> torch.Tensor:
        """The `(C, Q)` errors of every candidate so far, whose comparisons up
        to llm-compressor's early stop (`patience`) are torch's: repeated
        candidates have their predecessor's error, and qparams whose near
        errors may order them otherwise are scored with torch (module
        docstring). Sets `stopped` (`patience_stop`) and `chosen`, the `(Q,)`
        first least error's candidate among those scored before the stop."""
        if not self.settles:
            self.stopped = patience_stop(self.errors, patience)
            scored = self.errors[: self.stopped]
            self.chosen = torch.argmin(scored, dim=0) if scored.shape[0] else None
            return self.errors
        if self._done == 0:
            return self.errors
        table = (self._table, self._scale, self._zero_point, self._exact)
        while True:
            self.stopped = self.stop(patience)
            end = self._done if self.stopped is None else self.stopped
            # the running winners are those of every candidate scored
            known = self._best.clone() if end == self._done else None
            best, marks = native.mse_marks(
                *table, self.tolerance, self._flags, end, known
            )  # fmt: skip
            if not bool(marks.any()):
                break
            self._mark(marks.nonzero().flatten())
            # torch's errors change the comparisons: made again from the start
            native.mse_rows(
                *table, self.tolerance, self._least, self._best, self._flags,
                0, self._done,
            )  # fmt: skip
        self.chosen = best
        return self.errors
