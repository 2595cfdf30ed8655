"""Histogram observers per channel / per group: bins from the data, the
`"auto"` searches, exact merges, the placeholder without bins, the cache."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs import Observer, QuantizationArgs
from quantobs.observers import HistogramStatObserver
from quantobs.observers.histogram_options import auto_bins

NAMES = ["histogram", "percentile", "entropy", "histogram_mse"]
# every histogram-family observer, with torch's search as one more
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    *[(name, {}) for name in NAMES],
    ("histogram", {"mode": "torch"}),
]
CONFIG_IDS = [name + ("-torch" if opts else "") for name, opts in CONFIGS]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _observer(
    name: str, args: QuantizationArgs, **kwargs: Any
) -> HistogramStatObserver:
    found = Observer.load_from_registry(name, base_name="weight", args=args, **kwargs)
    assert isinstance(found, HistogramStatObserver)
    return found


CHANNEL = QuantizationArgs(num_bits=8, strategy="channel")
GROUP = QuantizationArgs(num_bits=4, group_size=32)


@pytest.mark.parametrize(
    ("values", "bins"),
    [(1, 64), (16, 64), (128, 64), (129, 128), (384, 256), (4096, 256)],
)
def test_auto_bins_follow_the_values_per_qparam(values: int, bins: int) -> None:
    assert auto_bins(values) == bins


@pytest.mark.parametrize("name", NAMES)
def test_bins_are_chosen_from_the_data(name: str) -> None:
    weight = torch.randn(8, 384, generator=_gen(1))
    per_channel = _observer(name, CHANNEL)
    per_channel.update(weight)
    assert per_channel.histogram.bins == 256  # 384 values per channel
    per_group = _observer(name, GROUP)
    per_group.update(weight)
    assert per_group.histogram.bins == 64  # groups of 32
    per_tensor = _observer(name, QuantizationArgs(num_bits=8))
    per_tensor.update(weight)
    assert per_tensor.histogram.bins == 2048  # as before: torch.ao, ModelOpt
    explicit = _observer(name, CHANNEL, bins=512)
    explicit.update(weight)
    assert explicit.histogram.bins == 512


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("entropy", {"search": "greedy"}, "search"),
        ("histogram", {"search": "exhaustive"}, "search"),
        ("histogram_mse", {"objective": "raw"}, "objective"),
        ("entropy", {"start_bin": 0}, "start_bin"),
        ("percentile", {"bins": 7}, "bins must be 'auto' or an int >= 8"),
        ("percentile", {"bins": True}, "bins must be 'auto' or an int >= 8"),
    ],
)
def test_new_options_are_validated(
    name: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _observer(name, CHANNEL, **options)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("histogram", {"search": "certified"}),
        ("histogram", {"search": "batched"}),
        ("entropy", {"search": "exhaustive"}),
        ("entropy", {"search": "coarse_to_fine", "start_bin": 4}),
        ("histogram_mse", {"objective": "bin_centers"}),
        ("histogram_mse", {"objective": "uniform_bins"}),
    ],
)
def test_every_search_runs_per_tensor_and_per_channel(
    name: str, options: dict[str, Any]
) -> None:
    weight = torch.randn(16, 256, generator=_gen(2))
    for args in (
        QuantizationArgs(num_bits=4),
        QuantizationArgs(num_bits=4, strategy="channel"),
    ):
        observer = _observer(name, args, **options)
        observer.update(weight)
        scale, _ = observer.get_qparams()
        assert bool(torch.isfinite(scale).all() & (scale > 0).all())
        low, high = observer.get_range()
        assert bool((low <= 0).all() & (high >= 0).all())
        assert bool((high <= weight.abs().amax() + 1e-6).all())


@pytest.mark.parametrize("name", NAMES)
def test_auto_searches_stay_close_to_the_per_tensor_ones(name: str) -> None:
    # The batched / coarse-to-fine / uniform-bin defaults against the
    # per-tensor searches on the same per-channel histograms: the chosen
    # ranges agree within a few percent of the channel's range.
    pinned = {
        "histogram": {"search": "certified"},
        "percentile": {},
        "entropy": {"search": "exhaustive"},
        "histogram_mse": {"objective": "bin_centers", "bins": 2048},
    }[name]
    weight = torch.randn(12, 1024, generator=_gen(3))
    fast = _observer(name, QuantizationArgs(num_bits=4, strategy="channel"))
    slow = _observer(name, QuantizationArgs(num_bits=4, strategy="channel"), **pinned)
    fast.update(weight)
    slow.update(weight)
    spread = weight.abs().amax(dim=1, keepdim=True)
    gap = (fast.get_range()[1] - slow.get_range()[1]).abs() / spread
    assert float(gap.max()) < 0.1


# ------------------------------------------------------------------ merges

_batch = st.tuples(
    st.integers(1, 3),  # rows of a weight-like batch (observations)
    st.floats(1e-2, 1e2),  # scale
    st.floats(-3, 3),  # shift
    st.integers(0, 2**31 - 1),  # seed
)


def _data(rows: int, scale: float, shift: float, seed: int) -> torch.Tensor:
    return torch.randn(rows * 4, 64, generator=_gen(seed)) * scale + shift


@settings(max_examples=15, deadline=None)
@given(
    batches=st.lists(_batch, min_size=2, max_size=4), config=st.sampled_from(CONFIGS)
)
def test_merge_equals_observing_the_concatenation_per_channel_and_group(
    batches: list[tuple[int, float, float, int]], config: tuple[str, dict[str, Any]]
) -> None:
    name, options = config
    data = [_data(*b)[:4] for b in batches]  # the same (4, 64) shape: a weight
    for args in (
        QuantizationArgs(num_bits=8, strategy="channel"),
        QuantizationArgs(num_bits=4, group_size=16, symmetric=False),
    ):
        whole = Observer.load_from_registry(
            name, base_name="weight", args=args, **options
        )
        parts = [
            Observer.load_from_registry(name, base_name="weight", args=args, **options)
            for _ in data
        ]
        for x, part in zip(data, parts, strict=True):
            whole.update(x)
            part.update(x)
        merged = parts[-1]
        for part in reversed(parts[:-1]):  # another order than observed
            merged = merged.merge(part)
        for ours, expected in zip(
            merged.statistic().state().values(),
            whole.statistic().state().values(),
            strict=True,
        ):
            assert torch.equal(ours, expected)
        for ours, expected in zip(
            merged.get_qparams(), whole.get_qparams(), strict=True
        ):
            assert torch.equal(ours, expected)


def test_group_strategy_tokens_merge_exactly_with_auto_bins() -> None:
    # Activations per group: the bins come from the group size (the args),
    # so batches of any token count merge exactly.
    args = QuantizationArgs(num_bits=8, group_size=16)
    xs = [torch.randn(n, 64, generator=_gen(n)) for n in (3, 17, 40)]
    whole = Observer.load_from_registry("entropy", base_name="input", args=args)
    parts = [
        Observer.load_from_registry("entropy", base_name="input", args=args) for _ in xs
    ]
    for x, part in zip(xs, parts, strict=True):
        whole.update(x)
        part.update(x)
    merged = parts[0].merge(parts[2]).merge(parts[1])
    assert torch.equal(merged.histogram.counts, whole.histogram.counts)
    assert merged.histogram.bins == auto_bins(16)


# ------------------------------------------------------- placeholder, state


def test_a_statistic_made_before_any_data_has_no_bins() -> None:
    # A fresh per-channel observer does not know its values per qparam (a
    # process that saw no batch, in a distributed sync): a placeholder
    # without bins, which reads as no statistic and is sized by the first
    # batch.
    observer = _observer("histogram", CHANNEL)
    placeholder = observer._new_statistic((8, 1), torch.device("cpu"))
    assert placeholder.counts.shape == (8, 1, 0)
    observer._store(placeholder)
    assert observer.statistic() is None and not observer.has_statistics
    aligned = placeholder.align(
        {"min_vals": torch.full((8, 1), -1.0), "max_vals": torch.full((8, 1), 1.0)}
    )
    assert aligned.counts.numel() == 0  # a sync fills it with the others' shape
    observer.update(torch.randn(8, 100, generator=_gen(4)))
    assert observer.histogram.bins == auto_bins(100)
    # Groups fix their values per qparam in the args: real bins at once.
    grouped = _observer("histogram", GROUP)
    assert grouped._new_statistic((8, 2), torch.device("cpu")).bins == auto_bins(32)


@pytest.mark.parametrize("name", NAMES)
def test_clear_data_and_load_keep_the_bins(name: str) -> None:
    weight = torch.randn(8, 384, generator=_gen(5))
    observer = _observer(name, CHANNEL)
    observer.update(weight)
    fresh = _observer(name, CHANNEL)
    fresh.load_state_dict(observer.state_dict())
    assert fresh.histogram.bins == 256
    fresh.clear_data()  # an empty statistic of the same bins
    assert fresh.statistic() is not None and fresh.histogram.bins == 256
    fresh.update(weight)
    for ours, expected in zip(fresh.get_qparams(), observer.get_qparams(), strict=True):
        assert torch.equal(ours, expected)


# ------------------------------------------------------------------ cache


class _Counting:
    """Counts calls of an observer's `_solve`."""

    def __init__(self, observer: HistogramStatObserver) -> None:
        self.calls = 0
        solve = observer._solve

        def counted(hist: Any) -> Any:
            self.calls += 1
            return solve(hist)

        observer._solve = counted  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "args", [QuantizationArgs(num_bits=8), CHANNEL], ids=["tensor", "channel"]
)
@pytest.mark.parametrize("name", NAMES)
def test_qparams_are_cached_until_the_statistic_changes(
    name: str, args: QuantizationArgs
) -> None:
    weight = torch.randn(8, 256, generator=_gen(6))
    observer = _observer(name, args)
    counter = _Counting(observer)
    observer.update(weight)
    first = observer.get_qparams()
    again = observer.get_qparams()
    observer.get_range()
    assert counter.calls == 1
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    again[0].zero_()  # results are the caller's: the cache keeps its own
    assert torch.equal(observer.get_qparams()[0], first[0])
    assert counter.calls == 1

    observer.update(weight * 3)  # update
    assert not torch.equal(observer.get_qparams()[0], first[0])
    assert counter.calls == 2

    other = _observer(name, args)
    other.update(weight * 5)
    observer.merge(other)  # merge
    observer.get_qparams()
    assert counter.calls == 3

    state = other.state_dict()
    observer.load_state_dict(state)  # load
    loaded = observer.get_qparams()
    assert counter.calls == 4
    for a, b in zip(loaded, other.get_qparams(), strict=True):
        assert torch.equal(a, b)

    observer.reset()  # reset
    with pytest.raises(RuntimeError, match="no statistics"):
        observer.get_qparams()
    observer.update(weight)
    assert torch.equal(observer.get_qparams()[0], first[0])
    assert counter.calls == 5

    observer.histogram.counts.add_(1)  # a buffer changed in place
    observer.get_qparams()
    assert counter.calls == 6


def test_cache_survives_pickling_and_deepcopy_empty() -> None:
    observer = _observer("histogram", CHANNEL)
    observer.update(torch.randn(4, 64, generator=_gen(7)))
    expected = observer.get_qparams()
    buffer = io.BytesIO()
    torch.save(observer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(observer)
    for copied in (loaded, twin):
        counter = _Counting(copied)
        for a, b in zip(copied.get_qparams(), expected, strict=True):
            assert torch.equal(a, b)
        assert counter.calls == 1  # solved again: nothing cached came along
