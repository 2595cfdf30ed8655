"""What the installed compressed-tensors can do that older versions cannot.

quantobs computes FP6 (e2m3) qparams and fake quantization itself, with or
without compressed-tensors. Exporting a checkpoint and `quantobs compare`
(whose evaluation runs compressed-tensors' own fake quantization) need its
FP6 support, added in compressed-tensors 0.20 (the FP6 E2M3 element, the
`mxfp6-pack-quantized` compressor, the MXFP6A16 / MXFP6A8 presets).
Under an older version they refuse with `check_fp6`'s error, naming the
version needed, before any long work.
"""

from __future__ import annotations

from collections.abc import Sequence

from quantobs.core.args import QuantizationArgs
from quantobs.core.presets import QuantizationScheme, preset_scheme

__all__ = [
    "COMPARE_TASK",
    "FP6_SINCE",
    "check_fp6",
    "check_fp6_schemes",
    "compressed_tensors_has_fp6",
    "uses_fp6",
]

#: The first compressed-tensors version with FP6 (e2m3) and its compressor.
FP6_SINCE = "0.20"
_FP6 = "float6_e2m3fn"
_PARTS = ("weights", "input_activations", "output_activations")
#: `quantobs compare`'s task: its cells run compressed-tensors' fake quantization.
COMPARE_TASK = "evaluate it (compare runs compressed-tensors' fake quantization)"


def compressed_tensors_has_fp6() -> bool:
    """Whether compressed-tensors is installed and quantizes FP6 (>= 0.20).

    Detected by the feature (its `FP6_E2M3_DATA`), not the version number.
    """
    try:
        from compressed_tensors.quantization import quant_args
    except ImportError:
        return False
    return hasattr(quant_args, "FP6_E2M3_DATA")


def uses_fp6(scheme: QuantizationScheme | QuantizationArgs | None) -> bool:
    """Whether a scheme (any of its args) or args quantize to FP6 (e2m3)."""
    if scheme is None:
        return False
    if isinstance(scheme, QuantizationArgs):
        return scheme.format.name == _FP6
    return any(uses_fp6(getattr(scheme, part)) for part in _PARTS)


def check_fp6(what: str, task: str) -> None:
    """Raise unless the installed compressed-tensors has FP6.

    Args:
        what: what needs it, e.g. `"scheme MXFP6A16"`.
        task: what for, e.g. `"export"`.

    Raises:
        ValueError: compressed-tensors is older than `FP6_SINCE` or missing;
            the message names the version installed and the one needed.
    """
    if compressed_tensors_has_fp6():
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = f"installed: {version('compressed-tensors')}"
    except PackageNotFoundError:
        installed = "not installed"
    raise ValueError(
        f"{what} needs compressed-tensors >= {FP6_SINCE} to {task} ({installed}); "
        f"pip install 'compressed-tensors>={FP6_SINCE}' (quantobs' observers, "
        "qparams and fake_quantize handle FP6 without it)"
    )


def check_fp6_schemes(
    schemes: Sequence[str], kv_cache_scheme: QuantizationArgs | None, task: str
) -> None:
    """`check_fp6` for preset names (FP6 in any of their args: MXFP6A16,
    MXFP6A8) and a kv-cache scheme.

    Raises:
        KeyError: an unknown preset name.
        ValueError: one of them needs FP6 and compressed-tensors lacks it.
    """
    for name in schemes:
        if uses_fp6(preset_scheme(name)):
            check_fp6(f"scheme {name}", task)
    if uses_fp6(kv_cache_scheme):
        check_fp6("the FP6 (e2m3) kv-cache scheme", task)
