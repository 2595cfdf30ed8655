"""Entropy (KL-divergence) calibration as in TensorRT and NVIDIA ModelOpt.

(One concept, a little over 500 lines: the exhaustive search and its
coarse-to-fine twin share the candidate rule and the divergence kernel.)

On a histogram of |x| whose bin 0 starts at 0, each candidate `i` (from
`start_bin` up to the bin holding the largest value, every `stride` bins)
clips at the edge `i * width` and is scored by `KL(P || Q)`:

* P: bins `0 .. i-1`, with the mass of every bin from `i` on added to bin
  `i - 1` (the clipped values);
* Q: bins `0 .. i-1` merged into `num_quantized_bins` levels (bin j goes to
  level `floor(j * num_quantized_bins / i)`), each level's mass spread evenly
  over its non-empty bins (empty bins stay empty);
* both normalized; `KL = sum p log(p / q)`.

The last minimum wins (ties go to the wider range) and the result is the edge
`i * width`, at most the largest |x| observed. As in ModelOpt (and
pytorch-quantization), bin 0 first takes bin 1's count, so a pile of exact
zeros (ReLU, padding) does not decide the range. Deliberate differences from
ModelOpt: a candidate whose P has mass where Q has none, or whose first `i`
bins are all empty, scores `+inf` (ModelOpt gets `inf` or NaN, and its
`argmin` picks a NaN); with no candidate at all (fewer than `start_bin`
bins hold data) the result is the largest value.

Vectorized: with prefix sums of the counts, of the non-empty bins and of
`c log c`, each candidate costs one gather per level, and all candidates of
all qparams are scored at once, in chunks of bounded memory (natively, one
loop over levels per candidate, where `quantobs.native` is built)::

    KL(i) = (sum_j p_j log p_j) / T - log T
            - (sum_k L_k log(L_k / n_k) + tail_i log q_{i-1}) / T + log S_i

with T the total, S_i the mass of bins `< i`, L_k / n_k the mass / non-empty
bins of level k.

Searches (`search=`)::

    "exhaustive"      every candidate (TensorRT / ModelOpt): O(candidates x
                      levels) per histogram
    "coarse_to_fine"  over each histogram's possible candidates (those whose
                      last bin holds data: any other scores +inf), 24 evenly
                      spread (first and last included), then around the best
                      2, candidates a quarter of the spacing apart (-4 .. 4
                      of them), down to neighbours: about 60 to 100 scored
                      instead of up to `bins`. The same candidates, divergence
                      and tie rule, so it equals the exhaustive search where
                      a histogram has at most 24 possible candidates;
                      elsewhere it can stop in a local minimum of a jagged KL
                      curve (benchmarks/bench_histogram_channels.py measures
                      how often and by how much).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from quantobs import native
from quantobs.native.dispatch import kernel

__all__ = [
    "EntropySearch",
    "coarse_to_fine",
    "entropy_divergences",
    "entropy_search",
]

EntropySearch = Literal["exhaustive", "coarse_to_fine"]

_CHUNK_ELEMS = 1 << 20  # float64 elements per (qparams, candidates, levels) temporary
_TINY = 1e-300
_CHUNK_QPARAMS = 256  # qparams scored together (the gathered rows' length)
_COARSE = 24  # coarse_to_fine: first-level candidates per histogram
_KEEP = 2  # coarse_to_fine: best candidates refined per level
_REACH = 4  # coarse_to_fine: -_REACH .. _REACH finer steps around each


def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.xlogy(x, x)  # 0 log 0 = 0


Prefixes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _prefixes(h: torch.Tensor) -> Prefixes:
    """`(csum, nz, plogp)` of `h` `(Q, B)`, each `(Q, B + 1)`: the mass, the
    non-empty bins and the `c log c` below each bin edge."""
    zero = torch.zeros(h.shape[0], 1, dtype=torch.float64, device=h.device)
    csum = torch.cat([zero, torch.cumsum(h, dim=1)], dim=1)
    nz = torch.nn.functional.pad(torch.cumsum(h > 0, dim=1), (1, 0))  # int64
    plogp = torch.cat([zero, torch.cumsum(_xlogx(h), dim=1)], dim=1)
    return csum, nz, plogp


def _divergences(
    h: torch.Tensor, prefixes: Prefixes, cands: torch.Tensor, levels: int
) -> torch.Tensor:
    """KL of each candidate `(C,)` for each row of `h` `(Q, B)` -> `(Q, C)`.

    The level boundaries depend only on the candidate and the level count, so
    they are computed once and every row gathers the same columns.
    """
    num_q = h.shape[0]
    csum, nz, _ = prefixes
    i = cands.to(torch.int64)  # (C,)
    num_c = i.numel()
    # Level k holds bins [ceil(k i / nb), ceil((k + 1) i / nb)): exact integers.
    k = torch.arange(levels + 1, device=h.device)  # (nb + 1,)
    bounds = (k[None, :] * i[:, None] + levels - 1) // levels  # (C, nb + 1)
    upper = bounds[:, 1:].reshape(-1)  # (C * nb,)
    lower = bounds[:, :-1].reshape(-1)  # (C * nb,)
    # Gather whole rows of the transposed prefix sums: (C * nb, Q) copies of
    # Q contiguous values, much faster than gathering columns.
    csum_t, nz_t = csum.T.contiguous(), nz.T.contiguous()  # (B + 1, Q)
    shape = (num_c, levels, num_q)  # (C, nb, Q)
    level_mass = (csum_t.index_select(0, upper) - csum_t.index_select(0, lower)).view(
        shape
    )
    level_bins = (nz_t.index_select(0, upper) - nz_t.index_select(0, lower)).view(shape)
    top = (i - 1) * levels // i  # (C,) the level of bin i-1
    columns = torch.arange(num_c, device=h.device)  # (C,)
    top_mass = level_mass[columns, top].T  # (Q, C)
    top_bins = level_bins[columns, top].T  # (Q, C)
    # (Q, C, nb) views: the sums over the levels run in this layout
    level_mass, level_bins = level_mass.permute(2, 0, 1), level_bins.permute(2, 0, 1)
    i = i.expand(num_q, num_c)  # (Q, C)
    return _kl(h, prefixes, i, level_mass, level_bins, top_mass, top_bins)


def _divergences_rows(
    h: torch.Tensor, prefixes: Prefixes, cands: torch.Tensor, levels: int
) -> torch.Tensor:
    """KL of each row's own candidates `(Q, C)` for the rows of `h` `(Q, B)`:
    `_divergences`' arithmetic, the level boundaries gathered per row."""
    num_q = h.shape[0]
    csum, nz, _ = prefixes
    i = cands.to(torch.int64)  # (Q, C)
    num_c = i.shape[1]
    k = torch.arange(levels + 1, device=h.device)  # (nb + 1,)
    bounds = (k * i[..., None] + levels - 1) // levels  # (Q, C, nb + 1)
    upper = bounds[..., 1:].reshape(num_q, -1)  # (Q, C * nb)
    lower = bounds[..., :-1].reshape(num_q, -1)  # (Q, C * nb)
    shape = (num_q, num_c, levels)  # (Q, C, nb)
    level_mass = (csum.gather(1, upper) - csum.gather(1, lower)).view(shape)
    level_bins = (nz.gather(1, upper) - nz.gather(1, lower)).view(shape)
    top = ((i - 1) * levels // i)[..., None]  # (Q, C, 1) the level of bin i-1
    top_mass = level_mass.gather(2, top).squeeze(2)  # (Q, C)
    top_bins = level_bins.gather(2, top).squeeze(2)  # (Q, C)
    return _kl(h, prefixes, i, level_mass, level_bins, top_mass, top_bins)


def _kl(
    h: torch.Tensor,
    prefixes: Prefixes,
    i: torch.Tensor,
    level_mass: torch.Tensor,
    level_bins: torch.Tensor,
    top_mass: torch.Tensor,
    top_bins: torch.Tensor,
) -> torch.Tensor:
    """`(Q, C)` KL of clip bins `i` `(Q, C)` for the rows of `h` `(Q, B)`, from
    the mass and the non-empty bins of each candidate's levels (`level_mass`,
    `level_bins`: `(Q, C, nb)`) and of the level holding bin `i - 1`
    (`top_mass`, `top_bins`: `(Q, C)`, laid out as the levels' first two
    dims); `_divergences` and `_divergences_rows` gather them."""
    bins = h.shape[1]
    csum, _, plogp = prefixes
    total = csum[:, -1:]  # (Q, 1)
    mass_below = csum.gather(1, i)  # S_i (Q, C)
    tail = total - mass_below  # (Q, C)
    last = h.gather(1, i - 1)  # h_{i-1} (Q, C)
    p_term = plogp.gather(1, i - 1) + _xlogx(last + tail)  # (Q, C)
    # sum_k L_k log(L_k / n_k); a level with no non-empty bin has no mass, and
    # then contributes 0 * (log(tiny) - log 1) = 0.
    log_bins = torch.log(
        torch.arange(bins + 1, dtype=torch.float64, device=h.device).clamp(min=1)
    )  # (B + 1,)
    log_ratio = torch.log(level_mass.clamp(min=_TINY)).sub_(log_bins[level_bins])
    # The order of the sum (its rounding) follows its output's layout: that
    # of the gathered levels' (Q, C), as `top_mass` has it.
    q_term = torch.empty_like(top_mass)  # (Q, C)
    torch.sum(log_ratio.mul_(level_mass), dim=2, out=q_term)
    # q of bin i-1: its level's mass per non-empty bin.
    top_bins = top_bins.to(torch.float64)
    q_last = torch.log(torch.where(top_bins > 0, top_mass / top_bins, 1.0))  # (Q, C)
    q_term = q_term + torch.where(tail > 0, tail * q_last, 0.0)

    safe_total = torch.where(total > 0, total, 1.0)  # (Q, 1)
    safe_below = torch.where(mass_below > 0, mass_below, 1.0)  # (Q, C)
    kl = (p_term - q_term) / safe_total - torch.log(safe_total) + torch.log(safe_below)
    impossible = (mass_below <= 0) | ((tail > 0) & (last <= 0))  # (Q, C)
    return torch.where(impossible, math.inf, kl)


@kernel
def _candidate_divergences(
    h: torch.Tensor, cands: torch.Tensor, levels: int, c_step: int
) -> torch.Tensor:
    """`(Q, C)` KL divergences of clip bins `cands` for histograms `h`
    `(Q, B)`: `cands` `(C,)` shared by every row or `(Q, C)` per row. In
    torch, candidates in chunks of `c_step`; natively (CPU) all at once."""
    prefixes = _prefixes(h)
    if cands.ndim == 2:
        return torch.cat(
            [
                _divergences_rows(h, prefixes, cands[:, c0 : c0 + c_step], levels)
                for c0 in range(0, cands.shape[1], c_step)
            ],
            dim=1,
        )
    return torch.cat(
        [
            _divergences(h, prefixes, cands[c0 : c0 + c_step], levels)
            for c0 in range(0, cands.numel(), c_step)
        ],
        dim=1,
    )


def _candidate_divergences_native(
    h: torch.Tensor, cands: torch.Tensor, levels: int, c_step: int
) -> torch.Tensor | None:
    return native.entropy(h, cands, levels)


_candidate_divergences.register("cpu", _candidate_divergences_native)


def _prepared(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h, stop)`: `(Q, bins)` float64 counts with ModelOpt's bin-0 rule (bin 0
    takes bin 1's count: exact zeros do not decide the range) and the `(Q,)`
    bins up to the largest value (one past the last non-empty bin; 0: none)."""
    bins = counts.shape[-1]
    h = counts.reshape(-1, bins).to(torch.float64, copy=True)  # modified below
    nonzero = (h > 0).to(torch.uint8)
    has_data = nonzero.amax(dim=1) > 0
    stop = torch.where(has_data, bins - nonzero.flip(1).argmax(dim=1), 0)
    if bins > 1:
        h[:, 0] = h[:, 1]
    return h, stop


def entropy_divergences(
    counts: torch.Tensor, cands: torch.Tensor, num_quantized_bins: int
) -> torch.Tensor:
    """The KL divergence the search scores for clip bins `cands`.

    Args:
        counts: `(Q, bins)` counts of |x|, bin 0 starting at 0.
        cands: `(Q, C)` int64 clip bins in `[1, bins]`, per row.
        num_quantized_bins: levels of the quantized |x|.

    Returns:
        `(Q, C)` float64 divergences (`+inf` for impossible candidates).
    """
    _check_levels(torch.as_tensor(num_quantized_bins), 1, num_quantized_bins)
    bins = counts.shape[-1]
    if cands.numel() and (int(cands.min()) < 1 or int(cands.max()) > bins):
        raise ValueError(f"cands must be clip bins in [1, {bins}]")
    h, _ = _prepared(counts)
    c_step = max(1, _CHUNK_ELEMS // (h.shape[0] * (num_quantized_bins + 1)))
    return _candidate_divergences(h, cands, num_quantized_bins, c_step)


def _check_levels(levels: torch.Tensor, num_q: int, given: object) -> None:
    """Raise `ValueError` unless `levels` holds one or `num_q` ints >= 1."""
    integral = not levels.is_floating_point() or bool((levels == levels.round()).all())
    if levels.numel() not in (1, num_q) or not integral:
        raise ValueError(
            f"num_quantized_bins must be an int or a ({num_q},) tensor of ints, "
            f"got {given!r}"
        )
    if bool((levels < 1).any()):
        raise ValueError(f"num_quantized_bins must be >= 1, got {given!r}")


def _host_levels(
    given: int | torch.Tensor, choices: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    """The level counts known on the host (an int, or the caller's
    `choices` for a tensor), checked there; None: read them from the tensor."""
    if isinstance(given, int) and not isinstance(given, bool):
        choices = (given,)
    if choices is None:
        return None
    if not choices or any(
        isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in choices
    ):
        raise ValueError(f"num_quantized_bins must be >= 1, got {given!r}")
    return tuple(choices)


def _exhaustive(
    h: torch.Tensor,
    stop: torch.Tensor,
    levels: torch.Tensor,
    cands: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every candidate `cands` `(C,)` up to each row's `stop`: `(best, found)`."""
    num_q = h.shape[0]
    best = torch.zeros(num_q, dtype=torch.int64, device=h.device)
    found = torch.zeros(num_q, dtype=torch.bool, device=h.device)
    for count in torch.unique(levels).tolist() if cands.numel() else []:
        # One or two distinct level counts (asymmetric args: per qparam sign).
        group = (levels == count).nonzero().squeeze(1)
        # Chunks of qparams with similar data extents: candidates past the
        # largest value of a whole chunk are not scored at all.
        group = group[torch.argsort(stop[group])]
        q_step = min(group.numel(), _CHUNK_QPARAMS)
        c_step = max(1, _CHUNK_ELEMS // (q_step * (count + 1)))
        for q0 in range(0, group.numel(), q_step):
            rows = group[q0 : q0 + q_step]
            mine = cands[cands <= stop[rows].max()]
            if mine.numel() == 0:
                continue
            kl = _candidate_divergences(h[rows], mine, int(count), c_step)
            kl = torch.where(mine[None, :] <= stop[rows, None], kl, math.inf)
            # Last minimum: search the reversed candidates for the first one.
            least, rev = kl.flip(1).min(dim=1)
            pick = mine.numel() - 1 - rev
            found[rows] = torch.isfinite(least)
            best[rows] = mine[pick]
    return best, found


@kernel
def coarse_to_fine(
    counts: torch.Tensor,
    levels: torch.Tensor,
    start_bin: int,
    stride: int,
    choices: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The module docstring's coarse-to-fine search over int64 counts `(Q,
    bins)` of |x| with `(Q,)` levels: `(Q,)` int64 chosen clip bins (0 where
    a row has no possible candidate).

    It walks each row's *possible* candidates only (any other scores `+inf`:
    clipped mass would land in an empty bin): the clip bins `start_bin + k *
    stride` up to the row's stop whose last bin holds data, indexed `m = 0
    .. top`. First `m = round-half-up(j * top / 23)`, `j = 0 .. 23`; then,
    while the spacing `step` exceeds 1, `step = ceil(step / 4)` and the
    moves `-4 .. 4` steps around each of the 2 best (clamped). Best: least
    KL, the larger candidate among ties. A kernel: the native pass
    (registered for "cpu") runs each row to the end in one loop.

    Here every row is scored in fixed-size blocks, once per distinct level
    count (`choices`, the values `levels` may hold: given, no host read is
    made; else read from `levels`), each row keeping the search of its own
    count: no host read decides anything.
    """
    if choices is None:
        _check_levels(levels, counts.shape[0], levels)
    h, stop = _prepared(counts)
    num_q, bins = h.shape
    device = h.device
    best = torch.zeros(num_q, dtype=torch.int64, device=device)
    cands = torch.arange(min(start_bin, bins + 1), bins + 1, stride, device=device)
    if cands.numel() == 0:
        return best
    if choices is None:
        choices = tuple(int(c) for c in torch.unique(levels).tolist())
    q_step = max(1, _CHUNK_ELEMS // max(1, cands.numel()))
    for count in choices:
        mine = levels == count  # (Q,) rows searched with this count
        for q0 in range(0, num_q, q_step):
            rows = slice(q0, q0 + q_step)
            hr = h[rows]
            possible = (cands[None, :] <= stop[rows, None]) & (hr[:, cands - 1] > 0)
            # possible candidates first, in increasing order: (R, C)
            order = torch.argsort((~possible).to(torch.uint8), dim=1, stable=True)
            packed = cands[order]
            top = possible.sum(dim=1, keepdim=True) - 1  # (R, 1) last index
            live = (top[:, 0] >= 0) & mine[rows]  # rows without any: 0
            chosen = _refine(hr, packed, top.clamp(min=0), int(count))
            best[rows] = torch.where(live, chosen, best[rows])
    return best


def _coarse_to_fine_native(
    counts: torch.Tensor,
    levels: torch.Tensor,
    start_bin: int,
    stride: int,
    choices: tuple[int, ...] | None = None,
) -> torch.Tensor | None:
    return native.entropy_search_rows(
        counts, levels, start_bin, stride, _COARSE, _KEEP, _REACH
    )


coarse_to_fine.register("cpu", _coarse_to_fine_native)


def _refine_levels(candidates: int) -> int:
    """Refinement levels the widest row of `candidates` can need (the loop
    of `_refine` runs while a row's step exceeds 1)."""
    step = (candidates - 1 + _COARSE - 2) // (_COARSE - 1)
    levels = 0
    while step > 1:
        step = max(1, (step + _REACH - 1) // _REACH)
        levels += 1
    return levels


def _refine(
    h: torch.Tensor, packed: torch.Tensor, top: torch.Tensor, levels: int
) -> torch.Tensor:
    """Coarse-to-fine over the index `m = 0 .. top` of each row's candidates
    `packed` `(R, C)` (`coarse_to_fine`); returns the `(R,)` chosen ones.
    Each row refines while its own step exceeds 1: as many levels as the
    widest row can need run, each leaving finished rows as they were."""
    rows = h.shape[0]
    device = h.device
    c_step = max(1, _CHUNK_ELEMS // (rows * (levels + 1)))

    def score(m: torch.Tensor) -> torch.Tensor:
        m = torch.minimum(torch.clamp(m, min=0), top)
        kl = _candidate_divergences(h, packed.gather(1, m), levels, c_step)
        # ties go to the larger candidate: a descending stable sort first
        order = torch.argsort(-m, dim=1, stable=True)
        m, kl = m.gather(1, order), kl.gather(1, order)
        keep = torch.argsort(kl, dim=1, stable=True)[:, :_KEEP]
        return m.gather(1, keep)  # (R, _KEEP) best first

    ticks = torch.arange(_COARSE, device=device)
    # round-half-up(j * top / (_COARSE - 1)), in integers
    chosen = score((2 * ticks * top + _COARSE - 1) // (2 * (_COARSE - 1)))
    step = (top + _COARSE - 2) // (_COARSE - 1)  # (R, 1) candidates apart
    moves = torch.arange(-_REACH, _REACH + 1, device=device)
    for _ in range(_refine_levels(packed.shape[1])):
        active = step > 1  # rows still refining (the others are done)
        step = torch.where(
            active, torch.clamp((step + _REACH - 1) // _REACH, min=1), step
        )
        near = chosen[:, :, None] + moves * step[:, :, None]
        chosen = torch.where(active, score(near.reshape(rows, -1)), chosen)
    return packed.gather(1, chosen[:, :1]).squeeze(1)


def entropy_search(
    counts: torch.Tensor,
    width: torch.Tensor,
    num_quantized_bins: int | torch.Tensor = 128,
    *,
    start_bin: int = 128,
    stride: int = 1,
    amax: torch.Tensor | None = None,
    search: EntropySearch = "exhaustive",
    level_choices: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The clipping threshold of least KL divergence, per qparam.

    Args:
        counts: `(*Q, bins)` counts of |x|, bin 0 starting at 0.
        width: `(*Q,)` bin width.
        num_quantized_bins: levels of the quantized |x| (128 for int8 as in
            TensorRT; one int or a `(*Q,)` tensor).
        start_bin: the smallest candidate (in bins).
        stride: candidate spacing (in bins).
        amax: `(*Q,)` largest |x| observed; results are clamped to it (and it
            is the result where no candidate exists). Default: the right edge
            of the last non-empty bin.
        search: `"exhaustive"` (every candidate) or `"coarse_to_fine"` (see
            the module docstring).
        level_choices: for a tensor `num_quantized_bins`, the values it may
            hold (ints >= 1), if the caller knows them: the coarse-to-fine
            search then reads nothing of it on the host (the caller vouches
            for its values; else they are checked, and read).

    Returns:
        `(*Q,)` float64 thresholds (0 where a qparam has no counts).

    Raises:
        ValueError: `start_bin < 1`, `stride < 1`, fewer than 1 level or an
            unknown search.
    """
    for name, value in (("start_bin", start_bin), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if search not in ("exhaustive", "coarse_to_fine"):
        raise ValueError(
            f"search={search!r} is not one of ['exhaustive', 'coarse_to_fine']"
        )
    qshape = tuple(counts.shape[:-1])
    bins = counts.shape[-1]
    rows = counts.reshape(-1, bins)
    num_q = rows.shape[0]
    device = rows.device
    levels = torch.as_tensor(num_quantized_bins, device=device).reshape(-1)
    choices = _host_levels(num_quantized_bins, level_choices)
    if choices is None:
        _check_levels(levels, num_q, num_quantized_bins)
    elif levels.numel() not in (1, num_q):
        raise ValueError(
            f"num_quantized_bins must be an int or a ({num_q},) tensor of ints, "
            f"got {num_quantized_bins!r}"
        )
    levels = levels.expand(num_q) if levels.numel() == 1 else levels
    width64 = width.reshape(-1).to(torch.float64)
    if search == "coarse_to_fine":
        best = coarse_to_fine(rows, levels.to(torch.int64), start_bin, stride, choices)
        found = best > 0
        stop = None
        has_data = (rows > 0).any(dim=1)
    else:
        h, stop = _prepared(rows)
        has_data = stop > 0
        cands = torch.arange(min(start_bin, bins + 1), bins + 1, stride, device=device)
        best, found = _exhaustive(h, stop, levels, cands)
    if amax is not None:
        amax64 = amax.reshape(-1).to(torch.float64)
    else:
        if stop is None:
            _, stop = _prepared(rows)
        amax64 = stop.to(torch.float64) * width64
    best64 = best.to(torch.float64) * width64
    result = torch.where(found, torch.minimum(best64, amax64), amax64)
    result = torch.where(has_data, result, torch.zeros_like(result))
    return result.reshape(qshape)
