"""Quark face: parity with the real amd-quark 0.13 observers on the same inputs.

Every expected number comes from running Quark's own observer (or kernel) on
the same batches: scale and zero point must be equal in value, dtype and
shape. Where Quark has a bug the face does not copy, the test asserts the
correct number and a comment says what Quark returns.

Quark is imported once, in a module-scoped fixture (its first import compiles
C++ kernels; later imports still take ~20 s).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import quantobs.faces.quark as ours
from quantobs.core.qparams import quark_rule as ours_qparams
from tests.tiny_groups import tiny_groups

# Quark's power-of-two observers copy-construct tensors with torch.tensor().
_QUARK_COPY_WARNING = "ignore:To copy construct from a tensor:UserWarning"


@pytest.fixture(scope="module")
def q() -> SimpleNamespace:
    """Quark's config, enums, observers and MX helpers."""
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import (
        fake_quantize_mx,
    )
    from quark.torch.quantization.config import type as quark_type
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.observer import observer as quark_observer
    from quark.torch.quantization.utils import even_round

    return SimpleNamespace(
        QTensorConfig=QTensorConfig,
        type=quark_type,
        obs=quark_observer,
        even_round=even_round,
        fake_quantize_mx=fake_quantize_mx,
    )


def quark_spec(q: SimpleNamespace, **kwargs: Any) -> Any:
    """Quark's QTensorConfig from plain strings."""
    enums = {
        "dtype": q.type.Dtype,
        "mx_element_dtype": q.type.Dtype,
        "qscheme": q.type.QSchemeType,
        "scale_type": q.type.ScaleType,
        "zero_point_type": q.type.ZeroPointType,
    }
    out = {}
    for key, value in kwargs.items():
        if key in enums and isinstance(value, str):
            value = enums[key][value]
        elif key == "round_method" and isinstance(value, str):
            value = q.type.RoundType[value]
        elif key == "observer_cls":
            value = getattr(q.obs, value)
        out[key] = value
    return q.QTensorConfig(**out)


def pair(q: SimpleNamespace, name: str, **spec: Any) -> tuple[Any, Any]:
    """(Quark's observer, ours) of class `name` for the same spec."""
    theirs = getattr(q.obs, name)(quark_spec(q, observer_cls=name, **spec))
    mine = getattr(ours, name)(ours.QTensorConfig(observer_cls=name, **spec))
    return theirs, mine


def assert_same(theirs: Any, mine: Any) -> None:
    """Equal values, dtypes and shapes, element by element of a tuple."""
    assert len(theirs) == len(mine)
    for a, b in zip(theirs, mine, strict=True):
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape))
        assert torch.equal(a, b), (a, b)


def run(observers: tuple[Any, Any], batches: list[torch.Tensor]) -> None:
    for batch in batches:
        for observer in observers:
            observer(batch)


def batches(name: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Seeded calibration batches by scenario."""
    g = torch.Generator().manual_seed(6)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype)

    return {
        "normal": lambda: [randn(32, 64), randn(32, 64, scale=2, shift=0.5)],
        "growing": lambda: [
            randn(64, 64),
            randn(64, 64, scale=3),
            randn(64, 64, scale=0.5),
        ],
        "relu": lambda: [randn(64, 64).clamp(min=0), randn(64, 64, scale=2).relu()],
        "constant": lambda: [torch.full((8, 32), 0.75, dtype=dtype)] * 2,
        "4d": lambda: [randn(2, 16, 3, 32), randn(2, 16, 3, 32, scale=0.1)],
    }[name]()


INT_SPEC = {"round_method": "half_even", "scale_type": "float", "is_dynamic": False}
INPUTS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

# ------------------------------------------------------------ spec and API


@pytest.mark.parametrize(
    "enum", ["Dtype", "QSchemeType", "ScaleType", "RoundType", "ZeroPointType"]
)
def test_enums_have_quarks_members(q: SimpleNamespace, enum: str) -> None:
    theirs = {m.name: m.value for m in getattr(q.type, enum)}
    mine = {m.name: m.value for m in getattr(ours, enum)}
    assert mine == theirs


OBSERVER_NAMES = [
    "ObserverBase",
    "PlaceholderObserver",
    "UniformScalingObserver",
    "PerTensorMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerBlockMXObserver",
    "PerBlockBFPObserver",
    "PerTensorHistogramObserver",
    "PerTensorHistogramObserverPro",
    "PerTensorPercentileObserver",
    "PerTensorMSEObserver",
    "PerTensorPowOf2MinMaxObserver",
    "PerTensorPowOf2MinMSEObserver",
    "PerChannelPowOf2MinMaxObserver",
    "PerChannelPowOf2MinMSEObserver",
]


def _params(function: Callable[..., Any]) -> list[tuple[str, Any]]:
    return [
        (p.name, p.default) for p in inspect.signature(function).parameters.values()
    ]


@pytest.mark.parametrize("name", OBSERVER_NAMES)
def test_constructor_signature_is_quarks(q: SimpleNamespace, name: str) -> None:
    # Quark's parameters, plus our keyword-only `nan_policy` (every face's)
    mine = inspect.signature(getattr(ours, name).__init__).parameters
    extra = mine["nan_policy"]
    assert extra.kind is inspect.Parameter.KEYWORD_ONLY
    expected = "omit" if name == "PerBlockBFPObserver" else "raise"
    assert extra.default == expected  # Quark's own handling (BFP: NaN -> 0)
    kept = [(n, p.default) for n, p in mine.items() if n != "nan_policy"]
    assert kept == _params(getattr(q.obs, name).__init__)


@pytest.mark.parametrize(
    "method",
    [
        "PerTensorPercentileObserver.get_min_max_by_percentile",
        "PerTensorMSEObserver.get_min_max_by_mse",
        "UniformScalingObserver.calculate_qparams",
        "UniformScalingObserver.reset_min_max_vals",
    ],
)
def test_method_signature_is_quarks(q: SimpleNamespace, method: str) -> None:
    cls, name = method.split(".")
    mine = getattr(getattr(ours, cls), name)
    theirs = getattr(getattr(q.obs, cls), name)
    assert [p for p, _ in _params(mine)] == [p for p, _ in _params(theirs)]
    assert _params(mine) == _params(theirs)


def test_a_quark_spec_configures_our_observer(q: SimpleNamespace) -> None:
    spec = quark_spec(
        q,
        dtype="int8",
        qscheme="per_channel",
        ch_axis=0,
        symmetric=False,
        observer_cls="PerChannelMinMaxObserver",
        **INT_SPEC,
    )
    theirs = q.obs.PerChannelMinMaxObserver(spec)
    mine = ours.PerChannelMinMaxObserver(spec)  # Quark's own config object
    run((theirs, mine), batches("normal"))
    assert_same(theirs._calculate_qparams(), mine._calculate_qparams())


# ------------------------------------------------------------ min-max


@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int4", "uint4", "int3", "int2"])
@pytest.mark.parametrize(
    "observer, layout",
    [
        ("PerTensorMinMaxObserver", {"qscheme": "per_tensor"}),
        ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 1}),
        (
            "PerGroupMinMaxObserver",
            {"qscheme": "per_group", "ch_axis": 1, "group_size": 16},
        ),
    ],
    ids=["tensor", "channel", "group"],
)
def test_int_minmax_parity(
    q: SimpleNamespace,
    observer: str,
    layout: dict[str, Any],
    dtype: str,
    symmetric: bool,
    x_dtype: str,
) -> None:
    observers = pair(
        q, observer, dtype=dtype, symmetric=symmetric, **layout, **INT_SPEC
    )
    run(observers, batches("normal", INPUTS[x_dtype]))
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())


@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(
    "observer, layout",
    [
        ("PerTensorMinMaxObserver", {"qscheme": "per_tensor"}),
        ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
        (
            "PerGroupMinMaxObserver",
            {"qscheme": "per_group", "ch_axis": -1, "group_size": 32},
        ),
    ],
    ids=["tensor", "channel", "group"],
)
def test_fp8_minmax_parity(
    q: SimpleNamespace, observer: str, layout: dict[str, Any], dtype: str, x_dtype: str
) -> None:
    observers = pair(q, observer, dtype=dtype, is_dynamic=False, **layout)
    run(observers, batches("normal", INPUTS[x_dtype]))
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())


@pytest.mark.parametrize(
    "case",
    [
        {"is_dynamic": True},
        {"zero_point_type": "float32"},
        {"scale_type": "float32"},
        {"scale_type": "bfloat16"},
    ],
    ids=["dynamic", "float_zero_point", "scale_float32", "scale_bf16"],
)
@pytest.mark.parametrize("scenario", ["normal", "4d", "constant", "relu"])
def test_minmax_options_parity(
    q: SimpleNamespace, case: dict[str, Any], scenario: str
) -> None:
    spec = {**INT_SPEC, **case}
    for observer, layout in (
        ("PerTensorMinMaxObserver", {"qscheme": "per_tensor"}),
        ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 1}),
    ):
        observers = pair(q, observer, dtype="uint8", symmetric=False, **layout, **spec)
        run(observers, batches(scenario, torch.bfloat16))
        assert_same(
            observers[0]._calculate_qparams(), observers[1]._calculate_qparams()
        )


@pytest.mark.parametrize(
    "shape, axis",
    [((64,), 0), ((6, 8, 32), 1), ((6, 8, 32), -1), ((32, 6, 8), 0)],
    ids=["1d", "3d_axis1", "3d_last", "3d_axis0"],
)
def test_layouts_parity(q: SimpleNamespace, shape: tuple[int, ...], axis: int) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    for observer, layout in (
        ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": axis}),
        (
            "PerGroupMinMaxObserver",
            {"qscheme": "per_group", "ch_axis": axis, "group_size": 2},
        ),
    ):
        observers = pair(
            q, observer, dtype="int8", symmetric=True, **layout, **INT_SPEC
        )
        run(observers, [x])
        assert_same(
            observers[0]._calculate_qparams(), observers[1]._calculate_qparams()
        )


def test_unobserved_minmax_returns_quarks_defaults(q: SimpleNamespace) -> None:
    theirs, mine = pair(
        q,
        "PerTensorMinMaxObserver",
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        **INT_SPEC,
    )
    with pytest.warns(UserWarning, match="before any observation"):
        got = mine._calculate_qparams()
    assert_same(theirs._calculate_qparams(), got)


# ------------------------------------------------------------ MX


MX_ELEMENTS = ["fp4", "fp6_e2m3", "fp6_e3m2", "fp8_e4m3", "fp8_e5m2"]
MX_SHAPES = {
    "w_last": ((16, 128), -1),
    "w_pad": ((16, 100), -1),  # a partial last block (Quark pads zeros)
    "3d_axis0": ((40, 3, 7), 0),
}


def _mx_batches(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(*shape, generator=g) * scale).to(dtype) for scale in (1, 3, 0.01)
    ]


# Quark floors / ceils a float16 or bfloat16 log2 in `floor` / `ceil` modes
# (test_mx_bf16_exponent_is_exact): compare those on float32 inputs only.
MX_MODES = [
    pytest.param(mode, x_dtype, id=f"{mode}-{x_dtype}")
    for mode in ("even", "floor", "ceil")
    for x_dtype in (INPUTS if mode == "even" else ["f32"])
]


@pytest.mark.parametrize("layout", MX_SHAPES)
@pytest.mark.parametrize("mode, x_dtype", MX_MODES)
@pytest.mark.parametrize("element", MX_ELEMENTS)
def test_mx_e8m0_parity(
    q: SimpleNamespace, element: str, mode: str, x_dtype: str, layout: str
) -> None:
    shape, axis = MX_SHAPES[layout]
    observers = pair(
        q,
        "PerBlockMXObserver",
        dtype=element,
        qscheme="per_group",
        ch_axis=axis,
        group_size=32,
        scale_format="e8m0",
        scale_calculation_mode=mode,
        is_dynamic=False,
        scale_type="float",
        round_method="half_even",
    )
    run(observers, _mx_batches(shape, INPUTS[x_dtype]))
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())


@pytest.mark.parametrize("mode", ["even", "floor", "ceil"])
@pytest.mark.parametrize("x_dtype", ["f16", "bf16"])
@pytest.mark.parametrize("element", ["fp4", "fp6_e2m3", "fp8_e4m3"])
def test_mx_blocks_of_zeros_and_tiny_maxima_are_positive(
    q: SimpleNamespace, element: str, x_dtype: str, mode: str
) -> None:
    # Blocks of zeros, subnormal and tiny normal maxima (issue 25): Quark's
    # e8m0 "even" scales are float32 (2**-127 for a zero block), its floor /
    # ceil ones in the input's dtype with a floor of 2**-23: never 0; ours
    # are Quark's, bit for bit, except bfloat16 floor / ceil, where Quark
    # floors a log2 rounded in bfloat16 (MX_MODES; ours are exact, >= 2**-127).
    observers = pair(
        q,
        "PerBlockMXObserver",
        dtype=element,
        qscheme="per_group",
        ch_axis=-1,
        group_size=32,
        scale_format="e8m0",
        scale_calculation_mode=mode,
        is_dynamic=False,
        scale_type="float",
        round_method="half_even",
    )
    run(observers, [tiny_groups(8, 256, INPUTS[x_dtype])])
    theirs, mine = observers[0]._calculate_qparams(), observers[1]._calculate_qparams()
    if mode == "even" or x_dtype == "f16":
        assert_same(theirs, mine)
    assert bool((mine[0] > 0).all() & torch.isfinite(mine[0]).all())


@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("scale_format", ["float32", "e4m3"])
@pytest.mark.parametrize("element", ["fp4", "fp8_e4m3"])
def test_mx_float_and_two_level_scale_parity(
    q: SimpleNamespace, element: str, scale_format: str, x_dtype: str
) -> None:
    observers = pair(
        q,
        "PerBlockMXObserver",
        dtype=element,
        qscheme="per_group",
        ch_axis=-1,
        group_size=16,
        scale_format=scale_format,
        is_dynamic=True,
        scale_type="float",
        round_method="half_even",
    )
    run(observers, _mx_batches((8, 96), INPUTS[x_dtype]))
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())


@pytest.mark.parametrize("element", [*MX_ELEMENTS, "int8"])
def test_mx_even_rounding_is_quarks_bit_for_bit(
    q: SimpleNamespace, element: str
) -> None:
    # Every bfloat16 mantissa (and the float32 ones around each threshold)
    # at binades from subnormal to the top of float32: Quark's bit trick.
    mant = torch.arange(128, dtype=torch.float32) / 128 + 1
    near = torch.tensor([1.75, 1.875, 1.9375, 2 - 2**-9], dtype=torch.float64)
    ulp = torch.tensor([-(2**-23), 0.0, 2**-23], dtype=torch.float64)
    mant = torch.cat([mant, (near[:, None] + ulp).reshape(-1).float()])
    exps = torch.tensor([-149, -140, -127, -126, -20, -1, 0, 1, 7, 40, 126, 127])
    amax = (mant[:, None].double() * torch.exp2(exps.double())).float().reshape(-1)
    amax = torch.cat([amax, torch.tensor([0.0, float.fromhex("0x1.fffffep127")])])
    dtype = ours.Dtype(element)
    bits, emax = ours.spec.mx_element_params(dtype)
    mine = ours_qparams.e8m0_scale(amax, "round", bits, emax, 1e-7)  # "even"
    theirs = q.even_round(amax.clone(), q.type.Dtype(element))
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("mode", ["even", "floor", "ceil"])
def test_mx_int8_scale_matches_quarks_kernel(q: SimpleNamespace, mode: str) -> None:
    # Quark's observer rejects int8 elements; its MX kernel (OCP MXINT8)
    # quantizes int8 codes with step scale / 64. Our scale must reproduce it.
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(5)) * 3
    observer = ours.PerBlockMXObserver(
        ours.QTensorConfig(
            dtype="mx",
            mx_element_dtype="int8",
            ch_axis=-1,
            group_size=32,
            scale_calculation_mode=mode,
        )
    )
    observer(x)
    scale, _ = observer._calculate_qparams()  # (8, 3)
    step = scale.repeat_interleave(32, dim=1) / 64
    mine = torch.clamp(torch.round(x / step), -127, 127) * step
    theirs = q.fake_quantize_mx(
        x, axis=-1, block_size=32, scale_calculation_mode=mode, mx_element_dtype="int8"
    )
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("mode", ["floor", "ceil"])
def test_mx_bf16_exponent_is_exact(q: SimpleNamespace, mode: str) -> None:
    # 255 = 1.9921875 * 2**7 in bfloat16. The OCP exponent is floor(log2) = 7,
    # scale 2**(7 - 2) = 32 for fp4 (ceil: 2**6 = 64). Quark floors a
    # bfloat16 log2 that rounds to 8.0 and returns 64 in floor mode too.
    x = torch.full((1, 32), 255.0, dtype=torch.bfloat16)
    theirs, mine = pair(
        q,
        "PerBlockMXObserver",
        dtype="fp4",
        qscheme="per_group",
        ch_axis=-1,
        group_size=32,
        scale_format="e8m0",
        scale_calculation_mode=mode,
        is_dynamic=False,
        scale_type="float",
        round_method="half_even",
    )
    run((theirs, mine), [x])
    expected = {"floor": 32.0, "ceil": 64.0}[mode]
    scale, _ = mine._calculate_qparams()
    assert scale.dtype == torch.bfloat16 and scale.item() == expected
    assert theirs._calculate_qparams()[0].item() == 64.0  # Quark, both modes


# ------------------------------------------------------------ BFP16


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layout", MX_SHAPES)
def test_bfp_parity(q: SimpleNamespace, layout: str, dynamic: bool) -> None:
    # float32 inputs: Quark floors a float16 / bfloat16 log2 in those dtypes
    # (test_bfp_bf16_exponent_is_exact).
    shape, axis = MX_SHAPES[layout]
    observers = pair(
        q,
        "PerBlockBFPObserver",
        dtype="bfp16",
        ch_axis=axis,
        group_size=8,
        is_dynamic=dynamic,
    )
    run(observers, _mx_batches(shape, torch.float32))
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())


def test_bfp_overflow_doubling_and_nonfinite_are_quarks(q: SimpleNamespace) -> None:
    # Rows: the block's largest value P against amax A = m * 2**e (table in
    # quantobs.faces.quark.mx); NaN / inf count as 0.
    rows = [
        [1.984375, 0.5, 0, 0, 0, 0, 0, 0],  # P / scale = 127: kept
        [1.9921875, 0.5, 0, 0, 0, 0, 0, 0],  # 127.5 -> 128: doubled
        [-1.9921875, 0.5, 0, 0, 0, 0, 0, 0],  # -127.5 -> -128 fits: kept
        [0, 0, 0, 0, 0, 0, 0, 0],  # eps
        [math.nan, math.inf, -math.inf, 3.0, 0, 0, 0, 0],  # = [0, 0, 0, 3, ...]
        [1.9921875 * 2**-40, 0, 0, 0, 0, 0, 0, 0],
    ]
    x = torch.tensor(rows)
    observers = pair(q, "PerBlockBFPObserver", dtype="bfp16", ch_axis=-1, group_size=8)
    run(observers, [x])
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())
    scale, _ = observers[1]._calculate_qparams()
    assert scale[:4, 0].tolist() == [2**-6, 2**-5, 2**-6, torch.finfo().eps]


def test_bfp_bf16_exponent_is_exact(q: SimpleNamespace) -> None:
    # 31.75 = 1.984375 * 2**4: scale 2**(4 - 6) = 0.25, 31.75 / 0.25 = 127
    # fits int8. Quark's bfloat16 log2(31.75) rounds to 5.0: scale 0.5.
    x = torch.tensor([[31.75, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bfloat16)
    theirs, mine = pair(
        q, "PerBlockBFPObserver", dtype="bfp16", ch_axis=-1, group_size=8
    )
    run((theirs, mine), [x])
    assert mine._calculate_qparams()[0].item() == 0.25
    assert theirs._calculate_qparams()[0].item() == 0.5  # Quark


# ------------------------------------------------------------ histograms

HIST_DTYPES = {
    "int8": {"symmetric": True, **INT_SPEC},
    "uint8": {"symmetric": True, **INT_SPEC},
    "int4": {"symmetric": True, **INT_SPEC},
    "uint4": {"symmetric": True, **INT_SPEC},
    "fp8_e4m3": {"is_dynamic": False},
    "fp8_e5m2": {"is_dynamic": False},
}


@pytest.mark.parametrize("scenario", ["growing", "relu", "constant"])
@pytest.mark.parametrize("x_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("dtype", HIST_DTYPES)
@pytest.mark.parametrize(
    "observer", ["PerTensorPercentileObserver", "PerTensorMSEObserver"]
)
def test_symmetric_histogram_search_parity(
    q: SimpleNamespace, observer: str, dtype: str, x_dtype: str, scenario: str
) -> None:
    observers = pair(
        q, observer, dtype=dtype, qscheme="per_tensor", **HIST_DTYPES[dtype]
    )
    run(observers, batches(scenario, INPUTS[x_dtype]))
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())
    theirs, mine = observers
    assert torch.equal(theirs.calib_bin_edges, mine.calib_bin_edges)
    assert torch.equal(theirs.calib_hist.long(), mine.calib_hist)


def test_percentile_and_mse_methods_parity(q: SimpleNamespace) -> None:
    g = torch.Generator().manual_seed(2)
    hist = torch.randint(0, 50, (2048,), generator=g).float()
    edges = torch.linspace(0, 3.5, 2049)
    spec = {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC}
    theirs, mine = pair(q, "PerTensorPercentileObserver", **spec)
    theirs.device = torch.device("cpu")  # Quark sets it in forward
    for p in (0.0, 50.0, 99.0, 100.0):
        assert_same(
            theirs.get_min_max_by_percentile(hist, edges, p)[1:],
            mine.get_min_max_by_percentile(hist, edges, p)[1:],
        )
    with pytest.raises(ValueError, match="between 0 and 100"):
        mine.get_min_max_by_percentile(hist, edges, 100.5)
    theirs, mine = pair(q, "PerTensorMSEObserver", **spec)
    theirs.device = torch.device("cpu")
    for stride, start in ((1, 2045), (3, 1500), (1, 0)):
        assert_same(
            theirs.get_min_max_by_mse(hist, edges, stride, start)[1:],
            mine.get_min_max_by_mse(hist, edges, stride, start)[1:],
        )


def test_percentile_counts_are_exact(q: SimpleNamespace) -> None:
    # 2**25 values in bin 0 and one in bin 1: p = 99.99999999 keeps them all,
    # so the max is bin 1's left edge. Quark's float32 CDF is already 1.0 at
    # bin 0 (1 / (2**25 + 1) is below float32's resolution) and returns 0.
    spec = {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC}
    theirs, mine = pair(q, "PerTensorPercentileObserver", **spec)
    theirs.device = torch.device("cpu")
    counts, edges = torch.tensor([2.0**25, 1.0]), torch.tensor([0.0, 1.0, 2.0])
    assert mine.get_min_max_by_percentile(counts, edges, 99.99999999)[1] == 1.0
    assert theirs.get_min_max_by_percentile(counts, edges, 99.99999999)[1] == 0.0


def test_grown_histogram_bins_match_edges(q: SimpleNamespace) -> None:
    # Growing right twice: Quark counts the new bins with a float32 ceil and
    # builds the edges with a float64 arange; here they disagree, and Quark
    # bins the batch with 9547 bins under 9546 bins' edges (its MSE search
    # then fails on the shapes). Ours bins with the edges it keeps.
    top = (2.452694892883301, 2.50174880027771, 5.574535846710205)
    data = [torch.tensor([value, 0.5]) for value in top]
    spec = {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC}
    theirs, mine = pair(q, "PerTensorPercentileObserver", **spec)
    run((theirs, mine), data)
    assert torch.equal(mine.calib_bin_edges, theirs.calib_bin_edges)
    assert mine.calib_hist.numel() == mine.calib_bin_edges.numel() - 1 == 9546
    assert int(mine.calib_hist.sum()) == 6
    assert theirs.calib_hist.numel() == 9547  # Quark


def test_plain_histogram_sets_its_range(q: SimpleNamespace) -> None:
    spec = {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC}
    theirs, mine = pair(q, "PerTensorHistogramObserver", **spec)
    data = batches("growing")
    run((theirs, mine), data)
    reference = ours.PerTensorMinMaxObserver(
        ours.QTensorConfig(observer_cls="PerTensorMinMaxObserver", **spec)
    )
    run((reference,), data)
    assert_same(reference._calculate_qparams(), mine._calculate_qparams())
    assert torch.equal(theirs.calib_hist.long(), mine.calib_hist)
    # Quark never sets min_val / max_val: always the defaults (1.0, 0).
    assert theirs._calculate_qparams()[0].tolist() == [1.0]


def test_plain_histogram_is_symmetric_only() -> None:
    observer = ours.PerTensorHistogramObserver(
        ours.QTensorConfig(
            dtype="int8",
            qscheme="per_tensor",
            symmetric=False,
            observer_cls="PerTensorHistogramObserver",
            **INT_SPEC,
        )
    )
    with pytest.raises(ValueError, match="symmetric only"):
        observer(torch.randn(8))


def _asym(q: SimpleNamespace, name: str, dtype: str = "uint8") -> tuple[Any, Any]:
    return pair(q, name, dtype=dtype, qscheme="per_tensor", symmetric=False, **INT_SPEC)


def test_asymmetric_percentile_cuts_both_tails(q: SimpleNamespace) -> None:
    theirs, mine = _asym(q, "PerTensorPercentileObserver")
    theirs.device = torch.device("cpu")  # Quark sets it in forward
    counts = torch.full((100,), 10.0)  # 1000 values, 10 per bin
    edges = torch.linspace(-50, 50, 101)
    # p = 90: 5% (50 values, 5 bins) in each tail; as the symmetric rule cuts
    # the bin where the CDF reaches p% (its left edge is the max), the mirror
    # cuts one more bin at the bottom (its right edge is the min).
    low, high = mine.get_min_max_by_percentile(counts, edges, 90.0)
    assert (low.item(), high.item()) == (edges[6].item(), edges[94].item())
    # Quark's ends are both at the bottom: the data minimum and the lower
    # tail's percentile (with p = 99.99999999 both are the data minimum).
    bad = theirs.get_min_max_by_percentile(counts, edges, 90.0)
    assert bad[0].item() == -50.0 and bad[1].item() < low.item()
    x = torch.linspace(-3, 5, 8401)
    run((theirs, mine), [x])
    edges = mine.calib_bin_edges
    scale, zero_point = mine._calculate_qparams()  # default p = 99.99999999
    assert scale.item() == pytest.approx((edges[4199] - edges[1]).item() / 255)
    assert zero_point.item() == round(-float(edges[1]) / scale.item())
    theirs_scale, _ = theirs._calculate_qparams()
    assert theirs_scale.item() == pytest.approx(3 / 255)  # Quark: (-3, -3) -> (-3, 0)


def test_histogram_grows_left_keeping_counts(q: SimpleNamespace) -> None:
    first = torch.linspace(0.25, 1, 1001)
    second = torch.linspace(-0.5, 1, 301)
    theirs, mine = _asym(q, "PerTensorPercentileObserver")
    run((theirs, mine), [first, second])
    # The old grid grew left by whole bins of its width; the old edges and
    # counts are kept, the counts shifted by the bins added.
    old_edges = torch.linspace(0.25, 1, 4201)
    width = float(old_edges[1] - old_edges[0])
    added = math.ceil(0.75 / width)
    edges = mine.calib_bin_edges
    assert torch.equal(edges[added:], old_edges)
    assert edges[0].item() <= -0.5 < edges[1].item()
    old = torch.histc(first, 4200, 0.25, 1).long()
    kept = second[second != 0]  # the percentile observer skips zeros
    new = torch.histc(kept, 4200 + added, float(edges[0]), float(edges[-1])).long()
    expected = torch.cat([torch.zeros(added, dtype=torch.long), old]) + new
    assert torch.equal(mine.calib_hist, expected)
    assert int(mine.calib_hist.sum()) == 1001 + kept.numel()
    # Quark adds the old counts at offset 0 (under the values of [-0.5, 0]).
    assert not torch.equal(theirs.calib_hist.long(), expected)


def test_asymmetric_mse_keeps_the_data_minimum(q: SimpleNamespace) -> None:
    x = torch.linspace(-2, 6, 4097)
    theirs, mine = _asym(q, "PerTensorMSEObserver")
    run((theirs, mine), [x])
    edges = mine.calib_bin_edges
    low, high = mine.get_min_max_by_mse(mine.calib_hist, edges)
    centers = (edges[1:] + edges[:-1]) / 2
    assert low.item() == -2.0 and high.item() in centers[2045:].tolist()
    scale, zero_point = mine._calculate_qparams()
    assert zero_point.item() == round(2.0 / scale.item())  # qmin - min / scale
    # Quark fixes the minimum at 0: every negative value quantizes to 0.
    assert theirs._calculate_qparams()[1].item() == 0


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", ["uint4", "int8", "uint8"])
def test_histogram_pro_parity(q: SimpleNamespace, dtype: str, symmetric: bool) -> None:
    observers = pair(
        q,
        "PerTensorHistogramObserverPro",
        dtype=dtype,
        qscheme="per_tensor",
        symmetric=symmetric,
        **INT_SPEC,
    )
    run(observers, batches("growing"))
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())


# ------------------------------------------------------------ power of two

POW2 = {
    "PerTensorPowOf2MinMaxObserver": {"qscheme": "per_tensor"},
    "PerTensorPowOf2MinMSEObserver": {"qscheme": "per_tensor"},
    "PerChannelPowOf2MinMaxObserver": {"qscheme": "per_channel", "ch_axis": 0},
    "PerChannelPowOf2MinMSEObserver": {"qscheme": "per_channel", "ch_axis": 1},
}


@pytest.mark.filterwarnings(_QUARK_COPY_WARNING)
@pytest.mark.parametrize("scenario", ["growing", "relu"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("observer", POW2)
def test_pow2_parity_with_votes(
    q: SimpleNamespace, observer: str, dtype: str, symmetric: bool, scenario: str
) -> None:
    theirs, mine = pair(
        q, observer, dtype=dtype, symmetric=symmetric, **POW2[observer], **INT_SPEC
    )
    for batch in batches(scenario):  # Quark computes qparams after each batch
        run((theirs, mine), [batch])
        assert_same(theirs._calculate_qparams(), mine._calculate_qparams())


@pytest.mark.filterwarnings(_QUARK_COPY_WARNING)
def test_pow2_bf16_zero_point_is_exact(q: SimpleNamespace) -> None:
    # Symmetric int8 has zero point 0. Quark computes the zero point in
    # bfloat16 and gets -1 for this batch.
    x = torch.tensor([-1.0, 0.5, 1.0], dtype=torch.bfloat16)
    theirs, mine = pair(
        q,
        "PerTensorPowOf2MinMaxObserver",
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        **INT_SPEC,
    )
    run((theirs, mine), [x])
    assert mine._calculate_qparams()[1].item() == 0
    assert theirs._calculate_qparams()[1].item() == -1  # Quark


# ------------------------------------------------- bfloat16 / float16 inputs

# Observers (beyond the min-max, MX and histogram-search tests above, which
# take every input dtype) on bfloat16 / float16 / float32 batches: Quark's
# qparams, dtypes and bits (issue 25). Quark computes in the input's dtype
# where its code does (MX amax, BFP16 blocks, the power-of-two range),
# float32 elsewhere; the face follows it except where that is a bug (below).
LOW_PRECISION: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "histogram-pro-uint8-asym": (
        "PerTensorHistogramObserverPro",
        {"dtype": "uint8", "qscheme": "per_tensor", "symmetric": False, **INT_SPEC},
        ("f32", "bf16", "f16"),
    ),
    "histogram-pro-int8-sym": (
        "PerTensorHistogramObserverPro",
        {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC},
        ("f32", "bf16", "f16"),
    ),
    "percentile-int8-sym": (
        "PerTensorPercentileObserver",
        {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC},
        ("f16",),  # f32 / bf16: test_symmetric_histogram_search_parity
    ),
    "mse-int8-sym": (
        "PerTensorMSEObserver",
        {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, **INT_SPEC},
        ("f16",),
    ),
    # bfloat16: Quark floors a bfloat16 log2 (test_bfp_bf16_exponent_is_exact)
    "bfp16": (
        "PerBlockBFPObserver",
        {"dtype": "bfp16", "ch_axis": -1, "group_size": 8},
        ("f32", "f16"),
    ),
    # symmetric: Quark's bfloat16 zero point (test_pow2_bf16_zero_point_is_exact)
    "pow2-tensor-asym": (
        "PerTensorPowOf2MinMaxObserver",
        {"dtype": "int8", "qscheme": "per_tensor", "symmetric": False, **INT_SPEC},
        ("f32", "bf16", "f16"),
    ),
    "int4-group128-asym": (
        "PerGroupMinMaxObserver",
        {
            "dtype": "int4",
            "qscheme": "per_group",
            "ch_axis": 1,
            "group_size": 128,
            "symmetric": False,
            **INT_SPEC,
        },
        ("f32", "bf16", "f16"),
    ),
}
LOW_PRECISION_CASES = [
    pytest.param(case, x_dtype, id=f"{case}-{x_dtype}")
    for case, (_, _, dtypes) in LOW_PRECISION.items()
    for x_dtype in dtypes
]


@pytest.mark.filterwarnings(_QUARK_COPY_WARNING)
@pytest.mark.filterwarnings("ignore:.*observer_cls will not take effect")
@pytest.mark.parametrize("scenario", ["normal", "growing"])
@pytest.mark.parametrize("case, x_dtype", LOW_PRECISION_CASES)
def test_low_precision_parity(
    q: SimpleNamespace, case: str, x_dtype: str, scenario: str
) -> None:
    name, spec, _ = LOW_PRECISION[case]
    observers = pair(q, name, **spec)
    xs = batches(scenario, INPUTS[x_dtype])
    if case == "int4-group128-asym":
        xs = [x.repeat(1, 4) for x in xs]  # 256 columns: two groups of 128
    run(observers, xs)
    assert_same(observers[0]._calculate_qparams(), observers[1]._calculate_qparams())


@pytest.mark.filterwarnings(_QUARK_COPY_WARNING)
def test_pow2_min_mse_per_channel_float16(q: SimpleNamespace) -> None:
    # Quark's per-channel MinMSE raises on float16 batches (it writes a
    # float32 scale into a float16 tensor); the face computes in float32,
    # so a float16 batch gives the qparams of its float32 copy.
    spec = {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 1, "symmetric": True}
    x = batches("normal", torch.float16)[0]
    theirs, mine = pair(q, "PerChannelPowOf2MinMSEObserver", **spec, **INT_SPEC)
    with pytest.raises(RuntimeError, match="Half"):
        theirs(x)
        theirs._calculate_qparams()
    _, copy = pair(q, "PerChannelPowOf2MinMSEObserver", **spec, **INT_SPEC)
    run((mine,), [x])
    run((copy,), [x.float()])
    assert_same(copy._calculate_qparams(), mine._calculate_qparams())
