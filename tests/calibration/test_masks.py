"""Observers see real tokens only: qparams do not depend on how the texts
were grouped into padded batches, in one run, resumed or distributed.

The tiny decoder runs in float64 here: its forward then differs between
batchings only far below float32's precision, in which the statistics are
kept, so whole-model qparams can be compared bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from quantobs.calibration import (
    Recipe,
    attach,
    attachment_of,
    calibrate,
    load_state,
    save_state,
    text_batches,
)
from quantobs.calibration.tokens import TokenMask, real_tokens
from tests.calibration import dist_workers as workers
from tests.calibration.conftest import SENTENCES
from tests.decoders import build_decoder, kv_cache_quantizable, tiny_tokenizer

OBSERVERS = ("static_minmax", "histogram", "percentile")


def recipe(observer: str) -> Recipe:
    """Static int8 inputs of every Linear and the queries, fp8 k/v per head
    (the Linear inputs alone under a transformers whose attention states
    compressed-tensors cannot quantize: `kv_cache_quantizable`)."""
    int8 = {"num_bits": 8, "strategy": "tensor", "observer": observer}
    groups: dict[str, Any] = {
        "linear": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "strategy": "channel"},
            "input_activations": int8,
        }
    }
    if not kv_cache_quantizable():
        return Recipe(config_groups=groups, ignore=["lm_head"])
    groups["attn"] = {"targets": ["LlamaAttention"], "input_activations": int8}
    return Recipe(
        config_groups=groups,
        ignore=["lm_head"],
        kv_cache_scheme={
            "num_bits": 8,
            "type": "float",
            "strategy": "attn_head",
            "observer": observer,
        },
    )


@functools.cache
def _tokenizer() -> Any:
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def batches(texts: list[str], size: int) -> list[dict[str, torch.Tensor]]:
    return text_batches(_tokenizer(), texts, batch_size=size, max_length=64)


def model(observer: str) -> torch.nn.Module:
    found = build_decoder("llama", dtype=torch.float64)
    attach(found, recipe(observer))
    return found


def qparams(found: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: value.detach().clone()
        for name, value in found.named_parameters()
        if name.endswith(("_scale", "_zero_point"))
    }


def run(observer: str, size: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    calibrated = model(observer)
    report = calibrate(calibrated, batches(SENTENCES, size), progress=False)
    return qparams(calibrated), report.tokens


@functools.cache
def one_by_one(observer: str) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """One text per batch: nothing is padded."""
    return run(observer, 1)


def assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert found.keys() == expected.keys() and len(found) > 20
    for name, value in expected.items():
        assert torch.equal(found[name], value), name


# ------------------------------------------------------------------ the mask


def test_select_keeps_the_real_tokens_of_each_layout() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    tokens = TokenMask.of(mask)
    assert tokens.padded and tokens.count == 4
    value = torch.arange(2 * 3 * 2).reshape(2, 3, 2)  # (B, S, H)
    expected = value[mask != 0]  # (4, 2)
    assert torch.equal(tokens.select(value), expected)
    assert torch.equal(tokens.select(value.reshape(6, 2)), expected)  # (B*S, H)
    heads = torch.arange(2 * 2 * 3 * 4).reshape(2, 2, 3, 4)  # (B, h, S, D)
    found = tokens.select(heads, "heads")  # (1, h, n, D)
    assert found.shape == (1, 2, 4, 4)
    assert torch.equal(found[0], heads.transpose(1, 2)[mask != 0].transpose(0, 1))
    other = torch.zeros(5, 7)  # not the batch's token grid: unchanged
    assert tokens.select(other) is other
    unpadded = TokenMask.of(torch.ones(2, 3))
    assert not unpadded.padded and unpadded.select(value) is value


def test_the_mask_is_current_only_inside_the_batch() -> None:
    from quantobs.calibration.tokens import current_mask

    batch = {"input_ids": torch.zeros(1, 2), "attention_mask": torch.ones(1, 2)}
    with real_tokens(batch) as mask:
        assert current_mask() is mask and mask is not None
    assert current_mask() is None
    with real_tokens({"input_ids": torch.zeros(1, 2)}) as none:
        assert none is None and current_mask() is None


# ------------------------------------------------------- batching invariance


@pytest.mark.parametrize("observer", OBSERVERS)
@pytest.mark.parametrize("size", [3, 5])
def test_qparams_do_not_depend_on_the_batching(observer: str, size: int) -> None:
    """Texts padded in batches of 3 or 5 give the qparams and token counts
    of one text per batch (no padding at all)."""
    expected, tokens = one_by_one(observer)
    found, found_tokens = run(observer, size)
    assert_same(found, expected)
    assert found_tokens == tokens


def test_without_the_mask_padding_would_count() -> None:
    """The control: observing the padded positions too (what llm-compressor
    does) changes the token counts and qparams, so the test above can fail."""
    expected, tokens = one_by_one("histogram")
    calibrated = model("histogram")
    for entry in attachment_of(calibrated).entries:
        entry.masked = False
    report = calibrate(calibrated, batches(SENTENCES, 5), progress=False)
    assert all(report.tokens[k] > tokens[k] for k in tokens)
    found = qparams(calibrated)
    assert any(not torch.equal(found[k], v) for k, v in expected.items())


def test_observers_see_exactly_the_real_tokens() -> None:
    """Each input observer's statistic equals the same observer fed the
    real-token rows its layer received, recorded by a hook of our own."""
    calibrated = model("static_minmax")
    layer = calibrated.model.layers[1].mlp.down_proj
    seen: list[torch.Tensor] = []
    layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    data = batches(SENTENCES, 4)
    calibrate(calibrated, data, progress=False)
    real = torch.cat(
        [x[b["attention_mask"] != 0] for x, b in zip(seen, data, strict=True)]
    )
    low, high = layer.input_observer.get_range()
    assert torch.equal(low, real.amin().float().reshape(low.shape))
    assert torch.equal(high, real.amax().float().reshape(high.shape))


# ------------------------------------------------------- resume, distributed


@pytest.mark.parametrize("observer", ["static_minmax", "histogram"])
def test_a_resumed_run_with_other_batches_equals_one_run(
    observer: str, tmp_path: Path
) -> None:
    """Half the texts in batches of 2, saved; the rest resumed in batches of
    5: the qparams of one unpadded run."""
    expected, tokens = one_by_one(observer)
    half = len(SENTENCES) // 2
    first = model(observer)
    calibrate(first, batches(SENTENCES[:half], 2), progress=False)
    save_state(first, tmp_path / "state.safetensors")
    resumed = model(observer)
    load_state(resumed, tmp_path / "state.safetensors")
    report = calibrate(resumed, batches(SENTENCES[half:], 5), progress=False)
    assert_same(qparams(resumed), expected)
    assert report.tokens == tokens


def _distributed(rank: int, world: int) -> dict[str, Any]:
    """Each rank calibrates its contiguous share of the texts in batches of
    3 (other boundaries than one process's), synced."""
    from quantobs.cli.calibrate_cmd import shard

    mine = [SENTENCES[i] for i in shard(len(SENTENCES), rank, world)]
    found = {}
    for observer in ("static_minmax", "histogram"):
        calibrated = model(observer)
        report = calibrate(calibrated, batches(mine, 3), progress=False, sync=True)
        found[observer] = (qparams(calibrated), report.tokens)
    return found


@pytest.mark.slow
def test_a_distributed_run_with_other_batches_equals_one_run(tmp_path: Path) -> None:
    runs = workers.launch(_distributed, 2, tmp_path)
    for observer in ("static_minmax", "histogram"):
        # the workers run one thread each; so does the reference
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            expected, tokens = run(observer, 1)
        finally:
            torch.set_num_threads(threads)
        for rank, found in enumerate(runs):
            assert_same(found[observer][0], expected)
            assert found[observer][1] == tokens, rank
