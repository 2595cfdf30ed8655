"""quantobs' observers inside llm-compressor 0.14: its own `oneshot` and
`QuantizationModifier` on the embedded MiniLM, offline on the CPU.

Parity: where the algorithm is shared, `quantobs_<name>` gives llm-compressor's
`<name>` qparams bit for bit through the same pipeline (one `oneshot` per side,
config groups putting one observer on each set of layers). The histogram
family runs through `oneshot` too, and its compressed checkpoint loads back
with transformers. Registration, options and names; NVFP4 fusion; DDP sync
under a real 2-process gloo group.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

llmcompressor = pytest.importorskip("llmcompressor")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs as CTArgs,
)
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.registry import registry as ct_registry  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from llmcompressor.observers import FusionHandler  # noqa: E402
from llmcompressor.observers import Observer as LCObserver  # noqa: E402

import quantobs.integrations.llmcompressor as integration  # noqa: E402
from quantobs import Observer  # noqa: E402
from quantobs.observers import StaticMinMaxObserver  # noqa: E402
from quantobs.observers.engine import ObserverEngine  # noqa: E402
from tests.calibration.conftest import SENTENCES, minilm_dir  # noqa: E402

pytestmark = [pytest.mark.peers]

Recipe = dict[str, dict[str, Any]]
QParams = dict[str, torch.Tensor]

IGNORE = ["re:.*pooler.*"]
TEXTS = SENTENCES[:6]


# ---------------------------------------------------------------- oneshot


def _qparams(model: torch.nn.Module) -> QParams:
    """Every qparam llm-compressor wrote, by parameter name."""
    return {
        name: value.detach().clone()
        for name, value in model.named_parameters()
        if name.endswith(("_scale", "_zero_point"))
    }


@pytest.fixture(scope="module")
def dataset() -> Any:
    """The calibration sentences, tokenized (one per sample)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    return datasets.Dataset.from_dict({"text": TEXTS}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=64),
        remove_columns=["text"],
    )


def _oneshot(groups: Recipe, dataset: Any = None) -> torch.nn.Module:
    """A fresh MiniLM through llm-compressor's `oneshot` with `groups`."""
    model = transformers.AutoModel.from_pretrained(minilm_dir())
    recipe = QuantizationModifier(config_groups=groups, ignore=IGNORE)
    if dataset is None:
        llmcompressor.oneshot(model=model, recipe=recipe)
    else:
        llmcompressor.oneshot(
            model=model,
            recipe=recipe,
            dataset=dataset,
            num_calibration_samples=len(TEXTS),
            max_seq_length=64,
            # In order: moving averages depend on it.
            shuffle_calibration_samples=False,
        )
    return model


def _pairs(
    groups: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]],
    mine: bool,
) -> Recipe:
    """Config groups `{id: (target, weights, inputs)}` where each args'
    `observer` is llm-compressor's name, or ours (`quantobs_<name>`) when
    `mine`, and `observer_kwargs` may be `(theirs, ours)`."""

    def args(found: dict[str, Any]) -> dict[str, Any]:
        out = dict(found)
        name = out["observer"]
        if mine:
            out["observer"] = "quantobs_" + out.pop("ours", name)
        else:
            out.pop("ours", None)
        kwargs = out.pop("kwargs", ({}, {}))
        out["observer_kwargs"] = kwargs[1] if mine else kwargs[0]
        return out

    recipe: Recipe = {}
    for key, (target, weights, inputs) in groups.items():
        recipe[key] = {"targets": [target], "weights": args(weights)}
        if inputs is not None:
            recipe[key]["input_activations"] = args(inputs)
    return recipe


W4 = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
INT8_ASYM = {"num_bits": 8, "type": "int", "symmetric": False}
NVFP4 = preset_name_to_scheme("NVFP4", ["Linear"])
NVFP4_WEIGHTS = NVFP4.weights.model_dump(exclude={"observer"})
NVFP4_INPUTS = NVFP4.input_activations.model_dump(exclude={"observer"})

# id -> (target, weights, inputs): weight-only, no data (W4A16 and int8).
WEIGHT_ONLY = {
    "memoryless_minmax": (
        r"re:.*attention\.self\.query$",
        {**W4, "observer": "memoryless_minmax"},
        None,
    ),
    "memoryless_mse": (
        r"re:.*layer\.[01]\.attention\.self\.key$",
        {**W4, "observer": "memoryless_mse"},
        None,
    ),
    # One observation: static_mse's best candidate over all of them is
    # memoryless_mse's search without its early stop.
    "static_mse": (
        r"re:.*layer\.[01]\.attention\.self\.value$",
        {
            **W4,
            "observer": "memoryless_mse",
            "ours": "static_mse",
            "kwargs": ({"patience": 10**6}, {}),
        },
        None,
    ),
    # llm-compressor swaps `mse` on weights for `memoryless_mse`; one
    # observation of our moving average is the same range.
    "mse": (
        r"re:.*layer\.[01]\.intermediate\.dense$",
        {**W4, "observer": "mse"},
        None,
    ),
    "asymmetric_channel": (
        r"re:.*attention\.output\.dense$",
        {**INT8_ASYM, "strategy": "channel", "observer": "memoryless_minmax"},
        None,
    ),
}

# With data: FP8 static per-tensor inputs, NVFP4 (weights with global scales,
# locally dynamic inputs' global scales), int8 inputs under a moving average.
WITH_DATA = {
    "fp8_static_minmax": (
        r"re:.*attention\.self\.(query|key|value)$",
        {**FP8, "observer": "memoryless_minmax"},
        {**FP8, "observer": "static_minmax"},
    ),
    "nvfp4": (
        r"re:.*attention\.output\.dense$",
        {**NVFP4_WEIGHTS, "observer": "memoryless_minmax"},
        {**NVFP4_INPUTS, "observer": "static_minmax"},
    ),
    "int8_moving_average": (
        r"re:.*intermediate\.dense$",
        {**FP8, "strategy": "channel", "observer": "memoryless_minmax"},
        {**INT8_ASYM, "strategy": "tensor", "observer": "minmax"},
    ),
}

#: Whether quantobs has llm-compressor's importance-weighted MSE observer.
HAS_IMATRIX = "imatrix_mse" in {
    Observer.get_class(n).name for n in Observer.registered_names()
}
if HAS_IMATRIX:
    # Weights only; the importance of the inputs is gathered while the
    # sequential pipeline calibrates.
    WITH_DATA["imatrix_mse"] = (
        r"re:.*layer\.[01]\.output\.dense$",
        {**W4, "observer": "imatrix_mse"},
        None,
    )

# Ours only: the histogram family (FP8 per-tensor weights and inputs).
HISTOGRAM_FAMILY = {
    "histogram": r"re:.*attention\.self\.query$",
    "percentile": r"re:.*attention\.self\.key$",
    "entropy": r"re:.*attention\.self\.value$",
    "histogram_mse": r"re:.*attention\.output\.dense$",
    "static_mse": r"re:.*intermediate\.dense$",
}


def _members(qparams: QParams, target: str) -> QParams:
    """The qparams of the modules a `re:` target matches."""
    pattern = re.compile(target.removeprefix("re:"))
    return {
        name: value
        for name, value in qparams.items()
        if pattern.match(name.rsplit(".", 1)[0])
    }


@pytest.fixture(scope="module")
def weight_only() -> tuple[QParams, QParams]:
    """llm-compressor's and our weight-only qparams (no calibration data)."""
    theirs = _qparams(_oneshot(_pairs(WEIGHT_ONLY, mine=False)))
    ours = _qparams(_oneshot(_pairs(WEIGHT_ONLY, mine=True)))
    return theirs, ours


@pytest.fixture(scope="module")
def with_data(dataset: Any) -> tuple[QParams, QParams]:
    """llm-compressor's and our qparams calibrated on the sentences."""
    theirs = _qparams(_oneshot(_pairs(WITH_DATA, mine=False), dataset))
    ours = _qparams(_oneshot(_pairs(WITH_DATA, mine=True), dataset))
    return theirs, ours


@pytest.fixture(scope="module")
def histogram_model(dataset: Any) -> torch.nn.Module:
    """MiniLM calibrated with the histogram family through `oneshot`."""
    groups = {
        name: {
            "targets": [target],
            "weights": {**FP8, "observer": f"quantobs_{name}"},
            "input_activations": {**FP8, "observer": f"quantobs_{name}"},
        }
        for name, target in HISTOGRAM_FAMILY.items()
    }
    return _oneshot(groups, dataset)


def _assert_identical(theirs: QParams, ours: QParams, target: str) -> None:
    expected, found = _members(theirs, target), _members(ours, target)
    assert expected and expected.keys() == found.keys()
    for name, value in expected.items():
        assert found[name].dtype == value.dtype, name
        assert torch.equal(found[name], value), name


@pytest.mark.parametrize("group", list(WEIGHT_ONLY))
def test_weight_only_equals_llmcompressor(
    weight_only: tuple[QParams, QParams], group: str
) -> None:
    theirs, ours = weight_only
    _assert_identical(theirs, ours, WEIGHT_ONLY[group][0])


@pytest.mark.parametrize("group", list(WITH_DATA))
def test_calibrated_equals_llmcompressor(
    with_data: tuple[QParams, QParams], group: str
) -> None:
    theirs, ours = with_data
    _assert_identical(theirs, ours, WITH_DATA[group][0])
    if group == "nvfp4":
        names = _members(ours, WITH_DATA[group][0])
        assert any(n.endswith("weight_global_scale") for n in names)
        assert any(n.endswith("input_global_scale") for n in names)


@pytest.mark.parametrize("name", list(HISTOGRAM_FAMILY))
def test_histogram_family_through_oneshot(
    histogram_model: torch.nn.Module, name: str
) -> None:
    found = _members(_qparams(histogram_model), HISTOGRAM_FAMILY[name])
    scales = {k: v for k, v in found.items() if k.endswith("_scale")}
    # weight and input scales of 6 layers
    assert len(scales) == 12
    for key, scale in scales.items():
        assert bool(torch.isfinite(scale).all() and (scale > 0).all()), key
    layer = next(k for k in scales if k.endswith("input_scale")).rsplit(".", 1)[0]
    scheme = histogram_model.get_submodule(layer).quantization_scheme
    assert scheme.weights.observer == f"quantobs_{name}"
    assert scheme.input_activations.observer == f"quantobs_{name}"


# ------------------------------------------------------------- checkpoint


@pytest.fixture(scope="module")
def saved(
    histogram_model: torch.nn.Module, tmp_path_factory: Any
) -> tuple[Path, dict[str, torch.Tensor]]:
    """The histogram-family model saved compressed, as llm-compressor does,
    and its weights fake-quantized with their qparams (taken before saving:
    compressing replaces the weights)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    expected = {}
    for name, module in histogram_model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            zero_point = torch.zeros_like(module.weight_scale)  # symmetric
            expected[name] = fake_quantize(
                module.weight, module.weight_scale, zero_point, scheme.weights
            )
    path = Path(tmp_path_factory.mktemp("minilm_fp8"))
    histogram_model.save_pretrained(path, save_compressed=True)
    return path, expected


# oneshot leaves an `hf_device_map` of "cpu" on the model, which transformers'
# `save_pretrained` takes for offloaded modules (it only warns about memory).
@pytest.mark.filterwarnings(
    "ignore:Attempting to save a model with offloaded modules:UserWarning"
)
# The dequantized load warns that the checkpoint's own quantization_config
# wins over the one passed (only `dequantize` is taken from it).
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_checkpoint_loads_with_transformers(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, expected = saved
    config = transformers.CompressedTensorsConfig(dequantize=True)
    loaded = transformers.AutoModel.from_pretrained(
        path, quantization_config=config
    ).eval()
    assert len(expected) == 30
    for name, weight in expected.items():
        assert torch.equal(loaded.get_submodule(name).weight, weight), name
    # The recipe, as saved, names our observers.
    saved_config = json.loads((path / "config.json").read_text())
    groups = saved_config["quantization_config"]["config_groups"]
    observers = {g["input_activations"]["observer"] for g in groups.values()}
    assert observers == {f"quantobs_{name}" for name in HISTOGRAM_FAMILY}


# ------------------------------------------------------ names and options


def test_every_registry_observer_is_registered() -> None:
    # Other test modules may register observers after this one imported the
    # integration: the call registers those too.
    integration.register_observers()
    quantobs_names = {Observer.get_class(n).name for n in Observer.registered_names()}
    names = integration.registered_observers()
    assert names == sorted(f"quantobs_{n}" for n in quantobs_names)
    for name in ("quantobs_static_mse", "quantobs_histogram", "quantobs_percentile"):
        cls = LCObserver.get_value_from_registry(name)
        assert issubclass(cls, LCObserver)
        assert issubclass(cls, integration.QuantobsObserver)


def test_registering_twice_is_harmless() -> None:
    before = LCObserver.registered_names()
    first = integration.register_observers()
    # The module's code run a second time (a fresh module object).
    path = integration.__file__
    spec = importlib.util.spec_from_file_location("_quantobs_llmc_again", path)
    assert spec is not None and spec.loader is not None
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    assert LCObserver.registered_names() == before
    assert again.register_observers() == first  # the classes registered first


def test_observers_added_later_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registries restored after the test: copies stand in for them.
    monkeypatch.setattr(Observer.registry, "_classes", dict(Observer.registry._classes))
    monkeypatch.setattr(Observer.registry, "_names", dict(Observer.registry._names))
    for table in (ct_registry._REGISTRY, ct_registry._ALIAS_REGISTRY):
        monkeypatch.setitem(table, LCObserver, dict(table[LCObserver]))
    monkeypatch.setattr(integration, "_WRAPPERS", dict(integration._WRAPPERS))

    @Observer.register("late_minmax", alias="later_minmax")
    class LateMinMax(StaticMinMaxObserver):
        """Registered after the integration was imported."""

    assert "quantobs_late_minmax" not in integration.registered_observers()
    found = integration.register_observers()
    assert found["quantobs_late_minmax"].core_cls is LateMinMax
    alias = LCObserver.get_value_from_registry("quantobs_later_minmax")
    assert alias is found["quantobs_late_minmax"]


def _nvfp4_weight_args() -> CTArgs:
    return CTArgs.model_validate(NVFP4_WEIGHTS)


def test_bad_option_names_observer_and_option() -> None:
    args = CTArgs(**W4)
    with pytest.raises(ValueError, match=r"'quantobs_static_mse'.*maxshrnk"):
        LCObserver.load_from_registry(
            "quantobs_static_mse", base_name="weight", args=args, maxshrnk=0.5
        )
    with pytest.raises(ValueError, match=r"'quantobs_percentile'.*percentile=150"):
        LCObserver.load_from_registry(
            "quantobs_percentile",
            base_name="input",
            args=CTArgs(**FP8, observer_kwargs={"percentile": 150}),
        )


def test_bad_option_through_oneshot() -> None:
    groups = {
        "g": {
            "targets": [r"re:.*attention\.self\.query$"],
            "weights": {
                **W4,
                "observer": "quantobs_histogram",
                "observer_kwargs": {"bins": 4},
            },
        }
    }
    with pytest.raises(ValueError, match=r"'quantobs_histogram'.*bins=4"):
        _oneshot(groups)


def test_unknown_name_lists_ours() -> None:
    with pytest.raises(KeyError, match=r"quantobs-nope.*quantobs-static-mse"):
        LCObserver.load_from_registry(
            "quantobs_nope", base_name="weight", args=CTArgs(**W4)
        )


def test_missing_llmcompressor_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "llmcompressor.observers", None)
    spec = importlib.util.spec_from_file_location(
        "_quantobs_llmc_missing", integration.__file__
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match=r"pip install 'quantobs\[llmcompressor\]'"):
        spec.loader.exec_module(module)


# ----------------------------------------------------- the Observer contract


def _pair(name: str, base_name: str, args: dict[str, Any] | CTArgs) -> tuple[Any, Any]:
    """llm-compressor's `name` and our `quantobs_<name>`, on copies of args."""

    def fresh() -> CTArgs:
        if isinstance(args, CTArgs):
            return args.model_copy(deep=True)
        return CTArgs(**args)

    theirs = LCObserver.load_from_registry(name, base_name=base_name, args=fresh())
    ours = LCObserver.load_from_registry(
        f"quantobs_{name}", base_name=base_name, args=fresh()
    )
    return theirs, ours


def test_contract() -> None:
    theirs, ours = _pair("static_minmax", "input", FP8)
    assert not ours.has_statistics
    with pytest.raises(RuntimeError, match="no statistics"):
        ours.get_qparams()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 5, 32, generator=generator) * (i + 1) for i in range(3)]
    for x in batches:
        assert theirs(x) is theirs and ours(x) is ours
    assert ours(torch.empty(0, 32)) is ours
    assert ours.has_statistics and set(ours.get_statistics()) >= {"min_vals"}
    # (N, *qparam_shape, G): the canonical layout, as their base passes it
    ours.update_statistics_from_observed(torch.full((1, 1, 4), -50.0))
    theirs.update_statistics_from_observed(torch.full((1, 1, 4), -50.0))
    expected, found = theirs.get_qparams(), ours.get_qparams()
    assert expected.keys() == found.keys() == {"scale", "zero_point", "global_scale"}
    assert torch.equal(found["scale"], expected["scale"])
    assert torch.equal(found["zero_point"], expected["zero_point"])
    assert found["global_scale"] is None
    assert not ours.has_statistics  # deleted, as theirs
    assert ours.sync_activation_stats() == []  # not distributed: nothing to do


def test_weight_observed_once() -> None:
    _, ours = _pair("memoryless_minmax", "weight", W4)
    weight = torch.randn(8, 128)
    ours(weight)
    ours(weight * 100)  # ignored: a weight is observed once
    scale = ours.get_qparams()["scale"]
    ours(weight * 100)  # after deletion, observed again
    assert torch.allclose(ours.get_qparams()["scale"], scale * 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_global_scale_equals_llmcompressor(dtype: torch.dtype) -> None:
    # bfloat16 / float16: global and group scales rounded in it (issue 25)
    generator = torch.Generator().manual_seed(3)
    modules = [
        torch.nn.Linear(64, rows, bias=False, dtype=dtype) for rows in (32, 16, 16)
    ]
    with torch.no_grad():
        for i, module in enumerate(modules):
            shape = module.weight.shape  # (rows, 64)
            module.weight.copy_(torch.randn(shape, generator=generator) * (1 + 4 * i))
    found: dict[str, list[dict[str, Any]]] = {}
    for side in ("theirs", "ours"):
        name = "memoryless_minmax" if side == "theirs" else "quantobs_memoryless_minmax"
        observers = [
            LCObserver.load_from_registry(
                name, base_name="weight", args=_nvfp4_weight_args()
            )
            for _ in modules
        ]
        FusionHandler.fuse(zip(observers, modules, strict=True))
        observers[0](modules[0].weight)  # the partners are observed with it
        assert all(o.has_statistics for o in observers)
        found[side] = []
        for i, observer in enumerate(observers):
            found[side].append(observer.get_qparams())
            # deleted only once every member of the group asked
            assert observers[-1].has_statistics == (i < len(observers) - 1)
    for expected, ours in zip(found["theirs"], found["ours"], strict=True):
        for key in ("scale", "zero_point", "global_scale"):
            assert torch.equal(ours[key], expected[key]), key
    # one global scale for the group: the largest amax is the third weight's
    shared = {float(q["global_scale"]) for q in found["ours"]}
    assert shared == {float(_alone(modules[2])["global_scale"])}


def _alone(module: torch.nn.Linear) -> dict[str, Any]:
    """An unfused NVFP4 weight observer's qparams of `module.weight`."""
    observer = LCObserver.load_from_registry(
        "quantobs_memoryless_minmax", base_name="weight", args=_nvfp4_weight_args()
    )
    return dict(observer(module.weight).get_qparams())


# ----------------------------------------------------------------- DDP sync

DDP_OBSERVERS = ("static_minmax", "histogram", "percentile", "entropy")
DDP_BATCHES = 7


def _ddp_batches() -> list[torch.Tensor]:
    """Activations `(1, tokens, 32)` of growing spread."""
    generator = torch.Generator().manual_seed(11)
    return [
        torch.randn(1, 5 + i, 32, generator=generator) * (0.5 + i) + 0.1 * i
        for i in range(DDP_BATCHES)
    ]


def _ddp_modules() -> dict[str, torch.nn.Module]:
    """A module per observer, its observer attached as llm-compressor does."""
    modules: dict[str, torch.nn.Module] = {}
    for name in (*DDP_OBSERVERS, "minmax", "expert"):
        module = torch.nn.Module()
        kind = "static_minmax" if name == "expert" else name
        observer = LCObserver.load_from_registry(
            f"quantobs_{kind}", base_name="input", args=CTArgs(**INT8_ASYM)
        )
        module.register_module("input_observer", observer)
        modules[name] = module
    weight = torch.nn.Module()
    weight.register_module(
        "weight_observer",
        LCObserver.load_from_registry(
            "quantobs_static_minmax", base_name="weight", args=CTArgs(**W4)
        ),
    )
    modules["weight"] = weight
    if HAS_IMATRIX:
        linear = torch.nn.Linear(128, 8, bias=False)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(5)
            linear.weight.copy_(torch.randn(8, 128, generator=generator))
        observer = LCObserver.load_from_registry(
            "quantobs_imatrix_mse", base_name="weight", args=CTArgs(**W4)
        )
        linear.register_module("weight_observer", observer)
        observer.attach(linear)  # gathers the importance of its inputs
        modules["imatrix"] = linear
    return modules


#: Each rank's batches (uneven); only rank 1's tokens reach the "expert".
SHARDS = ([0, 1, 2, 3, 4], [5, 6])


def _ddp_feed(
    modules: dict[str, torch.nn.Module], indices: list[int], rank: int
) -> None:
    """Observe the batches `indices` as rank `rank` does."""
    data = _ddp_batches()
    for name, module in modules.items():
        if name == "weight":  # a different weight on each rank: never synced
            module.weight_observer(torch.full((4, 128), float(rank + 1)))
            continue
        if name == "imatrix":  # inputs (1, tokens, 128) through the hook
            for i in indices:
                module(data[i].repeat(1, 1, 4) + 0.01 * i)
            continue
        for i in indices:
            if name != "expert" or i in SHARDS[1]:
                module.input_observer(data[i])


def _child_states(observer: Any) -> list[dict[str, torch.Tensor]]:
    """The statistics of the engines a core holds for activations."""
    return [
        {k: v.clone() for k, v in engine.statistic().state().items()}
        for engine in observer.core.modules()
        if engine is not observer.core and isinstance(engine, ObserverEngine)
    ]


def _ddp_worker(rank: int, world: int) -> dict[str, Any]:
    """Each rank observes its shard; llm-compressor's own trigger syncs."""
    modules = _ddp_modules()
    _ddp_feed(modules, SHARDS[rank], rank)
    weight_stats = dict(modules["weight"].weight_observer.get_statistics())
    modifier = QuantizationModifier(targets="Linear", scheme="W4A16")
    modifier.sync_obs_act_stats(list(modules.values()))
    result: dict[str, Any] = {
        "weight_unsynced": all(
            torch.equal(v, modules["weight"].weight_observer.get_statistics()[k])
            for k, v in weight_stats.items()
        )
    }
    for name, module in modules.items():
        if name == "imatrix":  # observed after the importance was synced
            result["importance"] = _child_states(module.weight_observer)
            result[name] = module.weight_observer(module.weight).get_qparams()
        elif name != "weight":
            result[name] = module.input_observer.get_qparams()
    # static_mse: each rank's reference is its own first batch.
    mse = LCObserver.load_from_registry(
        "quantobs_static_mse", base_name="input", args=CTArgs(**INT8_ASYM)
    )
    mse(_ddp_batches()[rank])
    try:
        mse.sync_activation_stats()
    except ValueError as error:
        result["static_mse"] = str(error)
    return result


@pytest.mark.slow
def test_ddp_sync_equals_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.calibration import dist_workers

    # Where this starts the process server, it imports llm-compressor once
    # for both processes (a server already running keeps its own list).
    preload = [*dist_workers.PRELOAD, "quantobs.integrations.llmcompressor"]
    monkeypatch.setattr(dist_workers, "PRELOAD", [*preload, "datasets"])
    runs = dist_workers.launch(_ddp_worker, 2, tmp_path)
    single = _ddp_modules()
    _ddp_feed(single, list(range(DDP_BATCHES)), rank=0)
    for name in (*DDP_OBSERVERS, "expert", *(["imatrix"] if HAS_IMATRIX else [])):
        module = single[name]
        if name == "imatrix":
            importance = _child_states(module.weight_observer)
            assert importance  # the importance: summed over the ranks
            for run in runs:
                for theirs, mine in zip(run["importance"], importance, strict=True):
                    assert theirs.keys() == mine.keys()
                    for key, value in mine.items():
                        torch.testing.assert_close(theirs[key], value)
            expected = module.weight_observer(module.weight).get_qparams()
        else:
            expected = module.input_observer.get_qparams()
        for rank, run in enumerate(runs):
            for key in ("scale", "zero_point"):
                assert torch.equal(run[name][key], expected[key]), (name, rank, key)
    # a moving average merges approximately; every rank holds the same
    for key in ("scale", "zero_point"):
        assert torch.equal(runs[0]["minmax"][key], runs[1]["minmax"][key])
    assert all(run["weight_unsynced"] for run in runs)
    for run in runs:
        assert "quantobs_histogram_mse" in run["static_mse"]


@pytest.mark.slow
def test_memoryless_mse_on_every_layer_equals_llmcompressor() -> None:
    """W4A16 on all of MiniLM's linear weights (82,944 groups): every scale
    equals llm-compressor's `memoryless_mse`. The plug-in scores MSE
    candidates with torch's float32 arithmetic, as llm-compressor does (the
    native search settles the near tie of one group of layer 2's
    `output.dense` with torch too: tests/solvers/test_mse_ties.py)."""
    weights = {**W4, "strategy": "group"}
    theirs, ours = (
        _qparams(
            _oneshot(
                {"w4": {"targets": ["Linear"], "weights": {**weights, "observer": n}}}
            )
        )
        for n in ("memoryless_mse", "quantobs_memoryless_mse")
    )
    assert theirs.keys() == ours.keys() and len(theirs) == 2 * 36
    for name, value in theirs.items():
        assert torch.equal(value, ours[name]), name
