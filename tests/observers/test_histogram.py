"""The histogram observers: every strategy, merge, state, NaN policy, options."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from quantobs import Observer, QuantizationArgs, flatten_for_calibration
from quantobs.observers import HistogramL2Observer, HistogramStatObserver
from quantobs.solvers.torch_l2 import torch_l2_search
from tests.format_args import MXFP4 as _MXFP4
from tests.format_args import NVFP4 as _NVFP4

NAMES = ["histogram", "percentile", "entropy", "histogram_mse"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ observers


def _named(name: str, base_name: str = "weight", **kwargs: Any) -> Observer:
    args = kwargs.pop("args", QuantizationArgs(num_bits=8))
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kwargs)


# (id, base_name, args, shape of one batch): every strategy of every base name.
CASES: list[tuple[str, str, dict[str, Any], tuple[int, ...]]] = [
    ("w-tensor-int8", "weight", {"num_bits": 8}, (16, 32)),
    ("w-channel-int4", "weight", {"num_bits": 4, "strategy": "channel"}, (16, 32)),
    (
        "w-group-int4-asym",
        "weight",
        {"num_bits": 4, "group_size": 16, "symmetric": False},
        (16, 32),
    ),
    (
        "w-block-fp8",
        "weight",
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "block",
            "block_structure": [8, 16],
        },
        (20, 32),
    ),
    ("w-nvfp4", "weight", _NVFP4, (16, 32)),
    ("in-tensor-uint8", "input", {"num_bits": 8, "symmetric": False}, (2, 8, 32)),
    (
        "in-token-int8",
        "input",
        {"num_bits": 8, "strategy": "token", "dynamic": True},
        (2, 8, 32),
    ),
    ("out-group-int8", "output", {"num_bits": 8, "group_size": 16}, (2, 8, 32)),
    ("k-tensor-fp8", "k", {"num_bits": 8, "type": "float"}, (2, 4, 8, 16)),
    ("v-head-int8", "v", {"num_bits": 8, "strategy": "attn_head"}, (2, 4, 8, 16)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_and_base_name(
    name: str, case: tuple[str, str, dict[str, Any], tuple[int, ...]]
) -> None:
    _, base_name, kwargs, shape = case
    args = QuantizationArgs(**kwargs)
    observer = _named(name, base_name=base_name, args=args, bins=64)
    gen = _gen(3)
    for scale in (1.0, 3.0):
        observer.update(torch.randn(shape, generator=gen) * scale)
    scale_t, _ = observer.get_qparams()
    expected = flatten_for_calibration(torch.empty(shape), base_name, args).shape[1:-1]
    assert tuple(scale_t.shape) == tuple(expected)
    assert bool(torch.isfinite(scale_t).all()) and bool((scale_t > 0).all())
    min_vals, max_vals = observer.get_range()
    assert bool((min_vals <= max_vals).all())
    # Within the histogram's window (symmetric ranges: its largest magnitude).
    assert isinstance(observer, HistogramStatObserver)
    lo, width = observer.histogram.edges()
    reach = torch.maximum(lo.abs(), (lo + 64 * width).abs())
    assert bool((min_vals.abs() <= reach).all() and (max_vals.abs() <= reach).all())


# The per-tensor searches, pinned: the "auto" defaults of several qparams
# differ (batched L2, coarse-to-fine entropy, uniform-bin MSE, start_bin).
PER_TENSOR_SEARCH: dict[str, dict[str, Any]] = {
    "histogram": {"search": "certified"},
    "percentile": {},
    "entropy": {"search": "exhaustive", "start_bin": 128},
    "histogram_mse": {"objective": "bin_centers"},
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "kwargs",
    [{"num_bits": 8}, {"num_bits": 4, "symmetric": False}],
    ids=["int8-sym", "int4-asym"],
)
def test_per_channel_equals_per_tensor_channel_by_channel(
    name: str, kwargs: dict[str, Any]
) -> None:
    # With the same bins and searches, one histogram per channel is the
    # per-tensor observer of that channel.
    weight = (
        torch.randn(6, 256, generator=_gen(4))
        * torch.tensor([0.1, 1.0, 10.0, 1.0, 3.0, 0.5])[:, None]
    )
    weight[3, 7] = 40.0  # an outlier in one channel
    pinned = PER_TENSOR_SEARCH[name]
    channel = _named(
        name, args=QuantizationArgs(strategy="channel", **kwargs), bins=128, **pinned
    )
    channel.update(weight)
    got = channel.get_range()
    for row in range(weight.shape[0]):
        tensor = _named(name, args=QuantizationArgs(**kwargs), bins=128, **pinned)
        tensor.update(weight[row : row + 1])
        expected = tensor.get_range()
        assert torch.equal(got[0][row].reshape(1), expected[0].reshape(1)), row
        assert torch.equal(got[1][row].reshape(1), expected[1].reshape(1)), row


@pytest.mark.parametrize("name", NAMES)
def test_merge_equals_observing_everything(name: str) -> None:
    args = QuantizationArgs(num_bits=4, group_size=16, symmetric=False)
    gen = _gen(5)
    batches = [torch.randn(4, 32, generator=gen) * s for s in (0.5, 4.0, 1.0)]
    whole = _named(name, base_name="input", args=args, bins=64)
    parts = [_named(name, base_name="input", args=args, bins=64) for _ in batches]
    for batch, part in zip(batches, parts, strict=True):
        whole.update(batch)
        part.update(batch)
    merged = parts[2].merge(parts[0]).merge(parts[1])
    for ours, expected in zip(merged.get_qparams(), whole.get_qparams(), strict=True):
        assert torch.equal(ours, expected)
    assert merged.num_observations == whole.num_observations


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_then_continue(name: str) -> None:
    args = QuantizationArgs(num_bits=8, strategy="channel")
    gen = _gen(6)
    batches = [torch.randn(8, 64, generator=gen) * s for s in (1.0, 2.0)]
    straight = _named(name, args=args, bins=64)
    for batch in batches:
        straight.update(batch)
    first = _named(name, args=args, bins=64)
    first.update(batches[0])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = _named(name, args=args, bins=64)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    resumed.update(batches[1])
    for ours, expected in zip(
        resumed.get_qparams(), straight.get_qparams(), strict=True
    ):
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("name", NAMES)
def test_nan_policy(name: str) -> None:
    x = torch.randn(4, 16, generator=_gen(7))
    x[1, 2], x[2, :] = math.nan, -math.inf
    # update reads nothing on the host (issue 24): the error waits for
    # qparams, and stays until reset (the counts of such a batch are void)
    for args in (None, QuantizationArgs(num_bits=8, strategy="channel")):
        raising = _named(name, bins=64) if args is None else _named(name, args=args)
        raising.update(x)
        raising.update(torch.randn(4, 16, generator=_gen(8)))
        for _ in range(2):
            with pytest.raises(
                ValueError,
                match=rf"got non-finite value\(s\) \(NaN or inf\) in "
                rf"{1 if args is None else 2} qparam range\(s\)",
            ):
                raising.get_qparams()
        raising.reset()
        raising.update(x[:1])  # finite
        raising.get_qparams()
    args = QuantizationArgs(num_bits=8, strategy="channel")
    observer = _named(name, args=args, bins=64, nan_policy="omit")
    observer.update(x)
    assert isinstance(observer, HistogramStatObserver)
    assert observer.histogram.total().reshape(-1).tolist() == [16, 15, 0, 16]
    scale, _ = observer.get_qparams()
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    min_vals, max_vals = observer.get_range()
    assert min_vals[2] == 0 and max_vals[2] == 0  # a channel with no finite value


@pytest.mark.parametrize("name", NAMES)
def test_errors(name: str) -> None:
    observer = _named(name)
    with pytest.raises(RuntimeError, match="has no statistics; call update"):
        observer.get_qparams()
    budget = _named(
        name,
        args=QuantizationArgs(num_bits=8, strategy="channel"),
        max_counts=4096,
        bins=2048,
    )
    with pytest.raises(
        ValueError, match=rf"observer '{name}' for 'weight' would keep 8 qparams x 2048"
    ):
        budget.update(torch.randn(8, 4))
    with pytest.raises(ValueError, match=rf"options for observer '{name}': bins=4"):
        _named(name, bins=4)
    with pytest.raises(ValueError, match="bins must be 'auto' or an int >= 8"):
        _named(name, bins="many")


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("percentile", {"percentile": 0.0}, "percentile"),
        ("percentile", {"percentile": 100.5}, "percentile"),
        ("entropy", {"start_bin": 0}, "start_bin"),
        ("entropy", {"stride": 0}, "stride"),
        ("entropy", {"num_quantized_bins": 0}, "num_quantized_bins"),
        ("histogram", {"mode": "greedy"}, "mode"),
        ("histogram_mse", {"norm": 0}, "norm"),
        ("histogram_mse", {"maxshrink": 1.5}, "maxshrink"),
        ("histogram", {"percentile": 99.0}, "Extra inputs are not permitted"),
    ],
)
def test_bad_options(name: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _named(name, **options)


def test_torch_mode_is_torchs_search_on_our_histogram() -> None:
    args = QuantizationArgs(num_bits=8, symmetric=False, strategy="channel")
    observer = _named("histogram", args=args, mode="torch", bins=256)
    weight = torch.randn(3, 500, generator=_gen(8))
    weight[1, 0] = 30.0
    observer.update(weight)
    assert isinstance(observer, HistogramL2Observer)
    hist = observer.histogram
    lo, width = hist.edges()
    min_vals, max_vals = observer.get_range()
    for q in range(3):
        expected = torch_l2_search(
            hist.counts[q, 0].float(),
            lo[q, 0].float(),
            (lo[q, 0] + 256 * width[q, 0]).float(),
            256,
        )
        assert torch.equal(min_vals[q, 0], expected[0])
        assert torch.equal(max_vals[q, 0], expected[1])


def test_histogram_levels_follow_the_format() -> None:
    # Global mode: the returned range's ends are destination-bin centers, so
    # scale = (max - min) / (qmax - qmin) is the destination bin width.
    x = torch.rand(4000, generator=_gen(9)).reshape(-1, 1)
    for bits in (4, 8):
        observer = _named(
            "histogram",
            base_name="input",
            args=QuantizationArgs(num_bits=bits, symmetric=False),
            bins=64,
        )
        observer.update(x)
        min_vals, max_vals = observer.get_range()
        levels = 2**bits
        step = (max_vals - min_vals) / (levels - 1)
        assert float(max_vals + step / 2) <= float(x.max()) + 1e-6 + 1 / 64
        assert float(min_vals) >= -step / 2 - 1e-6


@pytest.mark.parametrize("policy", ["raise", "omit"])
def test_speculative_observer_handles_nonfinite_like_two_passes(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quantobs.stats.speculate as observers

    args = QuantizationArgs(num_bits=8, symmetric=False)
    x = torch.randn(64, 2048)
    bad = x.clone()
    bad[0, 5], bad[3, 77], bad[9, 1000] = math.nan, math.inf, -math.inf

    def run() -> Observer:
        obs = Observer.load_from_registry(
            "histogram", base_name="input", args=args, nan_policy=policy
        )
        obs.update(x)
        obs.update(bad)  # under "raise" the error waits for qparams
        obs.update(x * 2)
        return obs

    fast = run()
    monkeypatch.setattr(observers, "speculate", lambda hist, x_flat: None)
    slow = run()
    if policy == "raise":  # the counts are void: both raise
        for obs in (fast, slow):
            with pytest.raises(ValueError, match=r"non-finite value\(s\)"):
                obs.get_qparams()
        return
    for name, value in slow.statistic().state().items():
        assert torch.equal(fast.statistic().state()[name], value), name


def test_histogram_observer_pickles_after_a_refused_batch() -> None:
    args = QuantizationArgs(num_bits=8, symmetric=False)
    obs = Observer.load_from_registry("histogram", base_name="input", args=args)
    x = torch.randn(64, 2048)
    obs.update(x)
    bad = x.clone()
    bad[0, 0] = math.nan
    obs.update(bad)  # speculated; the NaN policy raises at qparams time
    buffer = io.BytesIO()
    torch.save(obs, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for name, value in obs.statistic().state().items():
        torch.testing.assert_close(
            loaded.statistic().state()[name], value, rtol=0, atol=0, equal_nan=True
        )
    for observer in (obs, loaded):
        with pytest.raises(ValueError, match="non-finite"):
            observer.get_qparams()


@pytest.mark.parametrize(
    ("kwargs", "groups", "mib"),
    [
        (_NVFP4, 8192 * 8192 // 16, 2048),
        (_MXFP4, 8192 * 8192 // 32, 1024),
        ({"num_bits": 4, "strategy": "group", "group_size": 128}, None, 256),
    ],
    ids=["nvfp4", "mxfp4", "int4-group128"],
)
@pytest.mark.parametrize("name", NAMES)
def test_per_group_histograms_of_a_large_weight_fit_or_refuse(
    name: str, kwargs: dict[str, Any], groups: int | None, mib: int
) -> None:
    # An 8192 x 8192 weight, planned on the meta device: nothing allocated.
    # NVFP4 / MX groups (16 / 32 values, 64 bins each) would need 2 / 1 GiB
    # of int64 counts and are refused before any allocation (docs/
    # architecture.md, "Histograms on a GPU"); int4 groups of 128 fit.
    observer = _named(name, args=QuantizationArgs(**kwargs))
    weight = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
    if groups is not None:
        with pytest.raises(
            ValueError,
            match=rf"would keep {groups} qparams x 64 bins .* \({mib} MiB\), above "
            r"max_counts=67108864; use a coarser granularity",
        ):
            observer.update(weight)
        return
    observer.update(weight)
    counts = observer.statistic().state()["counts"]
    assert counts.shape == (8192, 64, 64)
    assert counts.numel() * counts.element_size() == mib * 2**20
