"""quantobs.core.formats against ml_dtypes, numpy and torch's native dtypes."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantobs.core.formats import FORMATS, NumberFormat, get_format, int_format

NAMES = list(FORMATS)
# Formats small enough to check every bit pattern (all but int16, uint16, int32).
SMALL = [n for n in NAMES if FORMATS[n].bits <= 8]
WIDE_INTS = {"int16": np.int16, "uint16": np.uint16, "int32": np.int32}
FLOATS = [n for n in NAMES if FORMATS[n].is_float]
INTS = [n for n in SMALL if not FORMATS[n].is_float]
NATIVE_FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"]
E8M0_MIN = 2.0**-127
# float32 subnormals that ml_dtypes and torch round up to 2**-126 (not nearest).
E8M0_QUIRK = (E8M0_MIN, 1.5 * E8M0_MIN)

# Reference scalar types: ml_dtypes where it has the format, numpy for 8-bit ints.
REFERENCE: dict[str, Any] = {
    n: getattr(ml_dtypes, n) for n in NAMES if hasattr(ml_dtypes, n)
} | {"int8": np.int8, "uint8": np.uint8}

# ml_dtypes on overflow (3e38, inf); the 6- and 4-bit floats saturate.
ML_OVERFLOW = {"float8_e4m3fn": np.nan, "float8_e5m2": np.inf, "float8_e8m0fnu": np.nan}

EMAX = {
    "float8_e4m3fn": 8,
    "float8_e5m2": 15,
    "float6_e2m3fn": 2,
    "float6_e3m2fn": 4,
    "float4_e2m1fn": 2,
    "float8_e8m0fnu": 127,
}


def reference_decode(name: str) -> np.ndarray:
    """Value of every code per ml_dtypes / numpy, or sign extension by shifts."""
    fmt = FORMATS[name]
    codes = np.arange(1 << fmt.bits, dtype=np.uint8)
    if name in REFERENCE:
        ref: np.ndarray = codes.view(REFERENCE[name]).astype(np.float64)
        return ref
    if not fmt.signed:
        return codes.astype(np.float64)
    shift = 8 - fmt.bits  # move the sign bit to bit 7, arithmetic shift back
    return ((codes << shift).view(np.int8) >> shift).astype(np.float64)


def ml_round(name: str, x: np.ndarray) -> np.ndarray:
    """ml_dtypes' cast (round to nearest even; NaN/inf/wrap beyond range)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(x, np.float32).astype(REFERENCE[name]).astype(np.float32)
    return np.asarray(out)


def probe_points(fmt: NumberFormat) -> np.ndarray:
    """Representable values, midpoints and their float32 neighbours (in range)."""
    v = fmt.values().numpy()
    mid = ((v[:-1] + v[1:]) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (v[:-1] + v[1:]) / 2)  # exact
    up = np.nextafter(mid, np.float32(np.inf))
    down = np.nextafter(mid, np.float32(-np.inf))
    rand = np.random.default_rng(0).uniform(v[0], v[-1], 4096).astype(np.float32)
    pts = np.concatenate([v.astype(np.float32), mid, up, down, rand])
    return pts[(pts >= fmt.min) & (pts <= fmt.max)]


def random_float32(n: int, seed: int) -> np.ndarray:
    """Random finite float32 bit patterns: every magnitude, sign and subnormal."""
    bits = np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint32)
    x = bits.view(np.float32)
    return x[np.isfinite(x)]


def test_table() -> None:
    ints = [f"{u}int{b}" for u in ("", "u") for b in range(2, 9)]
    assert list(FORMATS) == [*ints, *WIDE_INTS, *EMAX]
    assert all(FORMATS[n].name == n for n in NAMES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        FORMATS["int4"].max = 8.0  # type: ignore[misc]


@pytest.mark.parametrize("name", SMALL)
def test_decode_matches_reference(name: str) -> None:
    fmt = FORMATS[name]
    codes = torch.arange(1 << fmt.bits)
    got = fmt.decode(codes).numpy()
    want = reference_decode(name)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)
    number = ~np.isnan(want)  # the sign of NaN means nothing
    np.testing.assert_array_equal(np.signbit(got[number]), np.signbit(want[number]))
    got8 = fmt.decode(codes.to(torch.uint8)).numpy()
    np.testing.assert_array_equal(got8, got)


@pytest.mark.parametrize("name", ["int8", "uint8", *NATIVE_FLOAT8])
def test_decode_matches_torch_dtype(name: str) -> None:
    fmt = FORMATS[name]
    assert fmt.torch_dtype is not None
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(fmt.torch_dtype).double()
    torch.testing.assert_close(fmt.decode(codes), want, equal_nan=True, rtol=0, atol=0)


def test_torch_dtypes() -> None:
    native = {n: f.torch_dtype for n, f in FORMATS.items() if f.torch_dtype}
    assert native == {
        "int8": torch.int8,
        "uint8": torch.uint8,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "float8_e8m0fnu": torch.float8_e8m0fnu,
        "int16": torch.int16,
        "uint16": torch.uint16,
        "int32": torch.int32,
    }


@pytest.mark.parametrize("name", list(WIDE_INTS))
def test_wide_ints(name: str) -> None:
    fmt = FORMATS[name]
    info = np.iinfo(WIDE_INTS[name])
    assert (fmt.min, fmt.max) == (info.min, info.max)
    assert fmt.torch_dtype is not None and torch.iinfo(fmt.torch_dtype).max == info.max
    codes = torch.tensor([0, 1, 2 ** (fmt.bits - 1) - 1, 2 ** (fmt.bits - 1)])
    top = 2.0 ** (fmt.bits - 1)
    want = [0.0, 1.0, top - 1, -top if fmt.signed else top]
    assert fmt.decode(codes).tolist() == want
    x = torch.tensor([2.5, -3.5, 1e12, -1e12])
    top_f32 = fmt.max if fmt.bits <= 16 else 2.0**31 - 128  # largest float32 in range
    assert fmt.round(x).tolist() == [2.0, max(-4.0, fmt.min), top_f32, fmt.min]
    assert fmt.round(x.double()).tolist() == [2.0, max(-4.0, fmt.min), fmt.max, fmt.min]
    if fmt.bits <= 16:
        assert fmt.values().numel() == 2**fmt.bits
    else:
        with pytest.raises(ValueError, match="too many"):
            fmt.values()


@pytest.mark.parametrize("name", SMALL)
def test_values_and_bounds(name: str) -> None:
    fmt = FORMATS[name]
    v = fmt.values()
    dec = reference_decode(name)
    want = np.unique(dec[np.isfinite(dec)])
    assert v.dtype == torch.float64
    np.testing.assert_array_equal(v.numpy(), want)
    assert not np.signbit(v.numpy()).any() or fmt.signed  # zero is +0.0
    assert (fmt.min, fmt.max) == (v[0].item(), v[-1].item())
    assert fmt.min_subnormal == v[v > 0][0].item()
    assert fmt.emax == EMAX.get(name, int(np.floor(np.log2(fmt.max))))
    if fmt.is_float:
        fi = ml_dtypes.finfo(REFERENCE[name])
        assert (fmt.min, fmt.max) == (float(fi.min), float(fi.max))
        assert fmt.min_normal == float(fi.smallest_normal)
        assert fmt.min_subnormal == float(fi.smallest_subnormal)
        assert (fmt.exponent_bits, fmt.mantissa_bits) == (fi.nexp, fi.nmant)
        assert fmt.emax == fi.maxexp - 1
    else:
        assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.exponent_bias) == (0, 0, 0)
        assert (fmt.min_normal, fmt.min_subnormal) == (1.0, 1.0)
        lo = -(2 ** (fmt.bits - 1)) if fmt.signed else 0
        assert (fmt.min, fmt.max) == (lo, lo + 2**fmt.bits - 1)
        if name in REFERENCE:
            ii = ml_dtypes.iinfo(REFERENCE[name])
            assert (fmt.min, fmt.max) == (ii.min, ii.max)


@pytest.mark.parametrize("name", FLOATS)
def test_round_matches_ml_dtypes_in_range(name: str) -> None:
    fmt = FORMATS[name]
    x = np.concatenate([probe_points(fmt), random_float32(1 << 16, seed=1)])
    x = x[(x >= fmt.min) & (x <= fmt.max)]
    if name == "float8_e8m0fnu":
        x = x[(x <= E8M0_QUIRK[0]) | (x >= E8M0_QUIRK[1])]  # see test_e8m0_*
    got = fmt.round(torch.from_numpy(x)).numpy()
    want = ml_round(name, x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("name", INTS)
def test_round_ints_half_to_even(name: str) -> None:
    fmt = FORMATS[name]
    v = fmt.values().numpy().astype(np.float32)
    x = np.concatenate([v, v + 0.5, v - 0.5, v + 0.25, v - 0.75, v * 3, [1e30]])
    x = np.concatenate([x, -x]).astype(np.float32)
    got = fmt.round(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, np.clip(np.rint(x), fmt.min, fmt.max))
    if name in REFERENCE:  # ml_dtypes truncates toward zero and wraps, but:
        np.testing.assert_array_equal(ml_round(name, v), v)  # fixed points


# int32's bounds are no float32 values: test_wide_ints checks its saturation.
@pytest.mark.parametrize("name", [n for n in NAMES if n != "int32"])
def test_round_saturates_beyond_range(name: str) -> None:
    fmt = FORMATS[name]
    f32 = np.finfo(np.float32)
    hi, lo = np.float32(fmt.max), np.float32(fmt.min)
    over = [np.nextafter(hi, f32.max), fmt.max * 1.0625, fmt.max * 2, 3e38, np.inf]
    under = [np.nextafter(lo, f32.min), fmt.min - 1, -(fmt.max * 2), -3e38, -np.inf]
    if not fmt.signed:
        under += [0.0, -0.0, fmt.min / 2] if fmt.min > 0 else [-0.5]
    with np.errstate(over="ignore"):  # 2 * max of e8m0 overflows float32
        x, y = np.array(over, np.float32), np.array(under, np.float32)
    assert (fmt.round(torch.from_numpy(x)) == fmt.max).all()
    assert (fmt.round(torch.from_numpy(y)) == fmt.min).all()
    assert fmt.round(torch.tensor([float("nan")])).isnan().all()
    if fmt.is_float:  # what ml_dtypes does instead
        want = ML_OVERFLOW.get(name, fmt.max)
        np.testing.assert_array_equal(ml_round(name, x[-3:]), [want] * 3)


def test_e8m0_no_zero_and_ties_up() -> None:
    fmt = FORMATS["float8_e8m0fnu"]
    x = torch.tensor([0.0, -0.0, -1.0, float("-inf"), 2.0**-149, 2.0**-128])
    assert (fmt.round(x) == E8M0_MIN).all()
    ties = torch.tensor([1.5, 3.0, 6.0, 0.75, 1.5 * E8M0_MIN, 1.5 * 2.0**126])
    want = torch.tensor([2.0, 4.0, 8.0, 1.0, 2.0**-126, 2.0**127])
    assert torch.equal(fmt.round(ties), want)
    np.testing.assert_array_equal(ml_round(fmt.name, ties.numpy()), want.numpy())
    with np.errstate(invalid="ignore"):  # ml_dtypes: no zero -> NaN
        assert np.isnan(np.float32(0).astype(ml_dtypes.float8_e8m0fnu))


def test_e8m0_nearest_where_native_casts_round_up() -> None:
    fmt = FORMATS["float8_e8m0fnu"]
    x = torch.tensor([1.0 + 2.0**-22, 1.25, 1.5 - 2.0**-22]) * E8M0_MIN
    assert x.dtype == torch.float32 and (x > E8M0_MIN).all()
    assert (fmt.round(x) == E8M0_MIN).all()
    native = x.to(torch.float8_e8m0fnu).float()
    assert (native == 2 * E8M0_MIN).all()
    assert (ml_round(fmt.name, x.numpy()) == 2 * E8M0_MIN).all()
    bits = torch.arange(0x00400000, 0x00800000, 97, dtype=torch.int32)
    band = bits.view(torch.float32)  # every float32 in [2**-127, 2**-126)
    ref = torch.where(band < 1.5 * E8M0_MIN, E8M0_MIN, 2 * E8M0_MIN)
    assert torch.equal(fmt.round(band), ref)


FLOAT_WITH_MANTISSA = [n for n, f in FORMATS.items() if f.is_float and f.mantissa_bits]


@pytest.mark.parametrize("name", FLOAT_WITH_MANTISSA)
def test_float32_fast_path_equals_generic(name: str) -> None:
    fmt = FORMATS[name]
    x = np.concatenate([probe_points(fmt), random_float32(1 << 16, seed=2)])
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38]
    y = torch.from_numpy(np.concatenate([x, -x, special]).astype(np.float32))
    fast, generic = fmt.round(y), fmt._round_generic(y)
    torch.testing.assert_close(fast, generic, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(fast), torch.signbit(generic))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_keeps_low_precision_dtype(name: str, dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    x = (torch.randn(512, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    got = fmt.round(x)
    assert got.dtype == dtype
    assert torch.equal(got, fmt.round(x.float()).to(dtype))


@pytest.mark.parametrize("name", FLOATS)
def test_round_float64_is_nearest(name: str) -> None:
    fmt = FORMATS[name]
    v = fmt.values()
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.uniform(fmt.min, fmt.max, 4096))
    got = fmt.round(x)
    assert got.dtype == torch.float64
    assert torch.isin(got, v).all()
    i = torch.searchsorted(v, x).clamp(1, len(v) - 1)
    best = torch.minimum((x - v[i - 1]).abs(), (v[i] - x).abs())
    assert torch.equal((got - x).abs(), best)


def test_round_float64_has_no_double_rounding() -> None:
    # Just above the 1 / 1.125 midpoint: float32 would round to the tie first.
    x = torch.tensor([1.0625 + 2.0**-40], dtype=torch.float64)
    assert FORMATS["float8_e4m3fn"].round(x).item() == 1.125
    assert FORMATS["float8_e4m3fn"].round(x.float()).item() == 1.0


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=32))
def test_round_idempotent_and_monotone(name: str, xs: list[float]) -> None:
    fmt = FORMATS[name]
    x = torch.tensor(sorted(xs), dtype=torch.float32)
    r = fmt.round(x)
    assert torch.equal(fmt.round(r), r)
    assert (r[1:] >= r[:-1]).all()


def test_round_and_decode_reject_bad_dtypes() -> None:
    fmt = FORMATS["int4"]
    with pytest.raises(TypeError, match="floating-point"):
        fmt.round(torch.arange(3))
    with pytest.raises(TypeError, match="integer"):
        fmt.decode(torch.zeros(2))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        fmt.decode(torch.tensor([16]))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        fmt.decode(torch.tensor([-1]))


def test_get_format() -> None:
    assert get_format("float4_e2m1fn") is FORMATS["float4_e2m1fn"]
    assert get_format("int16") is FORMATS["int16"]
    with pytest.raises(KeyError, match=r"unknown format 'int64'.*float8_e4m3fn"):
        get_format("int64")
    with pytest.raises(TypeError, match="str"):
        get_format(torch.int8)  # type: ignore[arg-type]


def test_int_format() -> None:
    assert int_format(4) is FORMATS["int4"]
    assert int_format(8, signed=False) is FORMATS["uint8"]
    for bad in (1, 9):
        with pytest.raises(ValueError, match=r"2\.\.8"):
            int_format(bad)
