"""The CUDA device a transport of this process uses.

A process launched for shardstream (``torchrun``, ``mpiexec``) owns its GPU choice: the launcher's
local rank picks it, and it becomes the current device. A process that lives inside another
framework does not: a vLLM worker already chose its device (``worker.device``, which is not
``LOCAL_RANK`` once ``CUDA_VISIBLE_DEVICES`` is remapped or data parallelism places ranks), and
setting another current device there would move the engine's own kernels. So the caller may name
the device; then it is used as given and nothing is set.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["cuda_device", "launcher_local_rank"]


def launcher_local_rank(rank: int) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun), MPICH's or Open MPI's local
    rank, else ``rank`` (one process per GPU in rank order on one node)."""
    for name in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return rank


def cuda_device(rank: int, device: Any = None) -> Any:
    """``device`` (a ``torch.device`` or index) when given: used as it is, the current device left
    alone. Else the launcher's local rank modulo the visible GPUs, made current."""
    import torch

    if device is not None:
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if d.type != "cuda" or d.index is None:
            raise ValueError(f"a CUDA transport needs a CUDA device with an index, got {device!r}")
        return d
    d = torch.device("cuda", launcher_local_rank(rank) % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d
