"""Whether an observer's objective fits the format it calibrates.

Two histogram observers choose a range by an objective that assumes an
integer quantizer's uniform levels, and on float formats (FP8, FP6, FP4,
NVFP4, MX) that assumption fails:

- `entropy` (TensorRT / ModelOpt KL calibration) clips |x| where quantizing
  the histogram into uniform bins keeps its shape best. A float format's
  levels are spaced in proportion to their magnitude: small values keep
  their relative precision whatever the range, so clipping gains them
  little and the clipped outliers are lost.
- `percentile` clips the tails by count, not by error, with the same loss
  on float formats.
- `entropy` on weights, any format: TensorRT and ModelOpt calibrate weights
  by max and keep KL calibration for activations. Clipping a weight's
  largest values by KL removes the ones that carry the most signal: on
  MiniLM's W8A8 weights (per channel int8) entropy gives 26.6 dB weight SQNR
  where min-max gives 41.1 (held-out cos mean 0.9837 vs 0.9976), and W4A16
  0.9386 vs 0.9500.

On all-MiniLM-L6-v2 (`quantobs compare`, held-out cos mean of the sentence
embeddings) min-max gives FP8 0.9977 and NVFP4 0.9671 where entropy gives
0.9425 and 0.7973 (NVFP4: on the inputs' global scale, the weights' groups
keep min-max), and percentile FP8 0.9800: the objective, not a defect
(ModelOpt's own entropy calibrator picks the same range on the same
histograms, `tests/solvers/test_modelopt_parity.py`). ModelOpt, likewise,
offers entropy and percentile calibration for int8 only.

Such an observer still runs (it is what the user asked for), but warns once
per observer and format with `ObjectiveFitWarning`, which names the reason
and what fits. Turn it into an error with
`warnings.simplefilter("error", quantobs.ObjectiveFitWarning)`.
"""

from __future__ import annotations

import warnings

from quantobs.core.args import QuantizationArgs

__all__ = ["ObjectiveFitWarning", "objective_mismatch", "warn_if_unfit"]


class ObjectiveFitWarning(UserWarning):
    """An observer's objective does not fit the format of its args."""


_WHY = {
    "entropy": (
        "KL calibration clips |x| where uniform bins keep the histogram's "
        "shape, but {fmt} spaces its levels in proportion to their magnitude, "
        "so small values keep their precision whatever the range and the "
        "clipped outliers are pure loss"
    ),
    "percentile": (
        "it clips the tails by count, not by error, but {fmt} spaces its "
        "levels in proportion to their magnitude, so small values keep their "
        "precision whatever the range and the clipped outliers are pure loss"
    ),
}
_WEIGHTS_WHY = (
    "TensorRT and ModelOpt calibrate weights by max and keep KL calibration "
    "for activations: clipping a weight's largest values removes the ones "
    "that carry the most signal"
)
_INSTEAD = (
    "minmax keeps the outliers; mse, static_mse or histogram_mse search the "
    "range with the format's real rounding"
)


def objective_mismatch(
    observer: str, args: QuantizationArgs, base_name: str = "input"
) -> str | None:
    """Why `observer`'s objective does not fit `args`' format (or, for
    entropy, the weights), or None.

    Args:
        observer: a registered observer name, e.g. `"entropy"`.
        args: the quantization args it calibrates.
        base_name: what it observes: `"weight"`, `"input"`, `"output"`,
            `"q"`, `"k"`, `"v"`.
    """
    why = _WHY.get(observer)
    if why is None:
        return None
    if args.format.is_float:
        return why.format(fmt=args.format.name)
    if observer == "entropy" and base_name == "weight":
        return _WEIGHTS_WHY
    return None


def warn_if_unfit(
    observer: str, args: QuantizationArgs, base_name: str, stacklevel: int = 2
) -> None:
    """Warn (`ObjectiveFitWarning`) when `objective_mismatch` gives a reason.

    The message names the observer and the format (or the weights), not the
    module, so the default warning filter shows it once per observer and
    format however many layers a recipe attaches it to.
    """
    reason = objective_mismatch(observer, args, base_name)
    if reason is None:
        return
    what = args.format.name if args.format.is_float else "weights"
    warnings.warn(
        f"observer {observer!r} does not fit {what}: {reason}; {_INSTEAD}",
        ObjectiveFitWarning,
        stacklevel=stacklevel + 1,
    )
