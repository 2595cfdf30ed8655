"""Building the native kernels: the `qo_*.c` files into one shared library.

The library has a plain C ABI (no Python or torch headers: one build serves
every Python and torch version) and is loaded with ctypes by
`quantobs.native.loader`. It is built in two ways, with the flags below:

* at install, by setup.py's optional extension (a failed compile does not
  fail `pip install`; the package then runs its torch implementations); an
  editable install builds it in place, next to this file;
* for development, by `build_library` here:

      python -m quantobs.native.build             # build in place, next to the sources
      python -m quantobs.native.build --if-stale  # only if missing or stale
      python src/quantobs/native/build.py         # the same, without importing quantobs

  or on first use with `QUANTOBS_NATIVE_BUILD=1` (see the loader).

No `-march=native`: what is built must run on every CPU of its platform. The
hot kernels carry ISA clones instead (`QO_CLONES` in qo_kernels.h: an AVX2
copy next to the baseline one on x86, and an AVX-512 one of the MSE scorers,
chosen at load time).

This module uses the standard library only: setup.py loads it by path, in a
build environment without torch or quantobs.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BASE_FLAGS",
    "HEADERS",
    "LIBRARY",
    "OPENMP_FLAGS",
    "SOURCES",
    "SOURCE_DIR",
    "VARIANTS",
    "BuildError",
    "Variant",
    "build_library",
    "compile_args",
    "library_filename",
    "library_hash",
    "link_args",
    "main",
    "source_hash",
]

SOURCE_DIR = Path(__file__).resolve().parent
# One library from every kernel family (see qo_kernels.h for what is where).
SOURCES = (
    "qo_entropy.c",
    "qo_histogram.c",
    "qo_info.c",
    "qo_minmax.c",
    "qo_mse.c",
    "qo_search.c",
)
HEADERS = ("qo_kernels.h",)
LIBRARY = "_qo_kernels"  # the module name of setup.py's extension, too

# Portable: the target's baseline ISA, wider ISAs by runtime dispatch only.
BASE_FLAGS = (
    "-O3",
    "-fPIC",
    "-ffp-contract=off",  # no FMA contraction: torch's float32 rounding, step by step
    "-fno-math-errno",  # lets sqrtf and rintf inline
    "-fno-trapping-math",  # lets rintf vectorize; values are unchanged
)
OPENMP_FLAGS = ("-fopenmp",)
NO_CLONES = ("-DQO_NO_CLONES",)  # where target_clones (ifunc) does not build
MSVC_FLAGS = ("/O2", "/fp:precise")
MSVC_OPENMP_FLAGS = ("/openmp",)


@dataclass(frozen=True)
class Variant:
    """One set of build options; builds try `VARIANTS` in order."""

    openmp: bool
    clones: bool

    def __str__(self) -> str:
        return ", ".join(
            [
                "OpenMP" if self.openmp else "no OpenMP",
                "ISA clones" if self.clones else "no ISA clones",
            ]
        )


# Threads and ISA clones first; then without the clones (a libc without
# ifunc), without OpenMP (a compiler without it), without both.
VARIANTS = (
    Variant(openmp=True, clones=True),
    Variant(openmp=True, clones=False),
    Variant(openmp=False, clones=True),
    Variant(openmp=False, clones=False),
)


class BuildError(RuntimeError):
    """Every variant failed to compile; the message holds each failure."""


def library_filename() -> str:
    """The library's file name on this platform (ctypes loads either)."""
    return LIBRARY + (".dll" if sys.platform == "win32" else ".so")


def compile_args(variant: Variant, msvc: bool = False) -> list[str]:
    """Compiler flags of one variant (MSVC: no clones, its own spelling)."""
    if msvc:
        return [*MSVC_FLAGS, *(MSVC_OPENMP_FLAGS if variant.openmp else ())]
    return [
        *BASE_FLAGS,
        *(OPENMP_FLAGS if variant.openmp else ()),
        *(() if variant.clones else NO_CLONES),
    ]


def link_args(variant: Variant, msvc: bool = False) -> list[str]:
    """Linker flags of one variant (the OpenMP runtime)."""
    if msvc:
        return []
    return list(OPENMP_FLAGS) if variant.openmp else []


def source_hash(directory: Path = SOURCE_DIR) -> str | None:
    """Hash of the C sources in `directory` (16 hex digits), None if absent.

    Line endings are normalized, so that a checkout with CRLF line endings
    hashes as the committed files do.
    """
    digest = hashlib.sha256()
    for name in sorted((*SOURCES, *HEADERS)):
        try:
            text = (directory / name).read_bytes().replace(b"\r\n", b"\n")
        except OSError:
            return None
        digest.update(name.encode() + b"\0" + text + b"\0")
    return digest.hexdigest()[:16]


def library_hash(library: ctypes.CDLL) -> str | None:
    """The source hash a loaded library was built from (None: it has none)."""
    try:
        function = library.qo_source_hash
    except AttributeError:
        return None
    function.argtypes = []
    function.restype = ctypes.c_char_p
    value: bytes | None = function()
    return None if value is None else value.decode()


def _compiler() -> list[str] | None:
    """The C compiler command: `$CC`, Python's own CC, then cc, gcc, clang."""
    candidates = [os.environ.get("CC"), sysconfig.get_config_var("CC")]
    candidates += ["cc", "gcc", "clang"]
    for candidate in candidates:
        if not candidate:
            continue
        command = shlex.split(candidate)
        if command and shutil.which(command[0]):
            return command
    return None


def build_library(
    target: Path, directory: Path = SOURCE_DIR, compiler: Sequence[str] | None = None
) -> Variant:
    """Compile the sources in `directory` into the library `target`.

    Tries each of `VARIANTS` until one compiles; the file appears atomically
    (concurrent builders race harmlessly). Returns the variant built.

    Raises:
        BuildError: no compiler, no sources, or every variant failed.
    """
    command = list(compiler) if compiler is not None else _compiler()
    if command is None:
        raise BuildError("no C compiler found ($CC, cc, gcc or clang)")
    digest = source_hash(directory)
    if digest is None:
        raise BuildError(f"the C sources are not all in {directory}")
    sources = [str(directory / name) for name in SOURCES]
    target.parent.mkdir(parents=True, exist_ok=True)
    failures = []
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        out = Path(scratch) / target.name
        for variant in VARIANTS:
            line = [
                *command,
                *compile_args(variant),
                "-shared",
                f"-DQO_SOURCE_HASH={digest}",
                *sources,
                "-o",
                str(out),
                *link_args(variant),
                "-lm",
            ]
            try:
                result = subprocess.run(
                    line, capture_output=True, text=True, timeout=300, check=False
                )
            except (OSError, subprocess.SubprocessError) as error:
                failures.append(f"{variant}: {error}")
                continue
            if result.returncode == 0:
                os.replace(out, target)
                return variant
            failures.append(f"{variant}: {shlex.join(line)}\n{result.stderr[-2000:]}")
    raise BuildError("\n".join(["every build variant failed:", *failures]))


def _is_current(path: Path, directory: Path) -> bool:
    # In another process: a library loaded here could not be replaced on
    # Windows, and one that crashes on load must not take the build along.
    code = (
        "import ctypes, sys\n"
        "lib = ctypes.CDLL(sys.argv[1])\n"
        "lib.qo_source_hash.restype = ctypes.c_char_p\n"
        "print(lib.qo_source_hash().decode())\n"
    )
    if not path.exists():
        return False
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.returncode == 0 and result.stdout.strip() == source_hash(directory)


def main(argv: Sequence[str] | None = None) -> int:
    """Build the library in place (development); returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m quantobs.native.build",
        description="Build quantobs' native kernels next to their C sources "
        "(where an editable install keeps them).",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=SOURCE_DIR / library_filename(),
        metavar="PATH",
        help="where to write the library (default: %(default)s)",
    )
    parser.add_argument(
        "--if-stale",
        action="store_true",
        help="do nothing if the library there is built from the current sources",
    )
    options = parser.parse_args(argv)
    output: Path = options.output
    if options.if_stale and _is_current(output, SOURCE_DIR):
        return 0
    try:
        variant = build_library(output)
    except BuildError as error:
        print(f"quantobs: native kernels not built: {error}", file=sys.stderr)
        return 1
    print(f"quantobs: built {output} ({variant}, sources {source_hash()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
