"""torch.ao's observers that compute nothing: fixed qparams, placeholders,
recording, no-op and input reuse; and the observer state-dict helpers.

They are engine observers that keep no statistic (`Statistic` is None):
`.to()`, `state_dict`, `copy.deepcopy` and `torch.save` cover what they
hold (the fixed qparams' buffers, the recorded tensors)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from quantobs.faces.torch_ao.base import FLOAT32_EPS, ObserverBase, reject_dynamic

__all__ = [
    "FixedQParamsObserver",
    "NoopObserver",
    "PlaceholderObserver",
    "RecordingObserver",
    "ReuseInputObserver",
    "get_observer_state_dict",
    "load_observer_state_dict",
]


def _no_qparams(owner: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"calculate_qparams() is not defined for {owner}: {why}. Use a "
        "MinMaxObserver / HistogramObserver where qparams are needed."
    )


class FixedQParamsObserver(ObserverBase):
    """Observer with qparams fixed at construction (for sigmoid, tanh, ...).

    Args:
        scale: the scale, kept as the float32 `(1,)` buffer `scale`.
        zero_point: the zero point, kept as the int32 `(1,)` buffer
            `zero_point`.
        dtype: quantized dtype.
        qscheme: recorded for the quantized module (per tensor only).
        quant_min: lower end of the quantized range.
        quant_max: upper end.
        is_dynamic: must be False.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(
        self,
        scale: float,
        zero_point: int,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        quant_min: int = 0,
        quant_max: int = 255,
        is_dynamic: bool = False,
    ) -> None:
        reject_dynamic(type(self).__name__, is_dynamic, "its qparams are fixed")
        super().__init__(dtype=dtype, is_dynamic=is_dynamic)
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.register_buffer("scale", torch.tensor([scale], dtype=torch.float))
        self.register_buffer("zero_point", torch.tensor([zero_point], dtype=torch.int))
        self.qscheme = qscheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x` unchanged."""
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """The fixed `(scale, zero_point)` buffers themselves."""
        return self.scale, self.zero_point


class PlaceholderObserver(ObserverBase):
    """Observer that records nothing and carries its configuration (dtype,
    range, dynamic flag) to the quantized module, e.g. for float16.

    Args:
        dtype: dtype of the quantized op's input (`torch.float16`, ...).
        custom_op_name: name of an op that needs no observation (graph mode).
        compute_dtype: deprecated; if set, the observer is dynamic (as if
            `is_dynamic=True`).
        quant_min: lower end of the quantized range (recorded only).
        quant_max: upper end (recorded only).
        qscheme: recorded; defaults to `torch.per_tensor_affine`.
        eps: recorded; defaults to float32's eps.
        is_dynamic: whether the quantize op computes its qparams at run time.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        custom_op_name: str = "",
        compute_dtype: torch.dtype | None = None,
        quant_min: int | None = None,
        quant_max: int | None = None,
        qscheme: torch.qscheme | None = None,
        eps: float | None = None,
        is_dynamic: bool = False,
    ) -> None:
        if compute_dtype:
            # torch warns and then drops the flag (its local variable is set
            # after the base class stored is_dynamic); we honour it.
            warnings.warn(
                "PlaceholderObserver(compute_dtype=...) is deprecated; pass "
                "is_dynamic=True instead",
                DeprecationWarning,
                stacklevel=2,
            )
            is_dynamic = True
        super().__init__(dtype=dtype, is_dynamic=is_dynamic)
        self.qscheme = torch.per_tensor_affine if qscheme is None else qscheme
        self.quant_min = quant_min
        self.quant_max = quant_max
        self.eps = FLOAT32_EPS if eps is None else eps
        self.custom_op = custom_op_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x` unchanged."""
        return x

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, is_dynamic={self.is_dynamic}"

    def calculate_qparams(self) -> Any:  # type: ignore[override]
        """Always raises: a placeholder has no statistics."""
        raise _no_qparams(type(self).__name__, "it only carries a configuration")


class RecordingObserver(ObserverBase):
    """Debug observer that keeps a copy of every tensor it sees.

    Args:
        dtype: quantized dtype (recorded only).
    """

    def __init__(self, dtype: torch.dtype = torch.quint8) -> None:
        super().__init__(dtype=dtype, is_dynamic=False)
        self.tensor_val: list[torch.Tensor | None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Append a copy of `x` to `tensor_val`; return `x` unchanged."""
        self.tensor_val.append(x.clone())
        return x

    def calculate_qparams(self) -> Any:  # type: ignore[override]
        """Always raises: a recording observer only records."""
        raise _no_qparams(type(self).__name__, "it only records tensors")

    def get_tensor_value(self) -> list[torch.Tensor | None]:
        """The recorded tensors, oldest first."""
        return self.tensor_val


class NoopObserver(ObserverBase):
    """Observer that does nothing and carries its dtype (float16 by default).

    Args:
        dtype: dtype of the quantized op's input.
        custom_op_name: name of an op that needs no observation (graph mode).
    """

    def __init__(
        self, dtype: torch.dtype = torch.float16, custom_op_name: str = ""
    ) -> None:
        super().__init__(dtype=dtype, is_dynamic=False)
        self.custom_op = custom_op_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x` unchanged."""
        return x

    def calculate_qparams(self) -> Any:  # type: ignore[override]
        """Always raises: a no-op observer has no statistics."""
        raise _no_qparams(type(self).__name__, "it does nothing")


class ReuseInputObserver(ObserverBase):
    """Marks an op (reshape, ...) whose output reuses its input's observer
    (FX graph mode); records nothing itself."""

    def __init__(self) -> None:
        super().__init__(torch.quint8, is_dynamic=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x` unchanged."""
        return x

    def calculate_qparams(self) -> Any:  # type: ignore[override]
        """Always raises: the input's observer holds the qparams."""
        raise _no_qparams(type(self).__name__, "the input's observer is reused")


def _is_observer(module: torch.nn.Module) -> bool:
    if isinstance(module, ObserverBase):
        return True
    try:  # torch's own observers and fake-quantize modules, when importable
        from torch.ao.quantization import FakeQuantizeBase
        from torch.ao.quantization import ObserverBase as TorchObserverBase
    except ImportError:  # pragma: no cover - torch without torch.ao
        return False
    return isinstance(module, (TorchObserverBase, FakeQuantizeBase))


def get_observer_state_dict(mod: torch.nn.Module) -> OrderedDict[str, Any]:
    """The entries of `mod.state_dict()` that belong to observers (keys that
    contain `activation_post_process`), with the state-dict metadata."""
    full = mod.state_dict()
    observed: OrderedDict[str, Any] = OrderedDict(
        (key, value) for key, value in full.items() if "activation_post_process" in key
    )
    observed._metadata = getattr(full, "_metadata", None)  # type: ignore[attr-defined]
    return observed


def load_observer_state_dict(mod: torch.nn.Module, obs_dict: dict[str, Any]) -> None:
    """Load observer statistics saved by `get_observer_state_dict` into `mod`.

    Works for quantobs' and torch's observers alike; per-channel buffers take
    the saved channel count.

    Raises:
        KeyError: an observer of `mod` has no entry in `obs_dict`, or
            `obs_dict` has an observer entry `mod` has no place for.
        RuntimeError: an entry does not fit its buffer (e.g. other `bins`).
    """
    missing: list[str] = []
    errors: list[str] = []
    metadata = getattr(obs_dict, "_metadata", None) or {}
    observers = [(n, m) for n, m in mod.named_modules() if _is_observer(m)]
    for name, module in observers:
        module._load_from_state_dict(
            dict(obs_dict),  # the hooks may rename / add entries
            name + ".",
            metadata.get(name, {}),
            True,
            missing,
            [],  # unexpected keys: found below across all observers
            errors,
        )
    if errors:
        raise RuntimeError("cannot load the observer state dict: " + "; ".join(errors))
    claimed = {f"{n}.{key}" for n, m in observers for key in m.state_dict()}
    saved = {key for key in obs_dict if "activation_post_process" in key}
    unexpected = sorted(saved - claimed)
    missing = [key for key in missing if "activation_post_process" in key]
    if missing or unexpected:
        raise KeyError(
            f"observer state dict mismatch: missing {missing}, unexpected "
            f"{unexpected}; save it with get_observer_state_dict() from a model "
            "prepared with the same qconfig"
        )
