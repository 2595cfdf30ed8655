"""The Triton kernels against their torch references, bit for bit.

Run on CUDA where present, else on CPU tensors under Triton's interpreter
(`conftest.py`): the MSE candidates' errors (`quantobs.native.triton_mse`),
the searches built on them (`best_shrink`, `imatrix_choice`: the chosen
candidate of every qparam equals the torch reference's, native kernels off,
on the same device), and the one-pass min/max. Shapes are tiny (the
interpreter runs each program in numpy); every format and granularity the
MSE observers search, bf16 / fp16 / float32 inputs, degenerate groups (all
zero, constant, values near the dtype's largest) and ties.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from quantobs import Observer, QuantizationArgs, native
from quantobs.core.formats import get_format
from quantobs.core.layout import flatten_for_calibration
from quantobs.core.qparams import generate_gparam
from quantobs.core.scoring import (
    candidate_qparams,
    error_power,
    search_args,
    shrink_factors,
)
from quantobs.core.syncs import SyncCounter
from quantobs.solvers import mse_gpu
from quantobs.solvers.imatrix import (
    imatrix_choice,
    imatrix_factors,
    normalize_importance,
)
from quantobs.solvers.mse import best_shrink
from quantobs.stats.reduce import _minmax3, absmax_or_zero, minmax
from tests.format_args import MXFP4, NVFP4

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# name -> (args kwargs, weight shape): each format and granularity searched
CASES: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    "int4-group": ({"num_bits": 4, "strategy": "group", "group_size": 16}, (6, 32)),
    "int4-group-asym": (
        {"num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": False},
        (6, 32),
    ),
    "int8-channel": ({"num_bits": 8, "strategy": "channel"}, (6, 40)),
    "uint8-channel-asym": (
        {"num_bits": 8, "strategy": "channel", "symmetric": False},
        (6, 40),
    ),
    "int8-tensor": ({"num_bits": 8}, (6, 40)),
    "fp8-tensor": ({"num_bits": 8, "type": "float"}, (6, 40)),
    "fp8-channel": ({"num_bits": 8, "type": "float", "strategy": "channel"}, (6, 40)),
    "nvfp4": (NVFP4, (6, 32)),
    "mxfp4": (MXFP4, (3, 64)),
}


@pytest.fixture
def torch_path() -> Iterator[None]:
    """The torch references run with the native kernels off."""
    previous = native.set_enabled(False)
    yield
    native.set_enabled(previous)


def _weight(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, with degenerate ones: all zero, constant, values near the
    dtype's largest (half of it: asymmetric ranges stay finite), one
    outlier, and a row of exact levels (every shrink ties at error 0)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    rows = shape[0]
    w[0] = 0.0
    if rows > 1:
        w[1] = 0.75
    if rows > 2:
        w[2] *= torch.finfo(dtype).max / 2 / w[2].abs().max()
    if rows > 3:
        w[3, 1] = 40.0
    if rows > 4:
        w[4] = torch.randint(-7, 8, (shape[1],), generator=gen).float() / 4
    return w.to(dtype)


def _setup(
    kwargs: dict[str, Any],
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    round_scales: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, QuantizationArgs, torch.Tensor, torch.Tensor, Any]:
    """`grid_search`'s set-up: `(x3, scoring args, mins, maxs, global scale)`."""
    args = QuantizationArgs(**kwargs)
    x_flat = flatten_for_calibration(_weight(shape, dtype, seed), "weight", args)
    x_flat = x_flat.to(device)
    mins, maxs = minmax(x_flat)
    scoring = search_args(args, round_scales)
    global_scale = None
    if round_scales:
        global_scale = generate_gparam(mins.min(), maxs.max())
    n, g = x_flat.shape[0], x_flat.shape[-1]
    x3 = x_flat.reshape(n, -1, g)
    return x3, scoring, mins.reshape(-1), maxs.reshape(-1), global_scale


# ------------------------------------------------------------ candidate errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["int4-group-asym", "fp8-channel", "nvfp4", "mxfp4"])
def test_errors_are_torchs_fake_quant(
    case: str, dtype: torch.dtype, triton_device: torch.device
) -> None:
    # Squared errors: the kernel's per-value errors are torch's bits (exact
    # fake quantization, a*a), so their float64 sums agree to the last bits
    # of float64 whatever the order; one float32 ulp off would show at 1e-8.
    from quantobs.native import triton_mse

    kwargs, shape = CASES[case]
    x3, scoring, mins, maxs, _ = _setup(kwargs, shape, dtype, triton_device)
    factors = shrink_factors(0.2, 100.0).to(triton_device)[:, None]
    scale, zp = candidate_qparams(mins * factors, maxs * factors, scoring)
    got = triton_mse.candidate_errors(x3, scale, zp, scoring.format, 2.0)
    assert got is not None and got.dtype == torch.float64
    zp4 = None if zp is None else zp[:, None, :, None]
    per_value = error_power(
        x3[None].float(), scale[:, None, :, None], zp4, scoring.format, 2.0
    )
    want = per_value.double().sum(dim=(1, 3))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0.0)


@pytest.mark.parametrize("norm", [2.4, 3.0, 1.5])
def test_error_powers_are_close_to_torchs(
    norm: float, triton_device: torch.device
) -> None:
    # `pow` is not torch's bit for bit: within 1e-6, far inside the
    # near-tie tolerance (2**-16) the search re-scores with torch.
    from quantobs.native import triton_mse

    x3, scoring, mins, maxs, _ = _setup(
        *CASES["int4-group"], torch.float32, triton_device
    )
    factors = shrink_factors(0.2, 100.0).to(triton_device)[:, None]
    scale, zp = candidate_qparams(mins * factors, maxs * factors, scoring)
    got = triton_mse.candidate_errors(x3, scale, zp, scoring.format, norm)
    per_value = error_power(x3[None].float(), scale[:, None, :, None], None,
                            scoring.format, norm)  # fmt: skip
    want = per_value.double().sum(dim=(1, 3))
    fast = triton_mse.candidate_errors(
        x3, scale, zp, scoring.format, norm, dtype=torch.float32, exact=False
    )
    assert got is not None and fast is not None and fast.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    # fast: a value within an ulp of a rounding midpoint may take the other
    # level (its error changes by about an ulp of the value): the sums of
    # the rows of exact levels, small, move by up to a few 1e-6
    torch.testing.assert_close(fast.double(), want, rtol=5e-6, atol=1e-30)


def test_long_qparams_in_segments(triton_device: torch.device) -> None:
    # Qparams of more values than a tile: segments of 8192, summed in order;
    # several rows (N > 1) address values by row and column.
    from quantobs.native import triton_mse

    gen = torch.Generator().manual_seed(3)
    x3 = torch.randn(3, 2, 3000, generator=gen).to(triton_device)
    scale = torch.tensor([[0.02, 0.03], [0.025, 0.035]], device=triton_device)
    fmt = QuantizationArgs(num_bits=8).format
    got = triton_mse.candidate_errors(x3, scale, None, fmt, 2.0)
    per_value = error_power(x3[None], scale[:, None, :, None], None, fmt, 2.0)
    want = per_value.double().sum(dim=(1, 3))
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0.0)


def test_strided_values_and_weights(triton_device: torch.device) -> None:
    # any strides (a transposed view, weights broadcast over rows): the
    # errors of the contiguous copies
    from quantobs.native import triton_mse

    gen = torch.Generator().manual_seed(6)
    x3 = torch.randn(2, 24, 5, generator=gen).transpose(1, 2).to(triton_device)
    weights = torch.rand(1, 5, 24, generator=gen).to(triton_device)
    scale = torch.rand(3, 5, generator=gen).add(0.1).to(triton_device)
    fmt = QuantizationArgs(num_bits=4).format
    found = [
        triton_mse.candidate_errors(x, scale, None, fmt, 2.4, w)
        for x, w in ((x3, weights), (x3.contiguous(), weights.expand(2, 5, 24)))
    ]
    assert found[0] is not None and found[1] is not None
    assert torch.equal(found[0], found[1])


def test_declines_what_it_does_not_round() -> None:
    from quantobs.native import gpu

    if not gpu.triton_importable():
        pytest.skip("triton is not installed")
    from quantobs.native import triton_mse

    x3 = torch.zeros(1, 2, 16)
    scale = torch.ones(3, 2)
    for name in ("int32", "float8_e8m0fnu"):  # too wide; no sign or mantissa
        fmt = get_format(name)
        assert triton_mse.candidate_errors(x3, scale, None, fmt, 2.0) is None
    assert triton_mse.candidate_errors(x3.double(), scale, None,
                                       QuantizationArgs(num_bits=8).format,
                                       2.0) is None  # fmt: skip


# ------------------------------------------------------------------- searches


@pytest.mark.parametrize("grid", [7.0, 20.0, 100.0, 111.0, 200.0, 1e4, 1e7])
def test_factors_built_on_the_device_are_pythons(grid: float) -> None:
    # no copy from the host (a synchronisation on CUDA), the same bits
    steps = max(1, int(1.0 * grid)) if grid < 1e5 else 20
    want = torch.tensor([1 - i / grid for i in range(steps)], dtype=torch.float32)
    maxshrink = steps / grid
    assert torch.equal(shrink_factors(maxshrink, grid), want)
    found = imatrix_factors(maxshrink, grid)
    assert torch.equal(found[:-1], want)


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_best_shrink_is_torchs(
    case: str, dtype: torch.dtype, triton_device: torch.device
) -> None:
    kwargs, shape = CASES[case]
    x3, scoring, mins, maxs, _ = _setup(kwargs, shape, dtype, triton_device)
    factors = shrink_factors(0.2, 100.0)
    want = best_shrink.torch(x3, scoring, mins, maxs, factors)
    impl = best_shrink.native("cuda")
    assert impl is not None
    got = impl(x3, scoring, mins, maxs, factors)
    assert got is not None
    assert torch.equal(got, want), (got, want)


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize(
    "options",
    [
        {"patience": None},
        {"round_scales": True},
        {"expand": 1.8, "maxshrink": 1.0, "grid": 111.0, "patience": None},
    ],
    ids=["no-patience", "stored-scales", "expanded"],
)
def test_best_shrink_options_are_torchs(
    options: dict[str, Any], triton_device: torch.device
) -> None:
    # NVFP4 with the stored FP8 group scales under the global scale, every
    # candidate scored, and nvfp4_expanded_mse's 111 candidates from 1.8x.
    kwargs, shape = CASES["nvfp4"]
    round_scales = options.get("round_scales", False)
    x3, scoring, mins, maxs, global_scale = _setup(
        kwargs, shape, torch.bfloat16, triton_device, round_scales, seed=1
    )
    expand = options.get("expand", 1.0)
    mins, maxs = mins * expand, maxs * expand
    factors = shrink_factors(options.get("maxshrink", 0.2), options.get("grid", 100.0))
    patience = options.get("patience", 5)
    kw = {"patience": patience, "global_scale": global_scale}
    want = best_shrink.torch(x3, scoring, mins, maxs, factors, **kw)
    impl = best_shrink.native("cuda")
    assert impl is not None
    got = impl(x3, scoring, mins, maxs, factors, **kw)
    assert got is not None and torch.equal(got, want), (got, want)


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize("weighted", [True, False], ids=["imatrix", "uniform"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["int4-group", "int8-channel", "nvfp4", "mxfp4"])
def test_imatrix_choice_is_torchs(
    case: str, dtype: torch.dtype, weighted: bool, triton_device: torch.device
) -> None:
    kwargs, shape = CASES[case]
    x3, scoring, mins, maxs, _ = _setup(kwargs, shape, dtype, triton_device)
    weights = None
    if weighted:  # importance per input column, as imatrix_search lays it out
        gen = torch.Generator().manual_seed(5)
        imp = normalize_importance(torch.rand(shape[1], generator=gen) ** 4)
        args = QuantizationArgs(**kwargs)
        w = flatten_for_calibration(imp.expand(shape), "weight", args)
        weights = w.reshape(1, -1, x3.shape[-1]).to(triton_device)
    factors = imatrix_factors(0.95, 20.0).to(triton_device)
    call = (x3, scoring, mins, maxs, factors, 3.0, 5, weights, 1 << 20)
    want = imatrix_choice.torch(*call)
    impl = imatrix_choice.native("cuda")
    assert impl is not None
    got = impl(*call)
    assert got is not None and torch.equal(got, want), (got, want)


# --------------------------------------------------------------- near ties


def test_near_ties_are_rescored() -> None:
    # Qparam 1's second candidate is within the tolerance of its first: only
    # that qparam is scored again, and keeps the re-scored errors.
    errors = torch.tensor(
        [[4.0, 4.0, 9.0], [3.0, 4.0 + 1e-9, 8.0]], dtype=torch.float64
    )
    repeats = torch.zeros(1, 3, dtype=torch.bool)
    asked = []

    def rescore(index: torch.Tensor) -> torch.Tensor:
        asked.append(index.clone())
        return torch.full((2, index.numel()), 1.0, dtype=torch.float64) * (
            index[None] + 10
        )

    found = mse_gpu.settle_near_ties(errors, repeats, 2.0**-16, rescore)
    assert torch.equal(found[:, 1], torch.tensor([11.0, 11.0], dtype=torch.float64))
    assert torch.equal(found[:, [0, 2]], errors[:, [0, 2]])
    # a repeated candidate (same qparams) is exact: never near
    repeats[0, 1] = True
    again = mse_gpu.settle_near_ties(errors, repeats, 2.0**-16, rescore)
    assert torch.equal(again, errors)


def test_near_ties_beyond_the_budget_keep_the_kernels_errors() -> None:
    num_q = 2000
    k = mse_gpu.tie_columns(num_q)
    assert 256 <= k < num_q
    errors = torch.ones(2, num_q, dtype=torch.float64)  # every qparam ties
    repeats = torch.zeros(1, num_q, dtype=torch.bool)
    found = mse_gpu.settle_near_ties(
        errors, repeats, 2.0**-16, lambda index: torch.zeros(2, index.numel())
    )
    assert torch.equal(found[:, :k], torch.zeros(2, k, dtype=torch.float64))
    assert torch.equal(found[:, k:], errors[:, k:])


def test_the_choice_reads_nothing_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Candidates the kernel does not make (torch's `(C, Q)` tensors): what
    # runs around the scoring (near ties, the early stop) makes no host
    # read; the scoring kernel is stood in for by torch here.
    from quantobs.native import gpu

    if not gpu.triton_importable():
        pytest.skip("triton is not installed")
    from quantobs.core.scoring import score_with_torch
    from quantobs.native import triton_mse

    def torch_errors(x3, scale, zp, fmt, norm, weights=None, dtype=None, exact=True):  # type: ignore[no-untyped-def]
        return score_with_torch(x3, scale, zp, fmt, norm).to(dtype)

    monkeypatch.setattr(triton_mse, "candidate_errors", torch_errors)
    monkeypatch.setattr(mse_gpu, "_rule", lambda *args: None)
    x3, scoring, mins, maxs, _ = _setup(*CASES["int4-group-asym"], torch.bfloat16,
                                        torch.device("cpu"))  # fmt: skip
    with SyncCounter() as syncs:
        found = mse_gpu.best_shrink(x3, scoring, mins, maxs, shrink_factors(0.2, 100))
        index = mse_gpu.imatrix_choice(
            x3, scoring, mins, maxs, imatrix_factors(0.95, 20.0), 3.0, 5, None, 1 << 20
        )
    assert found is not None and index is not None
    assert syncs.count == 0, syncs.by_op


@pytest.mark.parametrize("case", ["int4-group-asym", "nvfp4", "mxfp4"])
def test_the_choice_on_chip_reads_nothing_on_the_host(
    case: str, triton_device: torch.device
) -> None:
    # The kernels' path: candidates, errors, near ties, re-scoring and the
    # choice, with no host read (under the interpreter its own copies of
    # the launched tensors are no reads of a device's).
    x3, scoring, mins, maxs, _ = _setup(*CASES[case], torch.bfloat16, triton_device)
    with SyncCounter() as syncs:
        found = mse_gpu.best_shrink(x3, scoring, mins, maxs, shrink_factors(0.2, 100))
        index = mse_gpu.imatrix_choice(
            x3, scoring, mins, maxs, imatrix_factors(0.95, 20.0), 3.0, 5, None, 1 << 20
        )
    assert found is not None and index is not None
    assert syncs.count == 0, syncs.by_op


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize("weighted", [False, True], ids=["uniform", "imatrix"])
@pytest.mark.parametrize("case", ["int4-group-asym", "nvfp4"])
def test_candidates_made_with_torch_are_torchs(
    case: str,
    weighted: bool,
    triton_device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where the kernel does not make the candidates (e.g. a scale dtype it
    # does not round) they are made with torch, and the choice is the same.
    monkeypatch.setattr(mse_gpu, "_rule", lambda *args: None)
    kwargs, shape = CASES[case]
    x3, scoring, mins, maxs, _ = _setup(kwargs, shape, torch.float16, triton_device)
    factors = shrink_factors(0.2, 100.0)
    shrink = best_shrink.native("cuda")
    choice = imatrix_choice.native("cuda")
    assert shrink is not None and choice is not None
    got = shrink(x3, scoring, mins, maxs, factors)
    want = best_shrink.torch(x3, scoring, mins, maxs, factors)
    assert got is not None and torch.equal(got, want), (got, want)
    weights = None
    if weighted:
        gen = torch.Generator().manual_seed(5)
        weights = torch.rand(1, *x3.shape[1:], generator=gen).to(triton_device)
    grid = imatrix_factors(0.95, 20.0).to(triton_device)
    call = (x3, scoring, mins, maxs, grid, 3.0, 5, weights, 1 << 20)
    found = choice(*call)
    assert found is not None and torch.equal(found, imatrix_choice.torch(*call))


def test_rule_declines_scales_it_does_not_round() -> None:
    from quantobs.native import gpu

    if not gpu.triton_importable():
        pytest.skip("triton is not installed")
    from quantobs.native import triton_shrink

    int4 = {"num_bits": 4, "strategy": "group", "group_size": 16}
    for update in ({"scale_dtype": torch.bfloat16}, {"scale_dtype": torch.float16}):
        assert triton_shrink.Rule.of(QuantizationArgs(**int4, **update), None) is None
    asym = QuantizationArgs(**int4, symmetric=False)
    assert triton_shrink.Rule.of(asym, None) is not None
    assert triton_shrink.Rule.of(asym, torch.ones(1)) is None  # no global scale


# -------------------------------------------------------------------- min/max


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 8, 16), (3, 5, 7), (1, 3, 3000), (4, 2, 1), (2, 300, 16)]
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, None], ids=str)
def test_minmax_is_torchs(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    bad: float | None,
    triton_device: torch.device,
) -> None:
    # min/max (float32, exact), the absmax and the NaN policy's count of
    # qparams with a non-finite end, as torch's ops give them
    gen = torch.Generator().manual_seed(2)
    x3 = torch.randn(shape, generator=gen).to(dtype).to(triton_device)
    if bad is not None:
        x3[0, 0, 0] = bad  # propagates to qparam 0
        x3[-1, -1, -1] = -bad
    want = _minmax3.torch(x3)
    impl = _minmax3.native("cuda")
    assert impl is not None
    got = impl(x3, True)
    assert got is not None and want[2] is None
    for a, b in zip(got[:2], want[:2], strict=True):
        assert a.dtype == torch.float32
        assert torch.equal(a.nan_to_num(7.0), b.float().nan_to_num(7.0))
        assert torch.equal(a.isnan(), b.isnan())
    low, high = want[0].float(), want[1].float()
    absmax = absmax_or_zero(low, high)
    assert isinstance(got[2], torch.Tensor) and got[2].shape == (1,)
    assert torch.equal(got[2].nan_to_num(7.0), absmax.nan_to_num(7.0))
    count = torch.count_nonzero((low - low) + (high - high)).double()
    assert got[3] is not None
    assert got[3].tolist() == [float(count), 0.0, 0.0]
    assert impl(x3)[2] is None  # no absmax asked: none made


# ------------------------------------------------------- observers, on CUDA

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@CUDA
@pytest.mark.parametrize(
    "name", ["memoryless_mse", "mse", "nvfp4_expanded_mse", "imatrix_mse"]
)
@pytest.mark.parametrize("case", ["int4-group", "nvfp4", "mxfp4", "int8-channel"])
def test_observers_take_the_kernels_on_cuda(name: str, case: str) -> None:
    # The observer API reaches the kernels on CUDA tensors, with today's
    # qparams (the torch path's, same device) and no host read in update.
    from quantobs.native import gpu

    if not gpu.triton_importable():
        pytest.skip("triton is not installed")
    kwargs, _ = CASES[case]
    if name == "nvfp4_expanded_mse" and case != "nvfp4":
        pytest.skip("an NVFP4 observer")
    args = QuantizationArgs(**kwargs)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 256, generator=gen).to(torch.bfloat16).cuda()
    found = []
    for enabled in (True, False):
        previous = native.set_enabled(enabled)
        try:
            observer = Observer.get_class(name)("weight", args)
            with SyncCounter() as syncs:
                observer.update(w)
            if enabled:
                assert syncs.count == 0, syncs.by_op
            found.append(observer.get_qparams())
        finally:
            native.set_enabled(previous)
    for a, b in zip(found[0], found[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("torch_path")
def test_near_ties_are_torchs(
    triton_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Candidates 7e-7 apart on rows of 1024 values: float32 sums in torch's
    # order and in the kernel's order some of them differently. The settled
    # choice is torch's.
    args = QuantizationArgs(num_bits=8, strategy="channel")
    gen = torch.Generator().manual_seed(0)
    x3 = torch.randn(1, 8, 1024, generator=gen).to(triton_device)
    mins, maxs = minmax(x3)
    factors = shrink_factors(20 / 3e6, 3e6)
    want = best_shrink.torch(x3, args, mins, maxs, factors, patience=None)
    impl = best_shrink.native("cuda")
    assert impl is not None
    got = impl(x3, args, mins, maxs, factors, patience=None)
    assert got is not None and torch.equal(got, want)
    if triton_device.type == "cpu":  # the near tie is real: unsettled, it differs
        monkeypatch.setattr(mse_gpu, "_TOLERANCE", -1.0)
        unsettled = impl(x3, args, mins, maxs, factors, patience=None)
        assert unsettled is not None and not torch.equal(unsettled, want)


# ------------------------------------------- candidates made on chip (shrink)

# case -> (args kwargs, weight shape, round_scales): every rule the kernel makes
SHRINK_CASES = {**{k: (*v, False) for k, v in CASES.items()},
                "nvfp4-stored-scales": (NVFP4, (6, 32), True)}  # fmt: skip


def _shrink_setup(
    case: str, dtype: torch.dtype, device: torch.device, expand: float = 1.0
) -> tuple[torch.Tensor, QuantizationArgs, torch.Tensor, torch.Tensor, Any]:
    kwargs, shape, round_scales = SHRINK_CASES[case]
    x3, scoring, mins, maxs, gs = _setup(kwargs, shape, dtype, device, round_scales)
    top = torch.finfo(torch.float32).max
    return (x3, scoring, (mins * expand).clamp(-top, top),
            (maxs * expand).clamp(-top, top), gs)  # fmt: skip


@pytest.mark.parametrize("expand", [1.0, 1.8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHRINK_CASES)
def test_candidates_made_on_chip_are_torchs(
    case: str, dtype: torch.dtype, expand: float, triton_device: torch.device
) -> None:
    # every candidate's scale and zero point: scoring.candidate_qparams' bits
    # (all-zero, constant, near-max rows included; 1.8x ranges past the
    # dtype's largest saturate; factors down to 0)
    from quantobs.native import triton_shrink

    _, scoring, mins, maxs, gs = _shrink_setup(case, dtype, triton_device, expand)
    factors = shrink_factors(1.0, 50.0).to(triton_device)
    rule = triton_shrink.Rule.of(scoring, gs)
    assert rule is not None
    index = torch.arange(mins.numel(), device=triton_device).flip(0)
    scale, zp = triton_shrink.candidate_qparams(rule, mins, maxs, factors, index, gs)
    f = factors[:, None]
    want_scale, want_zp = candidate_qparams(
        mins[index][None] * f, maxs[index][None] * f, scoring, gs
    )
    assert torch.equal(scale, want_scale)
    assert (zp is None) == (want_zp is None)
    if zp is not None and want_zp is not None:
        assert torch.equal(zp, want_zp.float())


@pytest.mark.parametrize("case", ["int4-group-asym", "nvfp4-stored-scales", "mxfp4"])
def test_errors_of_candidates_made_on_chip(
    case: str, triton_device: torch.device
) -> None:
    # the same errors as scoring torch's candidates with the kernel, and the
    # near comparisons of `mse_gpu._near` on them
    from quantobs.native import triton_mse, triton_shrink

    x3, scoring, mins, maxs, gs = _shrink_setup(case, torch.bfloat16, triton_device)
    factors = shrink_factors(0.2, 100.0).to(triton_device)
    rule = triton_shrink.Rule.of(scoring, gs)
    assert rule is not None
    found = triton_shrink.shrink_errors(
        x3, rule, mins, maxs, factors, 2.4, 0.05, global_scale=gs,
        dtype=torch.float64, exact=True,
    )  # fmt: skip
    assert found is not None
    f = factors[:, None]
    scale, zp = candidate_qparams(mins[None] * f, maxs[None] * f, scoring, gs)
    want = triton_mse.candidate_errors(x3, scale, zp, scoring.format, 2.4)
    assert want is not None and torch.equal(found[0], want)
    repeats = scale[1:] == scale[:-1]
    if zp is not None:
        repeats &= zp[1:] == zp[:-1]
    near = mse_gpu._near(want, repeats, 0.05)
    assert torch.equal(found[1].bool(), near)
    if case == "int4-group-asym":  # some comparisons near, not all
        assert near.any() and not near.all()


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize("case", ["uint8-channel-asym"])  # ~4 s interpreted
def test_best_shrink_of_qparams_in_segments(
    case: str, triton_device: torch.device
) -> None:
    # qparams of more values than one program's segment: partial sums added
    # after the launch, near ties found by a second kernel
    kwargs, _ = CASES[case]
    args = QuantizationArgs(**kwargs)
    gen = torch.Generator().manual_seed(8)
    x3 = torch.randn(1, 2, 9000, generator=gen).to(triton_device)
    x3[0, 1] = x3[0, 1].round()  # every candidate ties somewhere
    mins, maxs = minmax(x3)
    factors = shrink_factors(0.2, 100.0)
    want = best_shrink.torch(x3, args, mins, maxs, factors)
    impl = best_shrink.native("cuda")
    assert impl is not None
    got = impl(x3, args, mins, maxs, factors)
    assert got is not None and torch.equal(got, want), (got, want)


def _tied_errors(seed: int) -> torch.Tensor:
    """`(C, Q)` errors with many exact ties, an inf column and a NaN."""
    gen = torch.Generator().manual_seed(seed)
    errors = torch.randint(0, 4, (12, 37), generator=gen).double()
    errors[:, 3] = math.inf
    errors[5, 7] = math.nan
    return errors


@pytest.mark.parametrize("patience", [None, 0, 1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_on_chip_is_first_best(
    patience: int | None, seed: int, triton_device: torch.device
) -> None:
    from quantobs.native import triton_shrink
    from quantobs.solvers.mse_ties import first_best

    errors = _tied_errors(seed).to(triton_device)
    factors = shrink_factors(0.12, 100.0).to(triton_device)
    for dtype in (torch.float64, torch.float32):
        e = errors.to(dtype)
        want = factors[first_best(e, patience)]
        got = triton_shrink.choose(e, patience, triton_shrink.FIRST_BEST, factors)
        assert torch.equal(got, want), (dtype, got, want)


@pytest.mark.parametrize("patience", [0, 1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_on_chip_is_best_index(
    patience: int, seed: int, triton_device: torch.device
) -> None:
    from quantobs.native import triton_shrink
    from quantobs.solvers.imatrix import best_index

    errors = _tied_errors(seed).float().to(triton_device)
    errors[:, 9] = torch.finfo(torch.float32).max  # never improves: index 0
    want = best_index(errors, patience)
    got = triton_shrink.choose(errors, patience, triton_shrink.BEST_INDEX)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
