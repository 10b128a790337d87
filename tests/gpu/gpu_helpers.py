"""What the gpu tier's modules share: the repo root, mpiexec, and how many GPUs this machine has."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")


def gpus() -> int:
    """Visible CUDA devices (0 without torch or CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0
