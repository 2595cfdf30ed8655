"""Every registered observer keeps its statistics in registered buffers:
they move with `.to()`, travel in `state_dict`, `copy.deepcopy` and
`torch.save`, on every available device."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from quantobs import Observer, QuantizationArgs

ARGS = {
    "channel": QuantizationArgs(num_bits=8, strategy="channel"),
    "nvfp4": QuantizationArgs(
        num_bits=4,
        type="float",
        strategy="tensor_group",
        group_size=16,
        scale_dtype=torch.float8_e4m3fn,
        zp_dtype=torch.float8_e4m3fn,
    ),
}
NAMES = sorted({Observer.get_class(n).name for n in Observer.registered_names()})


def _observer(name: str, args: str) -> Observer:
    options = (
        {"bins": 64} if "histogram" in name or name in ("percentile", "entropy") else {}
    )
    return Observer.load_from_registry(
        name, base_name="weight", args=ARGS[args], **options
    )


def _batches(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 64, generator=gen) * s).to(device) for s in (1.0, 3.0)]


def _qparams(observer: Observer) -> list[torch.Tensor]:
    found = list(observer.get_qparams())
    if observer.args.strategy == "tensor_group":
        found.append(observer.get_global_scale())
    return found


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("args", list(ARGS))
@pytest.mark.parametrize("name", NAMES)
def test_statistics_are_buffers_that_move_save_and_copy(
    name: str, args: str, device: torch.device
) -> None:
    first, second = _batches(device)
    observer = _observer(name, args).to(device)
    observer.update(first)
    stat = observer.statistic()
    assert stat is not None
    buffers = dict(observer.named_buffers())
    for field, value in stat.state().items():
        assert buffers[field] is value  # the statistic lives in its buffers
        assert value.device.type == device.type
    state = observer.state_dict()
    assert set(stat.state()) <= set(state)

    straight = _observer(name, args).to(device)
    straight.update(first)
    straight.update(second)
    resumed = _observer(name, args).to(device)
    resumed.load_state_dict(state)
    copied = copy.deepcopy(observer)
    buffer = io.BytesIO()
    torch.save(observer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (resumed, copied, loaded):
        other.update(second)
        _assert_same(_qparams(other), _qparams(straight))
        assert other.num_observations == straight.num_observations
    observer.update(second)  # the copies were independent of the original
    _assert_same(_qparams(observer), _qparams(straight))


@pytest.mark.parametrize("name", ["static_minmax", "histogram", "static_mse"])
def test_to_moves_statistics(name: str, device: torch.device) -> None:
    observer = _observer(name, "channel")
    observer.update(_batches(torch.device("cpu"))[0])
    moved = observer.to(device)
    for value in moved.statistic().state().values():  # type: ignore[union-attr]
        assert value.device.type == device.type
    moved.update(_batches(device)[1])
    assert moved.get_qparams()[0].device.type == device.type


def test_a_fresh_observer_loads_nothing_and_an_empty_state() -> None:
    used, fresh = (
        _observer("static_minmax", "channel"),
        _observer("static_minmax", "channel"),
    )
    used.update(torch.randn(4, 8))
    used.load_state_dict(fresh.state_dict())  # a state without statistics
    assert not used.has_statistics and used.num_observations == 0


def test_clear_data_keeps_only_the_shared_reference() -> None:
    """`clear_data` empties the statistic but keeps EQUAL fields (static_mse's
    reference): the identity of a merge under the same settings."""
    import quantobs
    from quantobs.stats.candidate_errors import CandidateErrors

    args = quantobs.QuantizationArgs(num_bits=8, strategy="tensor")
    load = quantobs.Observer.load_from_registry
    mse = load("static_mse", base_name="input", args=args)
    mse.update(torch.randn(64, 16))
    before = mse.statistic()
    assert isinstance(before, CandidateErrors)
    mse.clear_data()
    after = mse.statistic()
    assert isinstance(after, CandidateErrors)
    assert torch.equal(after.ref_min, before.ref_min)
    assert torch.equal(after.ref_max, before.ref_max)
    assert not after.errors.any() and mse.num_observations == 0
    histogram = load("histogram", base_name="input", args=args)
    histogram.update(torch.randn(64, 16))
    histogram.clear_data()
    stat = histogram.statistic()
    assert stat is not None and int(stat.counts.sum()) == 0  # type: ignore[attr-defined]
    fresh = quantobs.Observer.load_from_registry(
        "static_minmax", base_name="input", args=args
    )
    fresh.clear_data()
    assert not fresh.has_statistics
