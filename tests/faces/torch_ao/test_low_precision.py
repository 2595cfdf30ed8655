"""torch.ao face on bfloat16 / float16 / float32 values: the same forward
outputs, buffers (dtype and bits) and qparams as torch.ao.quantization's own
observers (issue 25).

torch.ao accepts both low-precision dtypes: its float32 buffers take the
batch's minima and maxima (exact), moving averages step in float32 (the
bfloat16 / float16 batch range promoted), the qparams are float32, and the
histogram observer bins the values over its float32 range (on the CPU
`histc` counts bfloat16 values in bfloat16). The face does the same, so
nothing here differs from float32 but the values observed.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.ao.quantization import observer as tob

import quantobs.faces.torch_ao as ours

from .test_observers import assert_identical, assert_same_state

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SYM = {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "minmax": ("MinMaxObserver", {}),
    "minmax-symmetric": ("MinMaxObserver", SYM),
    "minmax-reduce-range": ("MinMaxObserver", {"reduce_range": True}),
    "moving-average": ("MovingAverageMinMaxObserver", {"averaging_constant": 0.3}),
    "moving-average-symmetric": ("MovingAverageMinMaxObserver", SYM),
    "per-channel": ("PerChannelMinMaxObserver", {"ch_axis": 0}),
    "per-channel-symmetric": (
        "PerChannelMinMaxObserver",
        {"ch_axis": 0, "dtype": torch.qint8, "qscheme": torch.per_channel_symmetric},
    ),
    "per-channel-float-qparams": (
        "PerChannelMinMaxObserver",
        {"ch_axis": 1, "qscheme": torch.per_channel_affine_float_qparams},
    ),
    "moving-average-per-channel": (
        "MovingAveragePerChannelMinMaxObserver",
        {"ch_axis": -1, "averaging_constant": 0.2},
    ),
    "histogram": ("HistogramObserver", {}),
    "histogram-symmetric": ("HistogramObserver", SYM),
    "fixed-qparams": ("FixedQParamsObserver", {"scale": 1 / 256, "zero_point": 0}),
}


def _batches(dtype: torch.dtype) -> list[torch.Tensor]:
    """Ranges that grow, shift and shrink (moving averages round; the
    histogram re-bins)."""
    gen = torch.Generator().manual_seed(21)
    scales = ((1.0, 0.0), (3.0, 1.0), (0.5, 0.0))
    return [(torch.randn(12, 20, generator=gen) * s + b).to(dtype) for s, b in scales]


@pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_low_precision_equals_torch(config: str, dtype: torch.dtype) -> None:
    name, kwargs = CONFIGS[config]
    mine, theirs = getattr(ours, name)(**kwargs), getattr(tob, name)(**kwargs)
    for x in _batches(dtype):
        out_mine, out_theirs = mine(x), theirs(x)
        assert out_mine is x and out_theirs is x
    assert_same_state(mine, theirs)  # the buffers: dtype and bits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        found, expected = mine.calculate_qparams(), theirs.calculate_qparams()
    assert_identical(found[0], expected[0])
    assert_identical(found[1], expected[1])
