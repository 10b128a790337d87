"""Refit without mpiexec on one side (issue: PyTorch-native refit): a trainer job started by
``torchrun`` joins an inference job started by another torchrun (or by ``mpiexec``: over shm in
test_colocated.py) through the rendezvous file, over the store control plane and the gloo
transport; and failing fast
together: a refusal on one sender rank ends every rank of both jobs within seconds, with exit 1
and the reason, and leaves the receivers' output untouched."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from mpi_helpers import BIN, Ckpt, Saved, launch_pair, run, same_files

SEND = ["shardstream", "refit", "send"]
RECV = ["shardstream", "refit", "recv"]
TORCHRUN = shutil.which("torchrun", path=str(BIN))

pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed (the torch extra)")


def _torchrun(n: int, *args: object) -> list[object]:
    # the console script is a Python file: torchrun runs it like any training script
    return [TORCHRUN, "--standalone", "--nproc-per-node", n, str(BIN / "shardstream"), *args]


def _float16_file(ckpt: Ckpt, tmp: Path) -> Path:
    """A copy of the trainer checkpoint whose rank-1 file stores one bfloat16 tensor as float16
    (the header's dtype changed, the bytes kept: a file that lies about nothing but its dtype)."""
    import json
    import struct

    bad = tmp / "train-bad"
    shutil.copytree(ckpt.train, bad)
    f = bad / "rank-00001.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "BF16")
    header[name]["dtype"] = "F16"
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    f.write_bytes(raw[:8] + text.ljust(n, b" ") + raw[8 + n:])
    return bad


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_refused_sender_ends_both_jobs_fast(ckpt: Ckpt, tmp_path: Path, launcher: str) -> None:
    """One sender's file holds float16 where its manifest says bfloat16: every rank of both jobs
    exits 1 within seconds (the timeout is 120 s), the reason on the console, no output saved."""
    rdv, out = tmp_path / "rdv", tmp_path / "saved"
    bad = _float16_file(ckpt, tmp_path)
    send_args = ["--manifest", bad / "manifest.json", "--rendezvous", rdv, "--timeout", "120"]
    if launcher == "mpiexec":
        recv_cmd: list[object] = ["mpiexec", "-n", "4", *RECV]
        send_cmd: list[object] = ["mpiexec", "-n", "4", *SEND, *send_args]
    else:
        recv_cmd = ["mpiexec", "-n", "4", *RECV, "--control", "store"]
        send_cmd = _torchrun(4, "refit", "send", *send_args)
    send, recv, rc_s, rc_r, took = launch_pair(
        tmp_path, [*recv_cmd, "--manifest", ckpt.serve, "--rendezvous", rdv, "--save", out, "--timeout", "120"],
        send_cmd, timeout=60)
    assert rc_s == 1 and rc_r == 1, f"send {rc_s} recv {rc_r}\n{send.stderr[-3000:]}\n{recv.stderr[-3000:]}"
    assert took < 45, f"took {took:.1f} s: someone waited for a timeout"
    for job in (send, recv):
        assert "sender rank 1" in job.stderr and "float16" in job.stderr, job.stderr[-3000:]
        # (torchrun prints its own ChildFailedError traceback for any child exit code but 0)
        assert "streamer/" not in job.stderr and "formats/" not in job.stderr, job.stderr[-3000:]
    assert not (out / "manifest.json").exists()


def test_gather_broadcast_baseline_over_gloo(ckpt: Ckpt, mpmd_saved: Saved, tmp_path: Path) -> None:
    """The baseline runs over the Transport protocol: on gloo it gives the reshard's bytes too."""
    from mpi_helpers import run

    out = tmp_path / "saved"
    rc, so, se = run(["mpiexec", "-n", "4", *SEND, "--manifest", ckpt.train, "--transport", "gloo",
                      "--strategy", "broadcast", "--timeout", "60", ":",
                      "-n", "4", *RECV, "--manifest", ckpt.serve, "--transport", "gloo", "--strategy", "broadcast",
                      "--save", out, "--timeout", "60"], timeout=120)
    assert rc == 0, se[-3000:]
    assert "(broadcast)" in so
    assert same_files(out, mpmd_saved.dir) == []


def test_diverged_replica_refused_under_verify(ckpt: Ckpt, tmp_path: Path) -> None:
    """Sender ranks 0 and 1 both hold the (tensor-parallel replicated) norm weights of stage 0.
    One byte differs in rank 1's copy: with --verify every rank of both jobs exits 1 naming the
    array, the region and the ranks; nothing is saved."""
    import json
    import struct

    from mpi_helpers import run

    bad = tmp_path / "train-diverged"
    shutil.copytree(ckpt.train, bad)
    f = bad / "rank-00001.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k.endswith("input_layernorm.weight"))
    raw[8 + n + header[name]["data_offsets"][0]] ^= 0x01
    f.write_bytes(bytes(raw))
    out = tmp_path / "saved"
    rc, _so, se = run(["mpiexec", "-n", "4", *SEND, "--manifest", bad, "--timeout", "60", "--verify", ":",
                       "-n", "4", *RECV, "--manifest", ckpt.serve, "--save", out, "--timeout", "60"], timeout=120)
    assert rc == 1, se[-3000:]
    assert f"{name}: region" in se and "differs between its replicas" in se, se[-3000:]
    assert "sender rank 0" in se and "sender rank 1" in se, se[-3000:]
    assert not (out / "manifest.json").exists()


def test_torchrun_both_sides_stay_until_the_trainer_closes(ckpt: Ckpt, mpmd_saved: Saved, tmp_path: Path) -> None:
    """Two torchrun jobs: the receivers pick the store plane by themselves (no MPI launcher).
    ``refit recv --stay`` pulls every push until the sender job closes the session (the jobs
    agree on the larger ``--steps``; with ``--stay`` the receivers' loop ends only at the close),
    then saves and exits 0."""
    rdv, out = tmp_path / "rdv", tmp_path / "saved"
    send, recv, rc_s, rc_r, _ = launch_pair(
        tmp_path,
        _torchrun(4, "refit", "recv", "--manifest", ckpt.serve, "--rendezvous", rdv, "--save", out,
                  "--timeout", "60", "--json", "--stay"),
        _torchrun(4, "refit", "send", "--manifest", ckpt.train / "manifest.json", "--rendezvous", rdv,
                  "--timeout", "60", "--steps", "2"), file_wait=60)
    assert rc_s == 0 and rc_r == 0, f"send {rc_s} recv {rc_r}\n{send.stderr[-3000:]}\n{recv.stderr[-3000:]}"
    report = json.loads(recv.stdout.strip().splitlines()[-1])
    assert report["steps"] == 2, report
    assert same_files(out, mpmd_saved.dir) == []
    assert not rdv.exists()


def test_stay_is_refused_where_it_cannot_hold(ckpt: Ckpt, tmp_path: Path) -> None:
    """Under MPI a peer's death ends the launch: --stay there is a usage error, before any wait."""
    for cmd in (["mpiexec", "-n", "1", *RECV, "--control", "auto"], [*RECV, "--control", "mpi"],
                [*SEND, "--control", "store"]):
        rc, _, err = run([*cmd, "--manifest", ckpt.serve, "--rendezvous", tmp_path / "rdv", "--stay"], 60)
        assert rc == 2 and "--stay is for refit recv on the store control plane" in err, (cmd, rc, err)


def test_tcp_rendezvous_needs_no_shared_file(ckpt: Ckpt, mpmd_saved: Saved, tmp_path: Path) -> None:
    """``--rendezvous tcp://HOST:PORT``: receiver rank 0 serves the store at that address and the
    trainer dials it, with no file anywhere. The trainer starts first and waits for the receivers;
    the saved weights equal the MPMD run's."""
    from mpi_helpers import Background

    from streamer.transport.torch_dist import free_port

    rdv, out = f"tcp://127.0.0.1:{free_port()}", tmp_path / "saved"
    send = Background(_torchrun(4, "refit", "send", "--manifest", ckpt.train / "manifest.json", "--rendezvous", rdv,
                                "--timeout", "60", "--steps", "2"), tmp_path, "send")
    try:
        time.sleep(1.0)  # the trainer is dialing a store that does not exist yet
        recv = Background(_torchrun(4, "refit", "recv", "--manifest", ckpt.serve, "--rendezvous", rdv, "--save", out,
                                    "--timeout", "60", "--json", "--stay"), tmp_path, "recv")
        try:
            rc_s, rc_r = send.wait(90), recv.wait(90)
        finally:
            recv.close()
    finally:
        send.close()
    assert rc_s == 0 and rc_r == 0, f"send {rc_s} recv {rc_r}\n{send.stderr[-3000:]}\n{recv.stderr[-3000:]}"
    assert json.loads(recv.stdout.strip().splitlines()[-1])["steps"] == 2
    assert same_files(out, mpmd_saved.dir) == []
    assert not any(tmp_path.glob("*rdv*")), "a tcp:// rendezvous writes no file"
