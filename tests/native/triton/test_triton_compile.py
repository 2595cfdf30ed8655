"""`triton_shrink`'s, `triton_minmax`'s and `triton_qparams`' kernels
compile for a GPU (sm_90) on a machine without one: the interpreter runs
what the tests check, the compiler decides what a GPU runs
(`compile_shrink.py`, in a fresh process without `TRITON_INTERPRET`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantobs.native import gpu

SCRIPT = Path(__file__).with_name("compile_shrink.py")
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # Triton's compiler and ptxas: ~10-30 s cold
def test_shrink_kernels_compile_for_sm90(tmp_path: Path) -> None:
    if not gpu.triton_importable():
        pytest.skip("triton is not installed")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource / GPUTarget")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not read from a cache
    found = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    if (
        found.returncode != 0
        and "backend" in found.stderr.lower()
        and ("cuda" in found.stderr.lower() or "nvidia" in found.stderr.lower())
    ):
        pytest.skip(f"no CUDA backend in this Triton: {found.stderr[-300:]}")
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.count("compiled") == 23, found.stdout
