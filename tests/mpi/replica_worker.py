"""One job of a trainer serving several inference replicas (``test_replicas.py``), on the store
control plane with gloo, started by ``resilient_worker.launch`` (torchrun's environment):

    replica_worker.py --ranks N recv DIR --name a --rule 'S(1)' [--pulls K] [--die-after V] [--after FILE]
    replica_worker.py --ranks N send DIR --versions 1,...,7 --expect a,b --join c:3

``--rendezvous tcp://HOST:PORT`` instead of the file ``DIR/rdv``: the trainer's registry.
Both sides compute version v's weights alike (seeded changes of 2% of the elements per version),
so a replica checks what it holds after each pull. Replicas log one JSON line per event to
DIR/NAME-RANK.jsonl; the trainer's rank 0 logs each push (what each replica received) to
DIR/send.jsonl and touches DIR/pushed-V once version V is pushed. ``--die-after V``: the replica
SIGKILLs itself once the trainer pushed V (after its own pull of V), the trainer after pushing V;
``--kill-at V:F``: the replica's last rank SIGKILLs itself once it posted that fraction of its
receives of version V; ``--stall-after V --stall S``: it sleeps S seconds after its pull of V (a
hung engine); ``--pace S``: the trainer sleeps S seconds after each push; ``--pulls K``: it closes its
session after K pulls; ``--after FILE``: it opens only once FILE exists (a replica joining late);
``--then-weights V``: after its first failed pull it expects version V's weights whatever the
version (the next trainer is ``refit send --replicas``, which pushes its files at every step).
The trainer opens once the replicas of ``--expect`` wait, and pushes version V of ``--join c:V``
once replica c waits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from resilient_worker import digest, launch
from resilient_worker import weights as resilient_weights

from formats.errors import PushFailed
from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule
from streamer.refit.options import RefitOptions
from streamer.refit.persist import alloc_local
from streamer.refit.session import RefitSession
from streamer.transport.jobs import launcher_rank

#: ~3 MB of float32 weights
ARRAYS = {"w": (512, 1024), "v": (256, 1024)}
#: a slow link stated (GB/s): on one host a delta session would otherwise send full bytes
SLOW_LINK = 0.01


def manifest(rule: str, n: int) -> Any:
    mesh = parse_mesh(f"tp={n}")
    return apply_layout(manifest_from_arrays({k: (s, "float32") for k, s in ARRAYS.items()}), mesh,
                        [parse_rule(f"{k}={rule}", mesh) for k in ARRAYS], file_pattern=None)


def weights(version: int) -> dict[str, np.ndarray]:
    return resilient_weights(version, ARRAYS)  # the same versions as the resilience test, smaller arrays


def fill(m: Any, rank: int, local: dict[str, np.ndarray], version: int) -> None:
    full = weights(version)
    for fqn, _, c in m.iter_chunks():
        if rank in c.holders:
            sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
            dl = tuple(slice(o, o + s) for o, s in zip(c.local_box.offsets, c.local_box.sizes))
            local[c.tensor(fqn)][dl] = full[fqn][sl]


def wait_file(path: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def recv(d: Path, args: argparse.Namespace) -> int:
    rank, n = launcher_rank()
    m = manifest(args.rule, n)
    local = alloc_local(m, rank)
    log = (d / f"{args.name}-{rank}.jsonl").open("a", buffering=1)

    def note(**kw: Any) -> None:
        log.write(json.dumps({"t": time.time(), **kw}) + "\n")

    failed = False

    def holds(v: int | None) -> bool | None:
        if v is None:
            return None
        expect = alloc_local(m, rank)
        fill(m, rank, expect, args.then_weights if failed and args.then_weights >= 0 else v)
        return digest(expect) == digest(local)

    if args.after:
        wait_file(d / args.after)
    s = RefitSession.open(m, "recv", rendezvous=args.rendezvous or str(d / "rdv"), transport="gloo", timeout=args.timeout,
                          options=RefitOptions(delta=True, link_gbps=SLOW_LINK), replica=args.name)
    if args.kill_at:  # SIGKILL this rank once it posted that fraction of its receives of version V
        kill_v, kill_f = (float(x) for x in args.kill_at.split(":"))
    pulled = 0
    while pulled < args.pulls:
        if args.kill_at and s.version == kill_v - 1 and rank == n - 1:
            _die_midway(s, kill_f)
        try:
            st = s.pull(local)
        except PushFailed as e:
            note(event="failed", version=e.version, reason=e.reason, held=s.version)
            failed = True
            continue
        if st is None:
            note(event="closed", held=s.version)
            break
        pulled += 1
        note(event="ok", version=st.version, held=s.version, match=holds(s.version), wire=st.bytes_received,
             full=st.full_bytes_received)
        if st.version == args.stall_after:  # a hung engine: the trainer's timeout drops this replica
            time.sleep(args.stall)
        if st.version == args.die_after:
            wait_file(d / f"pushed-{st.version}")
            note(event="killed")
            os.kill(os.getpid(), signal.SIGKILL)
    s.close()
    note(event="exit")
    return 0


def _die_midway(s: RefitSession, fraction: float) -> None:
    t = s.transport
    assert t is not None
    total = sum(1 for msg in s.schedule if msg.dst == t.rank)
    at, posted, irecv = max(1, int(total * fraction)), 0, t.irecv

    def counting(buf: Any, src: int, tag: int) -> Any:
        nonlocal posted
        posted += 1
        if posted >= at:
            os.kill(os.getpid(), signal.SIGKILL)
        return irecv(buf, src, tag)

    t.irecv = counting  # type: ignore[method-assign]


def send(d: Path, args: argparse.Namespace) -> int:
    rank, n = launcher_rank()
    m = manifest("S(0)", n)
    local = alloc_local(m, rank)
    join, join_at = args.join.split(":") if args.join else ("", "-1")
    log = (d / "send.jsonl").open("a", buffering=1) if rank == 0 else None
    if log is not None:
        log.write(json.dumps({"t": time.time(), "event": "start"}) + "\n")
    with RefitSession.open(m, "send", rendezvous=args.rendezvous or str(d / "rdv"), transport="gloo",
                           timeout=args.timeout, options=RefitOptions(delta=True, link_gbps=SLOW_LINK),
                           replicas=True) as s:
        s.await_replicas(args.expect.split(",") if args.expect else [], 120)
        for v in (int(x) for x in args.versions.split(",")):
            if v == int(join_at):
                s.await_replicas([join], 120)
            fill(m, rank, local, v)
            try:
                st = s.push(local, version=v)
            except PushFailed as e:
                if log is not None:
                    log.write(json.dumps({"version": v, "raised": e.reason}) + "\n")
                break
            if log is not None:
                log.write(json.dumps({"t": time.time(), "version": st.version, "sent": st.bytes_sent, "replicas": [
                    [r.name, r.version, r.error, r.joined] for r in st.replicas]}) + "\n")
                (d / f"pushed-{v}").touch()
            time.sleep(args.pace)
            if v == args.die_after:  # between pushes: the replicas notice the silence, and wait for a new trainer
                os.kill(os.getpid(), signal.SIGKILL)
    if log is not None:
        log.write(json.dumps({"t": time.time(), "event": "closed"}) + "\n")
    return 0


def main() -> int:
    if sys.argv[1] == "--ranks":
        return launch(int(sys.argv[2]), sys.argv[3:], __file__)
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["send", "recv"])
    p.add_argument("dir", type=Path)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--rendezvous", default="", help="default: DIR/rdv (a file); or tcp://HOST:PORT")
    p.add_argument("--name", default="")
    p.add_argument("--rule", default="S(0)")
    p.add_argument("--pulls", type=int, default=1 << 30)
    p.add_argument("--die-after", type=int, default=-1)
    p.add_argument("--after", default="")
    p.add_argument("--stall-after", type=int, default=-1)
    p.add_argument("--stall", type=float, default=0.0)
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--kill-at", default="")
    p.add_argument("--then-weights", type=int, default=-1)
    p.add_argument("--versions", default="1")
    p.add_argument("--expect", default="")
    p.add_argument("--join", default="")
    args = p.parse_args()
    return recv(args.dir, args) if args.role == "recv" else send(args.dir, args)


if __name__ == "__main__":
    rc = main()
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
