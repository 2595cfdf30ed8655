"""torch.ao face, HistogramObserver: torch's histogram update and search bit
for bit, and the global L2 search option."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.ao.quantization import observer as tob

import quantobs.faces.torch_ao as ours
from quantobs.solvers.l2_error import l2_errors
from quantobs.stats.torch_histogram import rebin_histogram

from .test_observers import (
    SCENARIOS,
    assert_same_qparams,
    assert_same_state,
    batches,
    observe,
)

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "default_histogram_0_127": {"quant_min": 0, "quant_max": 127},
    "qint8_symmetric": {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
    "bins_256": {"bins": 256},
    "bins_100_reduce_range": {"bins": 100, "reduce_range": True},
}


def histogram_pair(**kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use quant_min", UserWarning)
        return ours.HistogramObserver(**kwargs), tob.HistogramObserver(**kwargs)


# huge / tiny inputs overflow / underflow torch's float32 L2 errors, so its
# greedy walk never stops early (~1e5 steps, about 1 s in torch): run one.
_FAST = [s for s in SCENARIOS if s not in ("huge", "tiny")]
CASES = [(c, s) for c in CONFIGS for s in _FAST] + [("default", "huge")]


@pytest.mark.parametrize("config, scenario", CASES, ids=[f"{c}-{s}" for c, s in CASES])
def test_histogram_matches_torch(config: str, scenario: str, backend: str) -> None:
    a, b = histogram_pair(**CONFIGS[config])
    xs = batches(scenario)
    observe(a, xs)
    observe(b, xs)
    assert_same_state(a, b)
    assert_same_qparams(a, b)


def _heavy_tails() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    outlier = torch.cat([torch.randn(4096, generator=g), torch.tensor([1e4])])
    t2 = torch.randn(4096, generator=g) / torch.randn(4096, generator=g).abs().sqrt()
    return [outlier, t2]


@pytest.mark.parametrize(
    "update",
    [
        "same_range",  # counts added
        "constant_then_wider",  # old histogram is one value
        "grow_both_sides",  # 16x upsampling and re-binning
        "heavy_tails",  # the search walks far
    ],
)
def test_histogram_update_paths_match_torch(update: str, backend: str) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, generator=g)
    xs = {
        "same_range": [x, x.flip(0) * 0.5],
        "constant_then_wider": [torch.full((50,), 2.0), x],
        "grow_both_sides": [x, x * 3, x * 7 - 2, x * 0.1],
        "heavy_tails": _heavy_tails(),
    }[update]
    a, b = histogram_pair()
    observe(a, xs)
    observe(b, xs)
    assert_same_state(a, b)
    assert_same_qparams(a, b)


def test_inf_is_dropped_with_a_warning_like_torch() -> None:
    x = torch.randn(64)
    x[3], x[9] = float("inf"), float("-inf")
    a, b = histogram_pair()
    with pytest.warns(UserWarning, match="inf values in the input are ignored"):
        a(x)
    with pytest.warns(UserWarning, match="torch.inf detected"):
        b(x)
    with pytest.warns(UserWarning), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.inf detected", UserWarning)
        a(torch.full((4,), float("inf")))  # nothing finite: ignored
        b(torch.full((4,), float("inf")))
    assert_same_state(a, b)
    assert_same_qparams(a, b)


def test_bf16_counts_saturate_as_in_torch() -> None:
    """Reproduced on purpose: torch.histc counts bf16 inputs in bf16, so a bin
    stops at 256 per thread; the face keeps torch's histogram and qparams."""
    x = torch.rand(20000, generator=torch.Generator().manual_seed(8)).bfloat16()
    a, b = histogram_pair(bins=4)
    a(x)
    b(x)
    assert_same_state(a, b)
    assert float(a.histogram.sum()) < x.numel()


def test_rebin_keeps_the_total() -> None:
    g = torch.Generator().manual_seed(5)
    hist = torch.rand(64, generator=g) * 100
    moved = rebin_histogram(
        hist,
        torch.tensor(-1.0),
        torch.tensor(1.0),
        torch.tensor(-3.0),
        torch.tensor(2.5),
    )
    assert moved.shape == hist.shape
    torch.testing.assert_close(moved.sum(), hist.sum())


# ------------------------------------------------------------------ global search


def _data(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return {
        "cube": lambda: torch.randn(3000, generator=g) ** 3,
        "outlier": lambda: torch.cat(
            [torch.randn(3000, generator=g), torch.tensor([60.0])]
        ),
        "student_t2": lambda: (
            torch.randn(3000, generator=g) / torch.randn(3000, generator=g).abs().sqrt()
        ),
        "relu": lambda: torch.randn(3000, generator=g).clamp(min=0),
    }[kind]()


@pytest.mark.parametrize("kind", ["cube", "outlier", "student_t2", "relu"])
@pytest.mark.parametrize(
    "bins, quant_max", [(24, 3), (64, 15), (256, 127), (2048, 255)], ids=str
)
def test_global_search_never_worse_than_torch(
    bins: int, quant_max: int, kind: str
) -> None:
    """The option's range has an L2 error (torch's closed form, with the real
    level count) no larger than torch's greedy range on the same histogram."""
    x = _data(kind, bins + quant_max)
    mine = ours.HistogramObserver(
        bins=bins, quant_min=0, quant_max=quant_max, search="global"
    )
    theirs = tob.HistogramObserver(bins=bins, quant_min=0, quant_max=quant_max)
    mine(x)
    theirs(x)
    width = (theirs.max_val - theirs.min_val) / bins

    def error_of(lo: torch.Tensor, hi: torch.Tensor) -> float:
        return float(
            l2_errors(
                theirs.histogram,
                theirs.min_val,
                width,
                lo.reshape(1),
                hi.reshape(1),
                quant_max + 1,
            )
        )

    greedy = error_of(*theirs._non_linear_param_search())
    best = error_of(*mine._global_search())
    assert best <= greedy * (1 + 1e-9)
    scale, zero_point = mine.calculate_qparams()
    assert bool(scale > 0) and bool(torch.isfinite(scale))
    assert 0 <= int(zero_point) <= quant_max


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
        {"qscheme": torch.per_tensor_symmetric},
        {"qscheme": torch.per_tensor_symmetric, "quant_min": 0, "quant_max": 100},
    ],
    ids=["qint8", "quint8_zp128", "quint8_custom_zp50"],
)
def test_global_search_symmetric(kwargs: dict[str, Any]) -> None:
    """Symmetric ranges are searched as [-amax, amax] with the signed grid
    the zero point gives (uint8: 128 or the middle of a custom range)."""
    a = ours.HistogramObserver(search="global", bins=256, **kwargs)
    a(_data("student_t2", 0))
    lo, hi = a._global_search()
    torch.testing.assert_close(lo, -hi)
    scale, zero_point = a.calculate_qparams()
    assert bool(scale > 0)
    assert int(zero_point) == {127: 0, 255: 128, 100: 50}[a.quant_max]


def test_global_search_of_one_value() -> None:
    a = ours.HistogramObserver(search="global")
    a(torch.full((10,), 3.0))
    b = tob.HistogramObserver()
    b(torch.full((10,), 3.0))
    assert_same_qparams(a, b)


@pytest.mark.parametrize("search", ["global", "torch"])
def test_searched_range_is_cached_until_the_histogram_changes(search: str) -> None:
    # torch.ao's convert calls calculate_qparams again: the search runs once
    # per histogram; observing, loading a state dict or a reset runs it again.
    observer = ours.HistogramObserver(search=search)
    calls = []
    found = observer._search

    def counted() -> Any:
        calls.append(1)
        return found()

    observer._search = counted  # type: ignore[method-assign]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    observer(x)
    first = observer.calculate_qparams()
    again = observer.calculate_qparams()
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    observer(x * 2)
    observer.calculate_qparams()
    assert len(calls) == 2
    other = ours.HistogramObserver(search=search)
    other(x * 3)
    observer.load_state_dict(other.state_dict())
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            observer.calculate_qparams(), other.calculate_qparams(), strict=True
        )
    )
    assert len(calls) == 3
    observer.reset_min_max_vals()
    observer(x)
    assert all(
        torch.equal(a, b)
        for a, b in zip(observer.calculate_qparams(), first, strict=True)
    )
    assert len(calls) == 4
