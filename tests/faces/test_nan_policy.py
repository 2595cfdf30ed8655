"""`nan_policy` on every face (issue 15): one name, the same three values.

`quantobs.Observer`, the torch.ao face, the Quark face and the legacy
llm-compressor face all take the keyword `nan_policy` with the values
`"raise"`, `"omit"` and `"propagate"` (the table of
`quantobs.stats.reduce`); each face's default keeps its behaviour. Under
`"omit"` non-finite values are ignored, and a batch with no finite value is
skipped: an observer that saw nothing else stays in its face's "nothing
observed" state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import quantobs.faces.quark as quark
import quantobs.torch_ao as torch_ao
from quantobs import Observer, QuantizationArgs
from quantobs.faces import llmcompressor_legacy as legacy

POLICIES = ["raise", "omit", "propagate"]
_QUARK_SPEC = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "symmetric": True,
    "is_dynamic": False,
    "round_method": "half_even",
    "scale_type": "float",
}


def _core(**kwargs: Any) -> Any:
    return Observer.load_from_registry(
        "static_minmax", base_name="input", args=QuantizationArgs(num_bits=8), **kwargs
    )


def _quark(name: str) -> Callable[..., Any]:
    def make(**kwargs: Any) -> Any:
        spec = quark.QTensorConfig(observer_cls=name, **_QUARK_SPEC)
        return getattr(quark, name)(spec, **kwargs)

    return make


def _legacy(cls: type) -> Callable[..., Any]:
    return lambda **kwargs: cls(QuantizationArgs(num_bits=8), **kwargs)


# (id, constructor taking nan_policy=..., observe, qparams)
FACES: list[tuple[str, Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = [
    ("core", _core, lambda o, x: o.update(x), lambda o: o.get_qparams()),
    *[
        (
            f"torch_ao-{cls.__name__}",
            cls,
            lambda o, x: o(x),
            lambda o: o.calculate_qparams(),
        )
        for cls in (
            torch_ao.MinMaxObserver,
            torch_ao.MovingAverageMinMaxObserver,
            torch_ao.HistogramObserver,
        )
    ],
    *[
        (
            f"quark-{name}",
            _quark(name),
            lambda o, x: o(x),
            lambda o: o._calculate_qparams(),
        )
        for name in (
            "PerTensorMinMaxObserver",
            "PerTensorHistogramObserver",
            "PerTensorPercentileObserver",
            "PerTensorMSEObserver",
        )
    ],
    *[
        (
            f"legacy-{cls.__name__}",
            _legacy(cls),
            lambda o, x: o(x),
            lambda o: o.get_qparams(),
        )
        for cls in (legacy.MinMaxObserver, legacy.MovingAverageMSEObserver)
    ],
]
IDS = [face[0] for face in FACES]


@pytest.mark.parametrize("face", FACES, ids=IDS)
def test_every_face_takes_the_three_policies(face: tuple[Any, ...]) -> None:
    _, make, _, _ = face
    for policy in POLICIES:
        assert make(nan_policy=policy).nan_policy == policy
    with pytest.raises(ValueError, match="nan_policy"):
        make(nan_policy="ignore")


@pytest.mark.parametrize("face", FACES, ids=IDS)
def test_default_raises_on_nan(face: tuple[Any, ...]) -> None:
    _, make, observe, qparams = face
    x = torch.randn(4, 32)
    x[0, 0] = float("nan")
    observer = make()
    with pytest.raises(ValueError, match=r"non-finite|NaN"):
        observe(observer, x)  # the faces raise here, as their peers do
        qparams(observer)  # quantobs' own observers here: no host read in update


@pytest.mark.parametrize("face", FACES, ids=IDS)
def test_omit_ignores_nonfinite_values(face: tuple[Any, ...]) -> None:
    _, make, observe, qparams = face
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    finite = x.flatten()[5:].reshape(1, -1)  # (1, 123): the same values
    dirty = x.clone()
    dirty.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0, 0])
    dirty.view(-1)[3:5] = float("nan")
    omitting, clean = make(nan_policy="omit"), make()
    observe(omitting, dirty)
    observe(clean, finite)
    for ours, reference in zip(qparams(omitting), qparams(clean), strict=True):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("face", FACES, ids=IDS)
def test_omit_skips_a_batch_without_finite_values(face: tuple[Any, ...]) -> None:
    name, make, observe, qparams = face
    bad = torch.full((4, 32), float("nan"))
    bad[2] = float("inf")
    observer = make(nan_policy="omit")
    if name.startswith("legacy"):  # each call returns qparams: none to give
        with pytest.raises(ValueError, match="NaN or inf"):
            observe(observer, bad)
    else:
        observe(observer, bad)
    # the face's "nothing observed": torch.ao and Quark's min-max warn and
    # return their defaults, the legacy face has no cached qparams, the
    # others raise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            scale, zero_point = qparams(observer)
        except (RuntimeError, ValueError) as error:
            assert "omit" in str(error) or "no data" in str(error)
        else:
            if name.startswith("legacy"):
                assert scale is None and zero_point is None
            else:
                assert float(scale.flatten()[0]) == 1.0 and not zero_point.any()
    # a later finite batch counts alone
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    observe(observer, x)
    if not name.startswith("legacy"):
        observe(observer, bad)  # skipped
    clean = make()
    observe(clean, x)
    for ours, reference in zip(qparams(observer), qparams(clean), strict=True):
        assert torch.equal(ours, reference)
