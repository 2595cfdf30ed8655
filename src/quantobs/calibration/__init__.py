"""Calibrating whole models: attach observers, calibrate, save / resume,
sync across processes, export a compressed-tensors checkpoint.

From a Hugging Face model to a compressed-tensors checkpoint::

    from quantobs.calibration import attach, calibrate, save_compressed, text_batches

    attach(model, Recipe.from_scheme("W4A16", ignore=["re:.*pooler.*"]))
    report = calibrate(model, text_batches(tokenizer, sentences))
    save_compressed(model, "out/")
"""

from quantobs.calibration.attach import (
    Attachment,
    Entry,
    attach,
    attachment_of,
    detach,
    observers_of,
)
from quantobs.calibration.calibrate import (
    CalibrationReport,
    calibrate,
    sync,
    text_batches,
    write_qparams,
)
from quantobs.calibration.distributed import sync_observers
from quantobs.calibration.experts import ExpertsReloadWarning
from quantobs.calibration.export import (
    SUPPORTED_FORMATS,
    checkpoint_formats,
    save_compressed,
)
from quantobs.calibration.qparams import (
    DEFAULT_EMPTY_RANGE,
    FUSED_LAYER_NAMES,
)
from quantobs.calibration.recipe import DEFAULT_OBSERVERS, Recipe
from quantobs.calibration.state import load_state, save_state

__all__ = [
    "DEFAULT_EMPTY_RANGE",
    "DEFAULT_OBSERVERS",
    "FUSED_LAYER_NAMES",
    "SUPPORTED_FORMATS",
    "Attachment",
    "CalibrationReport",
    "Entry",
    "ExpertsReloadWarning",
    "Recipe",
    "attach",
    "attachment_of",
    "calibrate",
    "checkpoint_formats",
    "detach",
    "load_state",
    "observers_of",
    "save_compressed",
    "save_state",
    "sync",
    "sync_observers",
    "text_batches",
    "write_qparams",
]
