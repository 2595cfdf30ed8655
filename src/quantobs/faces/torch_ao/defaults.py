"""torch.ao's `default_*` observer constructors, built from quantobs' classes
with torch 2.13's arguments (where the seed's table differs, torch wins)."""

from __future__ import annotations

import torch

from quantobs.faces.torch_ao.histogram import HistogramObserver
from quantobs.faces.torch_ao.minmax import MinMaxObserver, PerChannelMinMaxObserver
from quantobs.faces.torch_ao.misc import (
    FixedQParamsObserver,
    PlaceholderObserver,
    RecordingObserver,
    ReuseInputObserver,
)

__all__ = [
    "default_affine_fixed_qparams_observer",
    "default_debug_observer",
    "default_dynamic_quant_observer",
    "default_fixed_qparams_range_0to1_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_float_qparams_observer",
    "default_float_qparams_observer_4bit",
    "default_histogram_observer",
    "default_observer",
    "default_per_channel_weight_observer",
    "default_placeholder_observer",
    "default_reuse_input_observer",
    "default_symmetric_fixed_qparams_observer",
    "default_weight_observer",
    "per_channel_weight_observer_range_neg_127_to_127",
    "weight_observer_range_neg_127_to_127",
]

#: Static activations, restricted to 0..127 (no reduce_range overflow).
default_observer = MinMaxObserver.with_args(quant_min=0, quant_max=127)
#: No observation, e.g. float16.
default_placeholder_observer = PlaceholderObserver
#: Debug: records every tensor.
default_debug_observer = RecordingObserver
#: Weights: symmetric qint8 per tensor.
default_weight_observer = MinMaxObserver.with_args(
    dtype=torch.qint8, qscheme=torch.per_tensor_symmetric
)
#: Weights: symmetric qint8 restricted to -127..127.
weight_observer_range_neg_127_to_127 = MinMaxObserver.with_args(
    dtype=torch.qint8,
    qscheme=torch.per_tensor_symmetric,
    quant_min=-127,
    quant_max=127,
    eps=2**-12,
)
#: Static activations by histogram L2 search, restricted to 0..127.
default_histogram_observer = HistogramObserver.with_args(quant_min=0, quant_max=127)
#: Weights: symmetric qint8 per channel.
default_per_channel_weight_observer = PerChannelMinMaxObserver.with_args(
    dtype=torch.qint8, qscheme=torch.per_channel_symmetric
)
#: Weights: symmetric qint8 per channel restricted to -127..127.
per_channel_weight_observer_range_neg_127_to_127 = PerChannelMinMaxObserver.with_args(
    dtype=torch.qint8,
    qscheme=torch.per_channel_symmetric,
    quant_min=-127,
    quant_max=127,
    eps=2**-12,
)
#: Dynamic quantization of activations (qparams computed at run time).
default_dynamic_quant_observer = PlaceholderObserver.with_args(
    dtype=torch.quint8, quant_min=0, quant_max=255, is_dynamic=True
)
#: Embedding weights: per row, float zero point.
default_float_qparams_observer = PerChannelMinMaxObserver.with_args(
    dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0
)
#: Embedding weights, 4 bits: per row, float zero point.
default_float_qparams_observer_4bit = PerChannelMinMaxObserver.with_args(
    dtype=torch.quint4x2, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0
)
#: Outputs in [-1, 1] (tanh): fixed scale 2/256, zero point 128.
default_fixed_qparams_range_neg1to1_observer = FixedQParamsObserver.with_args(
    scale=2.0 / 256.0, zero_point=128, dtype=torch.quint8, quant_min=0, quant_max=255
)
#: Outputs in [0, 1] (sigmoid): fixed scale 1/256, zero point 0.
default_fixed_qparams_range_0to1_observer = FixedQParamsObserver.with_args(
    scale=1.0 / 256.0, zero_point=0, dtype=torch.quint8, quant_min=0, quant_max=255
)
#: Old names of the two above (the same objects).
default_symmetric_fixed_qparams_observer = default_fixed_qparams_range_neg1to1_observer
default_affine_fixed_qparams_observer = default_fixed_qparams_range_0to1_observer
#: Ops (reshape, ...) whose output reuses the input's observer (FX mode).
default_reuse_input_observer = ReuseInputObserver
