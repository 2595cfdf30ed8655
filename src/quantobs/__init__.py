"""quantobs: quantization observers on one vectorized core.

The core math: number formats, quantization args and presets, the canonical
calibration layout, range-to-qparams conversion, and (fake) quantization.
"""

from quantobs.core.args import (
    ActivationOrdering,
    DynamicType,
    QuantizationArgs,
    QuantizationStrategy,
    QuantizationType,
)
from quantobs.core.formats import FORMATS, NumberFormat, get_format
from quantobs.core.layout import BASE_NAMES, flatten_for_calibration, qparam_shape
from quantobs.core.presets import PRESET_SCHEMES, QuantizationScheme, preset_scheme
from quantobs.core.qparams import (
    amax_to_global_scale,
    calculate_qparams,
    calculate_range,
    generate_gparam,
    scale_to_storage,
    storage_to_scale,
)
from quantobs.core.quantize import dequantize, fake_quantize, quantize
from quantobs.observers import Observer
from quantobs.observers.fit import ObjectiveFitWarning

__version__ = "0.1.0"

__all__ = [
    "BASE_NAMES",
    "FORMATS",
    "PRESET_SCHEMES",
    "ActivationOrdering",
    "DynamicType",
    "NumberFormat",
    "ObjectiveFitWarning",
    "Observer",
    "QuantizationArgs",
    "QuantizationScheme",
    "QuantizationStrategy",
    "QuantizationType",
    "__version__",
    "amax_to_global_scale",
    "calculate_qparams",
    "calculate_range",
    "dequantize",
    "fake_quantize",
    "flatten_for_calibration",
    "generate_gparam",
    "get_format",
    "preset_scheme",
    "qparam_shape",
    "quantize",
    "scale_to_storage",
    "storage_to_scale",
]
