"""``bench refit --replicas N``: what a joining inference replica costs next to a steady push.

One trainer job (``senders`` ranks, rows split) serves N replica jobs (``receivers`` ranks each,
columns split on even replicas, rows on odd ones) on the store control plane with gloo, every job
started as torchrun starts its workers (``RANK``/``WORLD_SIZE``; one host). Replicas 1..N-1 wait
at the start; the trainer pushes ``repeats`` steady pushes to them, then replica N opens and
joins at the next push (its session is opened and planned, then it gets a full push while the
others get deltas), then ``repeats`` steady pushes to all N. The weights are float32 arrays of
``size`` bytes in all, 1% of their elements changed per push; delta sessions as a user gets them
(``delta`` auto: on one host ranks share memory, and full bytes beat encoding).

Reported from the trainer's slowest rank: the steady pushes' median seconds (before and after the
join), the join push's seconds, and within it the joiner's open (join) and first push, next to
a steady replica's push of the same step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

__all__ = ["bench_replicas", "bench_replicas_cli", "replicas_table", "replicas_worker"]

#: arrays of the benchmark's model: this many, of 1024 float32 columns
_ARRAYS = 8
_COLS = 1024


def _manifest(rows: int, n: int, dim: int) -> Any:
    from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule

    mesh = parse_mesh(f"tp={n}")
    arrays = {f"w{i}": ((rows, _COLS), "float32") for i in range(_ARRAYS)}
    return apply_layout(manifest_from_arrays(arrays), mesh, [parse_rule(f"{k}=S({dim})", mesh) for k in arrays],
                        file_pattern=None)


def _rows(size: int, senders: int, receivers: int) -> int:
    unit = senders * receivers * 8
    return max(unit, size // (_ARRAYS * _COLS * 4) // unit * unit)


def bench_replicas(work: str, *, replicas: int = 2, senders: int = 2, receivers: int = 2, size: int = 64 << 20,
                   repeats: int = 5, timeout: float = 600.0) -> dict[str, Any]:
    """Launch the trainer and ``replicas`` replica jobs (see the module docstring); their figures."""
    from formats.errors import TransportError, UsageError

    if replicas < 2:
        raise UsageError("bench refit --replicas N needs N >= 2 (replicas at the start, then one that joins)")
    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    rows = _rows(size, senders, receivers)
    common = ["--dir", str(w), "--rows", str(rows), "--repeats", str(repeats), "--timeout", str(timeout),
              "--replicas", str(replicas)]
    jobs = [_launch(senders, ["send", *common], w / "trainer.log")]
    jobs += [_launch(receivers, ["recv", str(i), *common], w / f"r{i}.log") for i in range(replicas)]
    deadline = time.monotonic() + timeout
    try:
        for job in jobs:
            rc = job.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise TransportError(f"bench refit --replicas: a job exited {rc}; see the logs in {w}")
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait(timeout=30)
    result: dict[str, Any] = json.loads((w / "replicas.json").read_text())
    return {**result, "senders": senders, "receivers": receivers, "replicas": replicas, "size_bytes": rows *
            _COLS * 4 * _ARRAYS, "repeats": repeats}


def bench_replicas_cli(work: str, args: Any) -> tuple[dict[str, Any], str]:
    """``bench refit --replicas N`` from the command line's ``args``: the figures and their table."""
    r = bench_replicas(work, replicas=args.replicas, senders=args.senders, receivers=args.receivers, size=args.size,
                       repeats=args.repeats or 5)
    return r, replicas_table(r)


class _Job:
    """One job's ranks, as torchrun starts them (a rank that fails ends the job's exit code)."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs

    def wait(self, timeout: float) -> int:
        rc = 0
        for p in self.procs:
            code = p.wait(timeout=timeout)
            rc = rc or code
        return rc

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        return None if None in codes else max(abs(c or 0) for c in codes)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def _launch(n: int, argv: list[str], log: Path) -> _Job:
    code = "import gc, sys; from streamer.tools.bench_replicas import replicas_worker; rc = replicas_worker(sys.argv[1:]); gc.freeze(); sys.exit(rc)"
    out = log.open("ab")
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(n))
    procs = [subprocess.Popen([sys.executable, "-c", code, *argv], stdout=out, stderr=out,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]
    return _Job(procs)


def replicas_worker(argv: list[str]) -> int:
    """One rank of the trainer (``send``) or of replica ``I`` (``recv I``)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["send", "recv"])
    ap.add_argument("index", type=int, nargs="?", default=0)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--repeats", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    a = ap.parse_args(argv)
    return _send(a) if a.role == "send" else _recv(a)


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _recv(a: Any) -> int:
    from streamer.refit.options import RefitOptions
    from streamer.refit.persist import alloc_local
    from streamer.refit.session import RefitSession
    from streamer.transport.jobs import launcher_rank

    rank, n = launcher_rank()
    m = _manifest(a.rows, n, 1 - a.index % 2)
    local = alloc_local(m, rank)
    if a.index == a.replicas - 1:  # the joiner: once the trainer has pushed its steady pushes
        _wait_file(a.dir / "join", a.timeout)
    with RefitSession.open(m, "recv", rendezvous=str(a.dir / "rdv"), transport="gloo", timeout=a.timeout,
                           options=RefitOptions(delta=True), replica=f"r{a.index}") as s:
        while s.pull(local) is not None:
            pass
    return 0


def _send(a: Any) -> int:
    import numpy as np

    from streamer.refit.options import RefitOptions
    from streamer.refit.persist import alloc_local
    from streamer.refit.session import RefitSession
    from streamer.transport.jobs import launcher_rank

    rank, n = launcher_rank()
    m = _manifest(a.rows, n, 0)
    local = alloc_local(m, rank)
    rng = np.random.default_rng(rank)
    for v in local.values():
        v[...] = rng.standard_normal(v.shape, dtype=np.float32)
    for i in range(a.replicas - 1):
        _wait_file(a.dir / f"rdv@r{i}", a.timeout)
    joiner = f"r{a.replicas - 1}"
    rows: list[dict[str, Any]] = []
    with RefitSession.open(m, "send", rendezvous=str(a.dir / "rdv"), transport="gloo", timeout=a.timeout,
                           options=RefitOptions(delta=True), replicas=True) as s:
        group = s.group.role_control
        for step in range(2 * a.repeats + 2):
            if step == a.repeats + 1:  # the joiner opens now, and joins at this push
                if rank == 0:
                    (a.dir / "join").touch()
                _wait_file(a.dir / f"rdv@{joiner}", a.timeout)
            for v in local.values():  # 1% of the elements change
                flat = v.reshape(-1)
                idx = rng.choice(flat.size, max(1, flat.size // 100), replace=False)
                flat[idx] += np.float32(0.01)
            group.barrier(a.timeout)
            t0 = time.perf_counter()
            st = s.push(local, version=step + 1)
            mine = {"s": time.perf_counter() - t0, "replicas": {r.name: [r.seconds, r.join_seconds, r.bytes_sent,
                                                                         r.full_bytes_sent, r.joined]
                                                                for r in st.replicas}}
            ranks = [json.loads(x) for x in group.allgather_bytes(json.dumps(mine).encode(), a.timeout)]
            rows.append(_slowest(ranks))
    if rank == 0:
        (a.dir / "replicas.json").write_text(json.dumps(_summary(rows, a.repeats, joiner)))
    return 0


def _slowest(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One push over the trainer's ranks: the slowest rank's seconds, the bytes of all."""
    names = ranks[0]["replicas"]
    return {"s": max(r["s"] for r in ranks),
            "replicas": {n: {"s": max(r["replicas"][n][0] for r in ranks), "join_s": max(r["replicas"][n][1] for r in ranks),
                             "wire": sum(r["replicas"][n][2] for r in ranks), "full": sum(r["replicas"][n][3] for r in ranks),
                             "joined": ranks[0]["replicas"][n][4]} for n in names}}


def _summary(rows: list[dict[str, Any]], repeats: int, joiner: str) -> dict[str, Any]:
    # the first push is every replica's first (full): steady pushes are those after it
    before, join, after = rows[1:repeats + 1], rows[repeats + 1], rows[repeats + 2:]
    steady = [n for n in join["replicas"] if n != joiner]
    return {"steady_before_s": median(r["s"] for r in before), "join_push_s": join["s"],
            "steady_after_s": median(r["s"] for r in after),
            "joiner": {"join_s": join["replicas"][joiner]["join_s"], "first_push_s": join["replicas"][joiner]["s"],
                       "wire_bytes": join["replicas"][joiner]["wire"], "full_bytes": join["replicas"][joiner]["full"]},
            "steady_replica": {"push_s": join["replicas"][steady[0]]["s"], "wire_bytes": join["replicas"][steady[0]]["wire"],
                               "full_bytes": join["replicas"][steady[0]]["full"],
                               "median_push_s": median(r["replicas"][steady[0]]["s"] for r in after)},
            "pushes": rows}


def replicas_table(r: dict[str, Any]) -> str:
    """The human summary of ``bench_replicas``."""
    j, s, n = r["joiner"], r["steady_replica"], r["replicas"]
    return "\n".join([
        f"bench refit --replicas {n} (trainer {r['senders']} rank(s), each replica {r['receivers']} rank(s), "
        f"{r['size_bytes'] / 1e6:.1f} MB float32, 1% changed per push; delta sessions, auto: on one host they "
        "send full bytes; gloo):",
        f"  steady push to {n - 1} replica(s):  {r['steady_before_s']:.3f} s (median of {r['repeats']})",
        f"  the push at which replica {n} joins:  {r['join_push_s']:.3f} s",
        f"    the joiner: join (open + plan) {j['join_s']:.3f} s, first push (full) {j['first_push_s']:.3f} s, "
        f"{j['wire_bytes'] / 1e6:.1f} of {j['full_bytes'] / 1e6:.1f} MB",
        f"    a steady replica in the same push: {s['push_s']:.3f} s, {s['wire_bytes'] / 1e6:.1f} of "
        f"{s['full_bytes'] / 1e6:.1f} MB (its median afterwards: {s['median_push_s']:.3f} s)",
        f"  steady push to {n} replicas:  {r['steady_after_s']:.3f} s (median of {r['repeats']})"])
