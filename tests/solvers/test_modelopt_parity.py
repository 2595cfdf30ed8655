"""The entropy and percentile searches against NVIDIA ModelOpt's own
calibrators (`nvidia-modelopt`, the `peers` extra) on identical histograms.

These tests settle where `entropy` and `percentile` lose accuracy on FP8 and
NVFP4 (`quantobs compare` on MiniLM): ModelOpt chooses the same clipping
range on the same histogram, so it is the objective (KL against a uniform
grid of 128 levels; a tail percentile), not a defect of ours.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from quantobs.solvers.entropy import entropy_search
from quantobs.solvers.percentile import percentile_upper

with warnings.catch_warnings():  # its import warns (torch.jit.script, pynvml)
    warnings.simplefilter("ignore")
    calib = pytest.importorskip("modelopt.torch.quantization.calib.histogram")


def _collect(x: torch.Tensor, bins: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's own histogram of |x| (HistogramCalibrator.collect)."""
    calibrator = calib.HistogramCalibrator(num_bits=8, num_bins=bins)
    calibrator.collect(x)
    return calibrator._calib_hist.clone(), calibrator._calib_bin_edges.clone()


def _inputs(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    if name == "gaussian":
        return torch.randn(200_000, generator=generator)
    if name == "laplace":
        u = torch.rand(200_000, generator=generator) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if name == "heavy":  # a gaussian bulk with 0.1 % outliers 20x wider
        x = torch.randn(200_000, generator=generator)
        x[::1000] *= 20
        return x
    # MiniLM-like activations: a narrow bulk and a shoulder of large values
    bulk = torch.randn(200_000, generator=generator) * 0.6
    bulk[::300] = (torch.rand(667, generator=generator) - 0.5) * 24
    return bulk


@pytest.mark.parametrize("name", ["gaussian", "laplace", "heavy", "activations"])
def test_entropy_equals_modelopt(name: str) -> None:
    # 512 bins rather than ModelOpt's 2048: its search loops in Python over
    # candidates x bins (~5 s per histogram at 2048)
    counts, edges = _collect(_inputs(name), bins=512)
    theirs = calib._compute_amax_entropy(
        counts.numpy().copy(), edges.numpy(), num_bits=8, unsigned=False
    )
    ours = entropy_search(
        counts, edges[1] - edges[0], 128, start_bin=128, stride=1, amax=edges[-1]
    )
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


@pytest.mark.parametrize("name", ["gaussian", "laplace", "heavy", "activations"])
@pytest.mark.parametrize("percentile", [99.9, 99.99])
def test_percentile_within_a_bin_of_modelopt(name: str, percentile: float) -> None:
    # ModelOpt takes the left edge of the bin where the CDF reaches p; ours
    # the bin's right edge (every value at or below p kept): one bin apart.
    counts, edges = _collect(_inputs(name))
    theirs = float(
        calib._compute_amax_percentile(counts.numpy().copy(), edges.numpy(), percentile)
    )
    width = edges[1] - edges[0]
    ours = percentile_upper(counts, torch.tensor(0.0), width, percentile, edges[-1])
    assert float(ours) - theirs == pytest.approx(float(width), rel=1e-4)
