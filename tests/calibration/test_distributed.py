"""Distributed calibration (`quantobs.calibration.distributed`).

Real gloo process groups of 2 and 3 processes (`dist_workers`), each rank
observing its shard of a fixed list of batches (uneven shards; with 3
processes one rank has no data), against one process observing every batch:
qparams bit for bit, states, counts, the number of collectives, the errors
every rank must raise alike, weights broadcast from their owners, and the
reference agreement of `static_mse`. One set of processes per world size
runs every scenario (process start-up dominates); the tests read its
results. Single-process behaviour and `owners_by_size` need no processes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from quantobs.calibration import distributed as qdist
from quantobs.calibration import owners as qowners
from quantobs.stats.base import reduce_states
from quantobs.stats.minmax import MovingAverage
from quantobs.stats.torch_histogram import TorchHistogram
from tests.calibration import dist_workers as workers

Runs = list[dict[str, Any]]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Runs:
    """Every scenario of `dist_workers.everything`, by rank."""
    world: int = request.param
    out: Path = tmp_path_factory.mktemp(f"world{world}")
    return workers.launch(workers.everything, world, out)


@functools.cache
def one_process(name: str, case: str) -> tuple[Any, ...]:
    """`(scale, zero_point, num_observations, num_observed_tokens, state)` of
    one process observing every batch."""
    obs = workers.single_process(name, case, list(range(workers.NUM_BATCHES)))
    scale, zero_point = obs.get_qparams()
    state = obs.statistic().state()
    return scale, zero_point, obs.num_observations, obs.num_observed_tokens, state


# ------------------------------------------------- sync_observers, gloo runs


@pytest.mark.slow
@pytest.mark.parametrize("case", list(workers.CASES))
@pytest.mark.parametrize("name", workers.NAMES)
def test_qparams_equal_one_process(runs: Runs, name: str, case: str) -> None:
    scale, zero_point, count, tokens, _ = one_process(name, case)
    for rank, run in enumerate(runs):
        (found_scale, found_zp), found_count, found_tokens = run["calibrate"][
            f"{name}/{case}"
        ]
        assert torch.equal(found_scale, scale), (rank, found_scale, scale)
        assert torch.equal(found_zp, zero_point), rank
        assert (found_count, found_tokens) == (count, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(workers.CASES))
@pytest.mark.parametrize("name", workers.NAMES)
def test_states_equal_one_process(runs: Runs, name: str, case: str) -> None:
    *_, state = one_process(name, case)
    found = runs[0]["calibrate"]["after"][f"{name}/{case}"]
    assert found.keys() == state.keys()
    for field, value in state.items():
        if field == "errors":  # float64 sums, added in another order
            torch.testing.assert_close(found[field], value, rtol=1e-12, atol=0)
        else:
            assert torch.equal(found[field], value), field


@pytest.mark.slow
def test_every_rank_holds_the_same_state(runs: Runs) -> None:
    first = runs[0]["calibrate"]["after"]
    for run in runs[1:]:
        theirs = run["calibrate"]["after"]
        assert theirs.keys() == first.keys()
        for key, state in first.items():
            if state is None:
                assert theirs[key] is None, key
                continue
            assert theirs[key].keys() == state.keys(), key
            for field, value in state.items():
                assert torch.equal(theirs[key][field], value), (key, field)


@pytest.mark.slow
def test_observer_no_rank_saw_stays_empty(runs: Runs) -> None:
    for run in runs:
        assert run["calibrate"]["unseen"] == (None, 0, None)
        assert run["calibrate"]["after"]["unseen"] is None


@pytest.mark.slow
def test_observer_only_one_rank_saw(runs: Runs) -> None:
    # An MoE expert only rank 1's tokens reached: the others take part with
    # an empty histogram and end with rank 1's.
    seen = workers.shard(1, len(runs))
    expected = workers.single_process("histogram", "int8", seen)
    expected_scale, expected_zp = expected.get_qparams()
    for run in runs:
        (scale, zero_point), count, tokens = run["calibrate"]["expert"]
        assert torch.equal(scale, expected_scale)
        assert torch.equal(zero_point, expected_zp)
        assert (count, tokens) == (expected.num_observations, 16 * len(seen))


@pytest.mark.slow
def test_latest_comes_from_the_highest_rank_with_data(runs: Runs) -> None:
    # The highest rank with data observed the last batch.
    expected = one_process("memoryless_minmax", "int8")
    for run in runs:
        (scale, zero_point), *_ = run["calibrate"]["latest"]
        assert torch.equal(scale, expected[0])
        assert torch.equal(zero_point, expected[1])


@pytest.mark.slow
def test_mean_is_the_count_weighted_mean(runs: Runs) -> None:
    before = [r["calibrate"]["before"]["mean"] for r in runs]
    config = workers.observer("minmax", "int8").statistic_config()
    expected = reduce_states(MovingAverage, [s for s in before if s], **config)
    found = runs[-1]["calibrate"]["after"]["mean"]
    assert torch.equal(found["count"], expected["count"])
    for field in ("min_vals", "max_vals"):
        torch.testing.assert_close(found[field], expected[field])


@pytest.mark.slow
def test_faces_sync_as_their_statistics_merge(runs: Runs) -> None:
    # torch.ao's histogram: moved to the union range (reduce_states).
    before = [r["calibrate"]["before"]["torch"] for r in runs]
    config = workers.torch_histogram().statistic_config()
    expected = reduce_states(TorchHistogram, [s for s in before if s], **config)
    # Quark's: only rank 0 has bins; the others none (zero-size fields).
    quark = workers.quark_histogram()
    quark(workers.batches("int8")[0])
    quark_qparams = workers.face_qparams(quark)
    for run in runs:
        found = run["calibrate"]["after"]
        for field, value in expected.items():
            assert torch.equal(found["torch"][field], value), field
        for field, value in quark.statistic().state().items():
            assert torch.equal(found["quark"][field], value), field
        assert all(
            torch.equal(a, b)
            for a, b in zip(run["calibrate"]["quark"], quark_qparams, strict=True)
        )


@pytest.mark.slow
def test_collectives_are_bucketed(runs: Runs) -> None:
    for run in runs:
        calls = run["collectives"]
        # 6 and 60 observers of 6 kinds: the same collectives, one
        # all-reduce per (op, dtype) and one object gather.
        assert calls["sync1"] == calls["sync10"]
        names = [name for name, _ in calls["sync1"]]
        assert names.count("all_gather_object") == 1
        reduces = [what for name, what in calls["sync1"] if name == "all_reduce"]
        assert len(reduces) == len(set(reduces)) == 4
        assert set(names) == {"all_gather_object", "all_reduce"}
        assert calls["agree"] == [
            ("all_gather_object", ""),
            ("all_reduce", f"{dist.ReduceOp.SUM}:{torch.int64}"),
        ]


@pytest.mark.slow
def test_mismatches_raise_alike_on_every_rank(runs: Runs) -> None:
    # Every rank raises the same error (none waits for the others), and the
    # group still works afterwards (`any_across` ran after them).
    world = len(runs)
    for run in runs:
        found = run["mismatches"]
        assert "observer 2 " in found["equal"]
        assert "CandidateErrors.ref_max" in found["equal"]
        assert "observer 1 " not in found["equal"]
        assert "agree_references" in found["equal"]
        assert f"({[2] + [1] * (world - 1)}, by rank)" in found["length"]
        assert "observer 0 is HistogramL2Observer" in found["kind"]
        assert "tensor 1 is (2,) torch.bfloat16 on rank 1" in found["dtype"]
        assert "torch.float32 on its owner, rank 0" in found["dtype"]
        assert "different owners" in found["owners"]
        assert found["any"] is True
        assert found["none"] is False
    assert len({r["mismatches"]["equal"] for r in runs}) == 1


@pytest.mark.slow
def test_broadcast_from_owners_is_bit_exact(runs: Runs) -> None:
    world = len(runs)
    owners = runs[0]["broadcast"]["owners"]
    expected = [
        workers.raw_bytes(workers.payload(i, owner)) for i, owner in enumerate(owners)
    ]
    owning = {o for i, o in enumerate(owners) if workers.payload(i, 0).numel()}
    for run in runs:
        found = run["broadcast"]
        assert found["owners"] == owners
        assert found["one"] == expected
        assert found["small"] == expected
        # One object gather (checks), then one broadcast per owner.
        gather = [("all_gather_object", "")]
        assert found["one_calls"] == gather + [("broadcast", "")] * len(owning)
        assert len(found["small_calls"]) > 1 + len(owning)
        assert torch.equal(found["parameter"], torch.full((3,), float(world - 1)))


@pytest.mark.slow
def test_agree_references_takes_the_lowest_rank(runs: Runs) -> None:
    late_batch = workers.batches("int8")[1]  # rank 0 had none; rank 1's wins
    first_channels = workers.batches("channel")[0]  # rank 0's wins
    for run in runs:
        found = run["references"]
        assert torch.equal(found["late"]["ref_min"], late_batch.min().reshape(1))
        assert torch.equal(found["late"]["ref_max"], late_batch.max().reshape(1))
        assert not found["late"]["errors"].any()
        assert found["nobody"] is None
        ref_min = found["everyone"]["ref_min"]
        assert torch.equal(ref_min, first_channels.amin(dim=1, keepdim=True))
        assert not found["everyone"]["errors"].any()
        assert found["counts"] == (0, 0)
    agreed_by_rank = [r["calibrate"]["agreed"].values() for r in runs]
    for agreed in zip(*agreed_by_rank, strict=True):
        for state in agreed[1:]:
            assert all(torch.equal(state[k], agreed[0][k]) for k in state)


# ----------------------------------------------------------- owners_by_size


def test_owners_by_size_largest_first_to_least_loaded() -> None:
    assert qowners.owners_by_size([5, 3, 3, 1], 2) == [0, 1, 1, 0]
    assert qowners.owners_by_size([1, 9, 4, 4, 2], 3) == [2, 0, 1, 2, 1]


def test_owners_by_size_ties_go_to_the_lower_rank_and_index() -> None:
    assert qowners.owners_by_size([2, 2, 2, 2], 3) == [0, 1, 2, 0]
    assert qowners.owners_by_size([0, 0], 2) == [0, 0]  # rank 0 stays least loaded
    assert qowners.owners_by_size([], 4) == []
    assert qowners.owners_by_size([7, 1, 3], 1) == [0, 0, 0]


def test_owners_by_size_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="world_size"):
        qowners.owners_by_size([1], 0)
    with pytest.raises(ValueError, match="sizes"):
        qowners.owners_by_size([1, -1], 2)


@given(
    st.lists(st.integers(0, 1000), max_size=30),
    st.integers(1, 6),
)
def test_owners_by_size_balances(sizes: list[int], world: int) -> None:
    owners = qowners.owners_by_size(sizes, world)
    assert owners == qowners.owners_by_size(sizes, world)
    assert all(0 <= o < world for o in owners)
    loads = [0] * world
    for size, owner in zip(sizes, owners, strict=True):
        loads[owner] += size
    # Greedy largest-first: no process exceeds another by more than an item.
    assert max(loads) - min(loads) <= max(sizes, default=0)


# ------------------------------------------------------------ one process


@pytest.fixture
def no_group() -> None:
    if qdist.is_distributed():
        pytest.skip("a process group is initialized in this process")


@pytest.mark.usefixtures("no_group")
def test_without_a_process_group_nothing_is_communicated() -> None:
    assert not qdist.is_distributed()
    assert qdist.rank_and_world() == (0, 1)
    assert qdist.collective_device() == torch.device("cpu")
    assert qdist.any_across(True) is True
    assert qdist.any_across(False) is False
    obs = workers.single_process("histogram", "int8", [0, 1])
    before = {k: v.clone() for k, v in obs.statistic().state().items()}
    qdist.sync_observers([obs])
    after = obs.statistic().state()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert obs.num_observations == 32
    tensor = torch.arange(4.0)
    qowners.broadcast_from_owners([tensor], [0])
    assert torch.equal(tensor, torch.arange(4.0))


@pytest.mark.usefixtures("no_group")
def test_broadcast_from_owners_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="2 tensors but 1 owners"):
        qowners.broadcast_from_owners([torch.zeros(1), torch.zeros(1)], [0])
    with pytest.raises(ValueError, match=r"owners \[1\] are not ranks"):
        qowners.broadcast_from_owners([torch.zeros(1)], [1])


@pytest.mark.usefixtures("no_group")
def test_agree_references_alone_keeps_the_reference_and_drops_errors(
    device: torch.device,
) -> None:
    obs = workers.observer("static_mse", "channel").to(device)
    unseen = workers.observer("static_mse", "int8").to(device)
    data = workers.batches("channel")
    obs.update(data[0].to(device))
    reference = obs.statistic()
    qdist.agree_references([obs, unseen])
    found = obs.statistic()
    assert torch.equal(found.ref_min, reference.ref_min)
    assert torch.equal(found.ref_max, reference.ref_max)
    assert found.errors.device.type == device.type
    assert not found.errors.any()
    assert obs.num_observations == 0
    assert not unseen.has_statistics
    # Then observing every batch equals one process observing them.
    for batch in data:
        obs.update(batch.to(device))
    expected = workers.single_process("static_mse", "channel", list(range(7)))
    torch.testing.assert_close(
        obs.get_qparams()[0].cpu(), expected.get_qparams()[0], rtol=0, atol=0
    )


def test_agree_references_needs_a_reference_observer() -> None:
    with pytest.raises(TypeError, match=r"observer 1 .*static_minmax.* no reference"):
        qdist.agree_references(
            [
                workers.observer("static_mse", "int8"),
                workers.observer("static_minmax", "int8"),
            ]
        )


# ------------------------------------------- calibrate(sync=True), whole models


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def model_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Runs:
    """`dist_workers.models` on every rank: synced calibrations of a Llama."""
    world: int = request.param
    out: Path = tmp_path_factory.mktemp(f"models{world}")
    return workers.launch(workers.models, world, out)


@functools.cache
def one_process_model(name: str) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    # The workers run one thread each; matmuls' float results depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        everything = list(range(workers.NUM_BATCHES))
        return workers.calibrate_model(name, everything, sync=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*workers.MODEL_OBSERVERS, "NVFP4", "imatrix_mse"])
def test_synced_model_calibration_equals_one_process(
    model_runs: Runs, name: str
) -> None:
    """Every process ends with the qparams (weights, inputs, q/k/v) and token
    counts of one process calibrating on all the batches: uneven shards, and
    with 3 processes a rank with no batch at all."""
    expected, tokens = one_process_model(name)
    assert len(expected) > 20
    for rank, run in enumerate(model_runs):
        found, found_tokens = run[name]
        assert found.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(found[key], value), (rank, key)
        assert found_tokens == tokens


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_synced_calibration_continues_and_resumes_exactly(
    world: int, tmp_path: Path
) -> None:
    """Two synced calls on halves of each shard, and a resume from process
    0's saved state, equal one process calibrating on every batch."""
    target = functools.partial(workers.continued, str(tmp_path))
    runs = workers.launch(target, world, tmp_path / "out")
    for name in ("histogram", "static_mse"):
        expected, tokens = one_process_model(name)
        for rank, run in enumerate(runs):
            continued, resumed, found_tokens = run[name]
            for key, value in expected.items():
                assert torch.equal(continued[key], value), (rank, key)
                assert torch.equal(resumed[key], value), (rank, key)
            assert found_tokens == tokens


@pytest.mark.slow
def test_a_second_pass_starts_from_every_process_first_pass(tmp_path: Path) -> None:
    """An observer declaring `Need.SECOND_PASS` whose second pass depends on
    the first pass's totals: 2 processes end with one process's qparams and
    tokens bit for bit, whole and layer by layer (the first pass combined
    between the passes; each batch counted once at the final sync)."""
    runs = workers.launch(workers.second_pass, 2, tmp_path / "out")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: matmul results depend on it
    try:
        everything = list(range(workers.NUM_BATCHES))
        expected = {
            p: workers.calibrate_two_passes(everything, False, p)
            for p in ("model", "layer")
        }
    finally:
        torch.set_num_threads(threads)
    for pipeline, (qparams, tokens) in expected.items():
        assert len(qparams) > 20
        for rank, run in enumerate(runs):
            found, found_tokens = run[pipeline]
            assert found.keys() == qparams.keys()
            for key, value in qparams.items():
                assert torch.equal(found[key], value), (pipeline, rank, key)
            assert found_tokens == tokens
