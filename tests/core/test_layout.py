"""flatten_for_calibration and qparam_shape: every strategy x base name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from llmcompressor.observers.helpers import (
    flatten_for_calibration as llmc_flatten,
)

from quantobs import QuantizationArgs, flatten_for_calibration, qparam_shape

R, C = 24, 64  # weight (rows, cols)
B, S, H = 2, 3, 64  # activation (batch, seq, hidden)
NH, D = 4, 8  # attention (heads, head_dim)

# (base_name, input shape, args kwargs, expected layout shape)
CASES: list[tuple[str, tuple[int, ...], dict[str, Any], tuple[int, ...]]] = [
    ("weight", (R, C), {}, (1, 1, R * C)),
    ("weight", (R, C), {"strategy": "channel"}, (1, R, 1, C)),
    ("weight", (R, C), {"group_size": 16}, (1, R, C // 16, 16)),
    (
        "weight",
        (R, C),
        {"strategy": "tensor_group", "group_size": 16, "type": "float", "num_bits": 4},
        (1, R, C // 16, 16),
    ),
    (
        "weight",
        (R, C),
        {"strategy": "block", "block_structure": [8, 16]},
        (1, R // 8, C // 16, 8 * 16),
    ),
    (  # not divisible: zero-padded to whole blocks
        "weight",
        (R, C),
        {"strategy": "block", "block_structure": [16, 48]},
        (1, 2, 2, 16 * 48),
    ),
    ("input", (B, S, H), {}, (B * S, 1, H)),
    ("output", (H,), {}, (1, 1, H)),  # a 1-D activation: one token
    ("output", (B, S, H), {"group_size": 32}, (B * S, H // 32, 32)),
    (
        "input",
        (B, S, H),
        {"strategy": "tensor_group", "group_size": 16, "type": "float", "num_bits": 4},
        (B * S, H // 16, 16),
    ),
    ("q", (B, NH, S, D), {}, (B * S, 1, NH * D)),
    ("k", (B, NH, S, D), {"strategy": "attn_head"}, (B * S, NH, 1, 1, D)),
    ("v", (B, NH, S, D), {"strategy": "attn_head"}, (B * S, NH, 1, 1, D)),
]


def _id(case: tuple[str, tuple[int, ...], dict[str, Any], tuple[int, ...]]) -> str:
    base_name, _, kwargs, _ = case
    args = QuantizationArgs(**kwargs)
    extra = args.group_size or args.block_structure or ""
    return f"{base_name}-{args.strategy}{extra}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_layout_matches_llm_compressor(
    case: tuple[str, tuple[int, ...], dict[str, Any], tuple[int, ...]],
) -> None:
    base_name, shape, kwargs, expected = case
    value = torch.randn(shape)
    ours = flatten_for_calibration(value, base_name, QuantizationArgs(**kwargs))
    theirs = llmc_flatten(value, base_name, CTArgs(**kwargs))
    assert tuple(ours.shape) == expected
    assert torch.equal(ours, theirs)
    assert qparam_shape(shape, base_name, QuantizationArgs(**kwargs)) == expected[1:-1]


def test_token_layout_broadcasts_per_token() -> None:
    # llm-compressor returns token activations unflattened (token scales are
    # computed on the fly there); our layout gives one statistic per token.
    args = QuantizationArgs(strategy="token", dynamic=True)
    value = torch.randn(B, S, H)
    flat = flatten_for_calibration(value, "input", args)
    assert flat.shape == (1, B, S, 1, H)
    amax = flat.abs().amax(dim=(0, -1))
    assert amax.shape == (B, S, 1)
    assert torch.equal(amax, value.abs().amax(dim=-1, keepdim=True))
    assert qparam_shape((B, S, H), "input", args) == (B, S, 1)


def test_statistics_are_reductions_over_first_and_last_dim() -> None:
    w = torch.randn(R, C)
    group = flatten_for_calibration(w, "weight", QuantizationArgs(group_size=16))
    expected = w.reshape(R, C // 16, 16).amax(-1)
    assert torch.equal(group.amax(dim=(0, -1)), expected)
    channel = flatten_for_calibration(w, "weight", QuantizationArgs(group_size=-1))
    assert torch.equal(channel.amin(dim=(0, -1)), w.amin(-1, keepdim=True))


def test_block_padding_is_zero() -> None:
    w = torch.ones(5, 7)
    args = QuantizationArgs(strategy="block", block_structure=[4, 4])
    flat = flatten_for_calibration(w, "weight", args)
    assert flat.shape == (1, 2, 2, 16)
    assert flat.sum() == w.numel()  # padding adds only zeros
    assert qparam_shape((5, 7), "weight", args) == (2, 2)


def test_g_idx_makes_groups_contiguous() -> None:
    w = torch.arange(2 * 8, dtype=torch.float32).reshape(2, 8)
    g_idx = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0])
    args = QuantizationArgs(group_size=4)
    flat = flatten_for_calibration(w, "weight", args, g_idx=g_idx)
    assert flat.shape == (1, 2, 2, 4)
    assert torch.equal(flat[0, 0, 0], w[0, [1, 3, 4, 7]])
    assert torch.equal(flat[0, 1, 1], w[1, [0, 2, 5, 6]])
    # the identity ordering is the plain layout
    identity = torch.arange(8) // 4
    plain = flatten_for_calibration(w, "weight", args)
    assert torch.equal(flatten_for_calibration(w, "weight", args, identity), plain)


@pytest.mark.parametrize(
    ("base_name", "shape", "kwargs", "error", "match"),
    [
        ("bias", (R, C), {}, ValueError, r"unknown base_name 'bias'; use one of"),
        (
            "weight",
            (R, C),
            {"strategy": "token", "dynamic": True},
            ValueError,
            r"strategy 'token' cannot be applied to 'weight'",
        ),
        (
            "weight",
            (R, C),
            {"strategy": "attn_head"},
            ValueError,
            r"'attn_head' cannot be applied to 'weight'",
        ),
        (
            "input",
            (B, S, H),
            {"strategy": "channel"},
            ValueError,
            r"'channel' cannot be applied to 'input' \(activation\)",
        ),
        (
            "output",
            (B, S, H),
            {"strategy": "block", "block_structure": [2, 2]},
            ValueError,
            r"'block' cannot be applied",
        ),
        (
            "q",
            (B, NH, S, D),
            {"group_size": 4},
            ValueError,
            r"'group' cannot be applied to 'q' \(attention\)",
        ),
        ("k", (B, NH, S, D), {"strategy": "channel"}, ValueError, r"cannot be applied"),
        (
            "weight",
            (R, 60),
            {"group_size": 16},
            ValueError,
            r"group_size 16 does not divide the 60 columns",
        ),
        (
            "input",
            (B, S, 60),
            {"group_size": 16},
            ValueError,
            r"does not divide the 60 columns of 'input'",
        ),
        (
            "weight",
            (2, R, C),
            {"strategy": "channel"},
            ValueError,
            r"'weight' must be 2-D",
        ),
        # a 1-D activation is one token for `tensor` (llm-compressor's
        # reshape(-1, 1, hidden)); groups and tokens need (..., hidden) rows
        ("input", (H,), {"group_size": 16}, ValueError, r"must be at least 2-D"),
        ("input", (), {}, ValueError, r"must be at least 1-D"),
        ("v", (B, S, H), {"strategy": "attn_head"}, ValueError, r"must be 4-D"),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith(("r", "'")) else None,
)
def test_layout_errors(
    base_name: str,
    shape: tuple[int, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        flatten_for_calibration(
            torch.zeros(shape), base_name, QuantizationArgs(**kwargs)
        )
    with pytest.raises(error, match=match):
        qparam_shape(shape, base_name, QuantizationArgs(**kwargs))


@pytest.mark.parametrize(
    ("g_idx", "match"),
    [
        (torch.zeros(8, dtype=torch.long), r"exactly 4 columns"),
        (torch.tensor([0, 1] * 3), r"must have shape \(8,\)"),
        (torch.tensor([0.0] * 8), r"integer tensor"),
        (torch.tensor([0, 1, 2, 0, 1, 0, 1, 1]), r"values 0\.\.1"),
        (torch.tensor([-1, 1, 0, 0, 1, 0, 1, 1]), r"exactly 4 columns"),
    ],
    ids=["one-group", "wrong-length", "float", "out-of-range", "negative"],
)
def test_bad_g_idx(g_idx: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        flatten_for_calibration(
            torch.zeros(2, 8), "weight", QuantizationArgs(group_size=4), g_idx
        )


def test_g_idx_only_for_weight_groups() -> None:
    with pytest.raises(ValueError, match=r"g_idx applies to weights"):
        flatten_for_calibration(
            torch.zeros(2, 8), "weight", QuantizationArgs(), torch.zeros(8).long()
        )


def test_non_tensor_input() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        flatten_for_calibration([1.0, 2.0], "weight", QuantizationArgs())  # type: ignore[arg-type]
