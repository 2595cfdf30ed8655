"""The canonical calibration layout: `(num_observations, *qparam_shape, group_size)`.

Every statistic of every observer is a reduction of this layout over dims
`(0, -1)`, so one reshape here replaces every per-strategy loop. The shapes are
llm-compressor's (`flatten_for_calibration`), with one extension: `token`
activations get the layout `(1, B, S, 1, H)`, whose qparam shape `(B, S, 1)`
broadcasts against the activation like the scales compressed-tensors computes
for dynamic token quantization (llm-compressor returns the value unflattened
there, since static token quantization does not exist).

The qparam shape always broadcasts against the original tensor (for group and
block strategies, against its grouped view), which is the scale shape that
`fake_quantize` expects.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantobs.core.args import QuantizationArgs

__all__ = [
    "BASE_NAMES",
    "block_view",
    "channel_view",
    "check_supported",
    "flatten_for_calibration",
    "group_view",
    "normalize_axis",
    "num_observations_of",
    "qparam_shape",
    "validate_g_idx",
]

BASE_NAMES = ("weight", "input", "output", "q", "k", "v")

# Which strategies each kind of tensor supports (llm-compressor's rules).
_SUPPORTED = {
    "weight": ("tensor", "channel", "group", "tensor_group", "block"),
    "activation": ("tensor", "token", "group", "tensor_group"),
    "attention": ("tensor", "attn_head"),
}


def _kind(base_name: str) -> str:
    if base_name == "weight":
        return "weight"
    if base_name in ("input", "output"):
        return "activation"
    if base_name in ("q", "k", "v"):
        return "attention"
    raise ValueError(
        f"unknown base_name {base_name!r}; use one of {', '.join(BASE_NAMES)}"
    )


def _check_strategy(base_name: str, kind: str, strategy: str) -> None:
    if strategy not in _SUPPORTED[kind]:
        raise ValueError(
            f"strategy {strategy!r} cannot be applied to {base_name!r} "
            f"({kind}); supported: {', '.join(_SUPPORTED[kind])}"
        )


def _check_ndim(value: torch.Tensor, base_name: str, expected: str, ok: bool) -> None:
    if not ok:
        raise ValueError(
            f"{base_name!r} must be {expected}, got shape {tuple(value.shape)}"
        )


def check_supported(base_name: str, args: QuantizationArgs) -> None:
    """Raise `ValueError` unless `args.strategy` applies to `base_name`."""
    _check_strategy(base_name, _kind(base_name), str(args.strategy))


def _groups(value: torch.Tensor, group_size: int | None, base_name: str) -> int:
    if group_size is None or group_size <= 0:
        raise ValueError(f"a positive group_size is required, got {group_size}")
    columns = value.shape[-1]
    if columns % group_size != 0:
        raise ValueError(
            f"group_size {group_size} does not divide the {columns} columns of "
            f"{base_name!r} (shape {tuple(value.shape)}); choose a group size "
            f"that divides {columns} or leave this module unquantized"
        )
    return columns // group_size


def _block_structure(args: QuantizationArgs) -> tuple[int, int]:
    if args.block_structure is None or len(args.block_structure) != 2:
        raise ValueError(
            f"block_structure must be [rows, cols], got {args.block_structure}"
        )
    rows, cols = args.block_structure
    return rows, cols


def validate_g_idx(g_idx: torch.Tensor, columns: int, group_size: int) -> None:
    """Check an activation-ordering index: one group id per column, full groups.

    Args:
        g_idx: `(columns,)` integer tensor, `g_idx[j]` = group of column `j`.
        columns: number of weight columns.
        group_size: columns per group.

    Raises:
        ValueError: wrong shape, dtype, range, or a group without exactly
            `group_size` columns.
    """
    num_groups = columns // group_size
    if g_idx.dtype.is_floating_point or g_idx.dtype == torch.bool:
        raise ValueError(f"g_idx must be an integer tensor, got {g_idx.dtype}")
    if g_idx.shape != (columns,):
        raise ValueError(
            f"g_idx must have shape ({columns},) (one group per column), got "
            f"{tuple(g_idx.shape)}"
        )
    counts = torch.bincount(g_idx.clamp(0, num_groups).long(), minlength=num_groups)
    if g_idx.min() < 0 or g_idx.max() >= num_groups or (counts != group_size).any():
        raise ValueError(
            f"g_idx must give each of the {num_groups} groups exactly "
            f"{group_size} columns (values 0..{num_groups - 1})"
        )


def _flatten_weight(
    value: torch.Tensor, args: QuantizationArgs, g_idx: torch.Tensor | None
) -> torch.Tensor:
    strategy = args.strategy
    if strategy == "tensor":
        return value.reshape(1, 1, -1)  # (1, 1, rows * cols)
    _check_ndim(value, "weight", "2-D (rows, cols)", value.ndim == 2)
    if strategy == "channel":
        return value.unsqueeze(-2).unsqueeze(0)  # (1, rows, 1, cols)
    if strategy in ("group", "tensor_group"):
        num_groups = _groups(value, args.group_size, "weight")
        group_size = value.shape[-1] // num_groups
        if g_idx is not None:
            validate_g_idx(g_idx, value.shape[-1], group_size)
            # Stable sort keeps the original column order inside each group.
            perm = torch.argsort(g_idx.to(value.device), stable=True)
            value = value.index_select(-1, perm)
        # (1, rows, num_groups, group_size)
        return value.unflatten(-1, (num_groups, group_size)).unsqueeze(0)
    # (1, num_block_rows, num_block_cols, block_rows * block_cols)
    return block_view(value, args).transpose(1, 2).flatten(-2, -1).unsqueeze(0)


def block_view(value: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """A 2-D weight as `(num_block_rows, block_rows, num_block_cols, block_cols)`.

    Zero-padded to whole blocks, as llm-compressor does; a view when no
    padding is needed. Reducing it over dims `(1, 3)` gives one value per
    block without the copy that the canonical block layout needs.
    """
    _check_ndim(value, "weight", "2-D (rows, cols)", value.ndim == 2)
    block_rows, block_cols = _block_structure(args)
    rows, cols = value.shape
    pad_rows, pad_cols = -rows % block_rows, -cols % block_cols
    if pad_rows or pad_cols:
        value = F.pad(value, (0, pad_cols, 0, pad_rows))
    num_block_rows = (rows + pad_rows) // block_rows
    return value.reshape(num_block_rows, block_rows, -1, block_cols)


def _flatten_activation(
    value: torch.Tensor, base_name: str, args: QuantizationArgs
) -> torch.Tensor:
    if args.strategy == "tensor":  # any activation of at least one dim
        _check_ndim(value, base_name, "at least 1-D (..., hidden)", value.ndim >= 1)
        # (batch * seq, 1, hidden); a 1-D (hidden,) activation: (1, 1, hidden)
        return value.reshape(-1, 1, value.shape[-1])
    _check_ndim(value, base_name, "at least 2-D (..., hidden)", value.ndim >= 2)
    hidden = value.shape[-1]
    if args.strategy == "token":
        # (1, *token_dims, 1, hidden), e.g. (1, batch, seq, 1, hidden)
        return value.unsqueeze(-2).unsqueeze(0)
    num_groups = _groups(value, args.group_size, base_name)
    # (batch * seq, num_groups, group_size)
    return value.reshape(-1, num_groups, hidden // num_groups)


def _flatten_attention(
    value: torch.Tensor, base_name: str, args: QuantizationArgs
) -> torch.Tensor:
    _check_ndim(value, base_name, "4-D (batch, heads, seq, head_dim)", value.ndim == 4)
    if args.strategy == "tensor":
        # (batch * seq, 1, heads * head_dim)
        return value.transpose(1, 2).flatten(0, 1).flatten(-2, -1).unsqueeze(-2)
    # attn_head: (batch * seq, heads, 1, 1, head_dim)
    return value.transpose(1, 2).flatten(0, 1).unsqueeze(-2).unsqueeze(-2)


def flatten_for_calibration(
    value: torch.Tensor,
    base_name: str,
    args: QuantizationArgs,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reshape a tensor to `(num_observations, *qparam_shape, group_size)`.

    A view where the strategy allows one (tensor, channel, group, token,
    activation groups); block layouts and `g_idx` orderings copy.

    Args:
        value: weight `(rows, cols)`, activation `(..., hidden)` or attention
            state `(batch, heads, seq, head_dim)`.
        base_name: `weight`, `input`, `output`, `q`, `k` or `v`.
        args: the quantization args; `args.strategy` picks the layout.
        g_idx: optional `(cols,)` group index per weight column (activation
            ordering); columns are permuted so each group is contiguous.

    Returns:
        The tensor in the canonical layout; reducing it over dims `(0, -1)`
        gives one statistic per quantization parameter.

    Raises:
        ValueError: unknown base name, a strategy the base name does not
            support, a group size that does not divide, a wrong number of
            dims, or `g_idx` with a non-group strategy or a non-weight.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"value must be a torch.Tensor, got {type(value).__name__}")
    kind = _kind(base_name)
    strategy = str(args.strategy)
    _check_strategy(base_name, kind, strategy)
    if g_idx is not None and not (
        kind == "weight" and strategy in ("group", "tensor_group")
    ):
        raise ValueError(
            f"g_idx applies to weights with strategy 'group' or 'tensor_group', "
            f"not {base_name!r} with {strategy!r}"
        )
    if kind == "weight":
        return _flatten_weight(value, args, g_idx)
    if kind == "activation":
        return _flatten_activation(value, base_name, args)
    return _flatten_attention(value, base_name, args)


def num_observations_of(
    shape: tuple[int, ...] | torch.Size, base_name: str, args: QuantizationArgs
) -> int:
    """`num_observations` (dim 0 of the layout) for a tensor shape."""
    meta = torch.empty(tuple(shape), device="meta")
    return int(flatten_for_calibration(meta, base_name, args).shape[0])


def qparam_shape(
    shape: tuple[int, ...] | torch.Size, base_name: str, args: QuantizationArgs
) -> tuple[int, ...]:
    """The shape of the scale / zero point for a tensor shape (no data touched).

    Args:
        shape: shape of the observed tensor.
        base_name: `weight`, `input`, `output`, `q`, `k` or `v`.
        args: the quantization args.

    Returns:
        `qparam_shape`, e.g. `(rows, cols // group_size)` for weight groups.

    Raises:
        ValueError: as `flatten_for_calibration`.
    """
    meta = torch.empty(tuple(shape), device="meta")
    return tuple(flatten_for_calibration(meta, base_name, args).shape[1:-1])


# ------------------------------------------------- views along an axis
#
# The faces of torch.ao and Quark name a channel axis instead of a base name.
# These views put any tensor in the canonical layout for such an axis; every
# statistic reduces dims (0, -1) of them as of any other.


def normalize_axis(axis: int, ndim: int, what: str = "ch_axis") -> int:
    """`axis` in `0 .. ndim - 1`.

    Raises:
        ValueError: `axis` is out of range for an `ndim`-dimensional input.
    """
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{what}={axis} is out of range for a {ndim}-D input; use an axis "
            f"in {-ndim}..{ndim - 1}"
        )
    return axis % ndim


def channel_view(x: torch.Tensor, axis: int) -> torch.Tensor:
    """`x` as `(N, C, G)` for the channels along `axis` (canonical layout).

    The dims before the axis become `N`, those after it `G` (1-D inputs:
    each element a channel). A contiguous tensor, or a permutation of one
    (a transposed weight), is viewed without a copy: the other dims are
    taken in memory order, which no statistic of the layout depends on.

    Raises:
        ValueError: a 0-dim `x`, or `axis` out of range.
    """
    if x.ndim == 0:
        raise ValueError(
            "a per-channel observer needs an input with at least one dim, got "
            "a 0-dim tensor"
        )
    axis = normalize_axis(axis, x.ndim)
    if not x.is_contiguous():
        strides = x.stride()
        order = sorted(range(x.ndim), key=lambda d: -strides[d])
        in_memory_order = x.permute(order)
        if in_memory_order.is_contiguous():
            x, axis = in_memory_order, order.index(axis)
    pre = math.prod(x.shape[:axis])
    post = math.prod(x.shape[axis + 1 :])
    return x.reshape(pre, x.shape[axis], post)  # (N, C, G)


def group_view(
    x: torch.Tensor, axis: int, group_size: int, *, pad: bool = False
) -> torch.Tensor:
    """`x` as `(1, rows, num_groups, group_size)`: groups along `axis`.

    Quark's layout: `axis` swapped with the last dim, every other dim
    flattened into rows (a view when `axis` is the last dim and the groups
    divide it).

    Args:
        x: any shape (a 0-dim tensor counts as 1-D).
        axis: the axis the groups run along.
        group_size: values per group, or -1 for the whole axis.
        pad: allow a trailing partial group, zero-padded (Quark's MX / BFP
            blocks); otherwise the group size must divide the axis.

    Raises:
        ValueError: `axis` out of range, or a group size that does not divide
            the axis (without `pad`).
    """
    if x.ndim == 0:
        x = x.reshape(1)
    axis = normalize_axis(axis, x.ndim)
    size = x.shape[axis]
    group = size if group_size == -1 else group_size
    remainder = size % group
    if remainder and not pad:
        raise ValueError(
            f"the axis {axis} of size {size} does not divide into groups of "
            f"{group}; use a group_size that divides {size}"
        )
    rows = x.transpose(axis, -1)
    if remainder:
        rows = F.pad(rows, (0, group - remainder))
    rows = rows.reshape(-1, rows.shape[-1])  # (rows, padded axis)
    return rows.reshape(1, rows.shape[0], -1, group)
