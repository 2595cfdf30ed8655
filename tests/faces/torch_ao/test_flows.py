"""torch.ao face inside torch's own flows: state dicts both ways, `with_args`,
eager `prepare` / `convert`, FX, `FakeQuantize`, observer state-dict helpers."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import observer as tob
from torch.ao.quantization.qconfig import qconfig_equals

import quantobs.faces.torch_ao as ours

from .test_observers import (
    assert_identical,
    assert_same_qparams,
    assert_same_state,
    batches,
    observe,
)

# torch.ao's flows warn that they are deprecated (and so are quantized
# tensors); the observers under test do not.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:torch.ao.quantization is deprecated:DeprecationWarning"
    ),
    pytest.mark.filterwarnings(
        "ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning"
    ),
]

STATEFUL: dict[str, dict[str, Any]] = {
    "MinMaxObserver": {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
    "MovingAverageMinMaxObserver": {"averaging_constant": 0.3},
    "PerChannelMinMaxObserver-axis0": {"ch_axis": 0},
    "PerChannelMinMaxObserver-axis1": {
        "ch_axis": 1,
        "qscheme": torch.per_channel_affine_float_qparams,
    },
    "MovingAveragePerChannelMinMaxObserver": {"ch_axis": 1},
    "HistogramObserver": {"bins": 256},
}


def _build(module: Any, key: str) -> torch.nn.Module:
    return getattr(module, key.split("-")[0])(**STATEFUL[key])


# ------------------------------------------------------------------ state dicts


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("key", STATEFUL)
def test_state_dict_interchanges(key: str, direction: str) -> None:
    first, second = batches("growing"), batches("normal")
    src_module, dst_module = (
        (tob, ours) if direction == "torch_to_ours" else (ours, tob)
    )
    src, dst = _build(src_module, key), _build(dst_module, key)
    observe(src, first)
    dst.load_state_dict(src.state_dict())
    assert_same_state(dst, src)
    assert_same_qparams(dst, src)
    observe(src, second)  # the loaded observer goes on as the saved one would
    observe(dst, second)
    assert_same_state(dst, src)
    assert_same_qparams(dst, src)


@pytest.mark.parametrize("saved_channels", [0, 3, 40], ids=["empty", "3ch", "40ch"])
def test_per_channel_buffers_resize_on_load(saved_channels: int) -> None:
    src = tob.PerChannelMinMaxObserver()
    if saved_channels:
        src(torch.randn(saved_channels, 5))
    dst = ours.PerChannelMinMaxObserver()
    dst(torch.randn(7, 5))  # 7 channels before the load
    dst.load_state_dict(src.state_dict())
    assert dst.min_val.shape == (saved_channels,)
    assert_same_qparams(dst, src)


def test_per_channel_version_2_names_load() -> None:
    src = tob.PerChannelMinMaxObserver()
    src(torch.randn(4, 5))
    state = src.state_dict()
    state["min_vals"] = state.pop("min_val")
    state["max_vals"] = state.pop("max_val")
    state._metadata[""]["version"] = 2  # type: ignore[attr-defined]
    dst = ours.PerChannelMinMaxObserver()
    dst.load_state_dict(state)
    assert_same_qparams(dst, src)


def test_histogram_version_2_empty_range_loads() -> None:
    src = ours.HistogramObserver(bins=16)
    state = src.state_dict()
    state["min_val"], state["max_val"] = torch.tensor([]), torch.tensor([])
    state._metadata[""]["version"] = 2  # type: ignore[attr-defined]
    dst = ours.HistogramObserver(bins=16)
    dst.load_state_dict(state)
    assert float(dst.min_val) == float("inf")
    assert dst.min_val.shape == ()


def test_fixed_qparams_state_dict_interchanges() -> None:
    src = tob.FixedQParamsObserver(scale=0.5, zero_point=7)
    dst = ours.FixedQParamsObserver(scale=1.0, zero_point=0)
    dst.load_state_dict(src.state_dict())
    assert_same_qparams(dst, src)


def test_eps_survives_a_load_without_metadata() -> None:
    """Beyond torch: torch replaces a saved eps by float32's when the state
    dict carries no version."""
    src = ours.MinMaxObserver(eps=2**-12)
    src(torch.zeros(3))
    dst = ours.MinMaxObserver()
    dst.load_state_dict(dict(src.state_dict()))
    assert float(dst.eps) == 2**-12


def test_observer_state_dict_helpers_round_trip() -> None:
    def prepared(module: Any) -> torch.nn.Module:
        model = _Model().eval()
        model.qconfig = tq.QConfig(
            activation=module.default_observer,
            weight=module.default_per_channel_weight_observer,
        )
        return tq.prepare(model)

    saved = prepared(tq)
    saved(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)))
    state = tob.get_observer_state_dict(saved)
    assert ours.get_observer_state_dict(saved).keys() == state.keys()
    loaded = prepared(ours)
    ours.load_observer_state_dict(loaded, state)
    for name, obs in saved.named_modules():
        if name.endswith("activation_post_process"):
            assert_same_qparams(loaded.get_submodule(name), obs)
    with pytest.raises(KeyError, match="missing"):
        ours.load_observer_state_dict(loaded, {})
    extra = {**state, "fc.activation_post_process.bogus": torch.zeros(1)}
    with pytest.raises(
        KeyError, match=r"unexpected \['fc.activation_post_process.bogus"
    ):
        ours.load_observer_state_dict(loaded, extra)


# ------------------------------------------------------------------ with_args


def test_with_args_builds_fresh_instances() -> None:
    factory = ours.MinMaxObserver.with_args(quant_min=0, quant_max=127)
    a, b = factory(), factory()
    assert a is not b
    assert (a.quant_min, a.quant_max) == (0, 127)
    override = factory.with_args(quant_max=63)()
    assert (override.quant_min, override.quant_max) == (0, 63)
    assert "MinMaxObserver" in repr(factory)


def test_with_callable_args_calls_at_each_construction() -> None:
    counter = itertools.count(1)
    factory = ours.MovingAverageMinMaxObserver.with_callable_args(
        averaging_constant=lambda: 1 / next(counter)
    ).with_args(dtype=torch.qint8)
    assert [factory().averaging_constant for _ in range(3)] == [1.0, 0.5, 1 / 3]
    assert factory(averaging_constant=0.2).averaging_constant == 0.2
    assert factory().dtype == torch.qint8


def test_factories_compare_by_content() -> None:
    a = ours.MinMaxObserver.with_args(quant_min=0, quant_max=127)
    b = ours.MinMaxObserver.with_args(quant_min=0, quant_max=127)
    assert a == b
    assert hash(a) == hash(b)
    assert a != ours.MinMaxObserver.with_args(quant_min=0, quant_max=63)
    one = tq.QConfig(activation=a, weight=ours.default_weight_observer)
    two = tq.QConfig(activation=b, weight=ours.default_weight_observer)
    assert qconfig_equals(one, two)


def test_torch_sees_our_classes_as_its_own() -> None:
    assert isinstance(ours.MinMaxObserver(), tob.ObserverBase)
    assert isinstance(ours.MovingAverageMinMaxObserver(), tob.MinMaxObserver)
    assert isinstance(ours.PlaceholderObserver(), tob.PlaceholderObserver)
    assert not isinstance(ours.FixedQParamsObserver(1.0, 0), tob.MinMaxObserver)


# ------------------------------------------------------------------ eager mode


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.relu = torch.nn.ReLU()
        self.fc = torch.nn.Linear(8 * 6 * 6, 10)
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv(self.quant(x)))
        return self.dequant(self.fc(x.flatten(1)))


QCONFIGS = {
    "minmax_per_channel": ("default_observer", "default_per_channel_weight_observer"),
    "histogram_per_tensor": ("default_histogram_observer", "default_weight_observer"),
    "moving_average_neg127": (
        "MovingAverageMinMaxObserver",
        "per_channel_weight_observer_range_neg_127_to_127",
    ),
}


def _calibrate(module: Any, qconfig: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _Model().eval()
    activation, weight = QCONFIGS[qconfig]
    model.qconfig = tq.QConfig(
        activation=getattr(module, activation), weight=getattr(module, weight)
    )
    prepared = tq.prepare(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        prepared(torch.randn(4, 3, 8, 8, generator=g))
    return tq.convert(prepared)


@pytest.mark.parametrize("qconfig", QCONFIGS)
def test_eager_prepare_convert_matches_torch(qconfig: str) -> None:
    a, b = _calibrate(ours, qconfig), _calibrate(tq, qconfig)
    for name in ("conv", "fc"):
        qa, qb = getattr(a, name), getattr(b, name)
        assert (qa.scale, qa.zero_point) == (qb.scale, qb.zero_point)
        wa, wb = qa.weight(), qb.weight()
        assert wa.qscheme() == wb.qscheme()
        assert torch.equal(wa.int_repr(), wb.int_repr())
        if wa.qscheme() == torch.per_channel_affine:
            assert_identical(wa.q_per_channel_scales(), wb.q_per_channel_scales())
        else:
            assert wa.q_scale() == wb.q_scale()
    assert_identical(a.quant.scale, b.quant.scale)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    assert_identical(a(x), b(x))


def test_embedding_float_qparams_flow_matches_torch() -> None:
    def convert(module: Any) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 12))
        model[0].qconfig = tq.QConfig(
            activation=module.default_placeholder_observer,
            weight=module.default_float_qparams_observer,
        )
        return tq.convert(tq.prepare(model))

    a, b = convert(ours), convert(tq)
    wa, wb = a[0].weight(), b[0].weight()
    assert_identical(wa.q_per_channel_scales(), wb.q_per_channel_scales())
    assert_identical(wa.q_per_channel_zero_points(), wb.q_per_channel_zero_points())
    indices = torch.tensor([1, 4, 9])
    assert_identical(a(indices), b(indices))


def test_dynamic_quantization_flow_matches_torch() -> None:
    def convert(module: Any) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
        )
        qconfig = tq.QConfig(
            activation=module.default_dynamic_quant_observer,
            weight=module.default_per_channel_weight_observer,
        )
        return tq.quantize_dynamic(model, {torch.nn.Linear: qconfig})

    a, b = convert(ours), convert(tq)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    assert_identical(a(x), b(x))


def test_fake_quantize_with_our_observer_matches_torch() -> None:
    def fake_quant(module: Any) -> torch.nn.Module:
        return tq.FakeQuantize.with_args(
            observer=module.MovingAverageMinMaxObserver, quant_min=0, quant_max=255
        )()

    a, b = fake_quant(ours), fake_quant(tq)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(16, 8, generator=g)
        assert_identical(a(x), b(x))
    assert_same_qparams(a, b)


def test_fx_prepare_convert_matches_torch() -> None:
    from torch.ao.quantization import QConfigMapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(6, 8)
            self.fc2 = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x))).reshape(-1)

    def convert(module: Any) -> torch.nn.Module:
        torch.manual_seed(0)
        qconfig = tq.QConfig(
            activation=module.HistogramObserver.with_args(bins=128),
            weight=module.default_per_channel_weight_observer,
        )
        example = (torch.randn(2, 6),)
        prepared = prepare_fx(
            copy.deepcopy(Net().eval()), QConfigMapping().set_global(qconfig), example
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            prepared(torch.randn(5, 6, generator=g))
        return convert_fx(prepared)

    a, b = convert(ours), convert(tq)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    assert_identical(a(x), b(x))
