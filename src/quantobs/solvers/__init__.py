"""Solvers: pure functions from a statistic to a `(min_vals, max_vals)` range.

Each solver family has its own module; all of them take histograms in the
layout of `quantobs.stats.histogram` (`(*qparam_shape, bins)` counts over uniform
bins) and return one range per qparam, with no Python loop over qparams.

=================  ============================================================
module             solver
=================  ============================================================
``torch_l2``       `torch_l2_search` (torch.ao's greedy search, bit for bit)
``global_l2``      `l2_search` (the global minimum of the same L2 error)
``l2_batched``     `l2_search_batched` (the same objective, many small
                   histograms at once: per channel / per group)
``l2_error``       the closed-form L2 error of any range (`l2_errors`)
``l2_bounds``      lower bounds on it: the global search's certificate
``percentile``     two-sided / one-sided (|x|) percentile ranges
``entropy``        TensorRT / ModelOpt KL-divergence calibration (exhaustive
                   or coarse-to-fine)
``histogram_mse``  expected `|fake_quant(x) - x| ** norm` under the histogram,
                   with the format's real rounding (bin centres), or the
                   squared error with values spread in their bins
=================  ============================================================
"""

from quantobs.solvers.entropy import entropy_search
from quantobs.solvers.global_l2 import l2_search
from quantobs.solvers.histogram_mse import histogram_mse_search, histogram_mse_uniform
from quantobs.solvers.l2_batched import l2_search_batched
from quantobs.solvers.l2_error import l2_errors
from quantobs.solvers.percentile import (
    percentile_lower,
    percentile_range,
    percentile_upper,
)
from quantobs.solvers.torch_l2 import torch_l2_search, torch_l2_search_batched

__all__ = [
    "entropy_search",
    "histogram_mse_search",
    "histogram_mse_uniform",
    "l2_errors",
    "l2_search",
    "l2_search_batched",
    "percentile_lower",
    "percentile_range",
    "percentile_upper",
    "torch_l2_search",
    "torch_l2_search_batched",
]
