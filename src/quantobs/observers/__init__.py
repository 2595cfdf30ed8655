"""Observers: statistics + range selection, registered by name."""

from quantobs.observers.base import Observer, ObserverOptions
from quantobs.observers.helpers import get_observer_token_count
from quantobs.observers.histogram import (
    EntropyObserver,
    EntropyOptions,
    HistogramL2Observer,
    HistogramL2Options,
    HistogramMSEObserver,
    HistogramMSEOptions,
    HistogramOptions,
    HistogramStatObserver,
    PercentileObserver,
    PercentileOptions,
)
from quantobs.observers.imatrix import (
    IMatrixMSEObserver,
    IMatrixMSEOptions,
    NVFP4ExpandedIMatrixObserver,
    NVFP4ExpandedIMatrixOptions,
    NVFP4ExpandedMSEObserver,
    NVFP4ExpandedMSEOptions,
)
from quantobs.observers.importance import ImportanceGatherer, ImportanceObserver
from quantobs.observers.minmax import (
    MemorylessMinMaxObserver,
    MinMaxObserver,
    MovingAverageOptions,
    StaticMinMaxObserver,
)
from quantobs.observers.mse import (
    MemorylessMSEObserver,
    MovingAverageMSEObserver,
    MovingAverageMSEOptions,
    MSEOptions,
    StaticMSEObserver,
    StaticMSEOptions,
)

__all__ = [
    "EntropyObserver",
    "EntropyOptions",
    "HistogramL2Observer",
    "HistogramL2Options",
    "HistogramMSEObserver",
    "HistogramMSEOptions",
    "HistogramOptions",
    "HistogramStatObserver",
    "IMatrixMSEObserver",
    "IMatrixMSEOptions",
    "ImportanceGatherer",
    "ImportanceObserver",
    "MSEOptions",
    "MemorylessMSEObserver",
    "MemorylessMinMaxObserver",
    "MinMaxObserver",
    "MovingAverageMSEObserver",
    "MovingAverageMSEOptions",
    "MovingAverageOptions",
    "NVFP4ExpandedIMatrixObserver",
    "NVFP4ExpandedIMatrixOptions",
    "NVFP4ExpandedMSEObserver",
    "NVFP4ExpandedMSEOptions",
    "Observer",
    "ObserverOptions",
    "PercentileObserver",
    "PercentileOptions",
    "StaticMSEObserver",
    "StaticMSEOptions",
    "StaticMinMaxObserver",
    "get_observer_token_count",
]
