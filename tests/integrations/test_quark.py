"""quantobs.integrations.quark: AMD Quark 0.13's ModelQuantizer runs our observers.

Each parity test quantizes the same small model (three Linear layers) with
the same config twice, once with Quark's observer classes and once with
`quantobs.quark`'s, calibrating on the same DataLoader; every quantizer's
scale and zero point (value, dtype, shape) and the quantized and frozen
models' outputs must be equal. Where our face fixes a Quark bug, the test
asserts our number and says in a comment what Quark returns.

Quark is imported once, in a module-scoped fixture (its import takes ~20 s).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import quantobs.quark as qo

pytestmark = pytest.mark.peers

IN, HIDDEN, OUT = 64, 96, 32


@pytest.fixture(scope="module")
def q() -> Iterator[SimpleNamespace]:
    """Quark's API and the integration (imported, so registered)."""
    pytest.importorskip("quark.torch")
    from quark.torch import ModelQuantizer
    from quark.torch.quantization import observer, tensor_quantize
    from quark.torch.quantization.config import config
    from quark.torch.quantization.config import type as quark_type

    import quantobs.integrations.quark as integration

    with pytest.MonkeyPatch.context() as patch:
        # Quark fake-quantizes through torch.compile (QUARK_DISABLE_COMPILE=1
        # turns it off, read at import): on CPU each new shape compiles for
        # seconds, and torch 2.13's Dynamo warns (DeprecationWarning) while
        # tracing Quark's autograd function. Both sides of every comparison
        # run the same kernel, eager here.
        patch.setattr(tensor_quantize, "QUARK_DISABLE_COMPILE", True)
        yield SimpleNamespace(
            ModelQuantizer=ModelQuantizer,
            obs=observer,
            cfg=config,
            type=quark_type,
            ScaledFakeQuantize=tensor_quantize.ScaledFakeQuantize,
            integration=integration,
        )


# ------------------------------------------------------------ helpers


def small_model() -> nn.Module:
    """Three seeded Linear layers (the same weights on every call)."""
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, IN), nn.Linear(IN, OUT)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.2)
    return model.eval()


def calibration_data() -> torch.utils.data.DataLoader[torch.Tensor]:
    """4 batches of 8 rows whose range grows, shrinks and grows again."""
    g = torch.Generator().manual_seed(1)
    scales = torch.tensor([1.0, 3.0, 0.5, 2.0]).repeat_interleave(8)[:, None]
    rows = torch.randn(32, IN, generator=g) * scales + 0.3
    return torch.utils.data.DataLoader(rows, batch_size=8)


def probe() -> torch.Tensor:
    return torch.randn(16, IN, generator=torch.Generator().manual_seed(2)) * 1.5


def spec(q: SimpleNamespace, observer: type, **fields: Any) -> Any:
    """Quark's QTensorConfig; enum fields given by name."""
    enums = {
        "dtype": q.type.Dtype,
        "qscheme": q.type.QSchemeType,
        "scale_type": q.type.ScaleType,
        "round_method": q.type.RoundType,
    }
    values = {k: enums[k][v] if k in enums else v for k, v in fields.items()}
    return q.cfg.QTensorConfig(observer_cls=observer, **values)


INT8 = {
    "dtype": "int8",
    "symmetric": True,
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
UINT8 = {**INT8, "dtype": "uint8", "symmetric": False}
MXFP4 = {
    "dtype": "fp4",
    "qscheme": "per_group",
    "ch_axis": -1,
    "group_size": 32,
    "symmetric": None,
    "scale_type": "float",
    "round_method": "half_even",
    "scale_format": "e8m0",
    "scale_calculation_mode": "even",
}

# Layer configs by case: `observers` is Quark's observer module or ours.
CASES: dict[str, Callable[[SimpleNamespace, Any], dict[str, Any]]] = {
    "per_tensor_minmax": lambda q, o: {
        "weight": spec(q, o.PerTensorMinMaxObserver, qscheme="per_tensor", **INT8),
        "input_tensors": spec(
            q, o.PerTensorMinMaxObserver, qscheme="per_tensor", **UINT8
        ),
    },
    "per_channel_minmax": lambda q, o: {
        "weight": spec(
            q, o.PerChannelMinMaxObserver, qscheme="per_channel", ch_axis=0, **INT8
        ),
        # ch_axis=1, not -1: Quark's per-channel fake quantization indexes
        # the scale with a negative axis as if it were positive (its output
        # then broadcasts to (channels, *x.shape)).
        "output_tensors": spec(
            q, o.PerChannelMinMaxObserver, qscheme="per_channel", ch_axis=1, **UINT8
        ),
    },
    # Weights static; activations dynamic (Quark has no static per-group
    # activations). Quark's own dynamic OCP MXFP4 runs a fused kernel without
    # its observer; with ours the quantizer calls our observer every forward.
    "mxfp4": lambda q, o: {
        "weight": spec(q, o.PerBlockMXObserver, is_dynamic=False, **MXFP4),
        "input_tensors": spec(q, o.PerBlockMXObserver, is_dynamic=True, **MXFP4),
    },
    "percentile": lambda q, o: {
        "weight": spec(
            q, o.PerChannelMinMaxObserver, qscheme="per_channel", ch_axis=0, **INT8
        ),
        "input_tensors": spec(
            q, o.PerTensorPercentileObserver, qscheme="per_tensor", **INT8
        ),
    },
}


def config(q: SimpleNamespace, case: str, observers: Any) -> Any:
    layer = q.cfg.QLayerConfig(**CASES[case](q, observers))
    return q.cfg.QConfig(global_quant_config=layer)


def quantize(q: SimpleNamespace, quant_config: Any) -> nn.Module:
    return q.ModelQuantizer(quant_config).quantize_model(
        small_model(), calibration_data()
    )


def quantizers(q: SimpleNamespace, model: nn.Module) -> dict[str, Any]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, q.ScaledFakeQuantize)
    }


def qparams(q: SimpleNamespace, model: nn.Module) -> dict[str, tuple[Any, Any]]:
    """(scale, zero_point) of every static quantizer, by module name."""
    return {
        name: (quantizer.scale, quantizer.zero_point)
        for name, quantizer in quantizers(q, model).items()
        if not quantizer.is_dynamic
    }


def assert_same_qparams(theirs: dict[str, Any], mine: dict[str, Any]) -> None:
    assert theirs.keys() == mine.keys() and theirs
    for name in theirs:
        for a, b in zip(theirs[name], mine[name], strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert torch.equal(a, b), (name, a, b)


def observer_modules(q: SimpleNamespace, model: nn.Module) -> set[str]:
    """Modules of the observer classes in the model's quantizers."""
    return {type(m.observer).__module__ for m in quantizers(q, model).values()}


# ------------------------------------------------------------ parity


@pytest.mark.parametrize("case", list(CASES))
def test_model_quantizer_parity(q: SimpleNamespace, case: str) -> None:
    theirs = quantize(q, config(q, case, q.obs))
    mine = quantize(q, config(q, case, qo))
    assert observer_modules(q, theirs) == {"quark.torch.quantization.observer.observer"}
    assert {m.split(".")[0] for m in observer_modules(q, mine)} == {"quantobs"}
    assert_same_qparams(qparams(q, theirs), qparams(q, mine))
    x = probe()
    with torch.no_grad():
        out = theirs(x)
        assert out.shape == (x.shape[0], OUT)
        assert torch.equal(out, mine(x))
        # every one of our observers has seen data (the dynamic ones in
        # this forward), driven by Quark's quantizers alone
        assert all(
            quantizer.observer.statistic() is not None
            for quantizer in quantizers(q, mine).values()
        )
        frozen = [q.ModelQuantizer.freeze(model) for model in (theirs, mine)]
        assert torch.equal(frozen[0](x), frozen[1](x))


def test_our_specs_and_swapped_configs_quantize_alike(q: SimpleNamespace) -> None:
    # The same percentile config three ways: Quark's specs naming our
    # classes (the parity test), a Quark config switched by
    # use_quantobs_observers, and quantobs.quark.QTensorConfig specs.
    reference = qparams(q, quantize(q, config(q, "percentile", qo)))
    quark_config = config(q, "percentile", q.obs)
    swapped = q.integration.use_quantobs_observers(quark_config)
    layer = swapped.global_quant_config
    assert layer.input_tensors.observer_cls is qo.PerTensorPercentileObserver
    assert layer.weight.observer_cls is qo.PerChannelMinMaxObserver
    # the original is untouched
    assert quark_config.global_quant_config.weight.observer_cls is (
        q.obs.PerChannelMinMaxObserver
    )
    ours = q.cfg.QLayerConfig(
        weight=qo.QTensorConfig(
            observer_cls=qo.PerChannelMinMaxObserver,
            qscheme="per_channel",
            ch_axis=0,
            **INT8,
        ),
        input_tensors=qo.QTensorConfig(
            observer_cls=qo.PerTensorPercentileObserver, qscheme="per_tensor", **INT8
        ),
    )
    assert isinstance(ours.weight, q.cfg.QTensorConfig)  # converted
    for quant_config in (swapped, q.cfg.QConfig(global_quant_config=ours)):
        assert_same_qparams(reference, qparams(q, quantize(q, quant_config)))


def test_asymmetric_percentile_cuts_both_tails(q: SimpleNamespace) -> None:
    # At the default percentile (99.99999999) of a few thousand values no
    # value is cut: the range runs from the right edge of the lowest bin to
    # the left edge of the highest (each holds one value), and the qparams
    # are Quark's rule of that range.
    def asymmetric(observer: type) -> Any:
        return q.cfg.QConfig(
            global_quant_config=q.cfg.QLayerConfig(
                input_tensors=spec(q, observer, qscheme="per_tensor", **UINT8)
            )
        )

    mine = quantizers(q, quantize(q, asymmetric(qo.PerTensorPercentileObserver)))
    theirs = quantizers(q, quantize(q, asymmetric(q.obs.PerTensorPercentileObserver)))
    rule = q.obs.PerTensorMinMaxObserver(
        spec(q, q.obs.PerTensorMinMaxObserver, qscheme="per_tensor", **UINT8)
    )
    assert mine.keys() == theirs.keys() and len(mine) == 3
    for name, quantizer in mine.items():
        edges = quantizer.observer.calib_bin_edges
        expected = rule.calculate_qparams(edges[1], edges[-2])
        assert_same_qparams(
            {name: expected}, {name: (quantizer.scale, quantizer.zero_point)}
        )
        # Quark: both ends at the bottom of the data (its observer's range
        # is the lowest edge twice), a scale for a range of width 0.
        quark_observer = theirs[name].observer
        low = quark_observer.calib_bin_edges[0]
        assert quark_observer.min_val == quark_observer.max_val == low


def test_per_channel_percentile_beyond_quark(q: SimpleNamespace) -> None:
    # Quark's percentile observer is per tensor only; ours also per channel.
    weight = spec(
        q, qo.PerTensorPercentileObserver, qscheme="per_channel", ch_axis=0, **INT8
    )
    model = quantize(
        q, q.cfg.QConfig(global_quant_config=q.cfg.QLayerConfig(weight=weight))
    )
    scales = [scale for scale, _ in qparams(q, model).values()]
    assert [s.shape for s in scales] == [(HIDDEN,), (IN,), (OUT,)]
    assert all(bool((s > 0).all()) for s in scales)


# ------------------------------------------------------------ registration


def test_quark_spec_accepts_every_observer_at_its_qschemes(
    q: SimpleNamespace,
) -> None:
    checked = 0
    for cls in q.integration.OBSERVER_CLASSES:
        theirs = getattr(q.obs, cls.__name__)
        for name in ("PER_TENSOR_OBSERVERS", "PER_CHANNEL_OBSERVERS"):
            # at least every qscheme of Quark's namesake
            assert theirs not in getattr(q.obs, name) or cls in getattr(q.obs, name)
        assert (theirs in q.obs.PER_GROUP_OBSERVERS) <= (
            cls in q.obs.PER_GROUP_OBSERVERS
        )
        assert cls in q.obs.OBSERVER_CLASSES
        assert q.obs.OBSERVER_MAP["quantobs.quark." + cls.__name__] is cls
        assert q.obs.OBSERVER_MAP[cls.__name__] is theirs  # Quark's names: Quark's
        checked += 1
    assert checked == 13
    built = spec(q, qo.PerTensorMinMaxObserver, qscheme="per_tensor", **INT8)
    assert built.observer_cls is qo.PerTensorMinMaxObserver


def test_pow2_observers_select_quarks_pow2_passes(q: SimpleNamespace) -> None:
    from quark.torch.quantization.graph import torch_utils
    from quark.torch.quantization.graph.optimization import model_optimization

    for holder in (torch_utils, model_optimization):
        assert qo.PerTensorPowOf2MinMaxObserver in holder.POW_OF_2_OBSERVER
        assert qo.PerChannelPowOf2MinMSEObserver in holder.POW_OF_2_OBSERVER


def test_registering_twice_is_harmless(q: SimpleNamespace) -> None:
    def snapshot() -> tuple[Any, ...]:
        from quark.torch.quantization.graph import torch_utils

        sets = ("OBSERVER_CLASSES", "PER_TENSOR_OBSERVERS", "PER_GROUP_OBSERVERS")
        return (
            *(frozenset(getattr(q.obs, name)) for name in sets),
            dict(q.obs.OBSERVER_MAP),
            torch_utils.POW_OF_2_OBSERVER,
            q.cfg.QLayerConfig.__post_init__,
            q.cfg.QConfig.__post_init__,
        )

    before = snapshot()
    q.integration.register()
    q.integration.register()
    assert snapshot() == before
    importlib.reload(q.integration)  # a second import runs register() again
    assert len(snapshot()[0]) == len(before[0])


def test_from_dict_reads_our_qualified_names(q: SimpleNamespace) -> None:
    saved = spec(q, qo.PerTensorMinMaxObserver, qscheme="per_tensor", **INT8)
    as_dict = saved.to_dict()
    assert as_dict["observer_cls"] == "PerTensorMinMaxObserver"
    reloaded = q.cfg.QTensorConfig.from_dict(as_dict)
    assert reloaded.observer_cls is q.obs.PerTensorMinMaxObserver  # Quark's name
    as_dict["observer_cls"] = "quantobs.quark.PerTensorMinMaxObserver"
    assert q.cfg.QTensorConfig.from_dict(as_dict).observer_cls is (
        qo.PerTensorMinMaxObserver
    )


# ------------------------------------------------------------ specs both ways


def test_to_quark_and_back(q: SimpleNamespace) -> None:
    ours = qo.QTensorConfig(
        observer_cls=qo.PerBlockMXObserver, is_dynamic=False, **MXFP4
    )
    theirs = q.integration.to_quark(ours)
    assert isinstance(theirs, q.cfg.QTensorConfig)
    assert theirs.dtype is q.type.Dtype.fp4
    assert theirs.qscheme is q.type.QSchemeType.per_group
    assert theirs.observer_cls is qo.PerBlockMXObserver
    assert q.integration.to_quark(theirs) is theirs
    assert q.integration.from_quark(theirs) == ours
    assert q.integration.to_quark(None) is None
    assert q.integration.to_quark([ours]) == [theirs]
    layer = q.cfg.QLayerConfig(weight=[ours])  # a sequential spec list
    assert layer.weight == [theirs]
    # Quark's own observer class becomes ours of the same name
    quark_spec = dataclasses.replace(theirs, observer_cls=q.obs.PerBlockMXObserver)
    assert q.integration.from_quark(quark_spec).observer_cls is qo.PerBlockMXObserver


def test_placeholder_becomes_quarks(q: SimpleNamespace) -> None:
    ours = qo.QTensorConfig(dtype="bfloat16", observer_cls=qo.PlaceholderObserver)
    theirs = q.integration.to_quark(ours)
    assert theirs.observer_cls is q.obs.PlaceholderObserver


def test_softmax_spec_is_converted(q: SimpleNamespace) -> None:
    softmax = qo.QTensorConfig(
        observer_cls=qo.PerTensorMinMaxObserver, qscheme="per_tensor", **UINT8
    )
    built = q.cfg.QConfig(
        global_quant_config=q.cfg.QLayerConfig(), softmax_quant_spec=softmax
    )
    assert isinstance(built.softmax_quant_spec, q.cfg.QTensorConfig)


def test_our_observer_takes_quarks_spec(q: SimpleNamespace) -> None:
    for observer_cls in (q.obs.PerTensorMinMaxObserver, qo.PerTensorMinMaxObserver):
        quark_spec = spec(q, observer_cls, qscheme="per_tensor", **UINT8)
        observer = qo.PerTensorMinMaxObserver(quark_spec)
        observer(torch.tensor([-1.0, 3.0]))
        scale, zero_point = observer._calculate_qparams()
        assert scale.item() == pytest.approx(4 / 255)
        assert zero_point.item() == 64


# ------------------------------------------------------------ errors


def test_to_quark_names_the_spec_classes(q: SimpleNamespace) -> None:
    with pytest.raises(TypeError, match=r"quantobs\.quark\.QTensorConfig"):
        q.integration.to_quark({"dtype": "int8"})
    with pytest.raises(TypeError, match="QTensorConfig"):
        q.integration.from_quark("int8")


def test_a_spec_quark_accepts_but_we_cannot_compute_names_the_fix(
    q: SimpleNamespace,
) -> None:
    # Quark accepts an fp4 spec without scale_format; our observer raises
    # when ModelQuantizer builds it (Quark's computes with a float scale
    # format it never declared).
    weight = spec(
        q, qo.PerBlockMXObserver, **{**MXFP4, "scale_format": None}, is_dynamic=False
    )
    quant_config = q.cfg.QConfig(global_quant_config=q.cfg.QLayerConfig(weight=weight))
    with pytest.raises(ValueError, match="needs scale_format"):
        quantize(q, quant_config)


def test_without_quark_the_import_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "quark", None)  # import quark: ImportError
    monkeypatch.delitem(sys.modules, "quantobs.integrations.quark", raising=False)
    with pytest.raises(ImportError, match=r"quantobs\[peers\]"):
        importlib.import_module("quantobs.integrations.quark")
