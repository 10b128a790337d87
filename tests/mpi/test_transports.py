"""The generic transport suite, run for every transport available (mpi, gloo, shm) under mpiexec;
delta pushes over a transport; a timed-out collective names the rank that never came."""

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


def _have(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="mpiexec not installed")
@pytest.mark.parametrize("kind", ["mpi", pytest.param("gloo", marks=pytest.mark.skipif(
    not _have("torch.distributed"), reason="torch.distributed not available")), "shm"])
@pytest.mark.parametrize("n", [4, 6])
def test_transport_suite(kind: str, n: int) -> None:
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(ROOT / "tests/mpi/transport_worker.py"), kind],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="mpiexec not installed")
@pytest.mark.parametrize(("kind", "n"), [("mpi", 4), pytest.param("gloo", 6, marks=pytest.mark.skipif(
    not _have("torch.distributed"), reason="torch.distributed not available"))])
def test_delta_refit_over_transport(kind: str, n: int) -> None:
    """Changing weights, delta pushes with verify and forwarding: the same bytes as a full push."""
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(ROOT / "tests/mpi/delta_worker.py"), kind],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="mpiexec not installed")
@pytest.mark.parametrize("absent", [0, 2])
def test_collective_timeout_names_the_absent_rank(absent: int) -> None:
    """A collective that times out names the rank that never came, rank 0 included."""
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([MPIEXEC, "-n", "3", sys.executable, str(ROOT / "tests/mpi/roll_call_worker.py"), str(absent)],
                       capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.count("OK") == 3, p.stdout[-3000:] + p.stderr[-3000:]
