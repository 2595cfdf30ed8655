"""Host copies of device histograms (`quantobs.observers.histogram_host`):
exact, read with the deferred checks, solved with the same numbers, and
dropped when the histogram changes. Run on the torch path (native kernels
off), the path of a CUDA tensor, where the copy is made."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from quantobs import Observer, QuantizationArgs, native
from quantobs.core.syncs import SyncCounter
from quantobs.observers.histogram import HistogramStatObserver
from quantobs.observers.histogram_host import HostCopy, pack, unpack
from quantobs.stats.histogram import Histogram


@pytest.fixture(autouse=True)
def _torch_path() -> Iterator[None]:
    previous = native.set_enabled(False)
    yield
    native.set_enabled(previous)


def test_pack_round_trips_exactly() -> None:
    big = (1 << 62) - 3
    hist = Histogram(
        counts=torch.tensor([[0, 1, (1 << 52) + 1], [7, 0, 2]], dtype=torch.int64),
        exponent=torch.tensor([-126, 40], dtype=torch.int64),
        offset=torch.tensor([-big, big], dtype=torch.int64),
        min_vals=torch.tensor([-math.inf, 1e-30], dtype=torch.float32),
        max_vals=torch.tensor([math.nan, 3.5], dtype=torch.float32),
        absolute=True,
    )
    back = unpack(pack(hist).tolist(), hist)
    assert back.absolute
    for name, value in hist.state().items():
        torch.testing.assert_close(
            back.state()[name], value, rtol=0, atol=0, equal_nan=True
        )


def _observer(name: str, **options: object) -> HistogramStatObserver:
    args = QuantizationArgs(num_bits=8, symmetric=options.pop("symmetric", True))
    observer = Observer.get_class(name)("input", args, **options)
    assert isinstance(observer, HistogramStatObserver)
    return observer


CASES = [
    ("histogram", {}),
    ("histogram", {"symmetric": False}),
    ("histogram", {"mode": "torch"}),
    ("entropy", {}),
]


@pytest.mark.parametrize(("name", "options"), CASES, ids=str)
def test_host_copy_gives_the_device_search_numbers(
    name: str, options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(4, 512, generator=gen) * s for s in (1.0, 3.0)]
    hosted = _observer(name, **dict(options))
    for batch in batches:
        hosted.update(batch)
    with SyncCounter() as syncs:
        found = hosted.get_qparams()
    assert syncs.count <= 2  # the copy travels with the deferred checks
    assert hosted._host.get(hosted.histogram) is not None  # solved on the copy
    # the same search on the histogram itself (its host reads counted)
    monkeypatch.setattr(type(hosted), "_host_search", lambda self, hist: False)
    direct = _observer(name, **dict(options))
    for batch in batches:
        direct.update(batch)
    for ours, expected in zip(found, direct.get_qparams(), strict=True):
        assert torch.equal(ours, expected)


def test_copy_is_dropped_when_the_histogram_changes() -> None:
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(5))
    observer = _observer("histogram")
    observer.update(x)
    first = observer.get_qparams()
    observer.update(x * 4)  # wider: a new histogram
    later = observer.get_qparams()
    fresh = _observer("histogram")
    fresh.update(x)
    fresh.update(x * 4)
    assert not torch.equal(first[0], later[0])
    assert torch.equal(later[0], fresh.get_qparams()[0])
    with SyncCounter() as syncs:  # asked again: cached, no new copy
        observer.get_qparams()
    assert syncs.count <= 1


def test_host_copy_is_not_pickled() -> None:
    import pickle

    observer = _observer("histogram")
    observer.update(torch.randn(4, 64))
    observer.get_qparams()
    assert observer._host.get(observer.histogram) is not None
    copy = pickle.loads(pickle.dumps(observer._host))
    assert isinstance(copy, HostCopy) and copy.get(observer.histogram) is None
