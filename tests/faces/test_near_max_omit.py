"""The faces on finite values at and near a dtype's maximum under
`nan_policy="omit"` (issue 25), and BFP16 blocks there.

Every Quark observer class with every spec kind of its extreme-input
property (int / uint / FP8 per tensor, channel, group; histograms,
percentile, MSE, power-of-two scales, MX FP4 blocks, BFP16 blocks), the
torch.ao face's min-max, moving-average, per-channel and histogram
observers (qint8 / quint8, affine / symmetric), and the legacy
llm-compressor face's min-max and MSE observers (int8 asymmetric per tensor /
channel / group / token, FP8, NVFP4, MXFP4), on float32 / float16 /
bfloat16 values of +-max, within 2**-6 of it, all +max, or +-max among
ordinary values, with or without NaN and +-inf among them: finite positive
scales and zero points in range, or the documented refusal of a range
wider than float32 (torch.ao face: `ValueError` "wider than ..."). A face
that does not take a dtype at all (an ordinary batch of it raises) is left
out for that dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import quantobs.faces.quark as quark
import quantobs.torch_ao as torch_ao
from quantobs import QuantizationArgs, calculate_range, preset_scheme
from quantobs.faces import llmcompressor_legacy as legacy
from tests.faces.quark.test_extreme_inputs import CASES as QUARK_CASES
from tests.observers.test_near_max_omit import DTYPES, KINDS, batch, with_nonfinite

SHAPE = (2, 32)
_QUARK_INT = {"is_dynamic": False, "round_method": "half_even", "scale_type": "float"}


def _quark(name: str, spec: dict[str, Any]) -> Callable[[], Any]:
    fields = {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True}
    fields.update(_QUARK_INT)
    fields.update(spec)

    def make() -> Any:
        config = quark.QTensorConfig(observer_cls=name, **fields)
        return getattr(quark, name)(config, nan_policy="omit")

    return make


def _torch_ao(cls: type, **kwargs: Any) -> Callable[[], Any]:
    return lambda: cls(nan_policy="omit", **kwargs)


def _legacy(cls: type, args: QuantizationArgs) -> Callable[[], Any]:
    return lambda: cls(args, nan_policy="omit")


_sym, _aff = torch.per_tensor_symmetric, torch.per_tensor_affine
_ch_sym, _ch_aff = torch.per_channel_symmetric, torch.per_channel_affine
_NVFP4, _MXFP4 = preset_scheme("NVFP4").weights, preset_scheme("MXFP4").weights
assert _NVFP4 is not None and _MXFP4 is not None
_LEGACY_ARGS = {
    "int8-asym-tensor": QuantizationArgs(num_bits=8, symmetric=False),
    "int8-channel": QuantizationArgs(num_bits=8, strategy="channel"),
    "int4-asym-group": QuantizationArgs(
        num_bits=4, symmetric=False, strategy="group", group_size=16
    ),
    "int8-token": QuantizationArgs(num_bits=8, strategy="token", dynamic=True),
    "fp8-tensor": QuantizationArgs(num_bits=8, type="float"),
    "nvfp4": _NVFP4,
    "mxfp4": _MXFP4,
}

#: (id, constructor, face, (qmin, qmax) of its zero points or None: the
#: observer's `quant_min` / `quant_max`)
FACES: list[tuple[str, Callable[[], Any], str, tuple[float, float] | None]] = [
    *[
        (f"quark-{name}-{i}", _quark(name, spec), "quark", None)
        for i, (name, spec) in enumerate(QUARK_CASES)
        if name != "PlaceholderObserver"
    ],
    *[
        (f"torch_ao-{cls.__name__}-{dtype}-{qscheme}", _torch_ao(cls, **kw), "ao", None)
        for cls, schemes in (
            (torch_ao.MinMaxObserver, (_sym, _aff)),
            (torch_ao.MovingAverageMinMaxObserver, (_sym, _aff)),
            (torch_ao.HistogramObserver, (_sym, _aff)),
            (torch_ao.PerChannelMinMaxObserver, (_ch_sym, _ch_aff)),
            (torch_ao.MovingAveragePerChannelMinMaxObserver, (_ch_sym, _ch_aff)),
        )
        for qscheme in schemes
        for dtype in (torch.qint8, torch.quint8)
        for kw in [{"dtype": dtype, "qscheme": qscheme}]
    ],
    *[
        (
            f"legacy-{cls.__name__}-{name}",
            _legacy(cls, args),
            "legacy",
            calculate_range(args),
        )
        for cls in (legacy.MinMaxObserver, legacy.MovingAverageMSEObserver)
        for name, args in _LEGACY_ARGS.items()
    ],
]


def _qparams(kind: str, observer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "quark":
        return observer._calculate_qparams()  # type: ignore[no-any-return]
    if kind == "ao":
        return tuple(observer.calculate_qparams())  # type: ignore[return-value]
    return observer.get_qparams()  # type: ignore[no-any-return]


def _zero_point_range(
    observer: Any, given: tuple[float, float] | None
) -> tuple[float, float] | None:
    if given is not None:
        return given
    low, high = (
        getattr(observer, "quant_min", None),
        getattr(observer, "quant_max", None),
    )
    if low is None or high is None:
        return None
    return float(low), float(high)


def _takes(make: Callable[[], Any], dtype: torch.dtype) -> bool:
    """Whether the face observes ordinary values of `dtype` at all."""
    observer = make()
    try:
        observer(torch.randn(SHAPE).to(dtype))
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # unsearchable histograms
@pytest.mark.parametrize("face", FACES, ids=[face[0] for face in FACES])
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)
@given(
    dtype=st.sampled_from(DTYPES),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=2),
    nonfinite=st.booleans(),
)
def test_values_near_the_max_are_observed_under_omit(
    face: tuple[str, Callable[[], Any], str, tuple[float, float] | None],
    dtype: torch.dtype,
    kinds: list[str],
    nonfinite: bool,
) -> None:
    _, make, kind, zp_range = face
    assume(_takes(make, dtype))
    observer = make()
    try:
        for i, value_kind in enumerate(kinds):
            x = batch(value_kind, dtype, SHAPE, i)
            observer(with_nonfinite(x) if nonfinite else x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scale, zero_point = _qparams(kind, observer)
    except ValueError as error:
        # the torch.ao face's documented refusal of a range past float32
        assert kind == "ao" and "wider than" in str(error), error
        return
    assert bool(torch.isfinite(scale).all() and (scale > 0).all()), scale
    zp = zero_point.double()
    assert bool(torch.isfinite(zp).all()), zero_point
    bounds = _zero_point_range(observer, zp_range)
    if bounds is not None and not zero_point.dtype.is_floating_point:
        assert bool(((zp >= bounds[0]) & (zp <= bounds[1])).all()), zero_point


# ------------------------------------------------------------ BFP16 blocks


def _bfp(x: torch.Tensor) -> torch.Tensor:
    config = quark.QTensorConfig(
        observer_cls="PerBlockBFPObserver",
        dtype="bfp16",
        qscheme="per_group",
        ch_axis=-1,
        group_size=8,
        is_dynamic=False,
        round_method="half_even",
    )
    observer = quark.PerBlockBFPObserver(config, nan_policy="omit")
    observer(x)
    scale, _ = observer._calculate_qparams()
    return scale  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 1 << 16))
def test_bfp16_blocks_at_the_max_clip_only_where_a_doubled_scale_overflows(
    dtype: torch.dtype, kind: str, seed: int
) -> None:
    """A block's int8 mantissas reach its largest value within half a step,
    except at the dtype's top exponent: there the mantissa 128 would need
    the doubled scale, whose own top value (64 times it) overflows the
    dtype, so the value saturates to 127 steps, within one step."""
    x = batch(kind, dtype, SHAPE, seed)
    scale = _bfp(x)
    assert bool(torch.isfinite(scale).all() and (scale > 0).all()), scale
    blocks = x.double().reshape(SHAPE[0], -1, 8)  # (rows, blocks, 8)
    step = scale.double().reshape(SHAPE[0], -1, 1)
    mantissa = torch.round(blocks / step).clamp(-128, 127)
    error = (mantissa * step - blocks).abs()
    assert bool((error <= step).all())
    clipped = error > step / 2
    top = 128 * step > torch.finfo(dtype).max  # a doubled scale overflows
    assert bool((~clipped | top).all()), (blocks[clipped], step)


# ------------------------------------------------- constant batches (found)


_F16_MAX, _BF16_MAX = torch.finfo(torch.float16).max, torch.finfo(torch.bfloat16).max


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, 1.0),
        (torch.float32, -2.5),
        (torch.float32, torch.finfo().max),
        (torch.float16, _F16_MAX),
        (torch.float16, -_F16_MAX),
        (torch.bfloat16, _BF16_MAX),
        (torch.bfloat16, 1e20),
    ],
)
@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (_torch_ao(torch_ao.HistogramObserver, dtype=torch.qint8, qscheme=_sym), "ao"),
        (_quark("PerTensorHistogramObserverPro", {}), "quark"),
    ],
    ids=["torch_ao-HistogramObserver", "quark-PerTensorHistogramObserverPro"],
)
def test_a_constant_batch_with_omitted_values_counts_its_kept_values(
    make: Callable[[], Any], kind: str, dtype: torch.dtype, value: float
) -> None:
    """Found by the fuzz above: a batch of one value among NaN / inf under
    "omit" raised torch.histc's "range of [nan, nan] is not finite" (over a
    one-value range histc takes the data's own range, NaN included), and
    one of float16's +-max or a large bfloat16 value made torch.histc fail
    to count it over `[c - 1, c + 1]` (with or without omitted values). It
    now counts as the kept values alone do, batch after batch."""
    dirty = with_nonfinite(torch.full(SHAPE, value, dtype=dtype))
    kept = torch.full((1, SHAPE[0] * SHAPE[1] - 3), value, dtype=dtype)
    omitting, clean = make(), make()
    for _ in range(2):
        omitting(dirty)
        clean(kept)
    assert torch.equal(omitting.histogram, clean.histogram)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, reference = _qparams(kind, omitting), _qparams(kind, clean)
    for got, expected in zip(ours, reference, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"]
)
@pytest.mark.parametrize("second", ["at_max", "all_max"])
def test_a_quark_histogram_at_the_max_grows(
    name: str, dtype: torch.dtype, second: str
) -> None:
    """Found by the fuzz above: a first batch of only +max (its grid widened
    to bins of one float32 step, whose float32 edges are uneven there), then
    +-max, merged the grid into groups whose last one lay past the new grid
    (`IndexError` in `bounded_histogram._merged_growth`); then +max again
    grew it by Quark's `arange` into fewer bins than it held (a negative
    size)."""
    observer = _quark(name, {"dtype": "uint8", "symmetric": False})()
    observer(batch("all_max", dtype, SHAPE, 0))
    observer(batch(second, dtype, SHAPE, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scale, zero_point = observer._calculate_qparams()
    top = torch.finfo(dtype).max
    assert bool(torch.isfinite(scale).all() and (scale > 0).all())
    assert 0 <= int(zero_point) <= 255
    assert 255 * float(scale) >= top * (1 - 2**-6)  # the grid covers the data
