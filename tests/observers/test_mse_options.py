"""The MSE observers' opt-in searches: options, validation, end to end."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quantobs import Observer, QuantizationArgs, fake_quantize, generate_gparam
from quantobs.observers.mse import MSEOptions
from tests.format_args import MXFP4 as _MXFP4
from tests.format_args import NVFP4 as _NVFP4

_INT4_ASYM = {"num_bits": 4, "group_size": 32, "symmetric": False}


def _observer(
    name: str, kwargs: dict[str, Any], base_name: str = "weight", **options: Any
) -> Observer:
    return Observer.load_from_registry(
        name, base_name=base_name, args=QuantizationArgs(**kwargs), **options
    )


def _weight(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 128, generator=gen) * torch.rand(32, 1, generator=gen)
    w[2, 3] = 6.0
    return w


def _error(
    w: torch.Tensor, observer: Observer, args: QuantizationArgs, **kwargs: Any
) -> float:
    scale, zero_point = observer.get_qparams()
    fq = fake_quantize(w, scale, zero_point, args, **kwargs)
    return float(((fq - w).abs() ** 2.4).sum())


def test_defaults_are_llm_compressors_grid() -> None:
    options = MSEOptions()
    assert options.search == "grid"
    assert options.independent_bounds is False
    assert options.scale_search == "continuous"
    w = _weight()
    kwargs = {"num_bits": 4, "group_size": 32}
    plain = _observer("memoryless_mse", kwargs)
    explicit = _observer(
        "memoryless_mse",
        kwargs,
        search="grid",
        independent_bounds=False,
        scale_search="continuous",
    )
    plain.update(w)
    explicit.update(w)
    for got, want in zip(explicit.get_qparams(), plain.get_qparams(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "options", "match"),
    [
        (_INT4_ASYM, {"search": "coarse"}, "search"),
        (_INT4_ASYM, {"scale_search": "rounded"}, "scale_search"),
        (_INT4_ASYM, {"independent_bound": True}, "Extra inputs"),
        (
            {"num_bits": 4, "group_size": 32},
            {"independent_bounds": True},
            "independent_bounds=True needs asymmetric",
        ),
        (
            {"num_bits": 4, "group_size": 32},
            {"scale_search": "discrete"},
            "scale_search='discrete' needs",
        ),
        (
            _NVFP4,
            {"scale_search": "discrete", "search": "refine"},
            "takes no search= or independent_bounds=",
        ),
    ],
    ids=[
        "unknown-search",
        "unknown-scale-search",
        "typo",
        "bounds-symmetric",
        "discrete-int",
        "discrete-and-search",
    ],
)
def test_bad_options_raise(
    kwargs: dict[str, Any], options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _observer("memoryless_mse", kwargs, **options)


def test_static_mse_keeps_the_grid() -> None:
    # its candidates are fixed before the first batch so that sums merge
    with pytest.raises(ValueError, match="Extra inputs"):
        _observer("static_mse", _INT4_ASYM, search="refine")


@pytest.mark.parametrize("name", ["memoryless_mse", "mse"])
@pytest.mark.parametrize(
    "options",
    [
        {"search": "fine"},
        {"search": "refine"},
        {"independent_bounds": True},
        {"search": "refine", "independent_bounds": True},
    ],
    ids=["fine", "refine", "bounds", "refine-bounds"],
)
def test_searches_end_to_end(name: str, options: dict[str, Any]) -> None:
    args = QuantizationArgs(**_INT4_ASYM)
    w = _weight(1)
    default = _observer(name, _INT4_ASYM)
    searched = _observer(name, _INT4_ASYM, **options)
    default.update(w)
    searched.update(w)
    # one batch: the moving average is that batch's range for both
    assert _error(w, searched, args) <= _error(w, default, args)
    scale, _ = searched.get_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()


def test_activations_with_a_refined_search() -> None:
    observer = _observer(
        "mse", _INT4_ASYM, base_name="input", search="refine", independent_bounds=True
    )
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        observer.update(torch.randn(2, 8, 64, generator=gen))
    scale, zero_point = observer.get_qparams()
    assert scale.shape == zero_point.shape == (64 // 32,)
    assert torch.isfinite(scale).all() and (scale > 0).all()


def test_discrete_nvfp4_stores_the_searched_scales() -> None:
    args = QuantizationArgs(**_NVFP4)
    w = _weight(2)
    discrete = _observer("memoryless_mse", _NVFP4, scale_search="discrete")
    discrete.update(w)
    gscale = discrete.get_global_scale()
    # the global scale of the observed range, fixed before the search
    assert torch.equal(gscale, generate_gparam(w.min(), w.max()))
    scale, _ = discrete.get_qparams()
    assert torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)
    # less stored error than the grid's ranges under the same global scale
    grid = _observer("memoryless_mse", _NVFP4, round_scales=True, patience=None)
    grid.update(w)
    assert torch.equal(grid.get_global_scale(), gscale)
    found = _error(w, discrete, args, global_scale=gscale)
    assert found < _error(w, grid, args, global_scale=gscale)


def test_discrete_mx_scales_are_powers_of_two() -> None:
    args = QuantizationArgs(**_MXFP4)
    w = _weight(3)
    discrete = _observer("memoryless_mse", _MXFP4, scale_search="discrete")
    default = _observer("memoryless_mse", _MXFP4)
    discrete.update(w)
    default.update(w)
    scale, _ = discrete.get_qparams()
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()
    assert _error(w, discrete, args) <= _error(w, default, args)
