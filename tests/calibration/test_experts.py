"""MoE experts stored as fused 3-D parameters, observed per expert
(`quantobs.calibration.experts`), on the tiny decoders of four families."""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs import Observer, QuantizationArgs
from quantobs.calibration import Recipe, attach, calibrate, detach, text_batches
from quantobs.calibration.attach import attachment_of
from quantobs.calibration.experts import (
    CalibrationExperts,
    ExpertsReloadWarning,
    expert_tag,
    observe_all_experts,
)
from quantobs.calibration.export import save_compressed
from quantobs.calibration.simulate import compressed_tensors_copy
from quantobs.core.presets import QuantizationScheme, preset_scheme
from tests.calibration.conftest import (
    SENTENCES,
    dequantize_drops_activations,
    load_quantized,
)
from tests.decoders import MOE, build_decoder, tiny_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

MERGE_WARNING = "ignore:You passed `quantization_config`:UserWarning"


def _w4a16() -> QuantizationScheme:
    """W4A16 with groups of 16 (the tiny models' 32-wide experts)."""
    scheme = preset_scheme("W4A16")
    assert scheme.weights is not None
    weights = scheme.weights.model_copy(update={"group_size": 16})
    return scheme.model_copy(update={"weights": weights})


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread (on a busy machine torch's thread
    pool makes these tests ten times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def batches() -> list[dict[str, torch.Tensor]]:
    """Three padded batches of four sentences (no pad token: eos pads)."""
    tok = tiny_tokenizer()
    tok.pad_token = tok.eos_token
    found = text_batches(tok, SENTENCES, batch_size=4)
    assert all(not b["attention_mask"].all() for b in found)  # padded
    return found


def _eager(family: str, dtype: torch.dtype = torch.float32) -> Any:
    model = build_decoder(family, dtype=dtype)
    model.set_experts_implementation("eager")
    return model


def _fused(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if name.endswith("mlp.experts") and not isinstance(m, CalibrationExperts)
    }


def _logits(model: Any, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**b).logits[b["attention_mask"].bool()] for b in batches]


# ------------------------------------------------------------ observation


@pytest.mark.parametrize("family", MOE)
def test_every_expert_is_observed_per_projection(
    family: str, batches: list[dict[str, torch.Tensor]]
) -> None:
    model = _eager(family)
    fused = _fused(model)
    attach(model, Recipe.from_scheme("FP8", ignore=["lm_head"]))
    for name, original in fused.items():
        module = model.get_submodule(name)
        assert isinstance(module, CalibrationExperts)
        gate_up = original.gate_up_proj
        first = module.expert(0).linears()[0].weight
        # a view of the fused parameter: nothing copied
        assert (
            first.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
        )
    calibrate(model, batches[:1], progress=False, all_experts=True)
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj")
    for name, original in fused.items():
        experts = int(original.gate_up_proj.shape[0])
        for index in range(experts):
            for projection in names:
                linear = model.get_submodule(f"{name}.{index}.{projection}")
                assert linear.weight_scale.shape == (1,)
                assert linear.input_scale.shape == (1,)
    # the routers stay dense: they are not Linear modules
    assert not any(
        hasattr(m, "weight_scale")
        for n, m in model.named_modules()
        if n.endswith(".gate")
    )


def test_outputs_are_unchanged_and_detach_restores_the_fused_module(
    batches: list[dict[str, torch.Tensor]],
) -> None:
    model = _eager("qwen3_moe")
    fused = _fused(model)
    before = _logits(model, batches)
    attach(model, Recipe.from_scheme("FP8"))
    assert not _fused(model)
    from quantobs.calibration.tokens import real_tokens

    with torch.no_grad():  # padding is computed, not observed: same outputs
        for batch, expected in zip(batches, before, strict=True):
            with real_tokens(batch):
                found = model(**batch).logits[batch["attention_mask"].bool()]
            assert torch.equal(found, expected)
            # every token through every expert: only the routed outputs count
            with real_tokens(batch), observe_all_experts():
                found = model(**batch).logits[batch["attention_mask"].bool()]
            torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)
    calibrate(model, batches, progress=False, all_experts=True)
    assert all(
        torch.equal(a, b) for a, b in zip(_logits(model, batches), before, strict=True)
    )
    detach(model)
    assert _fused(model) == fused  # the same module objects
    assert all(
        torch.equal(a, b) for a, b in zip(_logits(model, batches), before, strict=True)
    )


def _routed_inputs(
    family: str, batches: list[dict[str, torch.Tensor]], all_experts: bool = False
) -> dict[str, list[torch.Tensor]]:
    """`{"...experts.3.gate_proj": [inputs (n, H) per batch]}`: the real tokens
    the fused module routes to each expert (every real token with
    `all_experts`), and the down projections' inputs, from the model's own
    eager forward."""
    model = _eager(family)
    fused = _fused(model)
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in fused}
    handles = []
    for name, module in fused.items():

        def hook(_: Any, args: tuple[Any, ...], name: str = name) -> None:
            seen[name].append((args[0].detach(), args[1].detach()))

        handles.append(module.register_forward_pre_hook(hook))
    _logits(model, batches)
    found: dict[str, list[torch.Tensor]] = {}
    gate, up, down = (
        ("w1", "w3", "w2")
        if family == "mixtral"
        else (
            "gate_proj",
            "up_proj",
            "down_proj",
        )
    )
    for name, module in fused.items():
        inter = module.down_proj.shape[2]
        for (hidden, top_k), batch in zip(seen[name], batches, strict=True):
            real = batch["attention_mask"].reshape(-1).bool()
            for index in range(module.gate_up_proj.shape[0]):
                rows = real if all_experts else real & (top_k == index).any(-1)
                x = hidden[rows]
                weights = module.gate_up_proj[index]
                with torch.no_grad():
                    g = torch.nn.functional.linear(x, weights[:inter])
                    u = torch.nn.functional.linear(x, weights[inter:])
                    h = module.act_fn(g) * u
                for projection, value in ((gate, x), (up, x), (down, h)):
                    key = f"{name}.{index}.{projection}"
                    found.setdefault(key, []).append(value)
    return found


def _static_minmax_scale(values: list[torch.Tensor], args: QuantizationArgs) -> Any:
    observer = Observer.load_from_registry(
        "static_minmax", base_name="input", args=args
    )
    for value in values:
        if value.numel():
            observer.update(value)
    return observer.get_qparams()[0]


@pytest.mark.parametrize("all_experts", [False, True])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_inputs_are_the_min_max_of_their_routed_real_tokens(
    family: str, all_experts: bool, batches: list[dict[str, torch.Tensor]]
) -> None:
    expected = _routed_inputs(family, batches, all_experts)
    model = _eager(family)
    attach(model, Recipe.from_scheme("FP8", ignore=["lm_head"]))
    report = calibrate(model, batches, progress=False, all_experts=all_experts)
    by_key = attachment_of(model).by_key()
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    for key, values in expected.items():
        entry = by_key[f"{key}.input"]
        assert entry.tokens == sum(v.shape[0] for v in values)
        if all_experts:
            assert entry.tokens == real
        if entry.tokens == 0:
            continue
        scale = _static_minmax_scale(values, entry.args)
        found = model.get_submodule(key).input_scale
        torch.testing.assert_close(found, scale, rtol=1e-6, atol=0)
        if not key.endswith(("w2", "down_proj")):
            assert torch.equal(found, scale), key  # the very same values
    # the report: each token routed to k experts per layer
    layers = {name.rpartition(".")[0] for name in report.experts}
    for layer in layers:
        counts = [
            n for name, n in report.experts.items() if name.startswith(layer + ".")
        ]
        assert sum(counts) == 2 * real
    assert report.unrouted == [n for n, c in report.experts.items() if c == 0]
    assert "tokens per expert" in str(report)


def _starve_expert(model: Any, index: int) -> str:
    """DeepSeek-V3's router never picks expert `index` (its score bias)."""
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias[index] = -1e4
    return f"model.layers.1.mlp.experts.{index}"


def test_an_expert_without_tokens_raises_or_takes_its_siblings_range(
    batches: list[dict[str, torch.Tensor]],
) -> None:
    model = _eager("deepseek_v3")
    starved = _starve_expert(model, 3)
    attach(model, Recipe.from_scheme("FP8", ignore=["lm_head"]))
    with pytest.raises(
        RuntimeError, match=rf"experts no token was routed to: {starved}"
    ):
        calibrate(model, batches, progress=False)
    detach(model)

    model = _eager("deepseek_v3")
    _starve_expert(model, 3)
    attach(model, Recipe.from_scheme("FP8", ignore=["lm_head"]))
    with pytest.warns(RuntimeWarning, match="saw no data"):
        report = calibrate(model, batches, progress=False, on_empty="fallback")
    assert report.unrouted == [starved]
    assert report.fallen_back == [starved]
    assert report.experts[starved] == 0
    for projection in ("gate_proj", "up_proj", "down_proj"):
        siblings = [
            model.get_submodule(f"model.layers.1.mlp.experts.{i}.{projection}")
            for i in range(3)
        ]
        widest = torch.stack([s.input_scale for s in siblings]).amax(0)
        found = model.get_submodule(f"{starved}.{projection}").input_scale
        assert torch.equal(found, widest)  # the same layer's, not the model's
    everything = max(
        m.input_scale.item()
        for n, m in model.named_modules()
        if n.endswith("gate_proj") and hasattr(m, "input_scale")
    )
    assert model.get_submodule(f"{starved}.gate_proj").input_scale.item() < everything

    model = _eager("deepseek_v3")
    _starve_expert(model, 3)
    attach(model, Recipe.from_scheme("FP8", ignore=["lm_head"]))
    report = calibrate(model, batches, progress=False, all_experts=True)
    assert report.unrouted == [starved] and not report.fallen_back


def test_targets_and_ignores_reach_the_experts(
    batches: list[dict[str, torch.Tensor]],
) -> None:
    model = _eager("qwen2_moe")
    down = _w4a16().model_copy(
        update={"targets": [r"re:.*mlp\.experts\.\d+\.down_proj$"]}
    )
    recipe = Recipe.from_scheme(down)
    attach(model, recipe)
    names = [e.name for e in attachment_of(model).entries]
    assert len(names) == 2 * 4 and all(n.endswith("down_proj") for n in names)
    detach(model)
    # experts ignored whole keep their fused module
    attach(model, Recipe.from_scheme(_w4a16(), ignore=["re:.*experts$", "lm_head"]))
    assert len(_fused(model)) == 2
    assert not any(expert_tag(e.module) for e in attachment_of(model).entries)


# --------------------------------------------------- llm-compressor parity


def _theirs(name: str, weights: list[torch.Tensor], args: Any) -> list[dict[str, Any]]:
    """llm-compressor 0.14's observer `name` on each 2-D weight (fused
    global scale when several)."""
    from llmcompressor.observers import Observer as LObserver
    from llmcompressor.observers.fusion import FusionHandler

    observers = [
        LObserver.load_from_registry(name, base_name="weight", args=args)
        for _ in weights
    ]
    if len(weights) > 1:
        linears = []
        for weight in weights:
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight = torch.nn.Parameter(weight.clone())
            linears.append(linear)
        FusionHandler.fuse(zip(observers, linears, strict=True))
    for observer, weight in zip(observers, weights, strict=True):
        observer(weight)
    return [observer.get_qparams() for observer in observers]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("scheme", ["W4A16", "W8A8", "FP8", "NVFP4"])
def test_weight_qparams_equal_llmcompressor_on_each_expert(
    scheme: str, batches: list[dict[str, torch.Tensor]]
) -> None:
    pytest.importorskip("llmcompressor")
    # float32 weights: on bfloat16 ones llm-compressor computes NVFP4 scales in
    # bfloat16 arithmetic, quantobs in float32 (one group in ~100 differs)
    model = _eager("qwen3_moe")
    recipe = Recipe.from_scheme(_w4a16() if scheme == "W4A16" else scheme)
    attach(model, Recipe(config_groups=recipe.config_groups, ignore=["lm_head"]))
    calibrate(model, batches[:1], progress=False)
    args = recipe.config_groups["group_0"].weights
    assert args is not None
    ct_args = args.to_compressed_tensors()
    for layer in range(2):
        fused = f"model.layers.{layer}.mlp.experts"
        for index in range(4):
            expert = model.get_submodule(f"{fused}.{index}")
            gate, up, down = expert.linears()
            if args.strategy == "tensor_group":  # gate and up share a global scale
                groups = [[gate, up], [down]]
            else:
                groups = [[gate], [up], [down]]
            for group in groups:
                expected = _theirs(
                    "memoryless_minmax", [m.weight.detach() for m in group], ct_args
                )
                for linear, theirs in zip(group, expected, strict=True):
                    assert torch.equal(linear.weight_scale, theirs["scale"])
                    if not args.symmetric:
                        assert torch.equal(
                            linear.weight_zero_point, theirs["zero_point"]
                        )
                    if theirs["global_scale"] is not None:
                        assert torch.equal(
                            linear.weight_global_scale, theirs["global_scale"]
                        )


# ------------------------------------------------------------------ export


def _checkpoint_keys(out: Path) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for path in glob.glob(str(out / "*.safetensors")):
        with safe_open(path, "pt") as f:
            keys.extend(f.keys())
    return keys


def _without_expert_inputs(copy_: torch.nn.Module) -> None:
    """compressed-tensors' fake quantization of the experts' weights only."""
    for module in copy_.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and expert_tag(module) is not None:
            module.quantization_scheme = scheme.model_copy(
                update={"input_activations": None}
            )


_PREFIX = {"mixtral": "block_sparse_moe"}
_NAMES = {"mixtral": ("w1", "w3", "w2")}
# what transformers 5.17 does not collect of the experts (reported unexpected)
_DROPPED = {
    "W4A16": (),
    "MXFP4A16": (),
    "FP8": ("input_scale",),
    "NVFP4": ("weight_global_scale", "input_global_scale"),
}


def _calibrated(family: str, scheme: str, batches: list[Any]) -> Any:
    dtype = torch.float32 if scheme in ("W4A16", "W8A8") else torch.bfloat16
    model = _eager(family, dtype)
    chosen = _w4a16() if scheme == "W4A16" else scheme
    # DeepSeek-V3's kv_b_proj has 16 columns: no MX group of 32
    ignore = ["lm_head", r"re:.*kv_b_proj$"]
    attach(model, Recipe.from_scheme(chosen, ignore=ignore))
    calibrate(model, batches[:1], progress=False, all_experts=True)
    return model


@pytest.mark.filterwarnings(MERGE_WARNING)
@pytest.mark.parametrize("scheme", ["W4A16", "MXFP4A16", "FP8", "W8A8", "NVFP4"])
@pytest.mark.parametrize("family", MOE)
def test_the_checkpoint_holds_every_expert_and_transformers_reloads_it(
    family: str, scheme: str, batches: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    model = _calibrated(family, scheme, batches)
    dtype = model.dtype
    out = tmp_path / "out"
    # copies: the calibrated model is compared with the checkpoint below
    if scheme in ("W4A16", "MXFP4A16"):
        save_compressed(model, out, copy=True)  # no warning: it reloads as calibrated
    else:
        with pytest.warns(ExpertsReloadWarning, match="does not reload them"):
            save_compressed(model, out, copy=True)
    keys = set(_checkpoint_keys(out))
    prefix = _PREFIX.get(family, "mlp")
    names = _NAMES.get(family, ("gate_proj", "up_proj", "down_proj"))
    stored = "weight" if scheme in ("FP8", "W8A8") else "weight_packed"
    for index in range(4):
        for projection in names:
            key = f"model.layers.1.{prefix}.experts.{index}.{projection}"
            assert {f"{key}.{stored}", f"{key}.weight_scale"} <= keys
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)
    # the router stays dense
    assert f"model.layers.1.{prefix}.gate.weight" in keys
    assert not any(".gate.weight_" in k for k in keys)

    if (
        scheme == "W8A8"
    ):  # transformers 5.17, 5.24: its expert converter misses `weight`
        with pytest.raises(RuntimeError, match="conversion"):
            load_quantized(out)
        return
    loaded, info = load_quantized(out, dtype=dtype)
    loaded.set_experts_implementation("eager")
    assert not info["missing_keys"] and not info["mismatched_keys"]
    dropped = _DROPPED[scheme]
    if scheme == "NVFP4" and dequantize_drops_activations():
        dropped = ("input_global_scale",)  # 5.24 collects the weight's
    unexpected = info["unexpected_keys"]
    assert all(".experts." in k and k.endswith(dropped) for k in unexpected)
    layers = sum(isinstance(m, CalibrationExperts) for m in model.modules())
    assert len(unexpected) == layers * 4 * 3 * len(dropped)

    fake_quantized = compressed_tensors_copy(model)
    if scheme == "NVFP4":
        _check_nvfp4_experts(model, out, loaded, _PREFIX.get(family, "mlp"))
        return
    _without_expert_inputs(fake_quantized)  # what the reload keeps of them
    for found, expected in zip(
        _logits(loaded, batches[:2]), _logits(fake_quantized, batches[:2]), strict=True
    ):
        assert torch.equal(found, expected)


def _check_nvfp4_experts(model: Any, out: Path, loaded: Any, stored: str) -> None:
    """Our NVFP4 experts decompress (compressed-tensors, with their global
    scales) to the calibrated fake-quantized weights; transformers 5.17's
    reload, which drops the global scales, does not give them back."""
    import json

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme as CTScheme
    from safetensors.torch import load_file

    from quantobs import fake_quantize

    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = CTScheme.model_validate(quant["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(quant["format"])
    tensors = load_file(out / "model.safetensors")
    prefix = "model.layers.1.mlp.experts"
    ours = model.get_submodule(prefix)
    theirs = loaded.get_submodule(prefix)
    for index in range(4):
        linear = ours.expert(index).linears()[0]  # gate
        key = f"model.layers.1.{stored}.experts.{index}.{ours.names[0]}."
        own = {k[len(key) :]: v for k, v in tensors.items() if k.startswith(key)}
        found = compressor.decompress(own, scheme)["weight"]
        entry = f"{prefix}.{index}.{ours.names[0]}.weight"
        args = attachment_of(model).by_key()[entry].args
        expected = fake_quantize(
            linear.weight,
            linear.weight_scale,
            None,
            args,
            global_scale=linear.weight_global_scale,
        )
        assert torch.equal(found.to(expected.dtype), expected)
        inter = expected.shape[0]
        assert not torch.allclose(theirs.gate_up_proj[index, :inter], expected)


class _TransposedExperts(torch.nn.Module):
    """Fused experts in a layout quantobs does not observe (GPT-OSS-like)."""

    is_transposed = True

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 8))  # (E, H, 2I)
        self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 8))  # (E, I, H)
        self.act_fn = torch.nn.SiLU()


def test_experts_of_another_layout_are_refused_where_targeted() -> None:
    model = torch.nn.ModuleDict(
        {"proj": torch.nn.Linear(8, 8), "experts": _TransposedExperts()}
    )
    with pytest.raises(ValueError, match=r"'experts'.*transposed.*ignore list"):
        attach(model, Recipe.from_scheme("FP8"))
    attach(model, Recipe.from_scheme("FP8", ignore=["experts"]))
    detach(model)
    attach(model, Recipe.from_scheme("FP8", targets=["proj"]))  # not reached
    assert [e.name for e in attachment_of(model).entries] == ["proj", "proj"]


def test_a_resumed_calibration_gives_the_same_expert_qparams(
    batches: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    from quantobs.calibration import load_state, save_state

    def scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if ".experts." in n and n.endswith("_scale")
        }

    whole = _eager("qwen3_moe")
    attach(whole, Recipe.from_scheme("FP8"))
    calibrate(whole, batches, progress=False)
    first = _eager("qwen3_moe")
    attach(first, Recipe.from_scheme("FP8"))
    calibrate(first, batches[:1], progress=False, on_empty="fallback")
    save_state(first, tmp_path / "state.safetensors")
    resumed = _eager("qwen3_moe")
    attach(resumed, Recipe.from_scheme("FP8"))
    load_state(resumed, tmp_path / "state.safetensors")
    calibrate(resumed, batches[1:], progress=False)
    expected, found = scales(whole), scales(resumed)
    assert len(found) == 2 * 4 * 3 * 2
    assert all(torch.equal(found[k], v) for k, v in expected.items())


def test_a_model_cast_while_attached_gets_its_experts_cast_back() -> None:
    model = _eager("qwen3_moe")
    attach(model, Recipe.from_scheme("FP8"))
    model.to(torch.float64)  # the Linears' weights are cast, not the fused ones
    detach(model)
    experts = model.get_submodule("model.layers.1.mlp.experts")
    assert experts.gate_up_proj.dtype == torch.float64
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
