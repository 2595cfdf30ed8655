"""Optional native kernels: min/max, MSE candidate errors, histogram counts.

The Python wrappers of the kernels (the ops). The library they call is built
when quantobs is installed and loaded with ctypes by
`quantobs.native.loader` (how it is built: `quantobs.native.build`; its C
sources: `qo_*.c` next to this file). Nothing requires it: without it (no C
compiler at install: one `RuntimeWarning` says so), with
`QUANTOBS_NATIVE=0`, or after `set_enabled(False)`, every caller runs its
eager torch twin, which gives the same min/max bit for bit and the same MSE
errors to float32 rounding (the kernel's `|e| ** 2.4` is within 3e-7
relative of `powf`, and its sums are its own). `backend_info()` says which
runs.

The kernels take contiguous float32 CPU tensors (the canonical layout
`(N, Q, G)` where they reduce per qparam); each function returns None (or
False) where it does not apply, and the caller falls back to torch.
`histc` is `torch.histc`'s twin for the torch.ao face, exact where it runs.
"""

from __future__ import annotations

from quantobs.native.ops_histogram import add_counts, histc, histogram_pass
from quantobs.native.ops_minmax import (
    all_finite,
    minmax,
    minmax_absmax,
    range_absmax,
    symmetric_scales,
)
from quantobs.native.ops_mse import (
    mse_block,
    mse_block_supported,
    mse_errors,
    mse_marks,
    mse_rows,
    mse_supported,
    pow24,
)
from quantobs.native.ops_search import (
    entropy,
    entropy_search_rows,
    l2_candidates,
    l2_errors,
    l2_survivors,
    l2_symmetric,
    torch_l2_terms,
)
from quantobs.native.runtime import available, backend_info, set_enabled

__all__ = [
    "add_counts",
    "all_finite",
    "available",
    "backend_info",
    "entropy",
    "entropy_search_rows",
    "histc",
    "histogram_pass",
    "l2_candidates",
    "l2_errors",
    "l2_survivors",
    "l2_symmetric",
    "minmax",
    "minmax_absmax",
    "mse_block",
    "mse_block_supported",
    "mse_errors",
    "mse_marks",
    "mse_rows",
    "mse_supported",
    "pow24",
    "range_absmax",
    "set_enabled",
    "symmetric_scales",
    "torch_l2_terms",
]
