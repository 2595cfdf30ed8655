"""Multi-process workers for `test_distributed.py` (a module, so that the
started processes can import them): a launcher, the shared calibration data,
and the scenarios each rank runs under a real gloo process group."""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quantobs import Observer, QuantizationArgs
from quantobs.calibration import distributed as qdist
from quantobs.calibration import owners as qowners

Worker = Callable[[int, int], dict[str, Any]]

#: What the process server imports once (installed modules only).
PRELOAD = [
    "torch",
    "pytest",
    "quantobs.calibration.distributed",
    "quantobs.faces.quark",
    "quantobs.faces.torch_ao",
]

# ------------------------------------------------------------------ launcher


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(target: Worker, rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.save(target(rank, world), os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def launch(
    target: Worker, world: int, out: Path, timeout: float = 120.0
) -> list[dict[str, Any]]:
    """Run `target(rank, world)` in `world` new processes under gloo and
    return each rank's result (what it returned, via `torch.save`).

    Raises:
        AssertionError: a process failed or ran past `timeout` (the
            processes still running are terminated).
    """
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    # Children fork from a fresh server that imported torch and quantobs once
    # (single-threaded, so forking it is safe): importing torch in every
    # spawned child is what a 2-core machine would spend its time on. (The
    # server does not see sys.path changes, so it preloads installed modules
    # only; each child imports this module itself.) Else spawn.
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
    else:  # pragma: no cover - platforms without fork
        context = mp.get_context("spawn")
    procs = [
        context.Process(target=_entry, args=(target, rank, world, port, str(out)))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].terminate()
        procs[rank].join(5)
    errors = [p.read_text() for p in sorted(out.glob("rank*.err"))]
    assert not hung, f"ranks {hung} hung (deadlock?); errors: {errors}"
    codes = [proc.exitcode for proc in procs]
    assert codes == [0] * world, f"exit codes {codes}: {errors}"
    return [
        torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)
    ]


# ---------------------------------------------------------------------- data

NAMES = (
    "static_minmax",
    "static_mse",
    "histogram",
    "percentile",
    "entropy",
    "histogram_mse",
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "int8": ("input", {"num_bits": 8, "strategy": "tensor"}),
    "fp8": ("input", {"num_bits": 8, "type": "float", "strategy": "tensor"}),
    "channel": ("weight", {"num_bits": 8, "strategy": "channel"}),
}
NUM_BATCHES = 7


def batches(case: str) -> list[torch.Tensor]:
    """The calibration batches of a case: activations `(16, 64)` (tokens,
    features) or weight-like `(8, 64)`, of growing spread and shifted."""
    generator = torch.Generator().manual_seed(1234)
    rows = 8 if CASES[case][0] == "weight" else 16
    return [
        torch.randn(rows, 64, generator=generator) * (0.5 + i) + 0.1 * i
        for i in range(NUM_BATCHES)
    ]


def shard(rank: int, world: int) -> list[int]:
    """Uneven contiguous shards; with 3 processes the last has no data."""
    bounds = {2: [0, 5, 7], 3: [0, 4, 7, 7]}[world]
    return list(range(bounds[rank], bounds[rank + 1]))


def observer(name: str, case: str) -> Observer:
    """An observer of the registry for a case."""
    base_name, args = CASES[case]
    return Observer.load_from_registry(
        name, base_name=base_name, args=QuantizationArgs(**args)
    )


def single_process(name: str, case: str, indices: list[int]) -> Observer:
    """One process observing the batches `indices`, in order."""
    found = observer(name, case)
    data = batches(case)
    for i in indices:
        found.update(data[i])
    return found


def quark_histogram() -> Any:
    """Quark's per-tensor histogram observer (QuarkHistogram: no bins before
    data)."""
    import quantobs.faces.quark as quark

    spec = quark.QTensorConfig(
        dtype="int8",
        qscheme="per_tensor",
        symmetric=True,
        observer_cls="PerTensorHistogramObserver",
        round_method="half_even",
        scale_type="float",
        is_dynamic=False,
    )
    return quark.PerTensorHistogramObserver(spec)


def torch_histogram() -> Any:
    """torch.ao's HistogramObserver (TorchHistogram: float32 counts)."""
    import quantobs.faces.torch_ao as torch_ao

    return torch_ao.HistogramObserver(bins=64)


def face_qparams(obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A face observer's `(scale, zero_point)` (Quark's or torch.ao's call)."""
    if ".quark." in type(obs).__module__:
        return obs._calculate_qparams()
    return obs.calculate_qparams()


def _state(obs: Any) -> dict[str, torch.Tensor] | None:
    stat = obs.statistic()
    return None if stat is None else {k: v.clone() for k, v in stat.state().items()}


# ------------------------------------------------------------------ scenarios


def calibrate(rank: int, world: int) -> dict[str, Any]:
    """Every registry observer and case on this rank's shard, synced; plus
    observers no rank saw, one only rank 1 saw, LATEST and MEAN observers,
    and two faces. Returns qparams, counts and states (before and after)."""
    mine = shard(rank, world)
    observers: dict[str, Any] = {}
    feeds: dict[str, list[int]] = {}
    for name in NAMES:
        for case in CASES:
            observers[f"{name}/{case}"] = observer(name, case)
            feeds[f"{name}/{case}"] = mine
    observers["unseen"] = observer("static_minmax", "int8")
    feeds["unseen"] = []
    observers["expert"] = observer("histogram", "int8")  # only rank 1's tokens
    feeds["expert"] = mine if rank == 1 else []
    observers["latest"] = observer("memoryless_minmax", "int8")
    feeds["latest"] = mine
    observers["mean"] = observer("minmax", "int8")
    feeds["mean"] = mine
    # Quark's bin count grows with the data and its merge keeps each side's,
    # so only one process feeds it (the others hold no bins at all).
    observers["quark"] = quark_histogram()
    feeds["quark"] = [0] if rank == 0 else []
    observers["torch"] = torch_histogram()
    feeds["torch"] = mine

    # static_mse: a reference-only pass over the first batch, agreed.
    mse = [k for k in observers if k.startswith("static_mse/")]
    for key in mse:
        if mine:
            observers[key].update(batches(key.split("/")[1])[mine[0]])
    qdist.agree_references([observers[k] for k in mse])
    agreed = {k: _state(observers[k]) for k in mse}

    for key, obs in observers.items():
        case = key.split("/")[1] if "/" in key else "int8"
        data = batches(case)
        for i in feeds[key]:
            if key in ("quark", "torch"):
                obs(data[i])
            else:
                obs.update(data[i])
    before = {k: _state(o) for k, o in observers.items()}
    qdist.sync_observers(list(observers.values()))
    result: dict[str, Any] = {"agreed": agreed, "before": before, "after": {}}
    for key, obs in observers.items():
        result["after"][key] = _state(obs)
        if key in ("quark", "torch"):
            result[key] = face_qparams(obs) if obs.has_statistics else None
        elif obs.has_statistics:
            result[key] = (
                obs.get_qparams(),
                obs.num_observations,
                obs.num_observed_tokens,
            )
        else:
            result[key] = (None, obs.num_observations, obs.num_observed_tokens)
    return result


class _Counter:
    """Counts calls of the collectives `sync_observers` may use."""

    NAMES = ("all_reduce", "all_gather_object", "broadcast", "all_gather")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._saved = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self) -> _Counter:
        for name, original in self._saved.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            what = ""
            if name == "all_reduce":
                op = kwargs.get("op", dist.ReduceOp.SUM)
                what = f"{op}:{args[0].dtype}"
            self.calls.append((name, what))
            return original(*args, **kwargs)

        return counted


def _mixed_observers(copies: int, rank: int) -> list[Any]:
    """`copies` of each of several observer kinds, observed on this rank."""
    found: list[Any] = []
    data = batches("int8")
    for _ in range(copies):
        group = [
            observer("static_minmax", "int8"),
            observer("histogram", "int8"),
            observer("histogram", "channel"),
            observer("static_mse", "int8"),
            observer("minmax", "int8"),
            observer("memoryless_minmax", "int8"),
        ]
        group[3].set_reference(torch.tensor([-3.0]), torch.tensor([3.0]))
        for obs in group:
            if obs.base_name == "weight":
                obs.update(data[rank][:8])
            elif rank != 1:  # rank 1 leaves the activations unseen
                obs.update(data[rank])
        found += group
    return found


def collectives(rank: int, world: int) -> dict[str, Any]:
    """The collectives of `sync_observers` for 6 and for 60 observers, of
    `agree_references` and of `broadcast_from_owners`."""
    result: dict[str, Any] = {}
    for copies in (1, 10):
        observers = _mixed_observers(copies, rank)
        with _Counter() as counter:
            qdist.sync_observers(observers)
        result[f"sync{copies}"] = counter.calls
    mse = [observer("static_mse", "int8") for _ in range(5)]
    for obs in mse:
        obs.update(batches("int8")[rank])
    with _Counter() as counter:
        qdist.agree_references(mse)
    result["agree"] = counter.calls
    return result


def mismatches(rank: int, world: int) -> dict[str, Any]:
    """Errors every rank must raise alike (no rank left waiting): different
    references, different observer lists, tensors or owners that differ in
    a broadcast; then the group still works."""
    result: dict[str, Any] = {}
    same = observer("static_mse", "int8")
    same.set_reference(torch.tensor([-1.0]), torch.tensor([1.0]))
    other = observer("static_mse", "int8")
    other.set_reference(torch.tensor([-1.0]), torch.tensor([1.0 + rank]))
    for obs in (same, other):
        obs.update(batches("int8")[rank])
    try:
        qdist.sync_observers([observer("static_minmax", "int8"), same, other])
    except ValueError as error:
        result["equal"] = str(error)
    count = 2 if rank == 0 else 1
    try:
        qdist.sync_observers([observer("static_minmax", "int8")] * count)
    except ValueError as error:
        result["length"] = str(error)
    kinds = [observer("static_minmax" if rank == 0 else "histogram", "int8")]
    try:
        qdist.sync_observers(kinds)
    except ValueError as error:
        result["kind"] = str(error)
    wrong = torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    try:
        qowners.broadcast_from_owners([torch.zeros(3), wrong], [0, 0])
    except ValueError as error:
        result["dtype"] = str(error)
    try:
        qowners.broadcast_from_owners([torch.zeros(3)], [min(rank, 1)])
    except ValueError as error:
        result["owners"] = str(error)
    result["any"] = qdist.any_across(rank == world - 1)
    result["none"] = qdist.any_across(False)
    return result


def payload(index: int, rank: int) -> torch.Tensor:
    """Tensor `index` of the broadcast test as rank `rank` holds it."""
    generator = torch.Generator().manual_seed(100 * index + rank)
    base = torch.randn(3, 5, generator=generator)
    special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), rank])
    tensors = [
        base,
        torch.randn(6, 4, generator=generator).t(),  # not contiguous
        base.reshape(-1).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (4, 2), generator=generator),
        torch.rand(5, generator=generator) > 0.5,
        base[0].to(torch.float8_e4m3fn),
        torch.tensor(float(rank) + 0.25, dtype=torch.float64),  # 0-dim
        torch.zeros(0, 3),
        special,
        torch.randn(40, generator=generator).to(torch.float16),
    ]
    return tensors[index]


NUM_PAYLOADS = 10


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes (bit-exact comparison, NaN and -0.0 included)."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


def broadcast(rank: int, world: int) -> dict[str, Any]:
    """`broadcast_from_owners` on mixed dtypes, as one bucket per owner and
    in small buckets; returns the bytes each rank ends with."""
    sizes = [payload(i, 0).numel() for i in range(NUM_PAYLOADS)]
    owners = qowners.owners_by_size(sizes, world)
    result: dict[str, Any] = {"owners": owners}
    for label, limit in (("one", qowners.DEFAULT_BUCKET_BYTES), ("small", 32)):
        tensors = [payload(i, rank) for i in range(NUM_PAYLOADS)]
        with _Counter() as counter:
            qowners.broadcast_from_owners(tensors, owners, bucket_bytes=limit)
        result[label] = [raw_bytes(t) for t in tensors]
        result[f"{label}_calls"] = counter.calls
    parameter = torch.nn.Parameter(torch.full((3,), float(rank)))
    qowners.broadcast_from_owners([parameter], [world - 1])
    result["parameter"] = parameter.detach().clone()
    return result


def references(rank: int, world: int) -> dict[str, Any]:
    """`agree_references` where rank 0 has no reference (rank 1's wins), no
    rank has one, and every rank has its own (rank 0's wins)."""
    data = batches("int8")
    late = observer("static_mse", "int8")
    if rank >= 1:
        late.update(data[rank])
    nobody = observer("static_mse", "int8")
    everyone = observer("static_mse", "channel")
    everyone.update(batches("channel")[rank])
    qdist.agree_references([late, nobody, everyone])
    return {
        "late": _state(late),
        "nobody": _state(nobody),
        "everyone": _state(everyone),
        "counts": (late.num_observations, everyone.num_observations),
    }


def everything(rank: int, world: int) -> dict[str, Any]:
    """Every scenario in one set of processes (process start-up dominates)."""
    return {
        "calibrate": calibrate(rank, world),
        "collectives": collectives(rank, world),
        "mismatches": mismatches(rank, world),
        "broadcast": broadcast(rank, world),
        "references": references(rank, world),
    }


# ----------------------------------------------------- whole models, synced

MODEL_OBSERVERS = NAMES


def model_recipe(observer: str) -> Any:
    """FP8 weights, int8 static inputs under `observer`, fp8 k/v per head."""
    from quantobs.calibration import Recipe
    from tests.decoders import kv_cache_quantizable

    int8 = {"num_bits": 8, "strategy": "tensor", "observer": observer}
    linear = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": int8,
    }
    if not kv_cache_quantizable():  # no attention state is quantizable
        return Recipe(config_groups={"linear": linear}, ignore=["lm_head"])
    return Recipe(
        config_groups={
            "linear": linear,
            "attn": {"targets": ["LlamaAttention"], "input_activations": int8},
        },
        ignore=["lm_head"],
        kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "attn_head"},
    )


def model_batches() -> list[dict[str, torch.Tensor]]:
    """Seven token batches of varying shape for the tiny Llama."""
    generator = torch.Generator().manual_seed(7)
    return [
        {
            "input_ids": torch.randint(
                0, 128, (1 + i % 3, 5 + 2 * i), generator=generator
            )
        }
        for i in range(NUM_BATCHES)
    ]


def model_qparams(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every qparam the calibration wrote, by parameter name."""
    return {
        name: value.detach().clone()
        for name, value in model.named_parameters()
        if name.endswith(("_scale", "_zero_point"))
    }


def calibrate_model(
    name: str, indices: list[int], sync: bool, pipeline: str = "model"
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Calibrate a fresh tiny Llama on the batches at `indices`, under
    `model_recipe(name)`, or the preset `name` where it is one (`"NVFP4"`),
    whole or one decoder layer at a time (`pipeline`)."""
    from quantobs.calibration import Recipe, attach, calibrate
    from tests.calibration.conftest import tiny_llama

    model = tiny_llama()
    if name in MODEL_OBSERVERS:
        attach(model, model_recipe(name))
    elif name == "imatrix_mse":  # weights weighted by the inputs' importance
        weights = {"num_bits": 8, "strategy": "channel", "observer": name}
        groups = {"g": {"targets": ["Linear"], "weights": weights}}
        attach(model, Recipe(config_groups=groups, ignore=["lm_head"]))
    else:
        attach(model, Recipe.from_scheme(name, ignore=["lm_head"]))
    data = model_batches()
    streamed = (data[i] for i in indices)  # a generator: never held whole
    report = calibrate(model, streamed, progress=False, sync=sync, pipeline=pipeline)
    return model_qparams(model), report.tokens


def models(rank: int, world: int) -> dict[str, Any]:
    """`calibrate(sync=True)` of whole models on each rank's shard."""
    mine = shard(rank, world)
    names = [*MODEL_OBSERVERS, "NVFP4", "imatrix_mse"]
    return {name: calibrate_model(name, mine, sync=True) for name in names}


def layered(rank: int, world: int) -> dict[str, Any]:
    """`calibrate(sync=True, pipeline="layer")` on each rank's shard."""
    mine = shard(rank, world)
    names = ["static_mse", "imatrix_mse"]
    return {name: calibrate_model(name, mine, True, "layer") for name in names}


def continued(path: str, rank: int, world: int) -> dict[str, Any]:
    """Synced calibrations continued: twice in a row, and resumed from the
    state process 0 saved (every rank loads it), on halves of each shard."""
    from quantobs.calibration import attach, calibrate, load_state, save_state
    from tests.calibration.conftest import tiny_llama

    mine = shard(rank, world)
    first, second = mine[: len(mine) // 2], mine[len(mine) // 2 :]
    data = model_batches()
    found: dict[str, Any] = {}
    for name in ("histogram", "static_mse"):
        model = tiny_llama()
        attach(model, model_recipe(name))
        calibrate(model, [data[i] for i in first], progress=False, sync=True)
        if rank == 0:
            save_state(model, f"{path}/{name}.safetensors")
        dist.barrier()
        calibrate(model, [data[i] for i in second], progress=False, sync=True)
        resumed = tiny_llama()
        attach(resumed, model_recipe(name))
        load_state(resumed, f"{path}/{name}.safetensors")
        report = calibrate(
            resumed, [data[i] for i in second], progress=False, sync=True
        )
        found[name] = (model_qparams(model), model_qparams(resumed), report.tokens)
    return found


# ------------------------------------------------- a second pass, synced


def _two_pass_class() -> type[Observer]:
    """`TwoPasses`: a `static_minmax` observer declaring `Need.SECOND_PASS`
    (as `test_lifecycle`'s) whose second pass depends on the first pass of
    every process: it observes the values less the centre of the first
    pass's range, so its qparams equal one process's only when the first
    pass was combined before the second began."""
    from quantobs.observers.minmax import StaticMinMaxObserver
    from quantobs.observers.needs import Need

    class TwoPasses(StaticMinMaxObserver):
        needs = frozenset({Need.SECOND_PASS})

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.centre: torch.Tensor | None = None

        def begin_second_pass(self) -> None:
            stat: Any = self.statistic()
            if stat is None:  # no process saw data
                return
            self.centre = (stat.min_vals + stat.max_vals) / 2
            self.clear_data()

        def update(self, observed: torch.Tensor) -> None:
            if self.centre is not None:
                observed = observed - self.centre.to(observed.dtype)
            super().update(observed)

    return TwoPasses


def calibrate_two_passes(
    indices: list[int], sync: bool, pipeline: str
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """A tiny Llama's static int8 inputs observed by `TwoPasses` (its
    weights FP8), on the batches at `indices`."""
    from quantobs.calibration import attach, calibrate
    from quantobs.calibration.attach import attachment_of
    from tests.calibration.conftest import tiny_llama

    model = tiny_llama()
    attach(model, model_recipe("static_minmax"))
    two_passes = _two_pass_class()
    for entry in attachment_of(model).entries:
        if entry.base_name == "input":  # the observer replaced in place
            observer = two_passes("input", entry.args, entry.module)
            entry.module.register_module("input_observer", observer)
    data = model_batches()
    report = calibrate(
        model,
        (data[i] for i in indices),
        progress=False,
        sync=sync,
        pipeline=pipeline,
    )
    return model_qparams(model), report.tokens


def second_pass(rank: int, world: int) -> dict[str, Any]:
    """`calibrate(sync=True)` with a second pass, whole and layer by layer."""
    mine = shard(rank, world)
    return {p: calibrate_two_passes(mine, True, p) for p in ("model", "layer")}
