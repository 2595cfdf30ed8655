"""Solvers: pure functions from a statistic to a `(min_vals, max_vals)` range.

Each solver family has its own module; all of them take histograms in the
layout of `quantobs.stats.histogram` (`(*qparam_shape, bins)` counts over uniform
bins) and return one range per qparam, with no Python loop over qparams.

=================  ============================================================
module             solver
=================  ============================================================
``histogram_l2``   `torch_l2_search` (torch.ao's greedy search, bit for bit) and
                   `l2_search` (the global minimum of the same L2 error)
``percentile``     two-sided / one-sided (|x|) percentile ranges
``entropy``        TensorRT / ModelOpt KL-divergence calibration
``histogram_mse``  expected `|fake_quant(x) - x| ** norm` under the histogram,
                   with the format's real rounding
=================  ============================================================
"""

from quantobs.solvers.entropy import entropy_search
from quantobs.solvers.histogram_l2 import (
    l2_errors,
    l2_search,
    torch_l2_search,
    torch_l2_search_batched,
)
from quantobs.solvers.histogram_mse import histogram_mse_search
from quantobs.solvers.percentile import (
    percentile_lower,
    percentile_range,
    percentile_upper,
)

__all__ = [
    "entropy_search",
    "histogram_mse_search",
    "l2_errors",
    "l2_search",
    "percentile_lower",
    "percentile_range",
    "percentile_upper",
    "torch_l2_search",
    "torch_l2_search_batched",
]
