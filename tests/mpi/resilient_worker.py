"""One side of a refit that outlives its trainer (``test_resilience.py``), started by ``torchrun``
or by ``resilient_worker.py --ranks N`` (the same worker environment, without torchrun's start-up
time) on the store control plane with gloo:

    torchrun ... resilient_worker.py recv DIR [--delta] [--timeout S]
    resilient_worker.py --ranks N send DIR --versions 1,2,3 [--delta] [--kill-at V:FRACTION] [--hang-after V] [--die-after V]

Both sides compute the weights of version v the same way (seeded changes of 2% of the elements
per version, cumulative), so a receiver checks what it holds against its own computation: after
each pull, and after a failed one (its ``version`` then names what its tensors must still hold).
Receivers log one JSON line per event to DIR/recv-RANK.jsonl; a sender that kills itself
(``--kill-at``: SIGKILL once it posted that fraction of its messages of version V) first writes
DIR/killed-RANK with the time.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import PeerTimeoutError, PushFailed
from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule
from streamer.refit.options import RefitOptions
from streamer.refit.persist import alloc_local
from streamer.refit.session import RefitSession
from streamer.transport.jobs import launcher_rank

#: ~24 MB of float32 weights, split by rows on the trainer and by columns on the receivers
ARRAYS = {"w": (2048, 2048), "v": (1024, 2048)}
BUCKET = 256 << 10


def manifest(role: str, n: int) -> Any:
    types = {k: "float32" for k in ARRAYS}
    mesh = parse_mesh(f"tp={n}")
    rules = [parse_rule(f"{k}=S({0 if role == 'send' else 1})", mesh) for k in ARRAYS]
    return apply_layout(manifest_from_arrays({k: (s, types[k]) for k, s in ARRAYS.items()}), mesh, rules,
                        file_pattern=None)


def weights(version: int, arrays: dict[str, tuple[int, int]] = ARRAYS) -> dict[str, np.ndarray]:
    """The full ``arrays`` of ``version``: from seed 0, each version changes 2% of the elements."""
    full = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32) for k, s in arrays.items()}
    for v in range(1, version + 1):
        rng = np.random.default_rng(v)
        for a in full.values():
            flat = a.reshape(-1)
            idx = rng.choice(flat.size, flat.size // 50, replace=False)
            flat[idx] += rng.standard_normal(idx.size).astype(np.float32)
    return full


def fill(m: Any, rank: int, local: dict[str, np.ndarray], full: dict[str, np.ndarray]) -> None:
    """This rank's local tensors of ``full``."""
    for fqn, _, c in m.iter_chunks():
        if rank in c.holders:
            sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
            dl = tuple(slice(o, o + s) for o, s in zip(c.local_box.offsets, c.local_box.sizes))
            local[c.tensor(fqn)][dl] = full[fqn][sl]


def digest(local: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(local):
        h.update(local[k].tobytes())
    return h.hexdigest()


def recv(d: Path, args: argparse.Namespace) -> int:
    rank, n = launcher_rank()
    m = manifest("recv", n)
    local = alloc_local(m, rank)
    log = (d / f"recv-{rank}.jsonl").open("a", buffering=1)

    def note(**kw: Any) -> None:
        log.write(json.dumps({"t": time.time(), **kw}) + "\n")  # an explicit t wins

    def holds(v: int | None) -> bool | None:
        if v is None:
            return None
        expect = alloc_local(m, rank)
        fill(m, rank, expect, weights(v))
        return digest(expect) == digest(local)

    s = RefitSession.open(m, "recv", rendezvous=str(d / "rdv"), transport="gloo", control="store",
                          timeout=args.timeout, options=_options(args))
    note(event="open")
    if args.pull_timeout:  # the open's wait for the trainer is long; the wait for a push short
        s.timeout = args.pull_timeout
    while True:
        called = time.time()  # the times of the call and of its end, before any check's seconds
        try:
            st = s.pull(local)
        except PushFailed as e:
            note(event="failed", version=e.version, reason=e.reason, held=s.version, called=called, t=time.time(),
                 match=holds(s.version))
            if os.environ.get("RESILIENT_DEBUG"):
                import faulthandler

                faulthandler.dump_traceback_later(8, file=sys.stderr)
            continue
        except PeerTimeoutError as e:
            note(event="timeout", reason=str(e), held=s.version, called=called, t=time.time())
            break
        if st is None:
            note(event="closed", held=s.version)
            break
        note(event="ok", version=st.version, held=s.version, called=called, t=time.time(), match=holds(s.version),
             wire=st.bytes_received, full=st.full_bytes_received)
    s.close()
    note(event="exit")
    return 0


def send(d: Path, args: argparse.Namespace) -> int:
    rank, n = launcher_rank()
    if os.environ.get("RESILIENT_DEBUG"):
        import faulthandler

        faulthandler.dump_traceback_later(10, file=sys.stderr)
        print(f"start {time.time()}", file=sys.stderr)
    m = manifest("send", n)
    local = alloc_local(m, rank)
    kill_v, kill_f = (int(args.kill_at.split(":")[0]), float(args.kill_at.split(":")[1])) if args.kill_at else (-1, 0.0)
    with RefitSession.open(m, "send", rendezvous=str(d / "rdv"), transport="gloo", control="store",
                           timeout=args.timeout, options=_options(args)) as s:
        for v in (int(x) for x in args.versions.split(",")):
            fill(m, rank, local, weights(v))
            if v == kill_v:
                _die_midway(s, d, rank, kill_f)
            s.push(local, version=v)
            if os.environ.get("RESILIENT_DEBUG"):
                print(f"pushed {v} {time.time()}", file=sys.stderr)
            if v == args.hang_after:
                time.sleep(600)  # alive, silent: the receivers' timeout ends their wait
            if v == args.die_after:  # between pushes: only the heartbeat's silence says so
                (d / f"killed-{rank}").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
    return 0


def _die_midway(s: RefitSession, d: Path, rank: int, fraction: float) -> None:
    """SIGKILL this process once it posted ``fraction`` of its messages of the next push."""
    t = s.transport
    assert t is not None
    total = sum(1 for msg in s.schedule if msg.src == t.rank)
    at = max(1, int(total * fraction))
    posted = 0
    isend = t.isend

    def counting(buf: Any, dst: int, tag: int) -> Any:
        nonlocal posted
        if tag < 32:  # a message, or a delta's header (payloads travel on higher tags)
            posted += 1
            if posted >= at:
                (d / f"killed-{rank}").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        return isend(buf, dst, tag)

    t.isend = counting  # type: ignore[method-assign]


def launch(n: int, argv: list[str], script: str = __file__) -> int:
    """A launcher as torchrun starts its workers (RANK, WORLD_SIZE, LOCAL_RANK; a rank that dies
    takes the others down), without torchrun's own seconds of start-up: the job's exit code."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, script, *argv],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r)})
             for r in range(n)]
    rc = 0
    while procs:
        for p in list(procs):
            code = p.poll()
            if code is None:
                continue
            procs.remove(p)
            if code and not rc:
                rc = code if code > 0 else 128 - code
                for q in procs:
                    q.terminate()
        time.sleep(0.05)
    return rc


def _options(args: argparse.Namespace) -> RefitOptions:
    """A slow link stated: on one host the deltas would otherwise travel as full bytes."""
    return RefitOptions(delta=args.delta, bucket_size=BUCKET, link_gbps=0.01 if args.delta else None)


def main() -> int:
    if sys.argv[1] == "--ranks":
        return launch(int(sys.argv[2]), sys.argv[3:])
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["send", "recv"])
    p.add_argument("dir", type=Path)
    p.add_argument("--delta", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--pull-timeout", type=float, default=0.0)
    p.add_argument("--versions", default="1")
    p.add_argument("--kill-at", default="")
    p.add_argument("--hang-after", type=int, default=-1)
    p.add_argument("--die-after", type=int, default=-1)
    args = p.parse_args()
    return recv(args.dir, args) if args.role == "recv" else send(args.dir, args)


if __name__ == "__main__":
    rc = main()
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
