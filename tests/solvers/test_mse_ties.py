"""The native MSE kernel's near ties resolve as llm-compressor's do."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import QuantizationStrategy
from safetensors import safe_open

from quantobs import QuantizationArgs, native
from quantobs.cli.default_model import default_model_path
from quantobs.core.layout import flatten_for_calibration
from quantobs.core.scoring import candidate_errors, shrink_factors
from quantobs.core.syncs import SyncCounter
from quantobs.solvers.mse import mse_search
from quantobs.solvers.mse_ties import (
    LlmCompressorErrors,
    first_best,
    patience_stop,
    patience_stops,
)

_W4 = {"num_bits": 4, "group_size": 128, "strategy": "group"}
_MX = {
    "num_bits": 4,
    "type": "float",
    "group_size": 32,
    "scale_dtype": torch.uint8,
    "zp_dtype": torch.uint8,
}


def _theirs(x_flat: torch.Tensor, kwargs: dict[str, object], patience: int = 5):
    try:  # private; llm-compressor 0.14.1's Triton grid search replaced it
        from llmcompressor.observers.mse_quant import _grid_search_mse
    except ImportError:
        pytest.skip(
            "this llm-compressor has no observers/mse_quant._grid_search_mse "
            "(removed after 0.14.0); its public MSE observers are compared in "
            "tests/observers/test_observers.py"
        )
    args = CTArgs(**kwargs)
    token = args.model_copy(update={"strategy": QuantizationStrategy.TOKEN})
    return _grid_search_mse(x_flat, args, token, 0.2, patience, 100.0, 2.4, 0.3)


def _minilm(name: str) -> torch.Tensor:
    try:
        path = default_model_path()
    except FileNotFoundError:  # pragma: no cover - the model ships with the repo
        pytest.skip("the embedded MiniLM is not installed")
    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name).float()


def _reference_stop(errors: torch.Tensor, patience: int) -> int | None:
    # llm-compressor's loop, one candidate at a time
    best = torch.full_like(errors[0], float("inf"))
    stale = 0
    for i, row in enumerate(errors):
        improved = row < best
        if improved.any():
            best = torch.where(improved, row, best)
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                return i + 1
    return None


@pytest.mark.parametrize("patience", [0, 1, 3, 5])
@pytest.mark.parametrize("seed", range(5))
def test_patience_stop_is_llm_compressors_loop(patience: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    errors = torch.rand(20, 6, generator=gen, dtype=torch.float64)
    errors = errors.cumsum(0) * (torch.rand(20, 6, generator=gen) < 0.5)  # ties
    assert patience_stop(errors, patience) == _reference_stop(errors, patience)
    assert patience_stop(errors, None) is None


@pytest.mark.parametrize("patience", [None, 0, 1, 3, 5])
@pytest.mark.parametrize("seed", range(5))
def test_early_stop_decided_on_the_device_is_the_loops(
    patience: int | None, seed: int
) -> None:
    # issue 24: the torch path scores every block, then stops as the loop did
    gen = torch.Generator().manual_seed(seed)
    errors = torch.rand(20, 6, generator=gen, dtype=torch.float64)
    errors = errors.cumsum(0) * (torch.rand(20, 6, generator=gen) < 0.5)  # ties
    stop = patience_stop(errors, patience) or errors.shape[0]
    with SyncCounter() as syncs:
        found = patience_stops(errors, patience)
        best = first_best(errors, patience)
    assert syncs.count == 0
    assert int(found) == stop
    assert torch.equal(best, torch.argmin(errors[:stop], dim=0))


def test_minilm_near_tie_group_matches_llm_compressor(backend: str) -> None:
    # Two candidates of this W4A16 group have equal float32 errors in torch
    # (candidates 3 and 14); the native kernel's own pow and float64 sums
    # once put candidate 14 a hair lower.
    w = _minilm("encoder.layer.2.output.dense.weight")
    x_flat = flatten_for_calibration(w, "weight", QuantizationArgs(**_W4))
    group = x_flat[:, 113:114, 6:7]  # (1, 1, 1, 128)
    factors = shrink_factors(0.2, 100.0)
    errors = candidate_errors(
        group,
        QuantizationArgs(**_W4),
        group.amin(dim=(0, -1)),
        group.amax(dim=(0, -1)),
        factors,
    ).flatten()
    if backend == "eager":
        assert errors[3] == errors[14]  # the tie llm-compressor sees
    # every candidate scored (alone, the group's early stop comes before 14)
    low, high = mse_search(group, QuantizationArgs(**_W4), patience=None)
    want_low, want_high = _theirs(group, _W4, patience=1000)
    assert torch.equal(low, want_low) and torch.equal(high, want_high)


def test_minilm_layer_matches_llm_compressor_bit_for_bit(backend: str) -> None:
    w = _minilm("encoder.layer.2.output.dense.weight")
    x_flat = flatten_for_calibration(w, "weight", QuantizationArgs(**_W4))
    low, high = mse_search(x_flat, QuantizationArgs(**_W4))
    want_low, want_high = _theirs(x_flat, _W4)
    assert torch.equal(low, want_low) and torch.equal(high, want_high)


def test_repeated_candidates_get_equal_errors(backend: str) -> None:
    # MX scales are powers of two: most shrink factors repeat the scale of
    # the one before, and their errors must compare equal (not less).
    args = QuantizationArgs(**_MX)
    x3 = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(0))
    low, high = x3.amin(dim=(0, -1)), x3.amax(dim=(0, -1))
    factors = shrink_factors(0.2, 100.0)
    table = LlmCompressorErrors(x3, args, low, high, factors, 2.4)
    table.extend(7)
    table.extend(13)
    errors = table.settle()  # (20, 64)
    previous = native.set_enabled(False)
    try:
        torch_errors = candidate_errors(x3, args, low, high, factors)
    finally:
        native.set_enabled(previous)
    same = torch_errors[1:] == torch_errors[:-1]
    assert same.float().mean() > 0.5
    assert torch.equal(errors[1:][same], errors[:-1][same])
    assert torch.equal(errors.argmin(dim=0), torch_errors.argmin(dim=0))


@pytest.mark.parametrize("patience", [None, 0, 2, 5])
@pytest.mark.parametrize(
    "kwargs",
    [_W4, {**_W4, "symmetric": False}, _MX, {"num_bits": 8, "strategy": "channel"}],
    ids=["w4", "w4-asym", "mxfp4", "w8-channel"],
)
def test_random_groups_match_llm_compressor(
    kwargs: dict[str, object], patience: int | None, backend: str
) -> None:
    args = QuantizationArgs(**kwargs)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 512, generator=gen) * torch.rand(64, 1, generator=gen)
    x_flat = flatten_for_calibration(w, "weight", args)
    low, high = mse_search(x_flat, args, patience=patience)
    want_low, want_high = _theirs(
        x_flat, kwargs, 1000 if patience is None else patience
    )
    assert torch.equal(low, want_low) and torch.equal(high, want_high)


def test_marked_qparams_get_torchs_errors_bit_for_bit() -> None:
    # Several rows per qparam (activations): one qparam alone would be summed
    # as one run of N * G values; the errors must be those of the full table.
    args = QuantizationArgs(num_bits=8, strategy="channel")
    x3 = torch.randn(64, 8, 256, generator=torch.Generator().manual_seed(0))
    low, high = x3.amin(dim=(0, -1)), x3.amax(dim=(0, -1))
    factors = shrink_factors(0.2, 100.0)
    previous = native.set_enabled(False)
    try:
        full = candidate_errors(x3, args, low, high, factors)
    finally:
        native.set_enabled(previous)
    table = LlmCompressorErrors(x3, args, low, high, factors, 2.4)
    for k in range(8):
        assert torch.equal(table._mark(torch.tensor([k]))[:, 0], full[:, k])
    assert torch.equal(table._mark(torch.tensor([1, 6])), full[:, [1, 6]])


def test_the_tied_minilm_group_is_rescored_with_torch() -> None:
    # candidates 3 and 14 of this group have equal float32 errors in torch:
    # the kernel's winner is near another candidate, so torch scores it
    if not native.available():
        pytest.skip("the native kernels are not built")
    w = _minilm("encoder.layer.2.output.dense.weight")
    x_flat = flatten_for_calibration(w, "weight", QuantizationArgs(**_W4))
    x3 = x_flat[:, 112:116, 6].reshape(1, 4, 128)  # the group is column 1
    args = QuantizationArgs(**_W4)
    low, high = x3.amin(dim=(0, -1)), x3.amax(dim=(0, -1))
    table = LlmCompressorErrors(x3, args, low, high, shrink_factors(0.2, 100.0), 2.4)
    assert table.settles
    table.extend(20)
    errors = table.settle(None)
    assert table._exact[1] and table.chosen is not None
    previous = native.set_enabled(False)
    try:
        torch_errors = candidate_errors(x3, args, low, high, shrink_factors(0.2, 100))
    finally:
        native.set_enabled(previous)
    assert torch.equal(errors[:, 1], torch_errors[:, 1])
    assert torch.equal(table.chosen, torch.argmin(torch_errors, dim=0))


@pytest.mark.parametrize("patience", [None, 0, 2])
@pytest.mark.parametrize(
    "kwargs", [_W4, {**_W4, "symmetric": False}, _MX], ids=["w4", "w4-asym", "mxfp4"]
)
def test_every_near_comparison_rescored_gives_torchs_choice(
    kwargs: dict[str, object], patience: int | None
) -> None:
    # a tolerance of 1: every comparison is near, every qparam is scored
    # with torch, in as many rounds as the early stop moves
    if not native.available():
        pytest.skip("the native kernels are not built")
    args = QuantizationArgs(**kwargs)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 256, generator=gen) * torch.rand(16, 1, generator=gen)
    x3 = flatten_for_calibration(w, "weight", args).reshape(1, -1, args.group_size)
    low, high = x3.amin(dim=(0, -1)), x3.amax(dim=(0, -1))
    factors = shrink_factors(0.2, 100.0)
    table = LlmCompressorErrors(x3, args, low, high, factors, 2.4)
    table.tolerance = 1.0
    for _ in range(0, 20, 3):
        table.extend(3)
        if table.stop(patience) is not None:
            break
    errors = table.settle(patience)
    assert table.chosen is not None
    # every qparam but those whose candidates before the stop share one
    # scale (MX's powers of two): nothing to compare there
    scales = table._scale[: table.stopped or errors.shape[0]]
    assert torch.equal(table._exact, (scales != scales[0]).any(dim=0))
    previous = native.set_enabled(False)
    try:
        torch_errors = candidate_errors(x3, args, low, high, factors)
    finally:
        native.set_enabled(previous)
    exact = table._exact
    assert torch.equal(errors[:, exact], torch_errors[: errors.shape[0], exact])
    assert table.stopped == patience_stop(torch_errors[: errors.shape[0]], patience)
    stop = table.stopped or errors.shape[0]
    assert torch.equal(table.chosen, torch.argmin(torch_errors[:stop], dim=0))
