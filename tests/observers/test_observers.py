"""Observers: parity with llm-compressor 0.14, laws, NaN policy, errors."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import fake_quantize as ct_fake_quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from llmcompressor.observers import Observer as LObserver

from quantobs import (
    Observer,
    QuantizationArgs,
    calculate_range,
    fake_quantize,
    generate_gparam,
    preset_scheme,
)
from quantobs.observers import StaticMSEObserver
from tests.format_args import MXFP4 as _MXFP4
from tests.format_args import NVFP4 as _NVFP4

SHARED = ["memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse"]
MSE_NAMES = ("memoryless_mse", "mse", "static_mse")

# (id, base_name, args, shape of one batch)
CASES: list[tuple[str, str, dict[str, Any], tuple[int, ...]]] = [
    ("w-tensor-int8", "weight", {"num_bits": 8}, (32, 64)),
    ("w-channel-int8", "weight", {"num_bits": 8, "strategy": "channel"}, (32, 64)),
    (
        "w-channel-int8-asym",
        "weight",
        {"num_bits": 8, "strategy": "channel", "symmetric": False},
        (32, 64),
    ),
    ("w-group-int4", "weight", {"num_bits": 4, "group_size": 16}, (32, 64)),
    (
        "w-group-int4-asym",
        "weight",
        {"num_bits": 4, "group_size": 16, "symmetric": False},
        (32, 64),
    ),
    (
        "w-block-fp8",
        "weight",
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "block",
            "block_structure": [16, 32],
        },
        (40, 64),
    ),
    ("w-nvfp4", "weight", _NVFP4, (32, 64)),
    ("w-mxfp4", "weight", _MXFP4, (32, 64)),
    ("in-tensor-fp8", "input", {"num_bits": 8, "type": "float"}, (2, 8, 64)),
    ("in-tensor-int8-asym", "input", {"num_bits": 8, "symmetric": False}, (2, 8, 64)),
    ("out-group-int8", "output", {"num_bits": 8, "group_size": 32}, (2, 8, 64)),
    ("in-nvfp4", "input", {**_NVFP4, "dynamic": "local"}, (2, 8, 64)),
    ("k-tensor-fp8", "k", {"num_bits": 8, "type": "float"}, (2, 4, 8, 16)),
    ("v-head-int8", "v", {"num_bits": 8, "strategy": "attn_head"}, (2, 4, 8, 16)),
]


def _batches(
    base_name: str, shape: tuple[int, ...], seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    count = 1 if base_name == "weight" else 3  # llm-compressor observes weights once
    return [torch.randn(shape, generator=gen) * (1 + i) for i in range(count)]


RUNS = [(n, None) for n in SHARED] + [(n, 5) for n in SHARED if "mse" in n]


@pytest.mark.parametrize(
    ("name", "patience"), RUNS, ids=[f"{n}-{p or 'all'}" for n, p in RUNS]
)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parity_with_llm_compressor(
    name: str,
    patience: int | None,
    case: tuple[str, str, dict[str, Any], tuple[int, ...]],
    backend: str,
) -> None:
    _, base_name, kwargs, shape = case
    options = {"patience": patience} if "mse" in name else {}
    ours = Observer.load_from_registry(
        name, base_name=base_name, args=QuantizationArgs(**kwargs), **options
    )
    theirs_options = {"patience": 1000} if patience is None else {}
    theirs = LObserver.load_from_registry(
        name, base_name=base_name, args=CTArgs(**kwargs), **theirs_options
    )
    for batch in _batches(base_name, shape):
        ours.update(batch)
        theirs(batch)
    expected = theirs.get_qparams()
    scale, zero_point = ours.get_qparams()
    assert torch.equal(scale, expected["scale"])
    assert torch.equal(zero_point, expected["zero_point"])
    if expected["global_scale"] is not None:
        assert torch.equal(ours.get_global_scale(), expected["global_scale"])


def _named(name: str, base_name: str = "weight", **kwargs: Any) -> Observer:
    args = kwargs.pop("args", QuantizationArgs(num_bits=8))
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kwargs)


@pytest.mark.parametrize(
    ("strategy", "symmetric", "expected"),
    [
        ("tensor", True, 4.8103e-06),
        ("tensor", False, 1.1258e-06),
        ("channel", True, 2.5675e-06),
        ("channel", False, 2.3696e-07),
        ("group", True, 3.1282e-06),
        ("group", False, 1.3794e-07),
        ("block", True, 2.8968e-06),
        ("block", False, 5.6068e-07),
    ],
)
def test_llm_compressor_mse_expected_losses(
    strategy: str, symmetric: bool, expected: float
) -> None:
    # The expected values of llm-compressor's own test_mse_observer.
    x = torch.arange(24).reshape(6, 4) / 24
    kwargs: dict[str, Any] = {
        "num_bits": 8,
        "strategy": strategy,
        "symmetric": symmetric,
        "group_size": 2 if strategy == "group" else None,
        "block_structure": [3, 2] if strategy == "block" else None,
    }
    args = QuantizationArgs(**kwargs)
    scale, zero_point = _named("mse", args=args)(x)
    loss = ((x - fake_quantize(x, scale, zero_point, args)) ** 2).sum() / x.numel()
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    again = ct_fake_quantize(x, scale, zero_point, CTArgs(**kwargs))
    assert torch.equal(again, fake_quantize(x, scale, zero_point, args))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("memoryless_minmax", [(0.0, 0.0), (-3.0, 1.0), (-1.0, 3.0)]),
        ("static_minmax", [(0.0, 0.0), (-3.0, 1.0), (-3.0, 3.0)]),
        ("minmax", [(0.0, 0.0), (-0.03, 0.01), (-0.0397, 0.0399)]),
    ],
)
def test_min_max_sequences(name: str, expected: list[tuple[float, float]]) -> None:
    observations = [[0.0, 0.0], [-3.0, 1.0], [-1.0, 3.0]]
    ours = _named(name, base_name="input")
    theirs = LObserver.load_from_registry(name, base_name="input", args=CTArgs())
    for values, (low, high) in zip(observations, expected, strict=True):
        x = torch.tensor([values])
        min_vals, max_vals = ours.get_min_max(ours.flatten(x))
        theirs(x)
        assert min_vals.item() == pytest.approx(
            low
        ) and max_vals.item() == pytest.approx(high)
        assert torch.equal(min_vals, theirs.min_vals)
        assert torch.equal(max_vals, theirs.max_vals)


def test_registry() -> None:
    names = Observer.registered_names()
    assert {*SHARED, "static_mse"} <= set(names)
    assert Observer.get_class("Static-MinMax") is Observer.get_class("static_minmax")
    assert Observer.get_class("MEMORYLESSMSE").name == "memoryless_mse"
    with pytest.raises(
        KeyError, match=r"unknown observer 'histo'; registered: .*static_mse"
    ):
        Observer.get_class("histo")
    with pytest.raises(ValueError, match="already registered"):
        Observer.register("minmax")(StaticMSEObserver)


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("minmax", {"averaging_constant": 0.0}, "averaging_constant"),
        ("minmax", {"averaging_constant": 1.5}, "averaging_constant"),
        (
            "static_minmax",
            {"averaging_constant": 0.1},
            "Extra inputs are not permitted",
        ),
        (
            "mse",
            {"maxshrik": 0.5},
            r"options for observer 'mse': maxshrik=0.5: Extra inputs.*maxshrink",
        ),
        ("memoryless_mse", {"norm": -1}, "norm"),
        ("memoryless_mse", {"expand": 0.5}, "expand"),
        ("memoryless_mse", {"patience": -1}, "patience"),
        ("static_mse", {"patience": 5}, "Extra inputs"),
        ("static_minmax", {"nan_policy": "ignore"}, "nan_policy"),
    ],
)
def test_bad_options(name: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _named(name, **options)


def test_options_from_args_observer_kwargs() -> None:
    args = QuantizationArgs(
        num_bits=4, observer="mse", observer_kwargs={"maxshrink": 0.5, "grid": 20}
    )
    observer = _named("mse", args=args, norm=2.0)
    assert observer.options.maxshrink == 0.5 and observer.options.grid == 20
    assert observer.options.norm == 2.0


@pytest.mark.parametrize(
    ("base_name", "kwargs", "match"),
    [
        ("bias", {}, "unknown base_name 'bias'"),
        ("input", {"strategy": "channel"}, "'channel' cannot be applied to 'input'"),
        ("q", {"group_size": 8}, "'group' cannot be applied to 'q'"),
    ],
)
def test_bad_base_name_or_strategy(
    base_name: str, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _named("static_minmax", base_name=base_name, args=QuantizationArgs(**kwargs))


def test_args_must_be_ours() -> None:
    with pytest.raises(TypeError, match="from_compressed_tensors"):
        Observer.load_from_registry("minmax", base_name="weight", args=CTArgs())


@pytest.mark.parametrize("name", [*SHARED, "static_mse"])
def test_qparams_before_observation(name: str) -> None:
    observer = _named(name)
    observer.update(torch.empty(0, 4))  # empty: a no-op
    with pytest.raises(RuntimeError, match="has no statistics; call update"):
        observer.get_qparams()


@pytest.mark.parametrize("name", [*SHARED, "static_mse"])
def test_nan_policy_raise(name: str) -> None:
    x = torch.randn(4, 8)
    x[1, 2], x[3, 3] = float("nan"), float("inf")
    observer = _named(name)
    # update reads nothing on the host (issue 24): the check waits for qparams
    observer.update(x)
    observer.update(torch.randn(4, 8))
    for _ in range(2):  # and stays until reset
        with pytest.raises(
            ValueError,
            match=rf"observer '{name}' for 'weight' got non-finite value\(s\) "
            r"\(NaN or inf\) in 1 qparam range\(s\).*nan_policy='omit'",
        ):
            observer.get_qparams()
    observer.reset()
    observer.update(torch.randn(4, 8))
    observer.get_qparams()


@pytest.mark.parametrize("name", [*SHARED, "static_mse"])
def test_nan_policy_omit(name: str) -> None:
    args = QuantizationArgs(num_bits=8, strategy="channel")
    x = torch.randn(4, 8)
    x[1, 2], x[2, :] = float("nan"), float("-inf")
    observer = _named(name, args=args, nan_policy="omit")
    observer.update(x)
    scale, _ = observer.get_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()
    min_vals, max_vals = observer.get_range()
    assert min_vals[2] == 0 and max_vals[2] == 0  # a channel with no finite value
    if name.endswith("minmax"):
        assert min_vals[1] == torch.cat([x[1, :2], x[1, 3:]]).min()


@pytest.mark.parametrize("name", ["static_minmax", "minmax", "static_mse"])
def test_moving_and_static_ignore_all_nan_groups(name: str) -> None:
    observer = _named(
        name,
        base_name="input",
        nan_policy="omit",
        args=QuantizationArgs(num_bits=8, group_size=4),
    )
    observer.update(torch.randn(3, 8))
    before = observer.get_range()
    nan_batch = torch.randn(3, 8)
    nan_batch[:, :4] = float("nan")
    observer.update(nan_batch)
    after = observer.get_range()
    if name != "static_mse":
        assert torch.isfinite(after[0]).all() and torch.isfinite(after[1]).all()
        assert after[0][0] == before[0][0] and after[1][0] == before[1][0]


def test_state_dict_round_trip_then_continue() -> None:
    batches = _batches("input", (2, 8, 64))
    for name in [*SHARED, "static_mse"]:
        args = QuantizationArgs(num_bits=4, group_size=16)
        straight = _named(name, base_name="input", args=args)
        for batch in batches:
            straight.update(batch)
        first = _named(name, base_name="input", args=args)
        first.update(batches[0])
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        resumed = _named(name, base_name="input", args=args)
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
        for batch in batches[1:]:
            resumed.update(batch)
        for ours, expected in zip(
            resumed.get_qparams(), straight.get_qparams(), strict=True
        ):
            assert torch.equal(ours, expected), name
        assert resumed.num_observations == straight.num_observations


def test_state_dict_refuses_other_observer() -> None:
    source = _named("static_minmax")
    source.update(torch.randn(4, 4))
    with pytest.raises(
        ValueError, match="state of observer 'static_minmax' cannot load"
    ):
        _named("minmax").load_state_dict(source.state_dict())


def test_merge_errors() -> None:
    a, b = _named("static_minmax"), _named("minmax")
    with pytest.raises(TypeError, match="cannot merge MinMaxObserver into"):
        a.merge(b)
    c = _named("static_minmax", args=QuantizationArgs(num_bits=4))
    with pytest.raises(ValueError, match="different args"):
        a.merge(c)
    a.update(torch.randn(4, 8))
    d = _named("static_minmax", args=QuantizationArgs(num_bits=8, strategy="channel"))
    e = _named("static_minmax", args=QuantizationArgs(num_bits=8, strategy="channel"))
    d.update(torch.randn(4, 8))
    e.update(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"cannot merge qparam shapes \(4, 1\)"):
        d.merge(e)
    with pytest.raises(ValueError, match="qparam shape changed"):
        d.update(torch.randn(5, 8))


def test_static_mse_reference_rules() -> None:
    a, b = (
        _named("static_mse", base_name="input"),
        _named("static_mse", base_name="input"),
    )
    a.update(torch.randn(8, 16))
    b.update(torch.randn(8, 16) * 3)
    with pytest.raises(ValueError, match="different reference ranges cannot merge"):
        a.merge(b)
    with pytest.raises(RuntimeError, match="must come before the first observation"):
        assert isinstance(a, StaticMSEObserver)
        a.set_reference(torch.tensor(-1.0), torch.tensor(1.0))


def test_static_mse_equals_memoryless_mse_on_one_batch() -> None:
    args = QuantizationArgs(num_bits=4, group_size=16)
    x = torch.randn(32, 64)
    static = _named("static_mse", args=args)
    static.update(x)
    memoryless = _named("memoryless_mse", args=args, patience=None)
    memoryless.update(x)
    assert torch.equal(static.get_range()[0], memoryless.get_range()[0])
    assert torch.equal(static.get_qparams()[0], memoryless.get_qparams()[0])


def test_static_mse_beats_averaged_mse_over_batches() -> None:
    # The range minimizing the error summed over all batches cannot have a
    # larger total error than the moving average of per-batch ranges.
    args = QuantizationArgs(num_bits=4)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(64, 32, generator=gen) * s for s in (1.0, 1.0, 4.0)]
    reference = torch.cat(batches)
    static = _named("static_mse", base_name="input", args=args)
    assert isinstance(static, StaticMSEObserver)
    static.set_reference(reference.min().reshape(1), reference.max().reshape(1))
    averaged = _named("mse", base_name="input", args=args, averaging_constant=0.5)
    for batch in batches:
        static.update(batch)
        averaged.update(batch)

    def total_error(observer: Observer) -> float:
        scale, zp = observer.get_qparams()
        return float(
            sum(
                ((fake_quantize(b, scale, zp, args) - b).abs() ** 2.4).sum()
                for b in batches
            )
        )

    assert total_error(static) <= total_error(averaged) * (1 + 1e-6)


def test_module_g_idx_and_global_scale() -> None:
    module = torch.nn.Linear(64, 8, bias=False)
    args = QuantizationArgs(**_NVFP4)
    g_idx = torch.randperm(64, generator=torch.Generator().manual_seed(0)) // 16
    module.weight_g_idx = g_idx  # type: ignore[assignment]
    observer = Observer.load_from_registry(
        "memoryless_minmax", base_name="weight", args=args, module=module
    )
    module.weight_global_scale = observer.get_global_scale(module.weight)  # type: ignore[assignment]
    scale, _ = observer(module.weight)
    assert scale.shape == (8, 4)
    permuted = module.weight[:, torch.argsort(g_idx, stable=True)]
    expected = permuted.detach().reshape(8, 4, 16).abs().amax(-1)
    global_scale = module.weight_global_scale
    assert isinstance(global_scale, torch.Tensor)
    fp8 = (global_scale * expected / 6).to(torch.float8_e4m3fn).float()
    assert torch.equal(scale, fp8)
    # a g_idx holding -1 means column order (llm-compressor's convention)
    module.weight_g_idx = torch.full((64,), -1)  # type: ignore[assignment]
    plain, _ = observer(module.weight)
    assert plain.shape == (8, 4)


def test_get_min_max_and_global_min_max_shapes() -> None:
    args = QuantizationArgs(num_bits=4, group_size=16)
    observer = _named("memoryless_minmax", args=args)
    x = torch.randn(8, 64)
    min_vals, max_vals = observer.get_min_max(observer.flatten(x))
    assert min_vals.shape == max_vals.shape == (8, 4)
    gmin, gmax = observer.get_global_min_max(x.reshape(1, 1, -1))
    assert gmin.shape == gmax.shape == (1,)
    assert gmin.item() == x.min().item() and gmax.item() == x.max().item()
    assert observer.get_range()[0].shape == (8, 4)  # untouched by the global call


def test_token_counting_rule() -> None:
    observer = _named("static_minmax", base_name="input")
    observer.update(torch.randn(5, 8))  # 2-D: MoE expert input, 5 tokens
    observer.update(torch.randn(2, 3, 8))  # 3-D: not counted as tokens
    assert observer.num_observed_tokens == 5
    assert observer.num_observations == 5 + 6
    observer.reset()
    assert observer.num_observed_tokens is None and not observer.has_statistics


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    # arithmetic="float32": low-precision values searched as their float32
    # copies (the default searches in their dtype, as llm-compressor:
    # tests/observers/test_llmcompressor_dtypes.py)
    x = torch.randn(16, 64)
    for name in ("static_minmax", "memoryless_mse"):
        args = QuantizationArgs(num_bits=4, group_size=16)
        low = _named(name, args=args, arithmetic="float32")
        low.update(x.to(dtype))
        full = _named(name, args=args)
        full.update(x.to(dtype).float())
        assert torch.equal(low.get_range()[0], full.get_range()[0])
        assert low.get_qparams()[0].dtype == torch.float32


def test_update_rejects_non_float() -> None:
    with pytest.raises(
        TypeError, match=r"expects a floating torch\.Tensor, got torch\.int64"
    ):
        _named("static_minmax").update(torch.ones(2, 2, dtype=torch.long))


# ------------------------------------------------------------------- laws

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


def _tensor(values: list[float], cols: int) -> torch.Tensor:
    rows = max(1, len(values) // cols)
    return torch.tensor((values * cols)[: rows * cols]).reshape(rows, cols)


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(finite, min_size=1, max_size=48),
    b=st.lists(finite, min_size=1, max_size=48),
)
def test_static_minmax_merge_is_concatenation(a: list[float], b: list[float]) -> None:
    args = QuantizationArgs(num_bits=4, group_size=4)
    xa, xb = _tensor(a, 8), _tensor(b, 8)
    left, right, both = (
        _named("static_minmax", base_name="input", args=args) for _ in range(3)
    )
    left.update(xa)
    right.update(xb)
    both.update(torch.cat([xa, xb]))
    merged = left.merge(right)
    for mine, expected in zip(merged.get_qparams(), both.get_qparams(), strict=True):
        assert torch.equal(mine, expected)


@settings(max_examples=40, deadline=None)
@given(
    a=st.lists(finite, min_size=1, max_size=32),
    b=st.lists(finite, min_size=1, max_size=32),
)
def test_static_mse_merge_is_concatenation(a: list[float], b: list[float]) -> None:
    args = QuantizationArgs(num_bits=4, group_size=4, symmetric=False)
    xa, xb = _tensor(a, 8), _tensor(b, 8)
    both_x = torch.cat([xa, xb])
    observers = [
        _named("static_mse", base_name="input", args=args, grid=20) for _ in range(3)
    ]
    flat = observers[0].flatten(both_x)
    for observer in observers:
        assert isinstance(observer, StaticMSEObserver)
        observer.set_reference(flat.amin(dim=(0, -1)), flat.amax(dim=(0, -1)))
    left, right, both = observers
    left.update(xa)
    right.update(xb)
    both.update(both_x)
    merged = left.merge(right)
    errors_merged = merged.statistic().state()["errors"]
    errors_both = both.statistic().state()["errors"]
    torch.testing.assert_close(errors_merged, errors_both, rtol=1e-6, atol=1e-30)
    # the chosen candidate is optimal for the concatenation up to float noise
    chosen = errors_merged.argmin(dim=0, keepdim=True)
    best_both = errors_both.min(dim=0, keepdim=True).values
    assert (errors_both.gather(0, chosen) <= best_both * (1 + 1e-6) + 1e-30).all()


values_1d = st.sampled_from(["random", "constant", "zero", "huge", "tiny", "negative"])


def _edge(kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 32, generator=gen)
    return {
        "random": x,
        "constant": torch.full((8, 32), 0.3),
        "zero": torch.zeros(8, 32),
        "huge": x.clamp(-3, 3) * 1e38,
        "tiny": x * 1e-38,
        "negative": -x.abs() - 1,
    }[kind]


@settings(max_examples=80, deadline=None)
@given(
    kind=values_1d,
    seed=st.integers(0, 100),
    name=st.sampled_from([*SHARED, "static_mse"]),
    preset=st.sampled_from(["W4A16", "W4A16_ASYM", "W8A8", "FP8", "NVFP4", "MXFP4"]),
)
def test_scales_finite_and_positive(
    kind: str, seed: int, name: str, preset: str
) -> None:
    args = preset_scheme(preset).weights
    assert args is not None
    if args.group_size:
        args = args.model_copy(update={"group_size": 16})
    observer = _named(name, args=args, **({"grid": 20} if "mse" in name else {}))
    observer.update(_edge(kind, seed))
    scale, zero_point = observer.get_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()
    qmin, qmax = calculate_range(args)
    assert ((zero_point.float() >= qmin) & (zero_point.float() <= qmax)).all()


def test_get_observer_token_count() -> None:
    from quantobs.observers import get_observer_token_count

    class Expert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_observer = _named("static_minmax", base_name="input")
            self.weight_observer = _named("static_minmax")

    model = torch.nn.ModuleDict({"a": Expert(), "b": Expert()})
    model["a"].input_observer.update(torch.randn(7, 8))
    model["a"].input_observer.update(torch.randn(3, 8))
    model["b"].input_observer.update(torch.randn(1, 4, 8))  # 3-D: not counted
    model["a"].weight_observer.update(torch.randn(4, 8))
    assert get_observer_token_count(model) == {"a": 10, "b": 0}
    assert get_observer_token_count(model, "weight") == {"a": 4, "b": 0}


@pytest.mark.parametrize("name", ["memoryless_mse", "static_mse"])
def test_round_scales_scores_the_stored_nvfp4_scales(name: str) -> None:
    # llm-compressor searches NVFP4 ranges with unrounded group scales and no
    # global scale; round_scales=True scores what will be stored, so the
    # real error of the result can only be lower or equal, group by group.
    args = QuantizationArgs(**_NVFP4)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    w[0, 0] = 8.0  # an outlier sets the global scale

    def group_errors(observer: Observer) -> torch.Tensor:
        scale, zero_point = observer.get_qparams()
        gs = observer.get_global_scale()
        err = (fake_quantize(w, scale, zero_point, args, global_scale=gs) - w).abs()
        return (err**2.4).reshape(64, 16, 16).sum(-1)

    plain = _named(
        name, args=args, **({} if name == "static_mse" else {"patience": None})
    )
    rounded = _named(
        name,
        args=args,
        round_scales=True,
        **({} if name == "static_mse" else {"patience": None}),
    )
    plain.update(w)
    rounded.update(w)
    assert torch.equal(plain.get_global_scale(), rounded.get_global_scale())
    better = group_errors(rounded) <= group_errors(plain) * (1 + 1e-6)
    assert better.all()
    assert group_errors(rounded).sum() < group_errors(plain).sum()


def test_set_reference_validation() -> None:
    observer = _named("static_mse", base_name="input")
    assert isinstance(observer, StaticMSEObserver)
    with pytest.raises(ValueError, match="needs finite"):
        observer.set_reference(torch.tensor([float("nan")]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="min_vals <= max_vals"):
        observer.set_reference(torch.tensor([2.0]), torch.tensor([1.0]))


@pytest.mark.parametrize("name", ["minmax", "mse"])
def test_moving_average_merge_is_count_weighted(name: str) -> None:
    a = _named(name, base_name="input", averaging_constant=1.0)
    b = _named(name, base_name="input", averaging_constant=1.0)
    a.update(torch.tensor([[-1.0, 1.0]]))  # one observation
    b.update(torch.tensor([[-4.0, 4.0], [0.0, 0.5], [0.1, 0.2]]))  # three
    a_range, b_range = a.get_range(), b.get_range()
    merged = a.merge(b)
    assert merged.num_observations == 4
    expected = (a_range[1] * 1 + b_range[1] * 3) / 4
    assert torch.allclose(merged.get_range()[1], expected)


@pytest.mark.parametrize("name", ["memoryless_minmax", "memoryless_mse"])
def test_memoryless_merge_keeps_the_later_batch(name: str) -> None:
    a, b = _named(name, base_name="input"), _named(name, base_name="input")
    a.update(torch.tensor([[-1.0, 1.0]]))
    b.update(torch.tensor([[-3.0, 2.0]]))
    assert torch.equal(a.merge(b).get_range()[0], b.get_range()[0])


def test_global_scale_is_recomputed_whenever_the_statistics_change() -> None:
    args = QuantizationArgs(**_NVFP4)
    observer = Observer.load_from_registry(
        "static_minmax", base_name="weight", args=args
    )
    x = torch.randn(8, 64)
    first = observer.get_global_scale(x)
    first.mul_(2.0)  # the caller's copy: the observer's answer is unchanged
    assert torch.equal(observer.get_global_scale(), generate_gparam(x.min(), x.max()))
    observer.update(x * 4)  # new statistics
    assert torch.equal(
        observer.get_global_scale(), generate_gparam(4 * x.min(), 4 * x.max())
    )
    # The global amax is part of the statistic (a buffer, merged with MAX):
    # an in-place edit of it is seen too.
    observer.absmax.mul_(8)
    expected = generate_gparam(4 * x.min(), 8 * (4 * x).abs().max())
    assert torch.equal(observer.get_global_scale(), expected)
    observer.reset()
    with pytest.raises(RuntimeError, match="no statistics"):
        observer.get_global_scale()


def test_observer_pickles_after_its_global_scale_is_memoized() -> None:
    args = QuantizationArgs(**_NVFP4)
    observer = Observer.load_from_registry(
        "static_minmax", base_name="weight", args=args
    )
    observer.update(torch.randn(64, 64))
    expected = observer.get_global_scale()  # memoized (weak references inside)
    buffer = io.BytesIO()
    torch.save(observer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded.get_global_scale(), expected)
    assert torch.equal(loaded.get_qparams()[0], observer.get_qparams()[0])
