"""NCCL transport: the generic transport suite on GPUs. Skipped without CUDA (NCCL needs one
GPU per rank, so at least 2 visible GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gpu_helpers import MPIEXEC, ROOT, gpus


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 2, reason="needs CUDA with at least 2 GPUs (one per NCCL rank)")
@pytest.mark.parametrize("n", [2, 4])
def test_nccl_transport_suite(n: int) -> None:
    if n > gpus():
        pytest.skip(f"needs {n} GPUs")
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(ROOT / "tests/mpi/transport_worker.py"), "nccl"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 1, reason="needs CUDA")
def test_executor_packs_gpu_tensors_in_place() -> None:
    """The torch code path of the executor on a GPU, over an in-process fake transport."""
    import torch

    from streamer.execute.executor import torch_byte_view

    t = torch.arange(24, dtype=torch.bfloat16, device="cuda").reshape(4, 6)
    v = torch_byte_view(t)
    assert v.shape == (4, 6, 2) and v.device.type == "cuda"
    v[1:2, 2:4] = 0
    assert (t[1, 2:4] == 0).all()
