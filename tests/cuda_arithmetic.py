"""CUDA's arithmetic where it differs from the CPU's, on the CPU (issue 24).

PyTorch's CUDA `div` (true division) by a CPU scalar - a Python number, or
a 0-d CPU tensor - multiplies by the scalar's reciprocal instead
(`div_true_kernel_cuda`: `a * (1 / b)` in the op's math type), which is
off by one unit in the last place for about a fifth of the quotients of
float32 values by 7.5, 127.5 or 448. A qparams rule that divides a range
by `(qmax - qmin) / 2` then gives other float32 scales on a GPU.

`CudaArithmetic` is a dispatch mode doing that on any device, so the
torch path a CUDA tensor takes is checked against the plain one on a CPU
(`tests/observers/test_device_identity.py`). It errs on the safe side: a
0-d tensor divisor counts as a CPU scalar even where on CUDA it would be
a device tensor (then CUDA divides exactly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CudaArithmetic"]

_aten = torch.ops.aten
_DIV = {_aten.div.Tensor, _aten.div_.Tensor, _aten.div.Scalar, _aten.div_.Scalar}


def _cpu_scalar(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    return isinstance(value, torch.Tensor) and value.dim() == 0


class CudaArithmetic(TorchDispatchMode):
    """Division by a scalar as CUDA computes it: `a * (1 / b)`."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DIV and not kwargs.get("rounding_mode") and len(args) == 2:
            a, b = args
            if isinstance(a, torch.Tensor) and a.dim() > 0 and _cpu_scalar(b):
                return self._reciprocal_mul(func, a, b)
        return func(*args, **kwargs)

    @staticmethod
    def _reciprocal_mul(func: Any, a: torch.Tensor, b: Any) -> torch.Tensor:
        out_dtype = torch.result_type(a, b)
        if not out_dtype.is_floating_point:
            out_dtype = torch.get_default_dtype()
        # the op's math type: float for float32 and narrower, else itself
        math = torch.float64 if out_dtype == torch.float64 else torch.float32
        value = b.item() if isinstance(b, torch.Tensor) else b
        inverse = torch.tensor(value, dtype=math).reciprocal()
        result = (a.to(math) * inverse).to(out_dtype)
        if func in (_aten.div_.Tensor, _aten.div_.Scalar):
            return a.copy_(result)
        return result
