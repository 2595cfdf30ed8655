"""torchao's PT2E flow with `quantobs.torch_ao` observers.

torch 2.13 deprecates `torch.ao.quantization` and points to torchao's PT2E
flow (`torch.export` -> `prepare_pt2e` -> calibrate -> `convert_pt2e`), which
keeps its own copy of torch.ao's observer classes
(`torchao.quantization.pt2e.observer`) and tests `isinstance` against them.
Importing this module registers every `quantobs.torch_ao` observer class as a
virtual subclass of its torchao namesake, so `convert_pt2e` replaces our
observers by quantize / dequantize ops as it does torchao's own::

    import quantobs.integrations.torchao  # noqa: F401  (the set-up)
    from quantobs.torch_ao import HistogramObserver, PerChannelMinMaxObserver
    from torchao.quantization.pt2e.quantizer import QuantizationSpec

    activation = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-128,
        quant_max=127,
        qscheme=torch.per_tensor_affine,
        observer_or_fake_quant_ctr=HistogramObserver.with_args(eps=2**-12),
    )

and a quantizer that annotates with such specs goes through `prepare_pt2e`
and `convert_pt2e` unchanged. The face also registers a class by itself the
first time it is built after torchao's observer module was loaded (which
`prepare_pt2e` does), so forgetting this import does not leave observers in a
converted graph; importing it registers every class up front and fails early
when torchao is missing.

`with_args` / `with_callable_args` constructors are the face's (torch's
semantics); they carry the `__name__` of the class they build, which
torchao's `prepare` reads to decide whether to pass `ch_axis`.

Raises:
    ImportError: on import, when torchao (the `peers` extra) is not installed.
"""

from __future__ import annotations

import importlib

from quantobs.faces import torch_ao as _face
from quantobs.faces.torch_ao.base import TORCHAO_OBSERVERS, register_twins

try:
    _torchao_observers = importlib.import_module(TORCHAO_OBSERVERS)
except ImportError as error:
    raise ImportError(
        "quantobs.integrations.torchao needs torchao >= 0.12 (its PT2E flow, "
        f"{TORCHAO_OBSERVERS}); install it with `pip install 'quantobs[peers]'` "
        "or `pip install torchao`"
    ) from error

__all__ = ["OBSERVER_CLASSES", "register"]

#: The face's observer classes, each registered with its torchao namesake.
#: (The face's `__all__` also names some classes twice, as `default_*`.)
OBSERVER_CLASSES: tuple[type[_face.ObserverBase], ...] = tuple(
    dict.fromkeys(
        obj
        for obj in (getattr(_face, name) for name in _face.__all__)
        if isinstance(obj, type) and issubclass(obj, _face.ObserverBase)
    )
)


def register() -> None:
    """Register every `OBSERVER_CLASSES` entry with torchao's observer classes.

    Done on import; calling it again is harmless.
    """
    register_twins(_torchao_observers, OBSERVER_CLASSES)


register()
