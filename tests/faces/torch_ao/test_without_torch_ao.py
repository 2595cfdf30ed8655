"""The torch.ao face without `torch.ao.quantization` (deprecated for removal,
pytorch/ao#2259): it imports and computes the same qparams."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest

# Each case makes `torch.ao.quantization` unusable before quantobs is imported
# (torch itself imports it: it is dropped from sys.modules after `import
# torch`), then checks the face's qparams against the numbers it gives here.
_PURGE = """
    import sys, torch, torch.ao
    for name in [n for n in sys.modules if n.startswith("torch.ao.quantization")]:
        del sys.modules[name]
    if hasattr(torch.ao, "quantization"):
        delattr(torch.ao, "quantization")
"""
_BLOCKERS = {
    "gone": (
        _PURGE,
        """
        import importlib.abc
        class Gone(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch.ao.quantization" or name.startswith(
                    "torch.ao.quantization."
                ):
                    raise ImportError(f"No module named {name!r}")
                return None
        sys.meta_path.insert(0, Gone())
    """,
    ),
    "raising stub": (
        _PURGE,
        """
        import types
        class Stub(types.ModuleType):
            def __getattr__(self, name):
                raise RuntimeError("torch.ao.quantization was removed")
        sys.modules["torch.ao.quantization"] = Stub("torch.ao.quantization")
    """,
    ),
    "deprecation warning as error": (
        """
        import warnings
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
    """,
    ),
}

_CHECK = """
    import torch
    from quantobs.torch_ao import (
        HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver,
    )
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    out = []
    for cls, kw in ((MinMaxObserver, {}),
                    (PerChannelMinMaxObserver, {"ch_axis": 0}),
                    (HistogramObserver, {})):
        obs = cls(**kw)
        obs(x)
        scale, zp = obs.calculate_qparams()
        out.append((scale.double().sum().item(), zp.sum().item()))
    print(repr(out))
"""


@functools.cache
def _run(prelude: tuple[str, ...]) -> str:
    code = "\n".join(textwrap.dedent(part) for part in (*prelude, _CHECK))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    if done.returncode:
        raise AssertionError(done.stderr[-3000:])
    return done.stdout.strip()


@pytest.mark.parametrize("how", sorted(_BLOCKERS))
def test_the_face_works_when_torch_ao_quantization_is_unusable(how: str) -> None:
    assert _run(_BLOCKERS[how]) == _run(())
