"""quantobs.observers.fit: entropy and percentile warn where their objective
does not fit the format, with the reason; every other case is silent."""

from __future__ import annotations

import warnings

import pytest
import torch

import quantobs
from quantobs import ObjectiveFitWarning, Observer, QuantizationArgs
from quantobs.observers.fit import objective_mismatch

FLOAT_SCHEMES = ["FP8", "NVFP4", "MXFP4", "MXFP8", "FP8_BLOCK"]
INT_SCHEMES = ["W8A8", "W4A16", "W4A16_ASYM", "W8A16"]
INT8_TENSOR = QuantizationArgs(num_bits=8, strategy="tensor", symmetric=True)


def _weights(scheme: str) -> QuantizationArgs:
    args = quantobs.preset_scheme(scheme).weights
    assert args is not None
    return args


def _build(name: str, args: QuantizationArgs, base_name: str = "weight") -> Observer:
    return Observer.get_class(name)(base_name, args)


@pytest.mark.parametrize("scheme", FLOAT_SCHEMES)
@pytest.mark.parametrize("name", ["entropy", "percentile"])
def test_clipping_objectives_warn_on_float_formats(name: str, scheme: str) -> None:
    args = _weights(scheme)
    with pytest.warns(ObjectiveFitWarning) as caught:
        observer = _build(name, args)
    (record,) = caught
    message = str(record.message)
    assert message.startswith(f"observer {name!r} does not fit {args.format.name}: ")
    assert "in proportion to their magnitude" in message
    assert "minmax keeps the outliers" in message
    assert record.filename == __file__  # attributed to the caller, not to us
    # It still runs: the user asked for it.
    observer.update(torch.randn(64, 128))
    scale, _ = observer.get_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()


@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_percentile_is_silent_on_int_formats(scheme: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _build("percentile", _weights(scheme))
        _build("percentile", INT8_TENSOR, "input")


@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_entropy_warns_on_int_weights_not_on_int_activations(scheme: str) -> None:
    args = _weights(scheme)
    with pytest.warns(ObjectiveFitWarning) as caught:
        _build("entropy", args)
    (record,) = caught
    message = str(record.message)
    assert message.startswith("observer 'entropy' does not fit weights: ")
    assert "calibrate weights by max" in message
    for base_name in ("input", "output", "k", "v"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _build("entropy", INT8_TENSOR, base_name)


@pytest.mark.parametrize("scheme", FLOAT_SCHEMES + INT_SCHEMES)
@pytest.mark.parametrize(
    "name", ["memoryless_minmax", "static_minmax", "histogram", "histogram_mse"]
)
def test_other_observers_never_warn(name: str, scheme: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _build(name, _weights(scheme))
    assert objective_mismatch(name, _weights(scheme)) is None


def test_the_warning_shows_once_per_observer_and_format() -> None:
    # A recipe attaches one observer per layer: the default filter shows the
    # warning once, since its text names no layer.
    args = _weights("FP8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(5):
            _build("entropy", args)
    assert len(caught) == 1


def test_the_warning_can_be_an_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ObjectiveFitWarning)
        with pytest.raises(ObjectiveFitWarning, match="does not fit float8_e4m3fn"):
            _build("percentile", _weights("FP8"))
