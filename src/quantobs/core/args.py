"""Quantization arguments: what to quantize to, and at which granularity.

`QuantizationArgs` has the field names, defaults and serialized form of
compressed-tensors' class of the same name, so configs interoperate both ways
(`from_compressed_tensors` / `to_compressed_tensors`). Validation is stricter:
every impossible combination is rejected with a message that names the value
and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)

from quantobs.core.formats import NumberFormat, get_format
from quantobs.core.registry import coerce_enum

__all__ = [
    "ActivationOrdering",
    "DynamicType",
    "QuantizationArgs",
    "QuantizationStrategy",
    "QuantizationType",
]


class QuantizationType(str, Enum):
    """Kind of number the values are quantized to."""

    INT = "int"
    FLOAT = "float"


class QuantizationStrategy(str, Enum):
    """Granularity of the quantization parameters (one scale per ...)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"
    TOKEN = "token"
    TENSOR_GROUP = "tensor_group"
    ATTN_HEAD = "attn_head"


class DynamicType(str, Enum):
    """`dynamic="local"`: only the local (group) scales are computed on the fly."""

    LOCAL = "local"


class ActivationOrdering(str, Enum):
    """Column ordering by activation magnitude (GPTQ); `static`/`dynamic` alias."""

    WEIGHT = "weight"
    GROUP = "group"


_ACTORDER_ALIASES = {"static": "weight", "dynamic": "group"}

# The number format of `type="float"` args per `num_bits` (compressed-tensors'
# FP4 E2M1, FP6 E2M3 (0.20) and FP8 E4M3).
_FLOAT_FORMATS = {4: "float4_e2m1fn", 6: "float6_e2m3fn", 8: "float8_e4m3fn"}

# Strategies that can be computed on the fly (compressed-tensors' rule).
_DYNAMIC_STRATEGIES = ("token", "tensor", "tensor_group", "group")


def _parse_dtype(value: Any) -> torch.dtype | None:
    """A torch dtype from a dtype, `"torch.xxx"` or `"xxx"`."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = getattr(torch, value.strip().removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(
        f"{value!r} is not a torch dtype; pass e.g. torch.float8_e4m3fn or "
        "the string 'torch.float8_e4m3fn'"
    )


TorchDtype = Annotated[
    torch.dtype,
    BeforeValidator(_parse_dtype),
    PlainSerializer(lambda dtype: str(dtype), return_type=str),
]


class QuantizationArgs(BaseModel, use_enum_values=True):
    """How one tensor (weight, activation or attention state) is quantized.

    Field names and defaults follow compressed-tensors. After validation
    `strategy` is always set (inferred from `group_size` when omitted) and enum
    fields hold their plain string values (`args.strategy == "group"`).

    Args:
        num_bits: bits per value: 2..8 for `int`; 4 (FP4 e2m1), 6 (FP6 e2m3,
            compressed-tensors >= 0.20) or 8 (FP8 e4m3) for `float`.
        type: `"int"` or `"float"`.
        symmetric: zero point fixed at 0 when True.
        strategy: one scale per tensor, channel, group, block, token,
            tensor_group (NVFP4: groups plus a global scale) or attn_head.
        group_size: values per group for `group` / `tensor_group`; -1 means
            `channel` when `strategy` is omitted.
        block_structure: `[rows, cols]` of a block for the `block` strategy
            (also accepted as the string `"128x128"`).
        dynamic: True to compute qparams at run time, `"local"` for only the
            group scales of `tensor_group`.
        actorder: `"weight"` or `"group"` activation ordering (GPTQ).
        observer: name of the observer that calibrates these args.
        observer_kwargs: options of that observer.
        scale_dtype: dtype the scales are rounded to (e.g. float8_e4m3fn for
            NVFP4; uint8 or float8_e8m0fnu for MX power-of-two scales).
        zp_dtype: dtype of the zero point; defaults as compressed-tensors.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    num_bits: int = 8
    type: QuantizationType = QuantizationType.INT
    symmetric: bool = True
    group_size: int | None = None
    strategy: QuantizationStrategy | None = None
    block_structure: list[int] | None = None
    dynamic: DynamicType | bool = False
    actorder: ActivationOrdering | None = None
    scale_dtype: TorchDtype | None = None
    zp_dtype: TorchDtype | None = None
    observer: str | None = None
    observer_kwargs: dict[str, Any] = Field(default_factory=dict)
    _format: NumberFormat = PrivateAttr()

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, value: Any) -> Any:
        return coerce_enum(QuantizationType, value, "type")

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> Any:
        return (
            None
            if value is None
            else coerce_enum(QuantizationStrategy, value, "strategy")
        )

    @field_validator("dynamic", mode="before")
    @classmethod
    def _dynamic(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        return coerce_enum(DynamicType, value, "dynamic")

    @field_validator("actorder", mode="before")
    @classmethod
    def _actorder(cls, value: Any) -> Any:
        if value is None or value is False:
            return None
        if value is True:
            return ActivationOrdering.GROUP
        if isinstance(value, str):
            value = _ACTORDER_ALIASES.get(value.strip().lower(), value)
        return coerce_enum(ActivationOrdering, value, "actorder")

    @field_validator("num_bits", mode="before")
    @classmethod
    def _num_bits(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"num_bits={value!r} must be an int")
        return value

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_size(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"group_size={value!r} must be an int or None")
        if value == 0 or value < -1:
            raise ValueError(
                f"group_size={value} is invalid; use a positive size for "
                "strategy='group' or -1 for 'channel'"
            )
        return value

    @field_validator("block_structure", mode="before")
    @classmethod
    def _block_structure(cls, value: Any) -> Any:
        if value is None:
            return None
        parsed = value
        if isinstance(value, str):
            try:
                parsed = [int(v) for v in value.lower().split("x")]
            except ValueError:
                parsed = None
        if (
            isinstance(parsed, (list, tuple))
            and len(parsed) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in parsed)
            and all(v > 0 for v in parsed)
        ):
            return list(parsed)
        raise ValueError(
            f"block_structure={value!r} must be two positive ints [rows, cols], "
            "e.g. [128, 128] or '128x128'"
        )

    @model_validator(mode="after")
    def _check_combination(self) -> QuantizationArgs:
        self._check_bits()
        self._infer_strategy()
        self._check_strategy()
        self._check_dynamic()
        if self.zp_dtype is None:
            self.zp_dtype = self._default_zp_dtype()
        self._format = get_format(self._format_name())
        return self

    def _format_name(self) -> str:
        if self.type == "float":
            return _FLOAT_FORMATS[self.num_bits]
        return f"int{self.num_bits}"

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> QuantizationArgs:
        """A copy; with `update`, validated again (pydantic's does not)."""
        if not update:
            return super().model_copy(deep=deep)
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self).model_validate({**fields, **update})

    def _check_bits(self) -> None:
        if self.type == "int" and not 2 <= self.num_bits <= 8:
            raise ValueError(
                f"num_bits={self.num_bits} is not supported for type 'int'; use 2..8"
            )
        if self.type == "float" and self.num_bits not in _FLOAT_FORMATS:
            raise ValueError(
                f"num_bits={self.num_bits} is not supported for type 'float'; "
                "use 8 (float8_e4m3fn), 6 (float6_e2m3fn) or 4 (float4_e2m1fn)"
            )
        if self.type == "float" and not self.symmetric and self.num_bits in (4, 6):
            raise ValueError(
                f"asymmetric FP{self.num_bits} is not supported (no zero point in "
                f"FP{self.num_bits} formats); set symmetric=True"
            )
        if self.is_mx and not self.symmetric:
            raise ValueError(
                "MX formats (power-of-two scales) are symmetric only; "
                "set symmetric=True"
            )

    def _infer_strategy(self) -> None:
        if self.strategy is not None:
            return
        if self.group_size is None:
            self.strategy = QuantizationStrategy.TENSOR.value  # type: ignore[assignment]
        elif self.group_size == -1:
            self.strategy = QuantizationStrategy.CHANNEL.value  # type: ignore[assignment]
        else:
            self.strategy = QuantizationStrategy.GROUP.value  # type: ignore[assignment]

    def _check_strategy(self) -> None:
        grouped = self.strategy in ("group", "tensor_group")
        if grouped and (self.group_size is None or self.group_size <= 0):
            raise ValueError(
                f"strategy={self.strategy!r} needs a positive group_size "
                f"(got {self.group_size}); e.g. group_size=128"
            )
        if not grouped and self.group_size is not None and self.group_size > 0:
            raise ValueError(
                f"group_size={self.group_size} needs strategy 'group' or "
                f"'tensor_group', not {self.strategy!r}"
            )
        if self.strategy == "block" and self.block_structure is None:
            raise ValueError("strategy='block' needs block_structure, e.g. [128, 128]")
        if self.strategy != "block" and self.block_structure is not None:
            raise ValueError(
                f"block_structure={self.block_structure} needs strategy='block', "
                f"not {self.strategy!r}"
            )

    def _check_dynamic(self) -> None:
        if self.strategy == "token" and not self.dynamic:
            raise ValueError(
                "strategy='token' cannot be static (one scale per token is only "
                "known at run time); set dynamic=True"
            )
        if self.dynamic and self.strategy not in _DYNAMIC_STRATEGIES:
            raise ValueError(
                f"dynamic={self.dynamic!r} is not supported with strategy "
                f"{self.strategy!r}; use one of {', '.join(_DYNAMIC_STRATEGIES)}"
            )
        if self.dynamic == "local" and self.strategy != "tensor_group":
            raise ValueError(
                f"dynamic='local' needs strategy='tensor_group', not {self.strategy!r}"
            )

    def _default_zp_dtype(self) -> torch.dtype:
        # compressed-tensors' defaults: FP8 for float formats, int8 for ints.
        if self.type == "float":
            return torch.float8_e4m3fn
        return torch.int8

    @field_serializer("zp_dtype")
    def _serialize_zp_dtype(self, dtype: torch.dtype | None) -> str | None:
        # As compressed-tensors: a symmetric zero point is not serialized.
        return None if self.symmetric or dtype is None else str(dtype)

    # ------------------------------------------------------------------ derived

    @property
    def format(self) -> NumberFormat:
        """The number format of the quantized values (e.g. `int4`, `float8_e4m3fn`),
        resolved once when the args are validated."""
        return self._format

    @property
    def is_mx(self) -> bool:
        """True for OCP MX formats: float elements, groups of 32, e8m0 scales."""
        return (
            self.type == "float"
            and self.group_size == 32
            and self.scale_dtype in (torch.uint8, torch.float8_e8m0fnu)
        )

    # ---------------------------------------------------------- compat faces

    @classmethod
    def from_compressed_tensors(cls, args: Any) -> QuantizationArgs:
        """Build from a compressed-tensors `QuantizationArgs` or its `model_dump()`."""
        if isinstance(args, BaseModel):
            # model_dump() drops a symmetric zp_dtype; keep the object's own.
            args = {**args.model_dump(), "zp_dtype": getattr(args, "zp_dtype", None)}
        if not isinstance(args, dict):
            raise TypeError(
                "expected a compressed-tensors QuantizationArgs or a dict, got "
                f"{type(args).__name__}"
            )
        return cls.model_validate(args)

    def to_compressed_tensors(self) -> Any:
        """The equivalent compressed-tensors `QuantizationArgs` (needs the package)."""
        try:
            from compressed_tensors.quantization import QuantizationArgs as CTArgs
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "to_compressed_tensors() needs compressed-tensors; "
                "pip install 'quantobs[peers]'"
            ) from err
        data = self.model_dump()
        # An explicit zp_dtype only where it is not the default: compressed-
        # tensors >= 0.20 saves the zp_dtype (of asymmetric args) only when
        # given, so its saved config equals that of its own args.
        data.pop("zp_dtype")
        if self.zp_dtype != self._default_zp_dtype():
            data["zp_dtype"] = self.zp_dtype
        return CTArgs.model_validate(data)
