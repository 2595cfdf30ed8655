"""The statistic protocol's laws, written once for every statistic.

* `state()` / `from_state()` round-trip.
* The reductions each statistic declares (`reduce_states`, what a
  cross-process all-reduce computes) give its own `merge`.
* Exact statistics merge to what observing the concatenated batches gives
  (merge = observe the concatenation); every statistic's merge keeps the
  qparam shape and, for exact ones, has the empty statistic as identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import QuantizationArgs
from quantobs.stats.base import Reduce, Statistic, reduce_states
from quantobs.stats.bfp import BfpAbsMax
from quantobs.stats.candidate_errors import CandidateErrors
from quantobs.stats.histogram import Histogram
from quantobs.stats.importance import Importance
from quantobs.stats.minmax import (
    AbsMax,
    LatestAbsMax,
    LatestRange,
    MinMax,
    MovingAverage,
)
from quantobs.stats.quark_histogram import QuarkHistogram
from quantobs.stats.torch_histogram import TorchHistogram

QSHAPE = (3,)
CPU = torch.device("cpu")

# name -> (class, config, qparam shape)
STATISTICS: dict[str, tuple[type[Statistic], dict[str, Any], tuple[int, ...]]] = {
    "minmax": (MinMax, {"track_absmax": True}, QSHAPE),
    "latest": (LatestRange, {"track_absmax": True}, QSHAPE),
    "moving_average": (MovingAverage, {"constant": 0.25, "form": "step"}, QSHAPE),
    "absmax": (AbsMax, {}, QSHAPE),
    "latest_absmax": (LatestAbsMax, {}, QSHAPE),
    "histogram": (Histogram, {"bins": 32}, QSHAPE),
    "histogram_abs": (Histogram, {"bins": 32, "absolute": True}, QSHAPE),
    "candidate_errors": (
        CandidateErrors,
        {"args": QuantizationArgs(num_bits=4), "grid": 20.0},
        QSHAPE,
    ),
    "quark_histogram": (QuarkHistogram, {"bins": 32, "absolute": True}, ()),
    "bfp": (BfpAbsMax, {}, QSHAPE),
    "torch_histogram": (TorchHistogram, {"bins": 32}, ()),
    "importance": (Importance, {}, QSHAPE),
}
EXACT = [name for name, (cls, _, _) in STATISTICS.items() if cls.exact]


def _empty(name: str) -> Statistic:
    cls, config, qshape = STATISTICS[name]
    stat = cls.empty(qshape, CPU, **config)
    if isinstance(stat, CandidateErrors):  # statistics to merge share a reference
        stat = stat.with_reference(torch.full(qshape, -4.0), torch.full(qshape, 4.0))
    return stat


def _observe(stat: Statistic, x_flat: torch.Tensor) -> Statistic:
    """What an observer does with a batch: scan, attach values, update."""
    batch = stat.scan(x_flat)
    if stat.needs_values:
        batch = dataclasses.replace(batch, x_flat=x_flat)
    return stat.update(batch)


def _batch(name: str, values: list[float], scale: float) -> torch.Tensor:
    qshape = STATISTICS[name][2]
    x = torch.tensor(values, dtype=torch.float32) * scale
    groups = 1 if not qshape else qshape[0]
    x = x[: len(values) // groups * groups].reshape(-1, groups, 1) if groups > 1 else x
    return x.reshape(-1, *qshape, 1) if qshape else x.reshape(1, -1)


def _same(a: Statistic, b: Statistic, exact: bool = True) -> None:
    sa, sb = a.state(), b.state()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        if exact:
            assert torch.equal(value, sb[key]), key
        else:
            torch.testing.assert_close(value, sb[key], rtol=1e-5, atol=1e-5)


def _fold(
    stats: list[Statistic], combine: Callable[[Statistic, Statistic], Statistic]
) -> Statistic:
    out = stats[0]
    for other in stats[1:]:
        out = combine(out, other)
    return out


# No subnormals: a negative one so small that scaling underflows it to -0.0 is
# binned by the histogram's one documented exception (quantobs.stats.histogram).
VALUES = st.lists(
    st.floats(-100.0, 100.0, allow_nan=False, allow_subnormal=False, width=32),
    min_size=3,
    max_size=24,
)


@pytest.mark.parametrize("name", list(STATISTICS))
@settings(max_examples=20, deadline=None)
@given(parts=st.lists(st.tuples(VALUES, st.floats(0.01, 10.0)), min_size=2, max_size=3))
def test_declared_reductions_give_the_merge(
    name: str, parts: list[tuple[list[float], float]]
) -> None:
    stats = [_observe(_empty(name), _batch(name, v, s)) for v, s in parts]
    cls, config, _ = STATISTICS[name]
    for stat in stats:  # state round-trip
        _same(cls.from_state(stat.state(), **config), stat)
    pairwise = reduce_states(cls, [stats[0].state(), stats[1].state()], **config)
    _same(cls.from_state(pairwise, **config), stats[0].merge(stats[1]))
    aligns = cls.align is not Statistic.align
    if len(stats) == 3 and (cls.exact or not aligns):
        # Re-binning approximately twice differs from once: pairs only.
        reduced = reduce_states(cls, [s.state() for s in stats], **config)
        mean = any(f.reduce == Reduce.MEAN for f in cls.fields)
        merged = _fold(stats, lambda a, b: a.merge(b))
        _same(cls.from_state(reduced, **config), merged, exact=not mean)


@pytest.mark.parametrize("name", EXACT)
@settings(max_examples=20, deadline=None)
@given(a=VALUES, b=VALUES, scale=st.floats(0.01, 10.0))
def test_exact_merge_is_observing_the_concatenation(
    name: str, a: list[float], b: list[float], scale: float
) -> None:
    first, second = _batch(name, a, 1.0), _batch(name, b, scale)
    merged = _observe(_empty(name), first).merge(_observe(_empty(name), second))
    together = _observe(_empty(name), torch.cat([first, second]))
    float_sums = name in ("candidate_errors", "importance")  # sums of floats
    _same(merged, together, exact=not float_sums)
    # the empty statistic is the identity of the merge
    _same(_empty(name).merge(merged), merged, exact=not float_sums)
    _same(merged.merge(_empty(name)), merged, exact=not float_sums)


@pytest.mark.parametrize("name", list(STATISTICS))
def test_config_survives_state(name: str) -> None:
    cls = STATISTICS[name][0]
    stat = _observe(_empty(name), _batch(name, [1.0, -2.0, 3.0, 0.5, 4.0, -1.0], 1.0))
    restored = cls.from_state(stat.state(), **stat.config())
    assert restored.config() == stat.config()
    assert restored.qparam_shape == stat.qparam_shape
