"""The optional native kernels; everything else is in pyproject.toml.

One shared library with a plain C ABI, `quantobs/native/_qo_kernels.so`
(loaded with ctypes, so one build serves every Python and torch version),
compiled from `src/quantobs/native/qo_*.c` with the portable flags and the
fallbacks of `src/quantobs/native/build.py` (no -march=native: ISA clones
dispatched at load time instead). Optional: where no variant compiles,
`pip install` still succeeds and quantobs runs its torch implementations,
with a warning at first use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

NATIVE = Path("src", "quantobs", "native")  # setuptools wants relative paths
ROOT = Path(__file__).resolve().parent
EXTENSION = "quantobs.native._qo_kernels"


def _load_build() -> ModuleType:
    """`quantobs.native.build`, by path: the build has no torch to import."""
    path = ROOT / NATIVE / "build.py"
    spec = importlib.util.spec_from_file_location("_quantobs_native_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


native_build = _load_build()


class BuildKernels(build_ext):
    """build_ext for a ctypes library: its own file name, no `PyInit_`
    export, and build.py's variants tried in order until one compiles."""

    def get_ext_filename(self, fullname: str) -> str:
        # called with the full name, and (get_ext_fullpath) with the last part
        if fullname not in (EXTENSION, EXTENSION.rpartition(".")[2]):
            return str(super().get_ext_filename(fullname))
        package = fullname.split(".")[:-1]
        return os.path.join(*package, native_build.library_filename())

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name != EXTENSION:
            return list(super().get_export_symbols(ext))
        return list(ext.export_symbols)  # QO_API marks them (Windows)

    def build_extension(self, ext: Extension) -> None:
        if ext.name != EXTENSION:
            super().build_extension(ext)
            return
        msvc = getattr(self.compiler, "compiler_type", "") == "msvc"
        failures = []
        for variant in native_build.VARIANTS:
            ext.extra_compile_args = native_build.compile_args(variant, msvc)
            ext.extra_link_args = native_build.link_args(variant, msvc)
            try:
                super().build_extension(ext)
            except (CCompilerError, BaseError) as error:
                failures.append(f"{variant}: {error}")
                continue
            print(f"quantobs: native kernels built ({variant})")
            return
        # ext.optional: setuptools reports this and the install goes on
        raise CCompilerError("; ".join(failures))


def _kernels() -> Extension:
    digest = native_build.source_hash(ROOT / NATIVE)
    options: dict[str, Any] = {
        "sources": [str(NATIVE / name) for name in native_build.SOURCES],
        "depends": [str(NATIVE / name) for name in native_build.HEADERS],
        "define_macros": [("QO_SOURCE_HASH", digest)],
        "libraries": [] if os.name == "nt" else ["m"],
        "optional": True,
    }
    return Extension(EXTENSION, **options)


setup(ext_modules=[_kernels()], cmdclass={"build_ext": BuildKernels})
