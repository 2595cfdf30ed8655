"""Quantize, dequantize and fake-quantize with given qparams.

Same signatures and numbers as compressed-tensors' functions of the same names:
`q = round(clamp(x / (scale / global_scale) + zero_point, qmin, qmax))` with the
format's own rounding (half to even for ints, a cast for FP8, the nearest
e2m1 value for FP4), and `x' = (q - zero_point) * (scale / global_scale)`.

Scales may be given as floats or in their storage dtype (FP8, or e8m0 / uint8
exponents for MX, see `scale_to_storage`). Every strategy is one broadcast:
the scale has the qparam shape of `quantobs.qparam_shape`, which broadcasts
against the tensor or, for group and block strategies, its grouped view.

Unlike compressed-tensors, `fake_quantize` always returns `x.dtype`
(compressed-tensors returns the scale's dtype for tensor, channel, token and
attention-head strategies), and float64 values are rounded to FP6 (e2m3)
once: compressed-tensors 0.20 rounds them to float32 first, so a value a
hair past a midpoint can land on the other side (`1.0625 + 1e-12` becomes
1.0 there, 1.125 here; float32, bfloat16 and float16 agree bit for bit).

Saturation. `fake_quantize` and `dequantize` clamp their results to the
finite range of the dtype they return, so finite inputs under finite scales
give finite outputs::

    finite input, finite scale               compressed-tensors  here
    level * scale past the dtype's max       +-inf               +-max of the
      (int8 symmetric: -128 * amax / 127.5                       dtype
      with amax near float32's max; MX
      levels near the e8m0 top scale)
    a value near -max whose level lands a    -inf                -max
      rounding error beyond it (int8
      asymmetric over [-max, max])
    a float32 result cast back to fp16 /     +-inf               +-max of fp16
      bf16 past that dtype's max                                 / bf16

Only values that would otherwise be infinite change; NaN stays NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from quantobs.core.args import QuantizationArgs
from quantobs.core.formats import NumberFormat
from quantobs.core.layout import validate_g_idx
from quantobs.core.qparams import check_global_scale, storage_to_scale

__all__ = ["dequantize", "fake_quant_values", "fake_quantize", "quantize"]

_Restore = Callable[[torch.Tensor], torch.Tensor]


def _grouped_view(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    g_idx: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, _Restore]:
    """View `x` so that `scale` broadcasts against it; and the way back."""
    strategy = args.strategy
    if g_idx is not None and strategy not in ("group", "tensor_group"):
        raise ValueError(
            f"g_idx applies to strategy 'group' or 'tensor_group', not {strategy!r}"
        )
    if strategy in ("group", "tensor_group"):
        group_size = int(args.group_size or 0)
        columns = x.shape[-1]
        if x.ndim == 0 or columns % group_size:
            raise ValueError(
                f"group_size {group_size} does not divide the last dim of x "
                f"(shape {tuple(x.shape)})"
            )
        if g_idx is not None:
            # Column j uses group g_idx[j]: gather the scale per column.
            validate_g_idx(g_idx, columns, group_size)
            g_idx = g_idx.to(scale.device)
            zp = None if zero_point is None else zero_point.index_select(-1, g_idx)
            return x, scale.index_select(-1, g_idx), zp, lambda out: out
        zp = None if zero_point is None else zero_point.unsqueeze(-1)
        # x: (..., num_groups, group_size); scale: (..., num_groups, 1)
        x_view = x.unflatten(-1, (columns // group_size, group_size))
        return x_view, scale.unsqueeze(-1), zp, lambda out: out.flatten(-2)
    if strategy == "block":
        if x.ndim != 2:
            raise ValueError(
                f"block quantization needs a 2-D tensor, got shape {tuple(x.shape)}"
            )
        block_rows, block_cols = args.block_structure or (1, 1)
        rows, cols = x.shape
        padded = F.pad(x, (0, -cols % block_cols, 0, -rows % block_rows))
        shape = (padded.shape[0] // block_rows, block_rows, -1, block_cols)

        def unblock(out: torch.Tensor) -> torch.Tensor:
            return out.reshape(padded.shape)[:rows, :cols]

        # x: (block_rows_n, block_rows, block_cols_n, block_cols);
        # scale: (block_rows_n, 1, block_cols_n, 1)
        zp = None if zero_point is None else zero_point[:, None, :, None]
        return padded.reshape(shape), scale[:, None, :, None], zp, unblock
    return x, scale, zero_point, lambda out: out


def _prepare(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    g_idx: torch.Tensor | None,
    global_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, _Restore]:
    """Validate inputs; return x view, effective scale, zero point, restore."""
    for name, given_value in (("x", x), ("scale", scale)):
        if not isinstance(given_value, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(given_value).__name__}"
            )
    if not isinstance(args, QuantizationArgs):
        raise TypeError(
            "args must be a quantobs.QuantizationArgs (convert compressed-tensors "
            "args with QuantizationArgs.from_compressed_tensors)"
        )
    scale = storage_to_scale(scale, args)
    if not scale.dtype.is_floating_point:
        raise TypeError(f"scale must be a floating tensor, got {scale.dtype}")
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(
            "scale must be finite and positive everywhere (compute it with "
            "calculate_qparams)"
        )
    if global_scale is not None:
        scale = scale / check_global_scale(global_scale)
    given = {"scale": scale.shape, "zero_point": getattr(zero_point, "shape", None)}
    x_view, scale, zero_point, restore = _grouped_view(
        x, scale, zero_point, args, g_idx
    )
    for name, maybe in (("scale", scale), ("zero_point", zero_point)):
        if maybe is None:
            continue
        try:
            fits = torch.broadcast_shapes(x_view.shape, maybe.shape) == x_view.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"{name} of shape {tuple(given[name] or ())} does not broadcast "
                f"against x of shape {tuple(x.shape)} for strategy "
                f"{args.strategy!r}; use quantobs.qparam_shape(x.shape, base_name, "
                "args)"
            )
    return x_view, scale, zero_point, restore


def _to_codes(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
) -> torch.Tensor:
    fmt = args.format
    scaled = x / scale
    if zero_point is not None:
        scaled = scaled + zero_point.to(x.dtype)
    return fmt.round(scaled.clamp(fmt.min, fmt.max))


def _from_codes(
    x_q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
) -> torch.Tensor:
    values = x_q.to(scale.dtype)
    if zero_point is not None:
        values = values - zero_point.to(scale.dtype)
    return values * scale


def _saturate(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` (a fresh tensor) clamped in place to the finite range of
    `dtype`, the dtype they are returned in (module docstring); +-inf from a
    level times the scale, or from the cast, becomes +-max. NaN stays."""
    info = torch.finfo(dtype)
    return values.clamp_(info.min, info.max)


def fake_quant_values(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    fmt: NumberFormat,
) -> torch.Tensor:
    """`(round(clamp(x / scale + zp)) - zp) * scale`: the one fake-quant
    arithmetic (fake_quantize's, and every search's error), on one fresh
    temporary of the broadcast shape of `x` and `scale`.

    Args:
        x: values; scale, zero_point: broadcast against `x` (zero_point None
            for 0).
        fmt: the format (its bounds and rounding).
    """
    values = x / scale
    zp = None if zero_point is None else zero_point.to(values.dtype)
    if zp is not None:
        values.add_(zp)
    values.clamp_(fmt.min, fmt.max)
    values = values.round_() if not fmt.is_float else fmt.round(values)
    if zp is not None:
        values.sub_(zp)
    return values.mul_(scale)


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    dtype: torch.dtype | None = None,
    g_idx: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize `x` to the codes of `args.format` (as floats unless `dtype`).

    Args:
        x: the tensor, e.g. a `(rows, cols)` weight.
        scale: `qparam_shape` scales (float, or their storage dtype).
        zero_point: `qparam_shape` zero points, or None for 0.
        args: the quantization args.
        dtype: optional dtype of the result (e.g. `torch.int8`).
        g_idx: optional `(cols,)` group of each column (group strategies).
        global_scale: optional `(1,)` global scale; the scale is divided by it.

    Returns:
        Codes in `[qmin, qmax]`, shaped like `x`.
    """
    x_view, scale, zero_point, restore = _prepare(
        x, scale, zero_point, args, g_idx, global_scale
    )
    codes = restore(_to_codes(x_view, scale, zero_point, args))
    return codes if dtype is None else codes.to(dtype)


@torch.no_grad()
def dequantize(
    x_q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    args: QuantizationArgs | None = None,
    dtype: torch.dtype | None = None,
    g_idx: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map codes back to values: `(x_q - zero_point) * scale / global_scale`.

    Args:
        x_q: codes, as returned by `quantize`.
        scale, zero_point, g_idx, global_scale: as for `quantize`.
        args: the quantization args (required: they give the strategy).
        dtype: dtype of the result; defaults to the scale's float dtype.

    Returns:
        The dequantized tensor, shaped like `x_q`, saturated to the finite
        range of its dtype (module docstring).
    """
    if args is None:
        raise ValueError("dequantize needs args (the strategy is not inferred)")
    x_view, scale, zero_point, restore = _prepare(
        x_q, scale, zero_point, args, g_idx, global_scale
    )
    values = _from_codes(x_view, scale, zero_point)
    out_dtype = values.dtype if dtype is None else dtype
    if out_dtype.is_floating_point:
        values = _saturate(values, out_dtype)
    values = restore(values)
    return values if dtype is None else values.to(dtype)


@torch.no_grad()
def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    g_idx: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize then dequantize in one pass (the calibration error model).

    Args: as for `quantize`.

    Returns:
        `dequantize(quantize(x))`, in `x.dtype`, shaped like `x`, saturated
        to the finite range of `x.dtype` (module docstring).
    """
    x_view, scale, zero_point, restore = _prepare(
        x, scale, zero_point, args, g_idx, global_scale
    )
    values = fake_quant_values(x_view, scale, zero_point, args.format)
    return restore(_saturate(values, x.dtype)).to(x.dtype)
