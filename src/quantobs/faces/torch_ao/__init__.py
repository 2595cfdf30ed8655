"""The torch.ao face: `torch.ao.quantization.observer`'s observers, drop-in.

Change the import, keep the code::

    from quantobs.faces.torch_ao import MinMaxObserver, default_weight_observer

    qconfig = torch.ao.quantization.QConfig(
        activation=MinMaxObserver.with_args(quant_min=0, quant_max=127),
        weight=default_weight_observer,
    )

Same class names, constructor signatures and defaults, buffers (state dicts
interchange both ways, version 3), `forward(x) -> x`, `calculate_qparams()`
numbers bit for bit (torch 2.13), `with_args` / `with_callable_args`, and the
exception types torch raises (ours also derive from `ValueError`, see
`quantobs.faces.torch_ao.errors`). When `torch.ao.quantization` is importable, each
class registers as a virtual subclass of its torch counterpart, so torch's
own flows (`prepare` / `convert`, FX, `FakeQuantize`) recognise them; the
same holds for torchao's copies (`torchao.quantization.pt2e.observer`, the
PT2E flow) once torchao is loaded (`quantobs.integrations.torchao`).

Every class is a thin adapter over the observer engine
(`quantobs.observers.engine.ObserverEngine`): the statistic (`MinMax`,
`MovingAverage`, `TorchHistogram`) lives in torch's registered buffers, so
it moves with `.to()`, resumes from `state_dict`, survives `copy.deepcopy`
and `torch.save`; the face keeps only what is torch's own (names,
signatures, defaults, state-dict layout and versions, exception types, the
qparams rule). The observers without statistics (fixed qparams,
placeholder, recording, no-op, input reuse) keep none.

Faster: per-tensor min-max is one `aminmax` pass in the input's dtype (torch
copies to float32 first); per-channel min-max reduces the channel view
(`quantobs.core.layout.channel_view`, no copy) with the engine's reductions
(the native kernel where it applies) instead of permute + copy +
`aminmax(dim=1)`; `HistogramObserver` counts with a native `histc` twin and
its search is vectorized (`torch_l2_search`).

Deliberate differences from torch.ao (each beyond or instead of a torch bug):

* `nan_policy="raise"` (default): a batch with NaN (min-max observers: NaN or
  inf) raises `ValueError`, instead of a NaN / inf scale or an opaque histc
  error. `nan_policy="omit"` ignores those values; `nan_policy="propagate"`
  restores torch's behaviour.
* Finite inputs near float32's limits give finite positive scales and
  in-range zero points (torch: inf / NaN scales, an int32 zero point that
  wraps to 0, an AssertionError once a moving average overflows), or a
  `ValueError` naming the fix; bf16 / fp16 batches `torch.histc` refuses are
  counted in float32; `quantobs.faces.torch_ao.overflow` has the table.
* Per-channel observers raise `ObserverShapeError` when the channel count
  changes, also from 1 channel to many (torch silently broadcasts that).
  They accept 1-D inputs (each element a channel; torch raises IndexError).
* `HistogramObserver(search="global")` picks the least-L2 range over all
  candidate ranges (not torch's greedy walk), with the real level count;
  `reset_min_max_vals()` works on it.
* `obs.merge(other)` folds another observer's statistic in (the engine's):
  exactly for the running min-max observers, by torch's re-binning for the
  histogram; moving averages keep no count to weight a merge and refuse.
* No `reduce_range` deprecation warning; `PlaceholderObserver(compute_dtype=)`
  makes the observer dynamic as documented (torch drops the flag).
* Loading a state dict without metadata keeps its saved `eps` (torch
  replaces it by float32's eps); loading copies values (torch's histogram
  observer aliases the loaded tensors).
* Not TorchScript-able (`torch.jit` is deprecated too); the experimental
  affine-quantization classes (`AffineQuantizedObserverBase`, granularities)
  are torchao's and not part of this face.
"""

from __future__ import annotations

import warnings

from quantobs.core.qparams.torch_rule import torch_qparams, torch_quant_range
from quantobs.faces.torch_ao.base import (
    ObserverBase,
    UniformQuantizationObserverBase,
    register_twins,
)
from quantobs.faces.torch_ao.defaults import (
    default_affine_fixed_qparams_observer,
    default_debug_observer,
    default_dynamic_quant_observer,
    default_fixed_qparams_range_0to1_observer,
    default_fixed_qparams_range_neg1to1_observer,
    default_float_qparams_observer,
    default_float_qparams_observer_4bit,
    default_histogram_observer,
    default_observer,
    default_per_channel_weight_observer,
    default_placeholder_observer,
    default_reuse_input_observer,
    default_symmetric_fixed_qparams_observer,
    default_weight_observer,
    per_channel_weight_observer_range_neg_127_to_127,
    weight_observer_range_neg_127_to_127,
)
from quantobs.faces.torch_ao.errors import (
    InvalidObserverArgument,
    ObserverShapeError,
    UnsupportedObserverConfig,
)
from quantobs.faces.torch_ao.histogram import HistogramObserver
from quantobs.faces.torch_ao.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from quantobs.faces.torch_ao.misc import (
    FixedQParamsObserver,
    NoopObserver,
    PlaceholderObserver,
    RecordingObserver,
    ReuseInputObserver,
    get_observer_state_dict,
    load_observer_state_dict,
)

__all__ = [
    "FixedQParamsObserver",
    "HistogramObserver",
    "InvalidObserverArgument",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "NoopObserver",
    "ObserverBase",
    "ObserverShapeError",
    "PerChannelMinMaxObserver",
    "PlaceholderObserver",
    "RecordingObserver",
    "ReuseInputObserver",
    "UniformQuantizationObserverBase",
    "UnsupportedObserverConfig",
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
    "get_observer_state_dict",
    "load_observer_state_dict",
    "per_channel_weight_observer_range_neg_127_to_127",
    "torch_qparams",
    "torch_quant_range",
    "weight_observer_range_neg_127_to_127",
]

_TWINS = (
    ObserverBase,
    UniformQuantizationObserverBase,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    HistogramObserver,
    FixedQParamsObserver,
    PlaceholderObserver,
    RecordingObserver,
    NoopObserver,
    ReuseInputObserver,
)


def _register_with_torch_ao() -> None:
    """Make `isinstance(ours, torch's twin)` true, so torch's flows (which
    test `isinstance(m, ObserverBase)`, `PlaceholderObserver`, ...) accept
    quantobs' observers. A no-op once torch.ao is gone: the face's classes
    compute the same qparams without it (they never call torch.ao), only the
    `isinstance` checks of torch's own flows no longer see them."""
    try:
        with warnings.catch_warnings():  # a deprecation notice is not ours
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            from torch.ao.quantization import observer as torch_observer

            register_twins(torch_observer, _TWINS)
    except Exception:  # removed, or a stub that raises on use: fail soft
        return


_register_with_torch_ao()
