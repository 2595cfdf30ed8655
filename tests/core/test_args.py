"""QuantizationArgs: defaults, validation matrix, compressed-tensors round trip."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization.quant_scheme import (
    PRESET_SCHEMES as CT_PRESETS,
)
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from pydantic import ValidationError

from quantobs import (
    PRESET_SCHEMES,
    QuantizationArgs,
    QuantizationStrategy,
    preset_scheme,
)


def test_defaults_match_compressed_tensors() -> None:
    ours, theirs = QuantizationArgs(), CTArgs()
    assert ours.model_dump() == theirs.model_dump()
    assert ours.strategy == "tensor" and ours.zp_dtype == torch.int8
    assert ours.format.name == "int8"


@pytest.mark.parametrize(
    ("kwargs", "strategy"),
    [
        ({}, "tensor"),
        ({"group_size": -1}, "channel"),
        ({"group_size": 64}, "group"),
        ({"strategy": "TENSOR_GROUP", "group_size": 16}, "tensor_group"),
        ({"strategy": "Block", "block_structure": "64x32"}, "block"),
    ],
    ids=["tensor", "channel", "group", "tensor_group", "block"],
)
def test_strategy_inferred_and_case_insensitive(
    kwargs: dict[str, Any], strategy: str
) -> None:
    args = QuantizationArgs(**kwargs)
    assert args.strategy == strategy == QuantizationStrategy(strategy)
    assert CTArgs(**kwargs).strategy == strategy


def test_enum_strings_case_insensitive() -> None:
    args = QuantizationArgs(
        type="FLOAT",
        num_bits=8,
        dynamic="LOCAL",
        strategy="tensor_group",
        group_size=16,
    )
    assert args.type == "float" and args.dynamic == "local"
    assert (
        QuantizationArgs(actorder="Static", strategy="group", group_size=8).actorder
        == "weight"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "group"}, r"strategy='group' needs a positive group_size"),
        ({"strategy": "tensor_group"}, r"needs a positive group_size"),
        ({"group_size": 0}, r"group_size=0 is invalid"),
        ({"group_size": -2}, r"group_size=-2 is invalid"),
        ({"group_size": 1.5}, r"group_size=1.5 must be an int"),
        ({"strategy": "channel", "group_size": 128}, r"group_size=128 needs strategy"),
        ({"strategy": "block"}, r"strategy='block' needs block_structure"),
        ({"block_structure": [128, 128]}, r"block_structure=\[128, 128\] needs"),
        ({"strategy": "block", "block_structure": [128]}, r"two positive ints"),
        ({"strategy": "block", "block_structure": [0, 4]}, r"two positive ints"),
        ({"strategy": "block", "block_structure": "axb"}, r"two positive ints"),
        ({"strategy": "block", "block_structure": [1.5, 2]}, r"two positive ints"),
        ({"strategy": "token"}, r"strategy='token' cannot be static"),
        ({"strategy": "channel", "dynamic": True}, r"not supported with strategy"),
        ({"dynamic": "local"}, r"dynamic='local' needs strategy='tensor_group'"),
        ({"type": "float", "num_bits": 4, "symmetric": False}, r"asymmetric FP4"),
        (
            {
                "type": "float",
                "group_size": 32,
                "scale_dtype": torch.uint8,
                "symmetric": False,
            },
            r"MX formats .* symmetric only",
        ),
        ({"type": "float", "num_bits": 6}, r"num_bits=6 is not supported"),
        ({"num_bits": 16}, r"num_bits=16 is not supported for type 'int'"),
        ({"num_bits": 1}, r"num_bits=1 is not supported"),
        ({"num_bits": True}, r"num_bits=True must be an int"),
        ({"strategy": "rows"}, r"strategy='rows' is not valid; use one of"),
        ({"type": "fixed"}, r"type='fixed' is not valid"),
        ({"dynamic": "sometimes"}, r"dynamic='sometimes' is not valid"),
        ({"actorder": "random"}, r"actorder='random' is not valid"),
        ({"scale_dtype": "torch.float9"}, r"is not a torch dtype"),
        ({"scale_dtype": 3}, r"is not a torch dtype"),
        ({"num_bit": 4}, r"Extra inputs are not permitted"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_invalid_combinations(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        QuantizationArgs(**kwargs)


def test_validation_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="needs a positive group_size"):
        QuantizationArgs(strategy="group")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_bits": 4, "symmetric": False, "group_size": 128},
        {"num_bits": 8, "type": "float", "strategy": "channel"},
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "block",
            "block_structure": [128, 128],
        },
        {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
            "scale_dtype": "torch.float8_e4m3fn",
            "dynamic": "local",
            "observer": "static_minmax",
        },
        {
            "num_bits": 8,
            "type": "float",
            "group_size": 32,
            "scale_dtype": torch.uint8,
            "zp_dtype": torch.uint8,
        },
        {
            "num_bits": 4,
            "group_size": 128,
            "actorder": "weight",
            "observer": "mse",
            "observer_kwargs": {"maxshrink": 0.5},
        },
        {"num_bits": 8, "strategy": "token", "dynamic": True},
    ],
    ids=[
        "default",
        "w4-asym",
        "fp8-channel",
        "fp8-block",
        "nvfp4-input",
        "mxfp8",
        "actorder",
        "token",
    ],
)
def test_round_trip_with_compressed_tensors(kwargs: dict[str, Any]) -> None:
    theirs = CTArgs(**kwargs)
    ours = QuantizationArgs.from_compressed_tensors(theirs)
    assert ours.model_dump() == theirs.model_dump()
    assert ours.zp_dtype == theirs.zp_dtype
    # A dump drops a symmetric zp_dtype, so only the dump itself must agree.
    from_dump = QuantizationArgs.from_compressed_tensors(theirs.model_dump())
    assert from_dump.model_dump() == theirs.model_dump()
    back = ours.to_compressed_tensors()
    assert isinstance(back, CTArgs)
    assert back.model_dump() == theirs.model_dump()
    assert back.zp_dtype == theirs.zp_dtype


def test_from_compressed_tensors_rejects_other_types() -> None:
    with pytest.raises(
        TypeError, match="compressed-tensors QuantizationArgs or a dict"
    ):
        QuantizationArgs.from_compressed_tensors(42)


def test_json_round_trip() -> None:
    args = preset_scheme("NVFP4").weights
    assert args is not None
    again = QuantizationArgs.model_validate_json(args.model_dump_json())
    assert again == args and again.scale_dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("name", sorted(CT_PRESETS), ids=str)
def test_presets_match_compressed_tensors(name: str) -> None:
    ours = preset_scheme(name)
    theirs = preset_name_to_scheme(name, ["Linear"])
    for part in ("weights", "input_activations", "output_activations"):
        mine, other = getattr(ours, part), getattr(theirs, part)
        assert (mine is None) == (other is None), part
        if mine is not None:
            assert mine.model_dump() == other.model_dump(), part
            assert mine.zp_dtype == other.zp_dtype


def test_preset_names() -> None:
    assert set(PRESET_SCHEMES) == set(CT_PRESETS)
    for name in (
        "W8A8",
        "W8A16",
        "W4A16",
        "W4A16_ASYM",
        "W4A8",
        "FP8",
        "FP8_DYNAMIC",
        "FP8_BLOCK",
        "NVFP4",
        "NVFP4A16",
        "MXFP4",
        "MXFP8",
    ):
        assert name in PRESET_SCHEMES
    assert preset_scheme("w4a16") == preset_scheme("W4A16")


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(KeyError, match=r"unknown preset scheme 'W9A9'.*W4A16"):
        preset_scheme("W9A9")
    with pytest.raises(TypeError, match="must be a str"):
        preset_scheme(4)  # type: ignore[arg-type]


def test_format_and_mx_properties() -> None:
    assert QuantizationArgs(num_bits=4).format.name == "int4"
    assert QuantizationArgs(type="float").format.name == "float8_e4m3fn"
    nvfp4 = preset_scheme("NVFP4").weights
    mxfp4 = preset_scheme("MXFP4").weights
    assert nvfp4 is not None and mxfp4 is not None
    assert nvfp4.format.name == "float4_e2m1fn" and not nvfp4.is_mx
    assert mxfp4.is_mx
    assert QuantizationArgs(
        type="float", group_size=32, scale_dtype=torch.float8_e8m0fnu
    ).is_mx
