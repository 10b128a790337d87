"""CUDA tensors over host transports, staged through pinned host buckets (streamer/staging.py):
the same code the fake-device tests run on CPU, here with real CUDA tensors, streams and events.
One GPU is enough: ranks share it. Skipped without CUDA.

- MPI and gloo under mpiexec (``tests/mpi/staged_worker.py ... cuda``): three pushes byte exact,
  receivers in place, no allocation after the first push (the staging ops' count and the CUDA
  caching allocator's count around each push), then a verify push.
- In one process over the loopback transport: the receiver's parameter is read by a captured
  CUDA graph; after a push, replaying the graph sees the new weights (the storage the graph
  captured was written in place, never reallocated).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import MPIEXEC, ROOT, gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpus() < 1, reason="needs CUDA")]


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="mpiexec not installed")
@pytest.mark.parametrize(("kind", "n"), [("mpi", 2), ("mpi", 4), ("gloo", 4)])
def test_staged_cuda_over_transport(kind: str, n: int) -> None:
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(ROOT / "tests/mpi/staged_worker.py"), kind, "cuda"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


def _run(executors: dict[int, Any]) -> None:
    errors: dict[int, BaseException] = {}

    def body(g: int) -> None:
        try:
            executors[g].run()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[g] = e

    threads = [threading.Thread(target=body, args=(g,), daemon=True) for g in executors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors


def test_push_keeps_a_captured_cuda_graph_valid() -> None:
    import torch
    from helpers import lay_out

    from formats.layouts import Mesh, Replicate, Shard
    from streamer.execute.executor import Executor
    from streamer.execute.schedule import build_schedule
    from streamer.plan.planner import plan_transfers
    from streamer.transport.loopback import LoopbackHub

    arrays = {"w": ((256, 512), "bfloat16"), "n": ((512,), "float32")}
    m2 = Mesh(("tp",), (2,))
    src = lay_out(arrays, m2, {"w": (Shard(0),), "n": (Replicate(),)})
    dst = lay_out(arrays, m2, {"w": (Shard(1),), "n": (Replicate(),)})
    plan = plan_transfers(src, dst)
    sched = build_schedule(plan, 64 << 10)
    dev = torch.device("cuda", 0)
    full = {"w": torch.randn(256, 512, device=dev).to(torch.bfloat16), "n": torch.randn(512, device=dev)}
    senders = {r: {"w": full["w"][r * 128:(r + 1) * 128].clone(), "n": full["n"].clone()} for r in range(2)}
    receivers = {r: {"w": torch.zeros(256, 256, dtype=torch.bfloat16, device=dev),
                     "n": torch.zeros(512, device=dev)} for r in range(2)}
    hub = LoopbackHub(4)
    eps = hub.endpoints()
    ex = {g: Executor(eps[g], plan, sched, senders[g] if g < 2 else receivers[g - 2], timeout=30) for g in range(4)}
    assert all(e._stager is not None and e._stager.ops.name == "cuda" for e in ex.values())
    _run(ex)  # the first push builds the index tensors
    w = receivers[1]["w"]
    ptrs = {r: {n: t.data_ptr() for n, t in ts.items()} for r, ts in receivers.items()}
    out = torch.empty(256, 256, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture, as torch.cuda.graphs asks
        out.copy_(w.float() * 2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(w.float() * 2)
    for step in (1, 2):
        new = {"w": torch.randn(256, 512, device=dev).to(torch.bfloat16), "n": torch.randn(512, device=dev)}
        for r in range(2):
            senders[r]["w"].copy_(new["w"][r * 128:(r + 1) * 128])
            senders[r]["n"].copy_(new["n"])
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
        _run(ex)
        assert torch.cuda.memory_stats(dev)["allocation.all.allocated"] == allocs, f"push {step} allocated"
        graph.replay()
        torch.cuda.synchronize()
        for r in range(2):
            assert torch.equal(receivers[r]["w"], new["w"][:, r * 256:(r + 1) * 256])
            assert torch.equal(receivers[r]["n"], new["n"])
        assert torch.equal(out, new["w"][:, 256:].float() * 2)  # the graph reads the new weights
    assert {r: {n: t.data_ptr() for n, t in ts.items()} for r, ts in receivers.items()} == ptrs
