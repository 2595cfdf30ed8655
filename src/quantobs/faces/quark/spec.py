"""The Quark-style quantization spec: `QTensorConfig` (alias `QuantizationSpec`).

Field names, enum names and enum values follow AMD Quark 0.13
(`quark.torch.quantization.config`), so a config written for Quark reads the
same here. Every field also takes a plain string (`dtype="int8"`,
`qscheme="per_group"`, `round_method="half_even"`) or Quark's own enum member;
an observer also accepts Quark's own `QTensorConfig` (converted field by field
with `as_spec`).

Validation happens at construction and names the bad value and the fix. The
rules are Quark's (its required fields per dtype, its qscheme / observer
pairs) plus the combinations Quark accepts but computes nonsense for
(asymmetric float formats, an FP4 spec without a scale format, a 2-D
`per_block` qscheme that no observer implements)::

    dtype                    needs                                 observer_cls
    int*, uint*              qscheme, is_dynamic, symmetric,       required
                             round_method, scale_type
    fp8_e4m3, fp8_e5m2       qscheme, is_dynamic                   required
    fp4, fp6_e2m3, fp6_e3m2  qscheme, scale_format                 required
    mx                       ch_axis, group_size, mx_element_dtype None or MX
    bfp16                    ch_axis, group_size (8)               None or BFP
    float16, bfloat16        -                                     Placeholder

    (MX: PerBlockMXObserver, BFP: PerBlockBFPObserver, Placeholder:
    PlaceholderObserver.)
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, TypeVar

from quantobs.core.registry import Registry, coerce_enum
from quantobs.faces.quark.dtypes import (
    BFP16_BLOCK,
    CAST_DTYPES,
    INT_DTYPES,
    MX_ELEMENT_DTYPES,
    SCALE_FORMATS,
    SCALE_MODES,
    SMALL_FLOAT_DTYPES,
    SUPPORTED_DTYPES,
    Dtype,
    QSchemeType,
    RoundType,
    ScaleType,
    ZeroPointType,
    element_format,
    mx_element_params,
    quant_range,
)

__all__ = [
    "MX_ELEMENT_DTYPES",
    "Dtype",
    "QSchemeType",
    "QTensorConfig",
    "QuantizationSpec",
    "RoundType",
    "ScaleType",
    "ZeroPointType",
    "as_spec",
    "element_format",
    "mx_element_params",
    "observer_class",
    "quant_range",
    "register_observer",
]


E = TypeVar("E", bound=Enum)


def _optional(enum: type[E], value: Any, field: str) -> E | None:
    return None if value is None else coerce_enum(enum, value, field)


# Observer classes by class name, filled by `quantobs.faces.quark.base.ObserverBase`
# subclasses as they are defined (`register_observer`).
_OBSERVERS: Registry[type] = Registry("Quark observer")


def register_observer(cls: type) -> None:
    """Make `cls` known to specs by its class name (done by `ObserverBase`)."""
    _OBSERVERS.register(cls.__name__)(cls)


def observer_class(value: Any) -> type:
    """Our observer class for a class (ours or Quark's) or a class name.

    Raises:
        ValueError: no observer of that name in `quantobs.faces.quark`.
    """
    name = value if isinstance(value, str) else getattr(value, "__name__", None)
    try:
        found = _OBSERVERS.get(name) if isinstance(name, str) else None
    except KeyError:
        found = None
    if found is None or _abstract(found):
        concrete = [n for n in _OBSERVERS.names() if not _abstract(_OBSERVERS.get(n))]
        raise ValueError(
            f"observer_cls={value!r} is not an observer of quantobs.faces.quark; use "
            f"one of {', '.join(concrete)}"
        )
    return found


def _abstract(cls: type) -> bool:
    check = getattr(cls, "is_abstract", None)
    return bool(check()) if callable(check) else False


def _check_int(value: Any, field: str, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}={value!r} must be an int; {fix}")


# ---------------------------------------------------------------- the spec


@dataclasses.dataclass(eq=True)
class QTensorConfig:
    """How one tensor is quantized: Quark 0.13's `QTensorConfig`, validated.

    Attributes:
        dtype: quantized data type (`Dtype` or its name).
        observer_cls: observer class (ours, Quark's of the same name, or a
            name).
        is_dynamic: qparams computed per batch at run time (no accumulation).
        qscheme: `per_tensor`, `per_channel` or `per_group`.
        ch_axis: channel axis (per_channel), or the axis groups / MX blocks
            run along (per_group, mx, bfp16).
        group_size: elements per group or block (`-1`: the whole axis).
        block_size: Quark's 2-D block size (`per_block`, not supported).
        symmetric: symmetric range (zero point 0); `None` for float formats.
        round_method: quantizer rounding (recorded, not used by observers).
        scale_type: `float` (model dtype), `float32`, `float16`, `bfloat16`,
            `pof2` (power-of-two scales), ...
        scale_format: `float32`, `e8m0` (power-of-two MX scale) or `e4m3`
            (two-level FP8 scales) for fp4 / fp6 / MX.
        scale_calculation_mode: e8m0 exponent rounding: `even` (default),
            `floor` or `ceil`.
        qat_spec: Quark's QAT settings (kept, unused).
        mx_element_dtype: element dtype when `dtype` is `mx`.
        zero_point_type: `int32` or `float32` (`-min / scale`, asymmetric).
        is_scale_quant: Quark's flag for specs of scales (kept, unused).
        enable_buffer_reuse: Quark's MX buffer-reuse flag (kept, unused).
        max_input_numel: Quark's buffer-reuse bound (kept, unused).

    Raises:
        ValueError: an unknown value or an invalid combination (see the
            module's table); the message names the field and the fix.
    """

    dtype: Dtype
    observer_cls: Any = None
    is_dynamic: bool | None = None
    qscheme: QSchemeType | None = None
    ch_axis: int | None = None
    group_size: int | None = None
    block_size: tuple[int, int] | None = None
    symmetric: bool | None = None
    round_method: RoundType | None = None
    scale_type: ScaleType | None = None
    scale_format: str | None = None
    scale_calculation_mode: str | None = None
    qat_spec: Any = None
    mx_element_dtype: Dtype | None = None
    zero_point_type: ZeroPointType | None = ZeroPointType.int32
    is_scale_quant: bool = False
    enable_buffer_reuse: bool = False
    max_input_numel: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        self.dtype = coerce_enum(Dtype, self.dtype, "dtype")
        self.qscheme = _optional(QSchemeType, self.qscheme, "qscheme")
        self.scale_type = _optional(ScaleType, self.scale_type, "scale_type")
        self.round_method = _optional(RoundType, self.round_method, "round_method")
        self.zero_point_type = _optional(
            ZeroPointType, self.zero_point_type, "zero_point_type"
        )
        self.mx_element_dtype = _optional(
            Dtype, self.mx_element_dtype, "mx_element_dtype"
        )
        if self.observer_cls is not None:
            self.observer_cls = observer_class(self.observer_cls)
        for field in ("scale_format", "scale_calculation_mode"):
            value = getattr(self, field)
            if isinstance(value, str):
                setattr(self, field, value.strip().lower())
        self._validate()

    # -- validation ---------------------------------------------------------

    def _validate(self) -> None:
        dtype = self.dtype
        if dtype not in SUPPORTED_DTYPES:
            valid = ", ".join(d.value for d in SUPPORTED_DTYPES)
            raise ValueError(
                f"dtype={dtype.value!r} is not supported by quantobs.faces.quark; use "
                f"one of {valid}"
            )
        self._validate_common()
        if dtype in CAST_DTYPES:
            if self.observer_cls is None or self.observer_cls.__name__ != (
                "PlaceholderObserver"
            ):
                raise ValueError(
                    f"dtype={dtype.value!r} is a plain cast: set "
                    f"observer_cls=PlaceholderObserver (got {self.observer_cls!r})"
                )
            return
        if dtype in (Dtype.mx, Dtype.bfp16):
            self._validate_block_dtype()
            return
        self._validate_scaled()

    def _validate_common(self) -> None:
        if self.ch_axis is not None:
            _check_int(self.ch_axis, "ch_axis", "pass the axis index, e.g. -1")
        if self.group_size is not None:
            _check_int(self.group_size, "group_size", "e.g. group_size=128")
            if not (self.group_size > 0 or self.group_size == -1):
                raise ValueError(
                    f"group_size={self.group_size} must be positive, or -1 for "
                    "the whole axis"
                )
        if self.scale_format is not None and self.scale_format not in SCALE_FORMATS:
            hint = (
                " (e5m3 scales are not supported)"
                if self.scale_format == ("e5m3")
                else ""
            )
            raise ValueError(
                f"scale_format={self.scale_format!r} is not supported{hint}; use "
                f"one of {', '.join(SCALE_FORMATS)}"
            )
        mode = self.scale_calculation_mode
        if mode is not None and mode not in SCALE_MODES:
            raise ValueError(
                f"scale_calculation_mode={mode!r} is not valid; use one of "
                f"{', '.join(SCALE_MODES)}"
            )
        if self.qscheme == QSchemeType.per_block:
            raise ValueError(
                "qscheme='per_block' (2-D blocks) has no observer in Quark 0.13 "
                "or here; use 'per_group' with group_size, or 'per_channel'"
            )

    def _validate_block_dtype(self) -> None:
        name = self.dtype.value
        for field in ("ch_axis", "group_size"):
            if getattr(self, field) is None:
                raise ValueError(f"dtype={name!r} needs {field} (e.g. ch_axis=-1)")
        if self.dtype == Dtype.mx:
            if self.mx_element_dtype not in MX_ELEMENT_DTYPES:
                valid = ", ".join(d.value for d in MX_ELEMENT_DTYPES)
                raise ValueError(
                    f"dtype='mx' needs mx_element_dtype in {valid}, got "
                    f"{self.mx_element_dtype!r}"
                )
            if self.scale_format not in (None, "e8m0"):
                raise ValueError(
                    f"dtype='mx' has e8m0 scales; scale_format="
                    f"{self.scale_format!r} must be None or 'e8m0'"
                )
            allowed = "PerBlockMXObserver"
        else:
            if self.group_size != BFP16_BLOCK:
                raise ValueError(
                    f"bfp16 blocks are {BFP16_BLOCK} elements; set group_size="
                    f"{BFP16_BLOCK} (got {self.group_size})"
                )
            allowed = "PerBlockBFPObserver"
        if self.observer_cls is not None and self.observer_cls.__name__ != allowed:
            raise ValueError(
                f"dtype={name!r} is observed by {allowed}, got observer_cls="
                f"{self.observer_cls.__name__}; use {allowed} or None"
            )

    def _validate_scaled(self) -> None:
        name = self.dtype.value
        if self.observer_cls is None:
            raise ValueError(
                f"dtype={name!r} needs observer_cls (e.g. PerTensorMinMaxObserver)"
            )
        if self.qscheme is None:
            raise ValueError(
                f"dtype={name!r} needs qscheme ('per_tensor', 'per_channel' or "
                "'per_group')"
            )
        required = ["is_dynamic"] if self.dtype not in SMALL_FLOAT_DTYPES else []
        if self.dtype in INT_DTYPES:
            required += ["symmetric", "round_method", "scale_type"]
        for field in required:
            if getattr(self, field) is None:
                raise ValueError(f"dtype={name!r} needs {field}; it is None")
        if self.dtype not in INT_DTYPES:
            if self.symmetric is False:
                raise ValueError(
                    f"dtype={name!r} is a float format without zero point; set "
                    "symmetric=None (or True)"
                )
            if self.zero_point_type == ZeroPointType.float32:
                raise ValueError(
                    f"zero_point_type='float32' needs an integer dtype, got {name!r}"
                )
        if self.dtype in SMALL_FLOAT_DTYPES and self.scale_format is None:
            raise ValueError(
                f"dtype={name!r} needs scale_format: 'e8m0' (OCP MX), 'float32' "
                "(float scales) or 'e4m3' (two-level FP8 scales)"
            )
        observer = self.observer_cls
        qschemes = getattr(observer, "qschemes", ())
        if self.qscheme not in qschemes:
            valid = ", ".join(q.value for q in qschemes) or "none"
            raise ValueError(
                f"{observer.__name__} does not support qscheme="
                f"{self.qscheme.value!r}; it supports {valid}"
            )
        if self.qscheme == QSchemeType.per_channel and self.ch_axis is None:
            raise ValueError("qscheme='per_channel' needs ch_axis (e.g. ch_axis=0)")
        if self.qscheme == QSchemeType.per_group:
            for field in ("ch_axis", "group_size"):
                if getattr(self, field) is None:
                    raise ValueError(
                        f"qscheme='per_group' needs {field} (e.g. ch_axis=-1, "
                        "group_size=128)"
                    )
        check = getattr(observer, "check_spec", None)
        if check is not None:
            check(self)

    # -- Quark's helpers ----------------------------------------------------

    def set_group_size(self, group_size: int) -> None:
        """Change `group_size` (positive, or -1 for the whole axis)."""
        _check_int(group_size, "group_size", "e.g. 128")
        if not (group_size > 0 or group_size == -1):
            raise ValueError(f"group_size={group_size} must be positive or -1")
        self.group_size = group_size

    def to_dict(self) -> dict[str, Any]:
        """Plain values by field name (enums by name, the observer by class name)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Enum):
                value = value.name
            elif field.name == "observer_cls" and value is not None:
                value = value.__name__
            out[field.name] = value
        return out

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QTensorConfig:
        """Inverse of `to_dict`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(
                f"unknown QTensorConfig fields {unknown}; valid: {sorted(names)}"
            )
        return cls(**config)


QuantizationSpec = QTensorConfig


def as_spec(qspec: Any) -> QTensorConfig:
    """Our `QTensorConfig` from ours or any object with its fields (Quark's).

    Raises:
        TypeError: `qspec` has no `dtype`.
        ValueError: the converted spec is invalid.
    """
    if isinstance(qspec, QTensorConfig):
        return qspec
    if not hasattr(qspec, "dtype"):
        raise TypeError(
            f"qspec must be a QTensorConfig (quantobs.faces.quark or Quark's), got "
            f"{type(qspec).__name__}"
        )
    names = [f.name for f in dataclasses.fields(QTensorConfig)]
    found = {name: getattr(qspec, name) for name in names if hasattr(qspec, name)}
    return QTensorConfig(**found)
