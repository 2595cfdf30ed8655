"""Division that rounds alike on every device (issue 24).

PyTorch's CUDA true division by a CPU scalar - a Python number or a 0-d
CPU tensor - multiplies by the scalar's reciprocal (`div_true_kernel_cuda`):
`x * (1 / b)` rounds twice and is one unit in the last place off for about
a fifth of the float32 quotients by 7.5, 127.5 or 448, where the CPU
divides. A scale `amax / 127.5` would then differ between CPU and GPU.

`divide` gives the divisor as a tensor of `x`'s device and rank, which
every device divides with one IEEE rounding::

    divide(amax, 127.5)  # == amax / 127.5 on the CPU, on CUDA too
    amax / 127.5  # on CUDA: amax * (1 / 127.5), not the same

Only the divisor matters: multiplication, addition, `x / tensor` with a
tensor divisor of at least one dimension, and `number / x` (a reciprocal
times the number on every device) already round alike.
"""

from __future__ import annotations

import math

import torch

__all__ = ["divide", "rounded_to"]


def rounded_to(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to the nearest `dtype` number (ties to even), on the
    host: `float(torch.tensor(value, dtype=dtype))` without a tensor (whose
    read would count as a synchronisation). Normal values of `dtype` only
    (the quantization constants: level counts, half ranges)."""
    if dtype == torch.float64 or value == 0 or not math.isfinite(value):
        return value
    bits = 1 - round(math.log2(torch.finfo(dtype).eps))  # significand bits
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent
    rounded = math.ldexp(round(math.ldexp(mantissa, bits)), exponent - bits)
    return (
        rounded
        if abs(rounded) <= torch.finfo(dtype).max
        else math.copysign(math.inf, rounded)
    )


def divide(x: torch.Tensor, divisor: float | torch.Tensor) -> torch.Tensor:
    """`x / divisor`, correctly rounded on every device.

    Args:
        x: the dividend (any shape, any device).
        divisor: a Python number, or a tensor broadcastable to `x`.

    Returns:
        The quotient, of the shape and dtype `x / divisor` has.
    """
    if isinstance(divisor, torch.Tensor) and divisor.dim() > 0:
        return torch.div(x, divisor)
    dtype = torch.result_type(x, divisor)
    if not dtype.is_floating_point:  # true division of integers
        dtype = torch.get_default_dtype()
    # float32 math for narrower floats (as their kernels do), then one cast
    math = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    shape = [1] * max(x.dim(), 1)
    if isinstance(divisor, torch.Tensor):
        by = divisor.to(device=x.device, dtype=math).reshape(shape)
    else:
        by = torch.full(shape, divisor, dtype=math, device=x.device)
    quotient = torch.div(x.to(math), by).to(dtype)
    return quotient if x.dim() else quotient.reshape(())
