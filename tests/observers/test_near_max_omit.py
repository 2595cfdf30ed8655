"""Finite values at and near a dtype's maximum under `nan_policy="omit"`
(issue 25): they are data, never "non-finite", whatever the observer, base
name, strategy, format and dtype.

A fuzz over every registered observer name x the base names (weight,
input, output, q, k, v) x the args of every preset scheme that applies to
them (int 2 to 8 bits per tensor / channel / group, FP8 per tensor /
channel / block / token / group, MXFP4 / MXFP6 / MXFP8, NVFP4) plus per-head
and asymmetric ones x float32 / float16 / bfloat16, fed values of +-max,
within 2**-6 of it, all +max, +-max among ordinary values, or +-max beside
groups of zeros and of subnormal / tiny normal maxima (`tests/tiny_groups.py`:
MX scales of float16 values that compressed-tensors' rule makes 1.0), with or
without NaN and +-inf among them. Each observation ends with finite
positive scales (and global scales), zero points in range, and no
exception: a combination the observer refuses is refused when it is built
(`ValueError` / `TypeError`), before any data.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from quantobs import (
    PRESET_SCHEMES,
    Observer,
    QuantizationArgs,
    calculate_range,
    preset_scheme,
)
from quantobs.core.layout import check_supported
from tests.tiny_groups import tiny_groups

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["at_max", "near_max", "all_max", "mixed", "tiny_groups"]
BASE_NAMES = ["weight", "input", "output", "q", "k", "v"]
# A tensor of each base name: 128 columns for the presets' groups of 128.
SHAPES = {
    "weight": (2, 128),
    "input": (1, 2, 128),
    "output": (1, 2, 128),
    "q": (1, 2, 2, 32),
    "k": (1, 2, 2, 32),
    "v": (1, 2, 2, 32),
}


def _preset_args() -> dict[str, QuantizationArgs]:
    """Every distinct weight / input args of the preset schemes, and a few
    the presets lack (asymmetric per tensor, per attention head)."""
    found: dict[str, QuantizationArgs] = {}
    seen: set[str] = set()
    for name in PRESET_SCHEMES:
        scheme = preset_scheme(name)
        for part in ("weights", "input_activations"):
            args = getattr(scheme, part)
            if args is None:
                continue
            key = args.model_dump_json(exclude={"observer", "observer_kwargs"})
            if key not in seen:
                seen.add(key)
                found[f"{name}-{part}"] = args
    found.update(
        {
            "int8-asym-tensor": QuantizationArgs(num_bits=8, symmetric=False),
            "int4-asym-group": QuantizationArgs(
                num_bits=4, symmetric=False, strategy="group", group_size=16
            ),
            "int8-attn_head": QuantizationArgs(num_bits=8, strategy="attn_head"),
            "fp8-attn_head": QuantizationArgs(
                num_bits=8, type="float", strategy="attn_head"
            ),
            "fp8-tensor": QuantizationArgs(num_bits=8, type="float"),
        }
    )
    return found


ARGS = _preset_args()


def _applies(base_name: str, args: QuantizationArgs) -> bool:
    try:
        check_supported(base_name, args)
    except ValueError:
        return False
    return True


#: (base name, args name) of every strategy the base name supports
COMBOS = [(b, a) for b in BASE_NAMES for a in sorted(ARGS) if _applies(b, ARGS[a])]


def batch(kind: str, dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> Any:
    """A finite tensor of `dtype` at or near its max (`KINDS`)."""
    top = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    sign = torch.where(base >= 0, 1.0, -1.0).to(torch.float64)
    if kind == "at_max":
        x = sign * top
    elif kind == "near_max":  # within 2**-6 of the max, both signs
        x = sign * top * (1 - torch.rand(shape, generator=gen).double() * 2.0**-6)
    elif kind == "all_max":
        x = torch.full(shape, top, dtype=torch.float64)
    elif kind == "tiny_groups":  # +-max beside groups of zero / tiny maxima
        x = tiny_groups(base.numel() // 32, 32, dtype, seed).double().reshape(shape)
        x.view(-1, 32)[1::2, 0] = sign.view(-1, 32)[1::2, 0] * top
    else:  # +-max among ordinary values
        x = base.clone()
        x.view(-1)[0::7], x.view(-1)[1::7] = top, -top
    x = x.clamp(-top, top).to(dtype)
    assert bool(torch.isfinite(x).all())
    return x


def with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """`x` with a NaN, +inf and -inf among its values (omitted)."""
    dirty = x.clone()
    dirty.view(-1)[1:4] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return dirty


def check_qparams(observer: Observer, args: QuantizationArgs) -> None:
    """Finite positive (global) scales, zero points inside the range."""
    scale, zero_point = observer.get_qparams()
    assert bool(torch.isfinite(scale).all() and (scale > 0).all()), scale
    qmin, qmax = calculate_range(args)
    zp = zero_point.double()
    assert bool(((zp >= qmin) & (zp <= qmax)).all()), zero_point
    if args.strategy == "tensor_group":
        global_scale = observer.get_global_scale()
        assert bool(torch.isfinite(global_scale).all() and (global_scale > 0).all())


@pytest.mark.filterwarnings("ignore::UserWarning")  # fallbacks, e.g. imatrix
@pytest.mark.parametrize("name", Observer.registry.names())
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)
@given(
    combo=st.sampled_from(COMBOS),
    dtype=st.sampled_from(DTYPES),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=2),
    nonfinite=st.booleans(),
)
# MX on float16 groups of zeros / subnormal maxima beside +-max (issue 25)
@example(
    combo=("weight", "MXFP8-weights"), dtype=torch.float16,
    kinds=["tiny_groups"], nonfinite=True,
)  # fmt: skip
@example(
    combo=("input", "MXFP4-weights"), dtype=torch.float16,
    kinds=["tiny_groups"], nonfinite=False,
)  # fmt: skip
def test_values_near_the_max_are_observed_under_omit(
    name: str,
    combo: tuple[str, str],
    dtype: torch.dtype,
    kinds: list[str],
    nonfinite: bool,
) -> None:
    base_name, args_name = combo
    args = ARGS[args_name]
    try:
        observer = Observer.load_from_registry(
            name, base_name=base_name, args=args, nan_policy="omit"
        )
    except (ValueError, TypeError):
        assume(False)  # a combination this observer refuses, before any data
        return
    for i, kind in enumerate(kinds):
        x = batch(kind, dtype, SHAPES[base_name], i)
        observer.update(with_nonfinite(x) if nonfinite else x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        check_qparams(observer, args)
