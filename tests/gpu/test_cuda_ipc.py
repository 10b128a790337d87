"""Colocated refit over CUDA IPC (issue 16 items 2 and 3): two or three processes on ONE GPU
(what colocated RL does between training and generation). Skipped without CUDA.

- ``RefitSession`` pushes of changing GPU tensors land byte for byte, written in place: the
  receivers' data pointers never change (captured CUDA graphs stay valid);
- the generic transport suite (phase-2 forwards, verify, broadcast) on four processes;
- ``shardstream refit --transport cuda-ipc`` (MPMD, 1 trainer rank + 2 server ranks on one GPU)
  saves exactly what the offline converter writes for the same layout;
- the benchmark's cuda-ipc path runs and reports identical bytes.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_helpers import MPIEXEC, ROOT, gpus

ENV = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
           PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")



pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpus() < 1, reason="needs CUDA")]


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


@pytest.mark.parametrize("n", [2, 3])
def test_session_on_one_gpu_in_place(n: int) -> None:
    env_one = dict(ENV, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(ROOT / "tests/mpi/ipc_worker.py"), "cuda-ipc"],
                       capture_output=True, text=True, timeout=240, env=env_one, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


def test_transport_suite_on_one_gpu() -> None:
    """The generic transport suite (a plan with phase-2 forwards, verify, the broadcast) over
    cuda-ipc, four processes on one GPU."""
    env_one = dict(ENV, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    p = subprocess.run([MPIEXEC, "-n", "4", sys.executable, str(ROOT / "tests/mpi/transport_worker.py"), "cuda-ipc"],
                       capture_output=True, text=True, timeout=240, env=env_one, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-3000:] + p.stderr[-3000:]


def test_refit_cli_on_one_gpu_matches_convert(tmp_path: Path) -> None:
    ss = [sys.executable, "-m", "streamer"]
    hf = tmp_path / "hf"
    for cmd in (["synth", "--preset", "qwen3-tiny", "--out", str(hf)],
                ["import", str(hf), "-o", str(hf / "manifest.json")],
                ["layout", "--like", str(hf / "manifest.json"), "--mesh", "tp=2", "--rule", "*.q_proj.weight=S(0)",
                 "--rule", "*.o_proj.weight=S(1)", "--rule", "*.gate_proj.weight=S(0)", "-o",
                 str(tmp_path / "serve.json")],
                ["convert", str(hf / "manifest.json"), str(tmp_path / "serve.json"), "--out", str(tmp_path / "off")]):
        p = _run(ss + cmd)
        assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "saved"
    env_one = dict(ENV, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    p = subprocess.run([MPIEXEC, "-n", "1", *ss, "refit", "send", "--manifest", str(hf / "manifest.json"),
                        "--transport", "cuda-ipc", "--timeout", "60", "--steps", "3", ":", "-n", "2", *ss, "refit",
                        "recv", "--manifest", str(tmp_path / "serve.json"), "--transport", "cuda-ipc", "--save",
                        str(out), "--verify", "--timeout", "60", "--steps", "3", "--json"],
                       capture_output=True, text=True, timeout=240, env=env_one, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    reports = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert {r["transport"] for r in reports} == {"cuda-ipc"} and all(r["verified"] for r in reports), reports
    names = sorted(x.name for x in (tmp_path / "off").iterdir() if not x.name.startswith("."))
    assert names == sorted(x.name for x in out.iterdir() if not x.name.startswith("."))
    assert all(filecmp.cmp(out / n, tmp_path / "off" / n, shallow=False) for n in names)


def test_bench_ipc_cuda() -> None:
    p = _run([sys.executable, "-m", "streamer.tools.bench_ipc", "--transport", "cuda-ipc", "--size", "64MiB",
              "--repeats", "3", "--json"])
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["transport"] == "cuda-ipc" and r["identical"] is True and r["refit_gbps"] > 0, r
