"""Device identity (issue 24): the same observer, options and data give
bit-identical scales, zero points and global scales on every path.

The paths: the CPU with the native kernels (`native`), the CPU without
(`torch`, the reference: the code a CUDA tensor runs where no GPU kernel
is registered), and CUDA where present (`cuda`: the torch path, or the
Triton kernels where they are registered). On a CPU-only machine `native`
against `torch` is the proxy of CPU against CUDA; `cuda` runs where CUDA
is (select it with `-k cuda` or `-m cuda`).

Every registered observer (the registry, not a hand list) on every format
and granularity it supports, for bfloat16, float16 and float32 inputs;
then every stateful class of the faces (torch.ao, Quark, llm-compressor's
legacy API).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import quantobs.faces.llmcompressor_legacy as legacy
from quantobs import Observer, QuantizationArgs, native
from tests.cuda_arithmetic import CudaArithmetic
from tests.faces.quark.test_spec import BLOCKS, INT_SPEC, STATEFUL
from tests.faces.quark.test_spec import observer as quark_observer
from tests.faces.torch_ao.test_statistics import STATEFUL as TORCH_AO
from tests.faces.torch_ao.test_statistics import build as torch_ao_build
from tests.format_args import MXFP4, NVFP4

CUDA = torch.cuda.is_available()
PATHS = [
    pytest.param("native", id="native"),
    pytest.param("emulated", id="emulated"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not CUDA, reason="CUDA is not available"),
        ],
    ),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# format id -> (base name, args kwargs, shape of one batch)
FORMATS: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    "int4-group128": (
        "weight",
        {"num_bits": 4, "strategy": "group", "group_size": 128},
        (8, 256),
    ),
    "int4-group128-asym": (
        "weight",
        {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False},
        (8, 256),
    ),
    "int8-channel": ("weight", {"num_bits": 8, "strategy": "channel"}, (8, 256)),
    "uint8-channel-asym": (
        "weight",
        {"num_bits": 8, "strategy": "channel", "symmetric": False},
        (8, 256),
    ),
    "fp8-tensor": ("weight", {"num_bits": 8, "type": "float"}, (8, 256)),
    "fp8-block": (
        "weight",
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "block",
            "block_structure": [8, 64],
        },
        (8, 256),
    ),
    "nvfp4": ("weight", NVFP4, (8, 256)),
    "mxfp4": ("weight", MXFP4, (8, 256)),
    "int8-input": ("input", {"num_bits": 8}, (2, 4, 256)),
    "int8-input-asym": ("input", {"num_bits": 8, "symmetric": False}, (2, 4, 256)),
    "fp8-input": ("input", {"num_bits": 8, "type": "float"}, (2, 4, 256)),
}

#: one class per registered name (aliases share a class)
NAMES = sorted({Observer.get_class(n).name for n in Observer.registry.names()})
BATCHES = 2


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # the fit warnings (entropy / percentile on float formats) say nothing here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _data(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Heavy-tailed batches whose range grows, as float32."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(BATCHES):
        x = torch.randn(shape, generator=gen)
        x = x * torch.exp(0.7 * torch.randn(shape, generator=gen))  # outliers
        out.append(x * (1.0, 2.5)[i])  # the range grows
    return out


def _on(path: str) -> tuple[torch.device, bool]:
    """(device, native kernels on) of a path; `emulated`: the torch path
    under CUDA's arithmetic (`CudaArithmetic`) on the CPU."""
    if path == "cuda":
        return torch.device("cuda"), True
    return torch.device("cpu"), path == "native"


def _run(
    path: str, fn: Callable[[torch.device], list[torch.Tensor]]
) -> list[torch.Tensor]:
    device, use_native = _on(path)
    previous = native.set_enabled(use_native)
    try:
        if path == "emulated":
            with CudaArithmetic():
                return [t.detach().cpu() for t in fn(device)]
        return [t.detach().cpu() for t in fn(device)]
    finally:
        native.set_enabled(previous)


def _assert_identical(
    found: list[torch.Tensor], expected: list[torch.Tensor], what: str
) -> None:
    assert len(found) == len(expected)
    for i, (ours, reference) in enumerate(zip(found, expected, strict=True)):
        assert ours.dtype == reference.dtype and ours.shape == reference.shape, what
        a = ours.reshape(-1).view(torch.uint8) if ours.is_floating_point() else ours
        b = reference.reshape(-1).view(torch.uint8)
        b = b if reference.is_floating_point() else reference
        differ = (a != b).reshape(-1).float().mean().item()
        assert torch.equal(a, b), f"{what}: qparam {i} differs in {differ:.1%}"


#: the emulated path (a dispatch mode: slow) runs float32 (the dtype whose
#: scales the division decides alone) on one format of each kind
EMULATED = {
    "int4-group128-asym",
    "int8-channel",
    "fp8-tensor",
    "nvfp4",
    "mxfp4",
    "int8-input-asym",
}


def _dtypes(path: str) -> list[torch.dtype]:
    return [torch.float32] if path == "emulated" else DTYPES


def _skip_unless(path: str) -> None:
    if path == "native" and not native.available():
        pytest.skip("no C compiler: the native kernels are not built")


# ------------------------------------------------------ registered observers


def _observer_qparams(
    name: str, face: str, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    base_name, kwargs, shape = FORMATS[face]
    cls = Observer.get_class(name)
    observer = cls(base_name, QuantizationArgs(**kwargs)).to(device)
    if hasattr(observer, "set_importance"):
        gen = torch.Generator().manual_seed(5)
        importance = torch.rand(shape[-1], generator=gen) + 0.1
        observer.set_importance(importance.to(device))
    for x in _data(shape, seed=len(face)):
        observer.update(x.to(dtype).to(device))
    found = list(observer.get_qparams())
    if observer.args.strategy == "tensor_group":
        found.append(observer.get_global_scale())
    return found


def _supports(name: str, face: str) -> bool:
    base_name, kwargs, _ = FORMATS[face]
    try:
        Observer.get_class(name)(base_name, QuantizationArgs(**kwargs))
    except ValueError:
        return False
    return True


_REFERENCES: dict[tuple[str, str, torch.dtype], list[torch.Tensor]] = {}
CASES = [(n, f) for n in NAMES for f in FORMATS if _supports(n, f)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("name", "face"), CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_observers_are_device_identical(name: str, face: str, path: str) -> None:
    _skip_unless(path)
    if path == "emulated" and face not in EMULATED:
        pytest.skip("emulated on a subset of the formats (time)")
    for dtype in _dtypes(path):
        key = (name, face, dtype)
        if key not in _REFERENCES:  # the torch path's, shared by the paths
            _REFERENCES[key] = _run(
                "torch",
                lambda d: _observer_qparams(name, face, dtype, d),  # noqa: B023
            )
        found = _run(path, lambda d: _observer_qparams(name, face, dtype, d))  # noqa: B023
        _assert_identical(found, _REFERENCES[key], f"{name} {face} {dtype} on {path}")


def test_every_registered_observer_is_covered() -> None:
    assert {n for n, _ in CASES} == set(NAMES)


# ------------------------------------------------------------------- faces


def _face_batches(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    return [x.to(dtype).to(device) for x in _data((16, 64), seed=3)]


def _torch_ao(key: str) -> Callable[[torch.dtype, torch.device], list[torch.Tensor]]:
    def run(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        observer = torch_ao_build(key).to(device)
        for x in _face_batches(dtype, device):
            observer(x)
        return list(observer.calculate_qparams())

    return run


def _quark(name: str) -> Callable[[torch.dtype, torch.device], list[torch.Tensor]]:
    kwargs = BLOCKS[name] if name in BLOCKS else {"symmetric": True, **STATEFUL[name]}
    if name not in BLOCKS:
        kwargs = {**kwargs, **INT_SPEC}

    def run(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        observer = quark_observer(name, **kwargs).to(device)
        for x in _face_batches(dtype, device):
            observer(x)
        return list(observer._calculate_qparams())

    return run


LEGACY = {
    "minmax-channel": ("MinMaxObserver", {"num_bits": 8, "strategy": "channel"}),
    "minmax-group": (
        "MinMaxObserver",
        {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False},
    ),
    "mse-tensor": ("MovingAverageMSEObserver", {"num_bits": 8}),
    "mse-group": (
        "MovingAverageMSEObserver",
        {"num_bits": 4, "strategy": "group", "group_size": 32},
    ),
}


def _legacy(key: str) -> Callable[[torch.dtype, torch.device], list[torch.Tensor]]:
    name, kwargs = LEGACY[key]

    def run(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        observer = getattr(legacy, name)(QuantizationArgs(**kwargs)).to(device)
        found: list[torch.Tensor] = []
        for x in _face_batches(dtype, device):
            scale, zero_point = observer(x)
            assert scale is not None and zero_point is not None
            found = [scale, zero_point]
        return found

    return run


FACE_CASES: dict[str, Callable[[torch.dtype, torch.device], list[torch.Tensor]]] = {
    **{f"torch_ao-{key}": _torch_ao(key) for key in TORCH_AO},
    **{f"quark-{name}": _quark(name) for name in [*STATEFUL, *BLOCKS]},
    **{f"legacy-{key}": _legacy(key) for key in LEGACY},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", FACE_CASES)
def test_faces_are_device_identical(case: str, path: str) -> None:
    _skip_unless(path)
    run = FACE_CASES[case]
    for dtype in _dtypes(path):
        if (
            path == "cuda"
            and dtype == torch.bfloat16
            and case.startswith("torch_ao-histogram")
        ):
            continue  # torch counts bfloat16 in bfloat16 on the CPU, not on CUDA
        expected = _run("torch", lambda d: run(dtype, d))  # noqa: B023
        found = _run(path, lambda d: run(dtype, d))  # noqa: B023
        _assert_identical(found, expected, f"{case} {dtype} on {path}")
