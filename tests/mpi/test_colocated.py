"""Colocated refit over the one-sided transport (issue 16 item 2) on CPU: ``--transport shm``, the
twin of ``cuda-ipc`` that runs the same protocol code everywhere. Through ``RefitSession`` (in
place, several pushes, no segment left behind) and through ``shardstream refit`` (bytes
identical to the mpi transport's, MPMD and torchrun + store plane, a refused push ending both
jobs fast, a killed trainer rank ending the server job within its timeout); ``cuda-ipc``
refused in one line without CUDA; the benchmark's code path."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from mpi_helpers import BIN, REPO, Ckpt, Saved, launch_pair, run, same_files

pytestmark = pytest.mark.mpi

SEND = ["shardstream", "refit", "send"]
RECV = ["shardstream", "refit", "recv"]
PY = str(BIN / "python") if (BIN / "python").exists() else sys.executable


def _skip_with_cuda() -> None:
    """In the test, not at collection: asking torch costs every pytest process its import."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the refusal is for machines without it")


@pytest.mark.parametrize("n", [2, 3])
def test_session_pushes_in_place_over_shm(n: int) -> None:
    rc, so, se = run(["mpiexec", "-n", n, PY, REPO / "tests/mpi/ipc_worker.py", "shm"], timeout=120)
    assert rc == 0 and so.strip().endswith("OK"), so[-3000:] + se[-3000:]


def test_refit_cli_over_shm_same_bytes_as_mpi(ckpt: Ckpt, mpmd_saved: Saved, tmp_path: Path) -> None:
    out = tmp_path / "saved"
    rc, so, se = run(["mpiexec", "-n", "4", *SEND, "--manifest", ckpt.train, "--timeout", "30", "--steps", "3",
                      "--transport", "shm", ":", "-n", "4", *RECV, "--manifest", ckpt.serve, "--save", out, "--verify",
                      "--timeout", "30", "--steps", "3", "--transport", "shm", "--json"], timeout=90)
    assert rc == 0, f"rc {rc}\nstdout:\n{so}\nstderr:\n{se}"
    reports = [json.loads(line) for line in so.splitlines() if line.startswith("{")]
    assert {r["transport"] for r in reports} == {"shm"} and all(r["verified"] for r in reports), reports
    assert mpmd_saved.rc == 0
    assert same_files(out, mpmd_saved.dir) == []


TORCHRUN = shutil.which("torchrun", path=str(BIN))


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed (the torch extra)")
def test_torchrun_trainer_over_shm(ckpt: Ckpt, mpmd_saved: Saved, tmp_path: Path) -> None:
    """torchrun senders (no MPI at all) and mpiexec receivers started with ``--control store``. The
    store plane has no point-to-point messages: headers and acks then go over gloo."""
    rdv, out = tmp_path / "rdv", tmp_path / "saved"
    send, recv, rc_s, rc_r, _ = launch_pair(
        tmp_path, ["mpiexec", "-n", "4", *RECV, "--manifest", ckpt.serve, "--rendezvous", rdv, "--control", "store",
                   "--save", out, "--verify", "--timeout", "60", "--steps", "2", "--transport", "shm"],
        [TORCHRUN, "--standalone", "--nproc-per-node", "4", str(BIN / "shardstream"), "refit", "send", "--manifest",
         ckpt.train / "manifest.json", "--rendezvous", rdv, "--timeout", "60", "--steps", "2", "--transport", "shm"])
    assert rc_s == 0 and rc_r == 0, f"send {rc_s} recv {rc_r}\n{send.stderr[-3000:]}\n{recv.stderr[-3000:]}"
    assert "checksums verified" in recv.stdout and "(reshard)" in recv.stdout, recv.stdout
    assert same_files(out, mpmd_saved.dir) == []
    assert not rdv.exists()


def test_refused_sender_over_shm_ends_both_jobs_fast(ckpt: Ckpt, tmp_path: Path) -> None:
    """One sender's file stores float16 where its manifest says bfloat16: both jobs exit 1 within
    seconds (the timeout is 120 s) with the reason, and nothing is saved."""
    from test_refit_launchers import _float16_file

    bad = _float16_file(ckpt, tmp_path)
    out = tmp_path / "saved"
    send, recv, rc_s, rc_r, took = launch_pair(
        tmp_path, ["mpiexec", "-n", "4", *RECV, "--manifest", ckpt.serve, "--rendezvous", tmp_path / "rdv", "--save",
                   out, "--timeout", "120", "--transport", "shm"],
        ["mpiexec", "-n", "4", *SEND, "--manifest", bad / "manifest.json", "--rendezvous", tmp_path / "rdv",
         "--timeout", "120", "--transport", "shm"], timeout=60)
    assert rc_s == 1 and rc_r == 1, f"send {rc_s} recv {rc_r}\n{send.stderr[-3000:]}\n{recv.stderr[-3000:]}"
    assert took < 45, f"took {took:.1f} s: someone waited for a timeout"
    for job in (send, recv):
        assert "sender rank 1" in job.stderr and "float16" in job.stderr, job.stderr[-3000:]
    assert not (out / "manifest.json").exists()


def test_cuda_ipc_without_cuda_is_refused_in_one_line(ckpt: Ckpt, tmp_path: Path) -> None:
    _skip_with_cuda()
    # one rank a side: each rank imports torch to ask for CUDA, and the refusal is the same on all
    rc, so, se = run(["mpiexec", "-n", "1", *SEND, "--manifest", ckpt.hf_manifest, "--timeout", "30", "--transport",
                      "cuda-ipc", ":", "-n", "1", *RECV, "--manifest", ckpt.hf1, "--timeout", "30", "--transport",
                      "cuda-ipc"], timeout=60)
    assert rc == 1, f"rc {rc}\n{se}"
    assert se.strip().splitlines() == [
        "every rank: --transport cuda-ipc: no CUDA device is visible (torch.cuda.is_available() is False)"], se


def test_bench_ipc_shm_tiny() -> None:
    """The colocated benchmark's code path on CPU: shm refit GB/s against the host memcpy floor."""
    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    import subprocess

    p = subprocess.run([PY, "-m", "streamer", "bench", "ipc", "--transport", "shm", "--size", "8MiB", "--repeats", "2",
                        "--json"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["transport"] == "shm" and r["bytes"] == 8 << 20 and r["identical"] is True, r
    assert r["refit_gbps"] > 0 and r["floor_gbps"] > 0 and r["ratio_to_floor"] == pytest.approx(
        r["refit_gbps"] / r["floor_gbps"], rel=1e-6)


def test_bench_ipc_cuda_without_cuda_is_refused() -> None:
    _skip_with_cuda()
    rc, so, se = run(["shardstream", "bench", "ipc", "--transport", "cuda-ipc", "--size", "1MiB"], timeout=120)
    assert rc == 1 and "no CUDA device is visible" in se and "Traceback" not in se, se[-3000:]


def test_killed_sender_rank_over_shm_ends_the_server_job(ckpt: Ckpt, tmp_path: Path) -> None:
    """Two jobs pushing for a long time over shm; SIGKILL one trainer rank. Every server rank
    stops waiting within --timeout (a header or an ack that never comes) and the job exits
    non-zero; no rank of either job survives, nothing is saved."""
    import signal
    import time

    from mpi_helpers import Background, child_ranks, session_pids

    T = 5
    rdv, out = tmp_path / "rdv", tmp_path / "saved"
    recv = Background(["mpiexec", "-n", "4", *RECV, "--manifest", ckpt.serve, "--rendezvous", rdv, "--save", out,
                       "--timeout", T, "--steps", "1000000", "--transport", "shm"], tmp_path, "recv")
    send = None
    try:
        deadline = time.monotonic() + 20
        while not rdv.exists() and recv.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        send = Background(["mpiexec", "-n", "4", *SEND, "--manifest", ckpt.train, "--rendezvous", rdv, "--timeout",
                           T, "--steps", "1000000", "--transport", "shm"], tmp_path, "send")
        ranks: list[int] = []
        deadline = time.monotonic() + 20
        while (rdv.exists() or len(ranks) < 4) and time.monotonic() < deadline and send.poll() is None:
            ranks = child_ranks(send.pid)
            time.sleep(0.05)
        assert not rdv.exists() and len(ranks) == 4, f"not connected: {ranks}\n{recv.stderr[-2000:]}"
        time.sleep(1.0)
        assert send.poll() is None and recv.poll() is None, f"{send.stderr[-2000:]}\n{recv.stderr[-2000:]}"
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        rc_recv = recv.wait(T + 15)
        msg = f"recv rc {rc_recv} after {time.monotonic() - t0:.1f} s\n{recv.stderr[-2000:]}\n{send.stderr[-2000:]}"
        assert rc_recv not in (None, 0), msg
        if rc_recv == 3:  # shardstream's own path; MPICH may end a reader first (see test_killed_peer)
            # the launcher kills the victim's whole job, so a server rank may be waiting on any of them
            assert "timed out" in recv.stderr and re.search(r"sender rank \d", recv.stderr), msg
        else:
            assert rc_recv in (6, 9, 11, 15), msg
        assert send.wait(10) not in (None, 0), msg
        time.sleep(0.2)
        assert session_pids(send.pid) == [] and session_pids(recv.pid) == [], msg
        assert not (out / "manifest.json").exists()
    finally:
        if send is not None:
            send.close()
        recv.close()
