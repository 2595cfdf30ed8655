"""The fused qparams kernel (`quantobs.native.triton_qparams`) against the
torch path of `observer_qparams`, bit for bit.

Run on CUDA where present, else on CPU tensors under Triton's interpreter
(`conftest.py`). Every format and granularity the min-max observers
support (int4 / int8 symmetric and asymmetric per tensor, channel and
group; FP8 tensor and channel; NVFP4 with its global scale from the amax or
the module's; MXFP4 / MXFP8), in float32 arithmetic and in bfloat16 /
float16 arithmetic, on ranges with the edge cases (empty, all zero, a range
of one value, tiny and subnormal, near the dtype's largest, one-signed,
a solver's range past float32 made finite) and the errors (NaN / inf
ranges, a bad or overflowing global scale) raised alike.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from quantobs import Observer, QuantizationArgs, native
from quantobs.core.qparams.fused import observer_qparams
from quantobs.core.syncs import SyncCounter
from tests.format_args import MXFP4, NVFP4

ARITHMETIC = [None, torch.bfloat16, torch.float16]
MXFP8: dict[str, Any] = {**MXFP4, "num_bits": 8}
MXFP6: dict[str, Any] = {**MXFP4, "num_bits": 6}  # e2m3: its own 3 bits
CASES: dict[str, dict[str, Any]] = {
    "int4-group": {"num_bits": 4, "strategy": "group", "group_size": 16},
    "int4-group-asym": {
        "num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": False,
    },
    "int8-channel": {"num_bits": 8, "strategy": "channel"},
    "int8-channel-asym": {"num_bits": 8, "strategy": "channel", "symmetric": False},
    "uint8-tensor-asym": {
        "num_bits": 8, "symmetric": False, "zp_dtype": torch.uint8,
    },
    "int8-tensor": {"num_bits": 8},
    "fp8-tensor": {"num_bits": 8, "type": "float"},
    "fp8-channel": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "int4-fp8-scales": {
        "num_bits": 4, "strategy": "group", "group_size": 16,
        "scale_dtype": torch.float8_e4m3fn,
    },
    "nvfp4": NVFP4,
    "mxfp4": MXFP4,
    "mxfp8": MXFP8,
    "mxfp6": MXFP6,
}  # fmt: skip


def _ranges(arith: torch.dtype | None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """`(Q,)` float32 minima and maxima: random ranges of values of the
    arithmetic's dtype and of float32 (a solver's), and the edge cases."""
    gen = torch.Generator().manual_seed(seed)
    dtype = arith or torch.float32
    top = torch.finfo(dtype).max
    a = torch.randn(40, generator=gen) * 10.0 ** torch.randint(
        -6, 6, (40,), generator=gen
    )
    b = torch.randn(40, generator=gen) * 10.0 ** torch.randint(
        -6, 6, (40,), generator=gen
    )
    # values of the dtype, finite (a float16 cast past 65504 would be inf)
    a[:20] = a[:20].clamp(-top, top).to(dtype).float()
    b[:20] = b[:20].clamp(-top, top).to(dtype).float()
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    tiny = torch.finfo(torch.float32).tiny
    edges = [
        (math.inf, -math.inf),  # empty: (0, 0)
        (0.0, 0.0),
        (0.75, 0.75),  # a range of one value
        (-0.75, -0.75),
        (-3.0, -1.0),  # one-signed
        (2.0, 5.0),
        (-tiny / 8, tiny / 4),  # subnormal
        (-1e-30, 3e-31),
        (-1e-6, 1e-6),
        (-top, top),  # the dtype's largest
        (-top / 2, top / 3),
        (-3.3e38, 3.3e38),  # past bf16 / fp16: a solver's range
        (1e-45, 1e-45),
        (-65504.0, 1.0),
        (-448.0, 448.0),
        (-6.0, 6.0),
        # float16's subnormal maxima (below 2**-14): MX rounds their bits
        # to 2**-14 from 0.75 * 2**-14 (FP6 e2m3: 0.9375), else to 0 -> 1.0
        (0.0, 0.75 * 2.0**-14),
        (-(0.75 * 2.0**-14 - 2.0**-24), 0.0),
        (0.0, 0.9375 * 2.0**-14),
        (0.0, 2.0**-24),
        (-1e-6, 3e-7),
        (0.0, 2.0**-14),  # float16's least normal
        (0.0, 57344.0),  # rounds past float16's max
    ]
    lo = torch.cat([lo, torch.tensor([e[0] for e in edges])])
    hi = torch.cat([hi, torch.tensor([e[1] for e in edges])])
    return lo, hi


def _both(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """The torch path's result and the kernel's (or the errors they raise)."""
    found = []
    impl = observer_qparams.native("cuda")
    assert impl is not None
    for fn in (observer_qparams.torch, impl):
        try:
            found.append(fn(*args, **kwargs))
        except ValueError as error:
            found.append(error)
    return found[0], found[1]


def _same(want: Any, got: Any) -> None:
    assert got is not None, "the kernel declined"
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
        return
    assert not isinstance(got, Exception), got
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        if a.dtype.is_floating_point and a.dtype.itemsize >= 2:
            assert torch.equal(a.view(-1).float(), b.view(-1).float()), (
                (a != b).nonzero()[:5],
                a[a != b][:5],
                b[a != b][:5],
            )
        else:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("arith", ARITHMETIC, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_qparams_are_torchs(
    case: str, arith: torch.dtype | None, triton_device: torch.device
) -> None:
    args = QuantizationArgs(**CASES[case])
    lo, hi = (t.to(triton_device) for t in _ranges(arith))
    amax = None
    if args.strategy == "tensor_group":
        amax = torch.tensor([2.5], device=triton_device)
    want, got = _both(lo, hi, args, None, amax, arith)
    _same(want, got)


@pytest.mark.parametrize("arith", ARITHMETIC, ids=str)
@pytest.mark.parametrize(
    "amax", [0.0, 1e-30, 0.01, 0.03, 2.5, 448.0, 6e4, 3e38], ids=str
)
def test_nvfp4_global_scale_from_amax(
    amax: float, arith: torch.dtype | None, triton_device: torch.device
) -> None:
    args = QuantizationArgs(**NVFP4)
    lo, hi = (t.to(triton_device) for t in _ranges(arith, seed=1))
    gs_amax = torch.tensor([amax], device=triton_device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        want, got = _both(lo, hi, args, None, gs_amax, arith)
    _same(want, got)
    kinds = [w.category for w in seen]
    assert kinds.count(RuntimeWarning) % 2 == 0  # both warn, or neither


@pytest.mark.parametrize("gs", [1.0, 3.7, 1e30, 0.0, -2.0, math.inf, math.nan], ids=str)
def test_module_global_scale(gs: float, triton_device: torch.device) -> None:
    args = QuantizationArgs(**NVFP4)
    lo, hi = (t.to(triton_device) for t in _ranges(torch.bfloat16, seed=2))
    global_scale = torch.tensor([gs], device=triton_device)
    want, got = _both(lo, hi, args, global_scale, None, torch.bfloat16)
    _same(want, got)


@pytest.mark.parametrize("case", ["int4-group-asym", "nvfp4", "mxfp4", "fp8-tensor"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_ranges_raise_alike(
    case: str, bad: float, triton_device: torch.device
) -> None:
    args = QuantizationArgs(**CASES[case])
    lo, hi = (t.to(triton_device) for t in _ranges(torch.bfloat16, seed=3))
    lo[3], hi[7] = bad, bad
    amax = torch.tensor([bad if case == "nvfp4" else 1.0], device=triton_device)
    amax = amax if args.strategy == "tensor_group" else None
    want, got = _both(lo, hi, args, None, amax, torch.bfloat16)
    _same(want, got)
    assert isinstance(want, ValueError)


@pytest.mark.parametrize("arith", ARITHMETIC, ids=str)
def test_solver_ranges_made_finite(
    arith: torch.dtype | None, triton_device: torch.device
) -> None:
    args = QuantizationArgs(**CASES["int4-group-asym"])
    data_lo, data_hi = (t.to(triton_device) for t in _ranges(arith, seed=4))
    lo, hi = data_lo * 1.5, data_hi * 1.5  # some past float32: +-inf
    lo[5], hi[6] = math.nan, math.nan
    want, got = _both(lo, hi, args, None, None, arith, (data_lo, data_hi))
    _same(want, got)


@pytest.mark.parametrize("case", ["int4-group-asym", "nvfp4"])
def test_many_programs_and_one_qparam(case: str, triton_device: torch.device) -> None:
    # qparams over several programs (their checks combined by atomics) and
    # a 0-d range (returned as (1,))
    args = QuantizationArgs(**CASES[case])
    gen = torch.Generator().manual_seed(7)
    lo = -torch.rand(2500, generator=gen).to(triton_device)
    hi = torch.rand(2500, generator=gen).to(triton_device)
    amax = torch.tensor([1.0], device=triton_device) if case == "nvfp4" else None
    _same(*_both(lo, hi, args, None, amax, torch.bfloat16))
    _same(*_both(lo[7], hi[7], args, None, amax, None))
    lo[5], hi[1100], lo[2400] = math.nan, math.inf, -math.inf
    want, got = _both(lo, hi, args, None, amax, torch.bfloat16)
    assert "3 non-finite" in str(want)
    _same(want, got)


def test_declines_what_it_does_not_compute(triton_device: torch.device) -> None:
    impl = observer_qparams.native("cuda")
    assert impl is not None
    lo, hi = (t.to(triton_device) for t in _ranges(None))
    args = QuantizationArgs(**CASES["int8-channel"])
    assert impl(lo.double(), hi.double(), args, None, None, None) is None
    assert impl(lo[::2], hi[::2], args, None, None, None) is None
    bf16_scales = QuantizationArgs(num_bits=8, scale_dtype=torch.bfloat16)
    assert impl(lo, hi, bf16_scales, None, None, None) is None


# ------------------------------------------------- observers, routed as CUDA


MINMAX = ["memoryless_minmax", "static_minmax", "minmax"]
OBSERVER_CASES = [
    (name, case, dtype)
    for name in MINMAX
    for case in ("int4-group-asym", "nvfp4", "mxfp4", "fp8-channel")
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
] + [("memoryless_mse", case, torch.bfloat16) for case in ("int4-group", "nvfp4")]


@pytest.mark.parametrize(("name", "case", "dtype"), OBSERVER_CASES, ids=str)
def test_observers_qparams_through_the_kernel(
    name: str,
    case: str,
    dtype: torch.dtype,
    triton_device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # get_qparams on the kernel (CUDA's registration) equals the torch path,
    # with at most two host reads
    args = QuantizationArgs(**CASES[case])
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(4, 64, generator=gen) * 0.02).to(dtype).to(triton_device)
    w[0] = 0.0
    w[1, :32] = 0.5
    torch_calls = []
    reference = observer_qparams.torch

    def counted(*args: Any, **kwargs: Any) -> Any:
        torch_calls.append(1)
        return reference(*args, **kwargs)

    monkeypatch.setattr(observer_qparams, "torch", counted)
    found = []
    for route in (True, False):
        observer = Observer.get_class(name)("weight", args)
        with _routed(route, triton_device):
            observer.update(w)
            observer.update(w * 2)
            with SyncCounter() as syncs:
                found.append(observer.get_qparams())
        if route:  # the kernel ran, within the budget (the torch path reads
            # float16's NVFP4 warning once more)
            assert not torch_calls and syncs.count <= 2, syncs.by_op
    assert torch_calls  # the torch path ran
    _same(found[1], found[0])


class _routed:
    """The kernel's registration for CPU tensors (as a CUDA tensor takes
    it), or the torch path (native kernels off)."""

    def __init__(self, kernels: bool, device: torch.device) -> None:
        self.kernels, self.device = kernels, device
        self._undo: list[Any] = []

    def __enter__(self) -> None:
        from quantobs.native import dispatch

        previous = native.set_enabled(self.kernels)
        self._undo.append(lambda: native.set_enabled(previous))
        if self.kernels and self.device.type == "cpu":
            original = dispatch._device_type

            def device_type(args: Any, kwargs: Any) -> str | None:
                found = original(args, kwargs)
                return "cuda" if found == "cpu" else found

            dispatch._device_type = device_type  # type: ignore[assignment]
            self._undo.append(lambda: setattr(dispatch, "_device_type", original))

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()


@pytest.mark.parametrize("policy", ["raise", "omit", "propagate"])
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax"])
@pytest.mark.parametrize("case", ["int4-group-asym", "nvfp4"])
def test_nan_policies_through_the_kernels(
    policy: str, name: str, case: str, triton_device: torch.device
) -> None:
    # the scan's on-chip findings and absmax: the same errors (and counts),
    # the same qparams, as the torch path
    args = QuantizationArgs(**CASES[case])
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(4, 64, generator=gen).to(torch.bfloat16).to(triton_device)
    bad = w.clone()
    bad[0, 3], bad[2, 40], bad[3, 63] = math.nan, math.inf, -math.inf
    found: list[Any] = []
    for route in (True, False):
        observer = Observer.get_class(name)("weight", args, nan_policy=policy)
        with _routed(route, triton_device):
            with SyncCounter() as syncs:
                observer.update(w)
                observer.update(bad)
            assert syncs.count == 0, syncs.by_op
            try:
                found.append(observer.get_qparams())
            except ValueError as error:
                found.append(error)
    if policy == "raise":
        assert isinstance(found[1], ValueError)
    _same(found[1], found[0])
