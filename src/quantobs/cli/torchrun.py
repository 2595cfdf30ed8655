"""The process group of `quantobs calibrate --distributed` under torchrun:
found when one is initialized, else started from torchrun's environment
(NCCL on the process's CUDA device, gloo on CPU); a missing environment is
one `UsageError` line."""

from __future__ import annotations

import os
from typing import Any

from quantobs.cli.inputs import UsageError

__all__ = ["TORCHRUN_ENV", "TorchrunGroup"]

#: What torchrun sets for every process.
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


class TorchrunGroup:
    """The torchrun process group this command started (or found)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        self.started = False
        self.device: Any = None
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            return
        if missing:
            raise UsageError(
                "--distributed needs the environment torchrun sets ("
                + ", ".join(missing)
                + " missing); run `torchrun --nproc-per-node N -m quantobs "
                "calibrate ... --distributed`"
            )
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", device_id=self.device)
        else:
            dist.init_process_group("gloo")
        self.started = True
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def close(self) -> None:
        """Destroy the process group if this command started it (idempotent)."""
        import torch.distributed as dist

        if self.started and dist.is_initialized():
            dist.destroy_process_group()
        self.started = False
