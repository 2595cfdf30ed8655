"""`quantobs calibrate`'s options for models bigger than memory.

    --offload-folder DIR          load with transformers' device_map="auto":
                                  what does not fit the memory limits goes
                                  to disk under DIR (accelerate's offloading)
    --max-memory DEVICE=SIZE ...  the limits (`cpu=4GiB`, `0=20GiB`); with
                                  --offload-folder only
    --max-shard-size SIZE         the largest checkpoint file (default 5GB)

An offloaded model calibrates one weight at a time and is exported module
by module (`quantobs.calibration.offload`, `quantobs.calibration.freeze`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from quantobs.calibration.export import DEFAULT_SHARD_SIZE, shard_bytes
from quantobs.cli.inputs import UsageError

__all__ = ["add_offload_options", "load_options", "shard_size"]


def add_offload_options(parser: argparse.ArgumentParser) -> None:
    """Register `--offload-folder`, `--max-memory` and `--max-shard-size`."""
    parser.add_argument(
        "--offload-folder",
        type=Path,
        default=None,
        metavar="DIR",
        help="load the model with accelerate's offloading (transformers' "
        "device_map='auto'): layers beyond the memory limits (--max-memory) "
        "stay on disk under DIR and are read one at a time",
    )
    parser.add_argument(
        "--max-memory",
        nargs="+",
        default=None,
        metavar="DEVICE=SIZE",
        help="with --offload-folder: memory per device for the model's "
        "weights, e.g. cpu=4GiB or 0=20GiB cpu=60GiB (transformers' max_memory)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_SHARD_SIZE,
        metavar="SIZE",
        help="the largest safetensors file of the checkpoint, e.g. 5GB or "
        f"500MB (default: {DEFAULT_SHARD_SIZE})",
    )


def shard_size(options: argparse.Namespace) -> int:
    """`--max-shard-size` in bytes.

    Raises:
        UsageError: not a size.
    """
    try:
        return shard_bytes(options.max_shard_size)
    except ValueError as error:
        raise UsageError(f"--max-shard-size: {error}") from None


def _device(name: str) -> int | str:
    return int(name) if name.isdigit() else name


def load_options(options: argparse.Namespace) -> dict[str, Any]:
    """`from_pretrained` keyword arguments for `--offload-folder` and
    `--max-memory` (none without them).

    Raises:
        UsageError: `--max-memory` without `--offload-folder`, or a
            malformed limit.

    With `--distributed` each process offloads under its own
    `rank-RANK` subfolder (torchrun's `RANK`): the processes load the model
    alike and write their qparams under the offload folder, so one folder
    each keeps them from reading each other's files.
    """
    folder: Path | None = options.offload_folder
    limits: list[str] | None = options.max_memory
    if folder is None:
        if limits:
            raise UsageError(
                "--max-memory needs --offload-folder (where the rest goes)"
            )
        return {}
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--offload-folder {folder} is not a directory")
    if getattr(options, "distributed", False):
        folder = folder / f"rank-{os.environ.get('RANK', '0')}"
    found: dict[str, Any] = {"device_map": "auto", "offload_folder": str(folder)}
    if limits:
        memory: dict[int | str, str] = {}
        for limit in limits:
            device, sep, size = limit.partition("=")
            if not sep or not device or not size:
                raise UsageError(
                    f"--max-memory {limit!r}: expected DEVICE=SIZE, e.g. cpu=4GiB"
                )
            try:
                shard_bytes(size)
            except ValueError:
                raise UsageError(
                    f"--max-memory {limit!r}: {size!r} is not a size such as 4GiB"
                ) from None
            memory[_device(device)] = size
        found["max_memory"] = memory
    return found
