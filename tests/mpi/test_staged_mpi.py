"""Device tensors staged through pinned host buckets over MPI and gloo, under mpiexec, with the
fake device (CPU tensors stand in for device tensors): three pushes byte exact, receivers
written in place, nothing allocated after the first push (``staged_worker.py``). The same worker
runs with CUDA tensors in ``tests/gpu/test_staged_gpu.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="mpiexec not installed")
@pytest.mark.parametrize(("kind", "n"), [("mpi", 6), ("gloo", 4)])
def test_staged_fake_device(kind: str, n: int) -> None:
    """mpi: 3 + 3 ranks, then 2 + 2 of them in the same launch (the worker's sub-run); gloo: 2 + 2."""
    pytest.importorskip("torch.distributed")
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(ROOT / "tests/mpi/staged_worker.py"), kind, "fake"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]
