"""llm-compressor's legacy (<= 0.7) observer API as a thin face on the engine.

A drop-in for `llmcompressor.observers.Observer` and its subclasses
`MinMaxObserver` ("minmax") and `MovingAverageMSEObserver` ("mse") as they
were up to llm-compressor 0.7: change the import, keep the calls. The numbers
are those of the legacy loops (per-group calls, a running range per
`tensor_id`), with every range turned into qparams by compressed-tensors'
rule (`CompressedTensorsRule`).

What each strategy reduces in `get_qparams(x)` (the legacy rules)::

    strategy        x               reduced            scale / zero point
    tensor          any             every dim          (1,)
    channel         (rows, ...)     all dims but 0     (rows, 1, ...)
    token           (B, T, ...)     all dims but 0, 1  (B, T, 1, ...)
    token           2-D (T, H)      every dim          (1,)  [legacy quirk]
    group           (rows, cols)    each group         (rows, cols // group_size)
    tensor_group    as group, group scales multiplied by `global_scale`

The face keeps what is its own (class names, constructor signatures and
defaults, compressed-tensors args, the `min_val` / `max_val` mappings, the
exception types); each running range is an `ObserverEngine` whose statistic
lives in registered buffers (`ranges.py`), so `.to()`, `state_dict()` /
`load_state_dict()`, `copy.deepcopy`, `torch.save` and `merge` just work.

Modules: `base.py` (the base class: registry, strategy dispatch, tokens),
`ranges.py` (running ranges per `tensor_id`), `minmax.py`, `mse.py`.

Differences from the legacy code, each deliberate:

* Groups are computed in one pass over the canonical layout
  (`flatten_for_calibration`, with `g_idx` for activation ordering), and the
  running range of all groups is one `(rows, num_groups)` tensor stored under
  `min_val[GROUPS_ID]` / `max_val[GROUPS_ID]` (legacy: one entry per group).
  A custom subclass that only overrides `calculate_qparams` gets one call
  with the grouped view `(rows, num_groups, group_size)` and `reduce_dims=(2,)`.
* The MSE observer keys its running range by `tensor_id or "default"` on
  read and write (llm-compressor 0.5 - 0.7 read `tensor_id` but wrote
  `tensor_id or "default"`, so group 0 and every non-group strategy never
  averaged), and reduces token strategies per token like the base class.
* Errors instead of silent garbage: a group size that does not divide the
  columns, `g_idx` groups of unequal size, a range whose shape changes while
  a moving average is kept, non-finite or empty inputs, unknown options, and
  the strategies the legacy API cannot express (`block`, `attn_head`).
  Non-finite inputs follow the option `nan_policy` (`"raise"` by default,
  `"omit"`, `"propagate"`: every face's), where the legacy code returned NaN
  scales.
"""

from quantobs.faces.llmcompressor_legacy.base import (
    GROUPS_ID,
    Observer,
    ObserverOptions,
)
from quantobs.faces.llmcompressor_legacy.minmax import MinMaxObserver, MinMaxOptions
from quantobs.faces.llmcompressor_legacy.mse import MovingAverageMSEObserver, MSEOptions

__all__ = [
    "GROUPS_ID",
    "MSEOptions",
    "MinMaxObserver",
    "MinMaxOptions",
    "MovingAverageMSEObserver",
    "Observer",
    "ObserverOptions",
]
