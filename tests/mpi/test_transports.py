"""The generic transport suite, run for every transport available (mpi, gloo, shm) under mpiexec;
delta pushes over a transport; a timed-out collective names the rank that never came."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mpi_helpers import MPIEXEC, REPO, have

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("kind", ["mpi", pytest.param("gloo", marks=pytest.mark.skipif(
    not have("torch"), reason="torch.distributed not available")), "shm"])
def test_transport_suite(kind: str) -> None:
    """One launch of 6 ranks: the suite on 3 + 3 ranks, then on 2 + 2 of them (the worker's sub-run)."""
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([str(MPIEXEC), "-n", "6", sys.executable, str(REPO / "tests/mpi/transport_worker.py"), kind],
                       capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize(("kind", "n"), [("mpi", 4), pytest.param("gloo", 6, marks=pytest.mark.skipif(
    not have("torch"), reason="torch.distributed not available"))])
def test_delta_refit_over_transport(kind: str, n: int) -> None:
    """Changing weights, delta pushes with verify and forwarding: the same bytes as a full push."""
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, str(REPO / "tests/mpi/delta_worker.py"), kind],
                       capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("absent", [0, 2])
def test_collective_timeout_names_the_absent_rank(absent: int) -> None:
    """A collective that times out names the rank that never came, rank 0 included."""
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([str(MPIEXEC), "-n", "3", sys.executable, str(REPO / "tests/mpi/roll_call_worker.py"), str(absent)],
                       capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert p.returncode == 0 and p.stdout.count("OK") == 3, p.stdout[-3000:] + p.stderr[-3000:]
