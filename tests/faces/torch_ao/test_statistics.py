"""torch.ao face on the engine: every observer's statistic lives in
registered buffers, so it moves with `.to()`, resumes from `state_dict`,
survives `copy.deepcopy` and `torch.save` / `torch.load`, and merges."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.ao.quantization import observer as tob

import quantobs.faces.torch_ao as ours
from quantobs.faces.torch_ao.overflow import TorchMovingAverage
from quantobs.observers.engine import ObserverEngine
from quantobs.stats.minmax import MinMax
from quantobs.stats.torch_histogram import TorchHistogram

from .test_observers import assert_same_qparams, assert_same_state, observe

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# name -> (class name, kwargs, statistic, the buffers holding it)
STATEFUL: dict[str, tuple[str, dict[str, Any], type, tuple[str, ...]]] = {
    "minmax": ("MinMaxObserver", {}, MinMax, ("min_val", "max_val")),
    "minmax_qint8_symmetric": (
        "MinMaxObserver",
        {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
        MinMax,
        ("min_val", "max_val"),
    ),
    "moving_average": (
        "MovingAverageMinMaxObserver",
        {"averaging_constant": 0.3},
        TorchMovingAverage,
        ("min_val", "max_val"),
    ),
    "per_channel_axis0": (
        "PerChannelMinMaxObserver",
        {"ch_axis": 0},
        MinMax,
        ("min_val", "max_val"),
    ),
    "per_channel_axis1_float_qparams": (
        "PerChannelMinMaxObserver",
        {"ch_axis": 1, "qscheme": torch.per_channel_affine_float_qparams},
        MinMax,
        ("min_val", "max_val"),
    ),
    "moving_average_per_channel": (
        "MovingAveragePerChannelMinMaxObserver",
        {"ch_axis": -1, "averaging_constant": 0.2},
        TorchMovingAverage,
        ("min_val", "max_val"),
    ),
    "histogram": (
        "HistogramObserver",
        {"bins": 128},
        TorchHistogram,
        ("histogram", "min_val", "max_val"),
    ),
    "histogram_global": (
        "HistogramObserver",
        {"bins": 64, "search": "global", "qscheme": torch.per_tensor_symmetric},
        TorchHistogram,
        ("histogram", "min_val", "max_val"),
    ),
}


def build(key: str, module: Any = ours) -> torch.nn.Module:
    name, kwargs, _, _ = STATEFUL[key]
    if module is tob:
        kwargs = {k: v for k, v in kwargs.items() if k != "search"}
    return getattr(module, name)(**kwargs)


def batches(device: str = "cpu") -> list[torch.Tensor]:
    """Three batches whose range grows and shrinks (the histogram re-bins)."""
    g = torch.Generator().manual_seed(21)
    xs = [
        torch.randn(12, 20, generator=g),
        torch.randn(12, 20, generator=g) * 3 + 1,
        torch.randn(12, 20, generator=g) * 0.5,
    ]
    return [x.to(device) for x in xs]


# ------------------------------------------------------------------ buffers


@pytest.mark.parametrize("key", STATEFUL)
def test_statistic_lives_in_registered_buffers(key: str) -> None:
    obs = build(key)
    _, _, statistic, names = STATEFUL[key]
    assert isinstance(obs, ObserverEngine)
    assert obs.statistic_type() is statistic
    observe(obs, batches())
    stat = obs.statistic()
    assert isinstance(stat, statistic)
    buffers = dict(obs.named_buffers())
    assert set(names) <= set(buffers)
    for field, value in stat.state().items():
        assert value is buffers[obs._buffer_name(field)]  # the buffers themselves
    assert set(names) <= set(obs.state_dict())


@pytest.mark.parametrize("key", STATEFUL)
def test_before_data_the_buffers_are_torchs(key: str) -> None:
    mine, theirs = build(key), build(key, tob)
    assert not mine.has_statistics and mine.statistic() is None
    assert_same_state(mine, theirs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", STATEFUL)
def test_to_device_moves_the_statistic(key: str, device: str) -> None:
    """Observe on CPU, move, go on on the device: as torch's observer does."""
    first, *rest = batches()
    mine, theirs = build(key), build(key, tob)
    mine(first)
    theirs(first)
    mine.to(device)
    theirs.to(device)
    for value in mine.state_dict().values():
        assert value.device.type == device
    observe(mine, [x.to(device) for x in rest])
    observe(theirs, [x.to(device) for x in rest])
    assert_same_state(mine, theirs)
    if STATEFUL[key][1].get("search") != "global":
        assert_same_qparams(mine, theirs)
    scale, zero_point = mine.calculate_qparams()
    assert scale.device.type == device and zero_point.device.type == device


@pytest.mark.parametrize("key", STATEFUL)
def test_state_dict_resumes_exactly(key: str) -> None:
    """state_dict into a fresh observer, then more batches: the same as one
    observer that saw every batch."""
    first, *rest = batches()
    whole, saved = build(key), build(key)
    observe(whole, [first, *rest])
    saved(first)
    resumed = build(key)
    resumed.load_state_dict(saved.state_dict())
    observe(resumed, rest)
    assert_same_state(resumed, whole)
    assert_same_qparams(resumed, whole)


@pytest.mark.parametrize("key", STATEFUL)
def test_state_dict_of_an_unobserved_observer_loads(key: str) -> None:
    observed = build(key)
    observe(observed, batches())
    observed.load_state_dict(build(key).state_dict())
    assert_same_state(observed, build(key))
    assert not observed.has_statistics


@pytest.mark.parametrize("key", STATEFUL)
def test_deepcopy_is_independent_and_continues_alike(key: str) -> None:
    first, *rest = batches()
    original = build(key)
    original(first)
    clone = copy.deepcopy(original)
    assert_same_state(clone, original)
    for name, value in clone.named_buffers():
        assert value is not original.get_buffer(name)
    observe(original, rest)
    observe(clone, rest)
    assert_same_state(clone, original)
    assert_same_qparams(clone, original)


@pytest.mark.parametrize("key", STATEFUL)
def test_torch_save_and_load(key: str) -> None:
    first, *rest = batches()
    original = build(key)
    original(first)
    whole = io.BytesIO()
    torch.save(original, whole)
    whole.seek(0)
    loaded = torch.load(whole, weights_only=False)
    state = io.BytesIO()
    torch.save(original.state_dict(), state)
    state.seek(0)
    from_state = build(key)
    from_state.load_state_dict(torch.load(state, weights_only=True))
    for obs in (original, loaded, from_state):
        observe(obs, rest)
    assert_same_state(loaded, original)
    assert_same_state(from_state, original)
    assert_same_qparams(loaded, original)


@pytest.mark.parametrize("key", STATEFUL)
def test_reset_returns_to_the_state_before_data(key: str) -> None:
    obs = build(key)
    observe(obs, batches())
    obs.reset_min_max_vals()
    assert not obs.has_statistics
    assert_same_state(obs, build(key))
    assert_same_qparams(obs, build(key))


# ------------------------------------------------------------------ merge


@pytest.mark.parametrize(
    "key", ["minmax", "per_channel_axis0", "per_channel_axis1_float_qparams"]
)
def test_minmax_merge_equals_observing_everything(key: str) -> None:
    first, second, third = batches()
    a, b, whole = build(key), build(key), build(key)
    observe(a, [first, third])
    b(second)
    observe(whole, [first, second, third])
    assert a.merge(b) is a
    assert_same_state(a, whole)
    assert_same_qparams(a, whole)


def test_histogram_merge_is_the_statistics_merge() -> None:
    first, second, _ = batches()
    a, b = build("histogram"), build("histogram")
    a(first)
    b(second)
    expected = a.statistic().merge(b.statistic())  # type: ignore[union-attr]
    a.merge(b)
    for field, value in expected.state().items():
        assert torch.equal(a.get_buffer(a._buffer_name(field)), value)


def test_merge_into_an_unobserved_observer_copies() -> None:
    a, b = build("per_channel_axis0"), build("per_channel_axis0")
    b(batches()[0])
    a.merge(b)
    assert_same_state(a, b)
    assert a.min_val is not b.min_val


def test_merge_refuses_other_settings_and_moving_averages() -> None:
    with pytest.raises(ValueError, match="different ch_axis"):
        build("per_channel_axis0").merge(ours.PerChannelMinMaxObserver(ch_axis=1))
    with pytest.raises(ValueError, match="different bins"):
        ours.HistogramObserver(bins=8).merge(ours.HistogramObserver(bins=16))
    a, b = build("moving_average"), build("moving_average")
    a(batches()[0])
    b(batches()[1])
    with pytest.raises(ValueError, match="by their counts"):
        a.merge(b)


# ------------------------------------------------------------------ no statistic

STATELESS: dict[str, Callable[[], torch.nn.Module]] = {
    "fixed_qparams": lambda: ours.FixedQParamsObserver(scale=0.5, zero_point=3),
    "placeholder": lambda: ours.PlaceholderObserver(dtype=torch.float16),
    "recording": ours.RecordingObserver,
    "noop": ours.NoopObserver,
    "reuse_input": ours.ReuseInputObserver,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", STATELESS)
def test_observers_without_statistics(name: str, device: str) -> None:
    obs = STATELESS[name]()
    assert isinstance(obs, ObserverEngine)
    assert obs.statistic_type() is None and obs.statistic() is None
    x = torch.randn(3, 4, device=device)
    obs.to(device)
    assert obs(x) is x
    clone = copy.deepcopy(obs)
    buffer = io.BytesIO()
    torch.save(obs, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded):
        assert type(other) is type(obs)
        assert other.state_dict().keys() == obs.state_dict().keys()
        for key, value in obs.state_dict().items():
            assert torch.equal(other.state_dict()[key], value)
            assert value.device.type == device
