"""Helpers for the ``mpi`` tier (imported by ``conftest.py`` and the test modules): the test
environment, ``run`` with a hard timeout, background launches, process lookups, file compares.

Every subprocess runs with ``HYDRA_LAUNCHER=fork``, ``OMP_NUM_THREADS=1`` and the venv's ``bin``
first on ``PATH``.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_VENV_BIN = REPO / ".venv" / "bin"
BIN = _VENV_BIN if (_VENV_BIN / "shardstream").exists() else Path(sys.executable).parent

ENV = dict(os.environ)
ENV.update(HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
ENV.pop("SHARDSTREAM_DEBUG", None)

MPIEXEC = shutil.which("mpiexec", path=ENV["PATH"])
SHARDSTREAM = shutil.which("shardstream", path=ENV["PATH"])


def have(package: str) -> bool:
    """Whether ``package`` is installed, without importing it (a collection-time check: importing
    torch or transformers costs every pytest process seconds)."""
    return importlib.util.find_spec(package) is not None

#: Megatron-style TP rules (column-parallel S(0), row-parallel S(1)); for a 2-axis mesh whose
#: first axis is pp or dp each rule gets ``R`` on that axis.
TP_PLACEMENTS = [
    ("*embed_tokens.weight", "S(0)"),
    ("*lm_head.weight", "S(0)"),
    ("*.q_proj.weight", "S(0)"),
    ("*.k_proj.weight", "S(0)"),
    ("*.v_proj.weight", "S(0)"),
    ("*.o_proj.weight", "S(1)"),
    ("*.gate_proj.weight", "S(0)"),
    ("*.up_proj.weight", "S(0)"),
    ("*.down_proj.weight", "S(1)"),
]


def tp_rules(axes: int = 1) -> list[str]:
    """``--rule`` arguments for TP on the last of ``axes`` mesh axes (``R`` on the others)."""
    out: list[str] = []
    for glob, pl in TP_PLACEMENTS:
        out += ["--rule", f"{glob}={','.join(['R'] * (axes - 1) + [pl])}"]
    return out


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: Sequence[str], timeout: float, cwd: str | os.PathLike[str] | None = None) -> tuple[int, str, str]:
    """Run ``cmd`` (the test environment, stdin closed) with a hard ``timeout``: on expiry the
    whole process group (mpiexec, its proxies, its ranks) is killed and the test fails.
    Returns ``(returncode, stdout, stderr)``."""
    p = subprocess.Popen(list(map(str, cmd)), env=ENV, cwd=cwd, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} still running after {timeout} s (killed)\n"
                             f"stdout:\n{out.decode(errors='replace')[-3000:]}\n"
                             f"stderr:\n{err.decode(errors='replace')[-3000:]}") from None
    finally:
        _kill_group(p)  # stray ranks left behind by an aborted launch
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def ok(cmd: Sequence[str], timeout: float = 60) -> str:
    """``run`` that must exit 0; returns stdout."""
    rc, out, err = run(cmd, timeout)
    assert rc == 0, f"{' '.join(map(str, cmd))} exited {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return out


class Background:
    """A process group started in the background, output to files (no pipe can fill up)."""

    def __init__(self, cmd: Sequence[str], log_dir: Path, name: str) -> None:
        self.cmd = list(map(str, cmd))
        self.out_path = log_dir / f"{name}.out"
        self.err_path = log_dir / f"{name}.err"
        self._out = open(self.out_path, "wb")  # noqa: SIM115 - open for the launch's lifetime
        self._err = open(self.err_path, "wb")  # noqa: SIM115
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(self.cmd, env=ENV, stdin=subprocess.DEVNULL, stdout=self._out,
                                  stderr=self._err, start_new_session=True)
        self.pid = self.p.pid

    def poll(self) -> int | None:
        return self.p.poll()

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after ``timeout`` (then killed)."""
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(self.p)
            self.p.wait()
            return None

    @property
    def stdout(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.err_path.read_text(errors="replace")

    def close(self) -> None:
        if self.p.poll() is None:
            _kill_group(self.p)
            self.p.wait()
        else:
            _kill_group(self.p)
        self._out.close()
        self._err.close()


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid`` (a ``Background``'s pid)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = st.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(d))
    return out


def child_ranks(pid: int) -> list[int]:
    """The rank processes (descendants that are not hydra/mpiexec) under launcher ``pid``."""
    kids: dict[int, list[int]] = {}
    cmdline: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = Path(f"/proc/{d}/stat").read_text()
            cl = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        kids.setdefault(int(st.rsplit(")", 1)[1].split()[1]), []).append(int(d))
        cmdline[int(d)] = cl
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            todo.append(c)
            if "shardstream" in cmdline.get(c, "") and "hydra" not in cmdline[c] and "mpiexec" not in cmdline[c]:
                out.append(c)
    return sorted(out)


def same_files(a: Path, b: Path) -> list[str]:
    """Differences between the visible files of two directories (names and bytes)."""
    fa = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    fb = sorted(p.name for p in b.iterdir() if not p.name.startswith("."))
    if fa != fb:
        return [f"file lists differ: {fa} vs {fb}"]
    return [f"{n} differs" for n in fa if not filecmp.cmp(a / n, b / n, shallow=False)]


def safetensors_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.safetensors"))


@dataclass(frozen=True)
class Ckpt:
    root: Path
    hf: Path  # HF checkpoint dir (model.safetensors + manifest.json)
    hf_manifest: Path
    train_manifest: Path  # TP2xPP2 layout (pp=2,tp=2)
    train: Path  # convert output: the trainer's rank files + manifest.json
    serve: Path  # TP4 layout
    serve_dp: Path  # TP2xDP2 layout (dp=2,tp=2)
    hf1: Path  # one-rank (HF) layout
    serve_bad: Path  # TP4 layout of a different model: one shape changed, one array missing
    bad_array_shape: str
    bad_array_missing: str


@dataclass(frozen=True)
class Saved:
    dir: Path
    rc: int
    stdout: str
    stderr: str
    seconds: float


def launch_pair(tmp: Path, recv_cmd: Sequence[object], send_cmd: Sequence[object], *, timeout: float = 90,
                file_wait: float = 30) -> tuple[Background, Background, int | None, int | None, float]:
    """The receiver job first (background) until it writes ``tmp/rdv``, then the sender job; both
    waited for. Returns the jobs, their exit codes and the seconds from the sender's start."""
    rdv = tmp / "rdv"
    recv = Background(recv_cmd, tmp, "recv")
    try:
        deadline = time.monotonic() + file_wait
        while not rdv.exists() and recv.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rdv.exists(), f"the receiver job never wrote {rdv} (rc {recv.poll()}):\n{recv.stderr[-2000:]}"
        t0 = time.monotonic()
        send = Background(send_cmd, tmp, "send")
        try:
            rc_send = send.wait(timeout)
            rc_recv = recv.wait(timeout)
        finally:
            send.close()
    finally:
        recv.close()
    return send, recv, rc_send, rc_recv, time.monotonic() - t0
