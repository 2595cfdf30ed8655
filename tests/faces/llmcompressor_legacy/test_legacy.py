"""Legacy (llm-compressor <= 0.7) observer face: parity with the looped algorithm."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from math import ceil
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization.utils import calculate_qparams as ct_qparams

from quantobs import QuantizationArgs, calculate_qparams
from quantobs.faces.llmcompressor_legacy import (
    GROUPS_ID,
    MinMaxObserver,
    MovingAverageMSEObserver,
    Observer,
)
from tests.format_args import NVFP4 as _NVFP4

# ------------------------------------------------------------------ reference


class LegacyReference:
    """llm-compressor <= 0.7's observers transcribed literally: a Python loop
    over groups, a dict of running ranges per tensor_id, a loop over MSE
    candidates; ranges become qparams through `quantobs.calculate_qparams`."""

    def __init__(self, args: QuantizationArgs, kind: str, **options: Any) -> None:
        self.args, self.kind = args, kind
        self.c = options.get("averaging_constant", 0.01)
        self.maxshrink = options.get("maxshrink", 0.2)
        self.patience = options.get("patience", 5)
        self.grid = options.get("grid", 100.0)
        self.norm = options.get("norm", 2.4)
        self.min_val: dict[Hashable, torch.Tensor] = {}
        self.max_val: dict[Hashable, torch.Tensor] = {}

    def get_qparams(self, observed, g_idx=None, global_scale=None):
        strategy = self.args.strategy
        if strategy == "tensor":
            return self.calculate_qparams(observed)
        if strategy == "channel":
            return self.get_qparams_along_dim(observed, 0)
        if strategy == "token":
            return self.get_qparams_along_dim(observed, {0, 1})
        group_size = self.args.group_size
        rows, columns = observed.shape
        num_groups = ceil(columns / group_size)
        scale = torch.empty((rows, num_groups), dtype=observed.dtype)
        zero_point = torch.empty((rows, num_groups), dtype=self.args.zp_dtype)
        if g_idx is None or -1 in g_idx:
            group_sizes = torch.full((num_groups,), group_size, dtype=torch.int)
        else:
            group_indices, group_sizes = torch.unique(g_idx, return_counts=True)
            group_sizes = group_sizes[torch.argsort(group_indices)]
            observed = observed[:, torch.argsort(g_idx)]
        end = 0
        for group_index, group_count in enumerate(group_sizes):
            start = end
            end = start + group_count
            s, z = self.get_qparams_along_dim(
                observed[:, start:end], 0, group_index, global_scale
            )
            scale[:, group_index] = s.squeeze(1)
            zero_point[:, group_index] = z.squeeze(1)
        return scale, zero_point

    def get_qparams_along_dim(self, observed, dim, tensor_id=None, global_scale=None):
        dims = {dim} if isinstance(dim, int) else set(dim)
        reduce_dims = tuple(i for i in range(observed.ndim) if i not in dims)
        return self.calculate_qparams(observed, reduce_dims, tensor_id, global_scale)

    def calculate_qparams(
        self, observed, reduce_dims=None, tensor_id=None, global_scale=None
    ):
        tensor_id = tensor_id or "default"
        if not reduce_dims:
            min_val, max_val = torch.aminmax(observed)
        else:
            min_val = torch.amin(observed, dim=reduce_dims, keepdim=True)
            max_val = torch.amax(observed, dim=reduce_dims, keepdim=True)
        if self.kind == "mse":
            min_val, max_val = self.mse_min_max(observed, reduce_dims, min_val, max_val)
        elif self.c == 1.0:
            self.min_val[tensor_id], self.max_val[tensor_id] = min_val, max_val
            return calculate_qparams(min_val, max_val, self.args, global_scale)
        running_min = self.min_val.get(tensor_id)
        running_max = self.max_val.get(tensor_id)
        if running_min is None or running_max is None:
            pass
        elif self.c is None:
            min_val = torch.minimum(min_val, running_min)
            max_val = torch.maximum(max_val, running_max)
        else:
            min_val = running_min + self.c * (min_val - running_min)
            max_val = running_max + self.c * (max_val - running_max)
        self.min_val[tensor_id], self.max_val[tensor_id] = min_val, max_val
        return calculate_qparams(min_val, max_val, self.args, global_scale)

    def mse_min_max(self, observed, reduce_dims, absolute_min, absolute_max):
        # Without a global scale, NVFP4 group scales stay unrounded.
        args = self.args
        if args.strategy == "tensor_group":
            args = args.model_copy(update={"scale_dtype": None})
        fmt = args.format
        best = torch.full_like(absolute_min, torch.finfo(absolute_min.dtype).max)
        min_val = torch.ones_like(absolute_min)
        max_val = torch.zeros_like(absolute_max)
        no_improve_count = 0
        for i in range(int(self.maxshrink * self.grid)):
            p = 1 - i / self.grid
            shrinked_min, shrinked_max = p * absolute_min, p * absolute_max
            scale, zero_point = calculate_qparams(shrinked_min, shrinked_max, args)
            zp = zero_point.to(observed.dtype)
            codes = fmt.round(torch.clamp(observed / scale + zp, fmt.min, fmt.max))
            q = (codes - zp) * scale
            q -= observed
            q.abs_()
            q.pow_(self.norm)
            err = torch.sum(q) if not reduce_dims else torch.sum(q, reduce_dims, True)
            tmp = err < best
            if torch.any(tmp):
                best[tmp] = err[tmp]
                min_val[tmp] = shrinked_min[tmp]
                max_val[tmp] = shrinked_max[tmp]
                no_improve_count = 0
            else:
                no_improve_count += 1
                if self.patience is not None and no_improve_count >= self.patience:
                    break
        return min_val, max_val


# ---------------------------------------------------------------------- cases

_FP8 = {"num_bits": 8, "type": "float"}
# id -> (args, batch shape, use a random g_idx)
CASES: dict[str, tuple[dict[str, Any], tuple[int, ...], bool]] = {
    "tensor-int8": ({"num_bits": 8}, (16, 32), False),
    "tensor-int8-asym": ({"num_bits": 8, "symmetric": False}, (4, 8, 32), False),
    "tensor-fp8": (_FP8, (16, 32), False),
    "channel-int4": ({"num_bits": 4, "strategy": "channel"}, (16, 32), False),
    "channel-int8-asym": (
        {"num_bits": 8, "strategy": "channel", "symmetric": False},
        (16, 32),
        False,
    ),
    "channel-fp8-4d": ({**_FP8, "strategy": "channel"}, (8, 4, 3, 3), False),
    "group-int4": ({"num_bits": 4, "group_size": 8}, (16, 32), False),
    "group-int4-asym": (
        {"num_bits": 4, "group_size": 8, "symmetric": False},
        (16, 32),
        False,
    ),
    "group-int4-asym-gidx": (
        {"num_bits": 4, "group_size": 8, "symmetric": False, "actorder": "group"},
        (16, 32),
        True,
    ),
    "group-int8-gidx": ({"num_bits": 8, "group_size": 16}, (8, 64), True),
    "token-int8": (
        {"num_bits": 8, "strategy": "token", "dynamic": True},
        (2, 6, 32),
        False,
    ),
    "token-int8-asym-2d": (
        {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": False},
        (6, 32),
        False,
    ),
    "tensor-group-nvfp4": (_NVFP4, (8, 64), False),
}
MSE_CASES = [
    "tensor-int8",
    "tensor-fp8",
    "channel-int4",
    "channel-int8-asym",
    "group-int4-asym",
    "group-int4-asym-gidx",
    "token-int8",
    "tensor-group-nvfp4",
]


def _batches(shape: tuple[int, ...], seed: int, count: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Different spreads and offsets per batch, so the moving average matters.
    return [
        torch.randn(shape, generator=gen) * (1.0 + 2 * i) + 0.3 * i
        for i in range(count)
    ]


def _g_idx(columns: int, group_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    groups = torch.arange(columns) // group_size
    return groups[torch.randperm(columns, generator=gen)].to(torch.int32)


def _assert_same(ours: tuple[Any, Any], ref: tuple[Any, Any]) -> None:
    for mine, theirs in zip(ours, ref, strict=True):
        assert mine.shape == theirs.shape
        assert mine.dtype == theirs.dtype
        assert torch.equal(mine, theirs)


def _run_parity(case: str, kind: str, options: dict[str, Any], count: int) -> None:
    kwargs, shape, use_g_idx = CASES[case]
    args = QuantizationArgs(**kwargs)
    cls = MinMaxObserver if kind == "minmax" else MovingAverageMSEObserver
    observer = cls(args, **options)
    reference = LegacyReference(args, kind, **options)
    g_idx = _g_idx(shape[-1], args.group_size or 1, 7) if use_g_idx else None
    global_scale = (
        torch.tensor([448.0 * 6.0 / 4.0]) if args.strategy == "tensor_group" else None
    )
    for x in _batches(shape, seed=len(case), count=count):
        ours = observer(x, g_idx=g_idx, global_scale=global_scale)
        ref = reference.get_qparams(x, g_idx=g_idx, global_scale=global_scale)
        _assert_same(ours, ref)
    assert observer.get_qparams() == ours  # cached: the very same tensors


# --------------------------------------------------------------------- parity


@pytest.mark.parametrize("constant", [0.01, 1.0, None], ids=["c0.01", "c1", "static"])
@pytest.mark.parametrize("case", list(CASES))
def test_minmax_matches_legacy_loop(case: str, constant: float | None) -> None:
    _run_parity(case, "minmax", {"averaging_constant": constant}, count=3)


@pytest.mark.parametrize("constant", [0.01, 1.0], ids=["c0.01", "c1"])
@pytest.mark.parametrize("case", MSE_CASES)
def test_mse_matches_legacy_loop(case: str, constant: float) -> None:
    _run_parity(case, "mse", {"averaging_constant": constant}, count=2)


@pytest.mark.parametrize(
    "options",
    [{"patience": None}, {"patience": 1, "maxshrink": 0.5}, {"norm": 2.0, "grid": 20}],
    ids=["no-patience", "patience1", "norm2-grid20"],
)
@pytest.mark.parametrize("case", ["channel-int4", "group-int4-asym-gidx"])
def test_mse_options_match_legacy_loop(case: str, options: dict[str, Any]) -> None:
    _run_parity(case, "mse", options, count=1)


@pytest.mark.parametrize("patience", [0, 1, 2, 3])
def test_mse_patience_is_per_group(patience: int) -> None:
    # One row per group: groups stop at different candidates, and a stop
    # shared by all groups (or a streak one too long) gives other ranges.
    args = QuantizationArgs(num_bits=4, group_size=16, symmetric=False)
    x = _batches((1, 1024), seed=patience, count=1)[0]
    ours = MovingAverageMSEObserver(args, patience=patience)(x)
    reference = LegacyReference(args, "mse", patience=patience)
    _assert_same(ours, reference.get_qparams(x))
    exhaustive = MovingAverageMSEObserver(args, patience=None)(x)
    assert not torch.equal(ours[0], exhaustive[0])


def test_bfloat16_keeps_dtype_and_matches() -> None:
    # the reference's qparams are float32 arithmetic on the bfloat16 ranges;
    # the default arithmetic, bfloat16's own, is checked against the real
    # llm-compressor 0.7.1 in test_low_precision.py
    args = QuantizationArgs(num_bits=4, group_size=8, symmetric=False)
    observer = MinMaxObserver(args, arithmetic="float32")
    reference = LegacyReference(args, "minmax")
    for x in _batches((8, 32), seed=3):
        x = x.to(torch.bfloat16)
        _assert_same(observer(x), reference.get_qparams(x))
    assert observer.get_qparams()[0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "reduce"),
    [
        ({"num_bits": 8}, None),
        ({"num_bits": 8, "symmetric": False}, None),
        ({"num_bits": 8, "strategy": "channel"}, (1,)),
        ({"num_bits": 4, "strategy": "channel", "symmetric": False}, (1,)),
        ({**_FP8, "strategy": "channel"}, (1,)),
        ({"num_bits": 4, "group_size": 8, "symmetric": False}, "group"),
    ],
    ids=[
        "tensor",
        "tensor-asym",
        "channel",
        "channel-int4-asym",
        "channel-fp8",
        "group",
    ],
)
def test_static_one_batch_matches_compressed_tensors(
    kwargs: dict[str, Any], reduce: Any
) -> None:
    x = _batches((16, 32), seed=11, count=1)[0]
    ours = MinMaxObserver(QuantizationArgs(**kwargs))(x)
    if reduce == "group":
        grouped = x.reshape(16, 4, 8)  # (rows, num_groups, group_size)
        min_vals, max_vals = grouped.amin(-1), grouped.amax(-1)
    elif reduce is None:
        min_vals, max_vals = torch.aminmax(x)
    else:
        min_vals, max_vals = x.amin(reduce, keepdim=True), x.amax(reduce, keepdim=True)
    theirs = ct_qparams(min_vals, max_vals, CTArgs(**kwargs))
    _assert_same(ours, theirs)


# ------------------------------------------------------------ shapes and state


def test_shapes_dtypes_and_group_state() -> None:
    x = torch.randn(16, 32)
    cases = [
        ({"num_bits": 8}, (1,), torch.int8),
        ({"num_bits": 8, "strategy": "channel"}, (16, 1), torch.int8),
        ({**_FP8, "strategy": "channel"}, (16, 1), torch.float8_e4m3fn),
        ({"num_bits": 4, "group_size": 8}, (16, 4), torch.int8),
    ]
    token = {"num_bits": 8, "strategy": "token", "dynamic": True}
    cases += [(token, (2, 8, 1), torch.int8), (token, (1,), torch.int8)]  # 3-D, 2-D
    for kwargs, shape, zp_dtype in cases:
        observed = x.reshape(2, 8, 32) if shape == (2, 8, 1) else x
        scale, zero_point = MinMaxObserver(QuantizationArgs(**kwargs))(observed)
        assert scale.shape == zero_point.shape == shape
        assert scale.dtype == torch.float32 and zero_point.dtype == zp_dtype
    observer = MinMaxObserver(QuantizationArgs(num_bits=4, group_size=8))
    observer(x)
    assert observer.min_val[GROUPS_ID].shape == (16, 4)
    assert list(observer.min_val) == [GROUPS_ID]


def test_direct_calls_keep_a_range_per_tensor_id() -> None:
    args = QuantizationArgs(num_bits=8, strategy="channel")
    observer, reference = MinMaxObserver(args), LegacyReference(args, "minmax")
    a, b, c = _batches((8, 16), seed=5)
    for tensor_id, x in [("a", a), ("b", b), ("a", c), (0, b), (None, c)]:
        ours = observer.calculate_qparams(x, reduce_dims=(-1,), tensor_id=tensor_id)
        ref = reference.calculate_qparams(x, (1,), tensor_id)
        _assert_same(ours, ref)
    assert set(observer.min_val) == {"a", "b", "default"}  # 0 and None: "default"
    along = MinMaxObserver(args).get_qparams_along_dim(a, -2)
    _assert_same(along, MinMaxObserver(args)(a))


def test_forward_counts_2d_tokens_only_and_reset_forgets() -> None:
    observer = MinMaxObserver(QuantizationArgs(num_bits=8))
    assert observer.get_qparams() == (None, None)
    observer(torch.randn(2, 5, 8))
    assert observer._num_observed_tokens is None
    observer(torch.randn(5, 8))
    observer(torch.randn(3, 8))
    assert observer._num_observed_tokens == 8
    observer.reset()
    assert observer._num_observed_tokens is None
    assert observer.get_qparams() == (None, None)
    assert observer.min_val == {} and observer.max_val == {}


def test_column_order_when_g_idx_is_uninitialized() -> None:
    args = QuantizationArgs(num_bits=4, group_size=8)
    x = torch.randn(4, 32)
    with_minus_one = MinMaxObserver(args)(x, g_idx=torch.full((32,), -1))
    _assert_same(with_minus_one, MinMaxObserver(args)(x))


def test_g_idx_is_ignored_by_channel_strategy() -> None:
    # llm-compressor's GPTQ passed g_idx to channel-strategy observers.
    args = QuantizationArgs(num_bits=4, strategy="channel")
    x = torch.randn(4, 32)
    _assert_same(
        MinMaxObserver(args)(x, g_idx=_g_idx(32, 8, 1)), MinMaxObserver(args)(x)
    )


def test_compressed_tensors_args_are_accepted() -> None:
    x = torch.randn(4, 32)
    ours = MinMaxObserver(CTArgs(num_bits=4, group_size=8))(x)
    _assert_same(ours, MinMaxObserver(QuantizationArgs(num_bits=4, group_size=8))(x))


def test_options_from_observer_kwargs() -> None:
    args = QuantizationArgs(num_bits=8, observer="mse", observer_kwargs={"grid": 50})
    observer = Observer.load_from_registry("mse", quantization_args=args, norm=3.0)
    assert isinstance(observer, MovingAverageMSEObserver)
    assert (observer.options.grid, observer.options.norm) == (50, 3.0)


# ------------------------------------------------------------------- registry


def test_registry_is_case_insensitive() -> None:
    args = QuantizationArgs(num_bits=8)
    assert type(Observer.load_from_registry("MinMax", quantization_args=args)) is (
        MinMaxObserver
    )
    assert Observer.get_value_from_registry(" MSE ") is MovingAverageMSEObserver
    with pytest.raises(KeyError, match=r"unknown observer 'nope'.*minmax.*mse"):
        Observer.load_from_registry("nope", quantization_args=args)


class _Calls(Observer):
    """A third-party subclass overriding only `calculate_qparams`."""

    def __init__(self, quantization_args: Any) -> None:
        super().__init__(quantization_args)
        self.calls: list[tuple[tuple[int, ...], Any, Any]] = []

    def calculate_qparams(
        self, observed, reduce_dims=None, tensor_id=None, global_scale=None
    ):
        self.calls.append((tuple(observed.shape), reduce_dims, tensor_id))
        min_vals = observed.amin(dim=reduce_dims, keepdim=True)
        max_vals = observed.amax(dim=reduce_dims, keepdim=True)
        return calculate_qparams(min_vals, max_vals, self.quantization_args)


def test_custom_subclass_gets_one_call_for_all_groups() -> None:
    Observer.register("legacy_test_calls")(_Calls)
    args = QuantizationArgs(num_bits=4, group_size=8)
    observer = Observer.load_from_registry("Legacy-Test-Calls", quantization_args=args)
    x = torch.randn(4, 32)
    scale, _ = observer(x)
    assert observer.calls == [((4, 4, 8), (2,), GROUPS_ID)]
    _assert_same((scale,), (MinMaxObserver(args)(x)[0],))
    with pytest.raises(ValueError, match="already registered"):
        Observer.register("legacy-test-calls")(MinMaxObserver)


# --------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda o: o(torch.randn(4, 30)), ValueError, "does not divide the 30"),
        (lambda o: o(torch.randn(2, 4, 32)), ValueError, "needs a 2-D"),
        (lambda o: o([1.0, 2.0]), ValueError, "expected a torch.Tensor"),
        (lambda o: o.get_qparams([1.0]), TypeError, "must be a torch.Tensor"),
        (lambda o: o(torch.ones(4, 32, dtype=torch.int32)), TypeError, "floating"),
        (lambda o: o(torch.empty(0, 32)), ValueError, "empty"),
        (
            lambda o: o(torch.full((4, 32), float("nan"))),
            ValueError,
            "128 non-finite",
        ),
        (
            lambda o: o(torch.randn(4, 32), g_idx=torch.zeros(32, dtype=torch.int64)),
            ValueError,
            "exactly 8 columns",
        ),
        (lambda o: o.get_qparams_along_dim(torch.randn(4, 32), 2), ValueError, "-2..1"),
        (
            lambda o: o.calculate_qparams(torch.randn(4, 32), reduce_dims=(1, -1)),
            ValueError,
            "repeats",
        ),
    ],
    ids=[
        "group-size",
        "group-3d",
        "forward-not-tensor",
        "not-tensor",
        "int-tensor",
        "empty",
        "nan",
        "g_idx-sizes",
        "dim-range",
        "dim-repeat",
    ],
)
def test_bad_inputs(call: Any, error: type[Exception], match: str) -> None:
    observer = MinMaxObserver(QuantizationArgs(num_bits=4, group_size=8))
    with pytest.raises(error, match=match):
        call(observer)


def test_changed_shape_with_moving_average_needs_reset() -> None:
    observer = MinMaxObserver(QuantizationArgs(num_bits=8, strategy="channel"))
    observer(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"\(4, 1\) to \(6, 1\); call reset\(\)"):
        observer(torch.randn(6, 8))
    observer.reset()
    observer(torch.randn(6, 8))
    latest_only = MinMaxObserver(
        QuantizationArgs(num_bits=8, strategy="channel"), averaging_constant=1.0
    )
    latest_only(torch.randn(4, 8))
    latest_only(torch.randn(6, 8))  # no running range is kept: no error


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: MinMaxObserver(
                QuantizationArgs(strategy="block", block_structure=[8, 8])
            ),
            ValueError,
            "'block' is not supported by the legacy",
        ),
        (
            lambda: MinMaxObserver(QuantizationArgs(strategy="attn_head")),
            ValueError,
            "'attn_head' is not supported",
        ),
        (lambda: MinMaxObserver({"num_bits": 9}), ValueError, "num_bits=9"),
        (lambda: MinMaxObserver(8), TypeError, "got int"),
        (
            lambda: MinMaxObserver(QuantizationArgs(), averaging_constant=0.0),
            ValueError,
            "averaging_constant",
        ),
        (
            lambda: MinMaxObserver(QuantizationArgs(), maxshrink=0.5),
            ValueError,
            "Extra inputs",
        ),
        (
            lambda: MovingAverageMSEObserver(QuantizationArgs(), grid=2, maxshrink=0.2),
            ValueError,
            "no candidate range",
        ),
    ],
    ids=["block", "attn_head", "bad-args", "not-args", "constant", "typo", "grid"],
)
def test_bad_construction(build: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_base_observer_needs_calculate_qparams() -> None:
    with pytest.raises(NotImplementedError, match="must implement calculate_qparams"):
        Observer(QuantizationArgs())(torch.randn(4, 4))


# ------------------------------------------- ranges in buffers: devices, state

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# id -> (observer class, options)
STATEFUL: dict[str, tuple[type[Observer], dict[str, Any]]] = {
    "minmax-c0.01": (MinMaxObserver, {}),
    "minmax-c1": (MinMaxObserver, {"averaging_constant": 1.0}),
    "minmax-static": (MinMaxObserver, {"averaging_constant": None}),
    "mse-c0.01": (MovingAverageMSEObserver, {}),
}
STATE_CASES = ["channel-int8-asym", "group-int4-asym-gidx", "token-int8"]


def _stateful(kind: str, case: str) -> Observer:
    cls, options = STATEFUL[kind]
    return cls(QuantizationArgs(**CASES[case][0]), **options)


def _feed(
    observer: Observer, case: str, batches: list[torch.Tensor]
) -> tuple[Any, Any]:
    """Observe `batches` as `get_qparams` does, plus direct calls per tensor id
    (a str, an int and a tuple id), and return the last qparams."""
    kwargs, shape, use_g_idx = CASES[case]
    group_size = kwargs.get("group_size", 1)
    device = batches[0].device
    g_idx = _g_idx(shape[-1], group_size, 7).to(device) if use_g_idx else None
    qparams = (None, None)
    for x in batches:
        qparams = observer(x, g_idx=g_idx)
        flat = x.reshape(-1, x.shape[-1])
        for tensor_id in ("a", 3, ("b", 1)):
            observer.calculate_qparams(flat, reduce_dims=(1,), tensor_id=tensor_id)
    return qparams


def _ranges(observer: Observer) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (observer.min_val[k], observer.max_val[k]) for k in observer.min_val}


def _assert_same_ranges(ours: Observer, theirs: Observer) -> None:
    mine, other = _ranges(ours), _ranges(theirs)
    assert list(mine) == list(other)
    for key in mine:
        _assert_same(mine[key], other[key])


@pytest.mark.parametrize("case", STATE_CASES)
@pytest.mark.parametrize("kind", list(STATEFUL))
def test_ranges_are_registered_buffers(kind: str, case: str) -> None:
    observer = _stateful(kind, case)
    _feed(observer, case, _batches(CASES[case][1], seed=1, count=2))
    buffers = [b for _, b in observer.named_buffers()]
    saved = [v for v in observer.state_dict().values() if isinstance(v, torch.Tensor)]
    assert set(observer.min_val) == {GROUPS_ID if "group" in case else "default"} | {
        "a",
        3,
        ("b", 1),
    }
    for min_vals, max_vals in _ranges(observer).values():
        for value in (min_vals, max_vals):
            assert any(value is b for b in buffers)
            assert any(torch.equal(value, s) for s in saved)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(STATEFUL))
def test_to_device_moves_ranges_and_cached_qparams(kind: str, device: str) -> None:
    case = "group-int4-asym-gidx"
    observer = _stateful(kind, case)
    batches = _batches(CASES[case][1], seed=2, count=2)
    _feed(observer, case, batches)
    before = {k: (lo.clone(), hi.clone()) for k, (lo, hi) in _ranges(observer).items()}
    observer.to(device)
    for key, (low, high) in _ranges(observer).items():
        assert low.device.type == high.device.type == device
        _assert_same((low.cpu(), high.cpu()), before[key])
    scale, zero_point = observer.get_qparams()
    assert scale is not None and zero_point is not None
    assert scale.device.type == zero_point.device.type == device
    # A fresh observer moved first loads the saved ranges onto its device.
    fresh = _stateful(kind, case).to(device)
    fresh.load_state_dict(observer.state_dict())
    assert all(lo.device.type == device for lo, _ in _ranges(fresh).values())
    scale, _ = _feed(fresh, case, [b.to(device) for b in batches])
    assert scale.device.type == device


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("case", STATE_CASES)
@pytest.mark.parametrize("kind", list(STATEFUL))
def test_state_dict_then_more_batches_equals_one_run(
    kind: str, case: str, split: int
) -> None:
    batches = _batches(CASES[case][1], seed=3, count=3)
    whole = _stateful(kind, case)
    expected = _feed(whole, case, batches)
    first = _stateful(kind, case)
    _feed(first, case, batches[:split])
    resumed = _stateful(kind, case)
    resumed.load_state_dict(first.state_dict())
    assert resumed._num_observed_tokens == first._num_observed_tokens
    _assert_same_ranges(resumed, first)
    _assert_same(_feed(resumed, case, batches[split:]), expected)
    _assert_same_ranges(resumed, whole)


def test_state_dict_keeps_input_dtype_and_loads_through_torch_save(
    tmp_path: Any,
) -> None:
    args = QuantizationArgs(num_bits=4, group_size=8, symmetric=False)
    observer = MinMaxObserver(args)
    observer(_batches((8, 32), seed=4, count=1)[0].to(torch.bfloat16))
    torch.save(observer.state_dict(), tmp_path / "state.pt")
    fresh = MinMaxObserver(args)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert fresh.min_val[GROUPS_ID].dtype == torch.bfloat16
    _assert_same_ranges(fresh, observer)


@pytest.mark.parametrize("kind", list(STATEFUL))
def test_torch_save_and_deepcopy_keep_observing_alike(kind: str, tmp_path: Any) -> None:
    case = "group-int4-asym-gidx"
    batches = _batches(CASES[case][1], seed=5, count=3)
    first, rest = batches[:1], batches[1:]
    observer = _stateful(kind, case)
    _feed(observer, case, first)
    torch.save(observer, tmp_path / "observer.pt")
    loaded = torch.load(tmp_path / "observer.pt", weights_only=False)
    copied = copy.deepcopy(observer)
    expected = _feed(observer, case, rest)
    for other in (loaded, copied):
        _assert_same(_feed(other, case, rest), expected)
        _assert_same_ranges(other, observer)
    # The copy's buffers are its own.
    copied.reset()
    assert len(observer.min_val) == 4 and observer.has_statistics
    assert len(copied.min_val) == 0 and not copied.has_statistics


def test_static_ranges_merge_exactly() -> None:
    case = "group-int4-asym-gidx"
    batches = _batches(CASES[case][1], seed=6, count=3)
    whole, left, right = (_stateful("minmax-static", case) for _ in range(3))
    _feed(whole, case, batches)
    _feed(left, case, batches[:1])
    _feed(right, case, batches[1:])
    _assert_same_ranges(left.merge(right), whole)
    assert left._num_observed_tokens == whole._num_observed_tokens
    with pytest.raises(ValueError, match="different options"):
        left.merge(_stateful("minmax-c0.01", case))


def test_state_of_another_observer_does_not_load() -> None:
    args = QuantizationArgs(num_bits=8)
    observer = MinMaxObserver(args)
    observer(torch.randn(4, 8))
    with pytest.raises(ValueError, match="state of observer 'minmax' cannot load"):
        MovingAverageMSEObserver(args).load_state_dict(observer.state_dict())
