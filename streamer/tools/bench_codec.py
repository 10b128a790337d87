"""``bench refit --delta --codec``: what the delta codec costs a push, on one core and on all.

One trainer rank and one receiver rank (two processes, gloo over a tcp rendezvous) hold
``--size`` bytes of bf16 weights in 8 arrays. Each step changes a fraction of the elements (as an
optimizer step does: ``--lr`` sets that fraction here, 2 % by default), and the same new weights
are pushed three ways side by side, in alternating order: ``full`` (a session without delta), and
two delta sessions over a link stated slow (every message encoded), one with its codec on one
thread (``SHARDSTREAM_CODEC_THREADS=1``) and one on every core the rank may use. The table gives
each push's wall time on the receiver, which waits for the whole push, and the codec's CPU
seconds on both sides. The receiver of a delta push applies it only once every message arrived
(a transactional push), so a delta push costs encode + wire + decode; the wire here is shared
memory, so the rest is the codec.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from statistics import median
from typing import Any

__all__ = ["KINDS", "bench_codec", "codec_table"]

KINDS = ("full", "delta-1", "delta-all")
ARRAYS = 8
#: the stated link of the delta sessions (GB/s): slow enough that every message is encoded
LINK_GBPS = 0.05


def _weights(nbytes: int, step: int, frac: float) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(nbytes // ARRAYS // 2, generator=g).to(torch.bfloat16)
          for i in range(ARRAYS)}
    for s in range(1, step + 1):  # every step moves its own fraction of the elements a little
        gs = torch.Generator().manual_seed(s)
        for x in sd.values():
            hit = torch.rand(x.shape, generator=gs) < frac
            x[hit] = (x[hit].float() * (1 + 1e-2) + 1e-3).to(torch.bfloat16)
    return sd


def _rank(role: str, rdvs: dict[str, str], nbytes: int, steps: int, frac: float, q: Any, barrier: Any) -> None:
    from streamer import RefitOptions, RefitSession, manifest_from_state_dict

    sd = _weights(nbytes, 0, frac)
    man = manifest_from_state_dict(sd, name="codec")
    opts = {"full": RefitOptions(), "delta-1": RefitOptions(delta=True, link_gbps=LINK_GBPS),
            "delta-all": RefitOptions(delta=True, link_gbps=LINK_GBPS)}
    sessions = {k: RefitSession.open(man, role, rendezvous=rdvs[k], transport="gloo", timeout=300, options=opts[k])
                for k in KINDS}
    bufs = {k: {n: x.clone() for n, x in sd.items()} for k in KINDS}
    rows = []
    for step in range(steps + 1):
        new = _weights(nbytes, step, frac) if role == "send" else None
        order = KINDS if step % 2 == 0 else KINDS[::-1]
        row: dict[str, Any] = {"step": step}
        for k in order:
            os.environ["SHARDSTREAM_CODEC_THREADS"] = "1" if k == "delta-1" else ""
            barrier.wait(600)  # both ranks start the push together: the receiver's time is the push's
            t0 = time.perf_counter()
            st = sessions[k].push(new, version=step + 1) if role == "send" else sessions[k].pull(bufs[k])
            row[k] = {"s": time.perf_counter() - t0, "codec_cpu_s": st.encode_seconds + st.decode_seconds,
                      "wire": st.bytes_sent + st.bytes_received, "full": st.full_bytes_sent + st.full_bytes_received,
                      "encodings": dict(st.encodings)}
        rows.append(row)
    if role == "recv":
        want = _weights(nbytes, steps, frac)
        for k in KINDS:
            bad = [n for n in want if not bool((want[n] == bufs[k][n]).all())]
            if bad:
                raise AssertionError(f"bench refit --codec: {k} delivered other bytes for {bad}")
    for s in sessions.values():
        s.close()
    q.put((role, rows))


def bench_codec(*, size: int, steps: int = 3, frac: float = 0.02) -> dict[str, Any]:
    """Run both ranks and return every step's figures and the medians after the first push."""
    from streamer.transport.torch_dist import free_port

    rdvs = {k: f"tcp://127.0.0.1:{free_port()}" for k in KINDS}
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_rank, args=(role, rdvs, size, steps, frac, q, barrier)) for role in ("send", "recv")]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"bench refit --codec: a rank exited {bad[0]}")
    send, recv = got["send"], got["recv"]
    later = range(1, len(recv))
    out: dict[str, Any] = {"size": size, "steps": steps, "changed": frac, "threads": _threads(),
                           "link_gbps": LINK_GBPS, "send": send, "recv": recv}
    for k in KINDS:
        out[f"{k}_s"] = median(recv[i][k]["s"] for i in later)
        out[f"{k}_codec_cpu_s"] = median(send[i][k]["codec_cpu_s"] + recv[i][k]["codec_cpu_s"] for i in later)
        out[f"{k}_wire_ratio"] = median(recv[i][k]["wire"] / recv[i][k]["full"] for i in later)
    out["encodings"] = recv[-1]["delta-all"]["encodings"]
    out["all_vs_one"] = median(recv[i]["delta-all"]["s"] / recv[i]["delta-1"]["s"] for i in later)
    out["all_vs_full"] = median(recv[i]["delta-all"]["s"] / recv[i]["full"]["s"] for i in later)
    return out


def _threads() -> int:
    from streamer.execute.codec import codec_threads

    return codec_threads(1)


def codec_table(r: dict[str, Any]) -> str:
    """The human summary of ``bench_codec``."""
    lines = [f"bench refit --delta --codec (1 sender + 1 receiver, gloo, {r['size'] / 2**20:.0f} MiB bf16, "
             f"{r['changed']:.1%} of the elements changed per step, link stated {r['link_gbps']} GB/s; "
             f"codec threads: 1 against {r['threads']})",
             "    step    full s  delta-1 s  delta-all s  all/one"]
    for row in r["recv"]:
        lines.append(f"    {row['step']:4d}  {row['full']['s']:8.3f}  {row['delta-1']['s']:9.3f}  "
                     f"{row['delta-all']['s']:11.3f}  {row['delta-all']['s'] / row['delta-1']['s']:7.2f}")
    lines.append(f"    median after the first push: every core {r['all_vs_one']:.2f}x one core's push time, "
                 f"{r['all_vs_full']:.2f}x a full push's; {r['delta-all_wire_ratio']:.2%} of the full bytes on the "
                 f"wire; codec CPU seconds per push {r['delta-1_codec_cpu_s']:.3f} (one core) and "
                 f"{r['delta-all_codec_cpu_s']:.3f} (every core)")
    return "\n".join(lines)
