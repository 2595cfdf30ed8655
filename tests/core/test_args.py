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


def _assert_same_config(ours: QuantizationArgs, theirs: CTArgs) -> None:
    """`ours` and compressed-tensors' `theirs` are the same args, and each
    one's saved config reads back into the other, under compressed-tensors
    0.19 (which saves every field) and 0.20 (which omits None, default
    `observer` and `zp_dtype` fields). Saved configs of both drop the
    zp_dtype of symmetric args (no zero point is stored): they are compared
    as saved (`model_dump`)."""
    saved = ours.model_dump()
    assert QuantizationArgs.from_compressed_tensors(theirs) == ours
    for their_config in (theirs.model_dump(), theirs.model_dump(mode="json")):
        assert QuantizationArgs.model_validate(their_config).model_dump() == saved
    again = QuantizationArgs.model_validate_json(ours.model_dump_json())
    assert again.model_dump() == saved
    back = ours.to_compressed_tensors()
    assert isinstance(back, CTArgs)
    assert back == theirs and back.zp_dtype == theirs.zp_dtype
    # the config compressed-tensors saves for ours is the one it saves for its own
    assert back.model_dump(mode="json") == theirs.model_dump(mode="json")
    read = QuantizationArgs.from_compressed_tensors(CTArgs.model_validate(saved))
    assert read.model_dump() == saved


def test_defaults_match_compressed_tensors() -> None:
    ours, theirs = QuantizationArgs(), CTArgs()
    _assert_same_config(ours, theirs)
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
        ({"type": "float", "num_bits": 6, "symmetric": False}, r"asymmetric FP6"),
        ({"type": "float", "num_bits": 5}, r"num_bits=5 is not supported"),
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
    _assert_same_config(QuantizationArgs(**kwargs), CTArgs(**kwargs))


def test_saved_configs_of_both_compressed_tensors_versions_read_back() -> None:
    # 0.19 saves every field; 0.20 omits None ones, an empty observer_kwargs,
    # and observer / zp_dtype unless given (written here, not read from the
    # installed version)
    full = {
        "num_bits": 4, "type": "int", "symmetric": False, "group_size": 128,
        "strategy": "group", "block_structure": None, "dynamic": False,
        "actorder": None, "scale_dtype": None, "zp_dtype": "torch.int8",
        "observer": None, "observer_kwargs": {},
    }  # fmt: skip
    sparse = {
        "num_bits": 4, "type": "int", "symmetric": False, "group_size": 128,
        "strategy": "group", "dynamic": False,
    }  # fmt: skip
    expected = QuantizationArgs(num_bits=4, symmetric=False, group_size=128)
    for saved in (full, sparse):
        assert QuantizationArgs.model_validate(saved) == expected
        assert CTArgs.model_validate(saved) == expected.to_compressed_tensors()
    assert expected.zp_dtype == torch.int8


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
            _assert_same_config(mine, other)


#: The presets compressed-tensors defines from 0.20 on.
PRESETS_SINCE_0_20 = {"MXFP4XFP8", "MXFP6A16", "MXFP6A8"}


def test_preset_names() -> None:
    # every preset of the installed compressed-tensors; 0.19 lacks 0.20's
    assert set(CT_PRESETS) <= set(PRESET_SCHEMES)
    assert set(PRESET_SCHEMES) - set(CT_PRESETS) <= PRESETS_SINCE_0_20
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
        *PRESETS_SINCE_0_20,
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
    mxfp6 = preset_scheme("MXFP6A16").weights
    assert mxfp6 is not None and mxfp6.is_mx
    assert mxfp6.format.name == "float6_e2m3fn"


@pytest.mark.parametrize("name", sorted(PRESETS_SINCE_0_20))
def test_presets_since_compressed_tensors_0_20(name: str) -> None:
    # their args as compressed-tensors 0.20 defines them (written out here,
    # so that they are checked under 0.19 too)
    mx = {"type": "float", "group_size": 32, "scale_dtype": torch.uint8}
    expected = {
        "MXFP4XFP8": (
            {"num_bits": 4, **mx},
            {"num_bits": 8, "type": "float", "group_size": 128, "dynamic": True},
        ),
        "MXFP6A16": ({"num_bits": 6, **mx}, None),
        "MXFP6A8": ({"num_bits": 6, **mx}, {"num_bits": 8, "dynamic": True, **mx}),
    }[name]
    scheme = preset_scheme(name)
    weights, inputs = expected
    assert scheme.weights == QuantizationArgs(**weights, zp_dtype=torch.uint8)
    if inputs is None:
        assert scheme.input_activations is None
    else:
        zp = {"zp_dtype": torch.uint8} if "scale_dtype" in inputs else {}
        assert scheme.input_activations == QuantizationArgs(**inputs, **zp)
    assert scheme.output_activations is None
