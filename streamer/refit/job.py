"""One side of a refit run from files: what ``shardstream refit send|recv`` does, as a library call.

Senders load their local tensors from the files their manifest names; receivers allocate
theirs. Both open a ``RefitSession`` and run ``steps`` pushes (timed to the job's slowest rank:
senders from a barrier of their job, receivers from the call, whose agreement round is one);
the sender job's ``close()`` ends the receivers' loop early, and ``stay`` keeps receivers
waiting after a failed push until the sender job closes (store plane). A sender job with
``replicas`` serves every inference replica that joins (``refit recv --replica NAME``; the
report names what each push delivered to each). Receivers may save what
they received (into an empty directory, locked while they write). Bad input on any rank (its
manifest, an option, the --save directory, its files) ends every rank of both jobs with the
reason and one exit code, in an agreement round (``ops.agree``), instead of leaving the others
to wait out the timeout.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from formats.errors import PushFailed, ShardstreamError, TransportError, UsageError
from formats.files.outdir import Lock, open_output, remove_state
from formats.manifest.wire import Manifest
from streamer.ops.agree import AgreedRefusal, LocalChecks, Refusal
from streamer.refit.options import RefitOptions
from streamer.refit.session import RefitSession, StepStats
from streamer.transport.jobs import Group, launched_by_mpi

__all__ = ["RefitJob", "RefitReport"]


@dataclass
class RefitReport:
    """What one job did (filled on every rank, the whole-plan byte figures only on ``reporter``,
    the job's rank 0)."""

    role: str
    strategy: str
    transport: str
    seconds: list[float]
    steps: list[StepStats]
    moved_bytes: int
    reshard_moved_bytes: int
    broadcast_moved_bytes: int
    verified: bool
    saved: str | None
    reporter: bool
    #: delta sessions: per step, this job's totals (see ``_delta_totals``)
    delta: list[dict[str, Any]] | None = None
    #: quantize on refit: the arrays, where each is quantized, the bytes saved
    #: (``quant_refit.refit_quant_report``) and this job's slowest rank's seconds quantizing per step
    quantized: dict[str, Any] | None = None
    #: a trainer serving replicas: per push, what each replica received (``ReplicaResult`` fields)
    replicas: list[list[dict[str, Any]]] | None = None

    @property
    def median_s(self) -> float:
        # no push at all (the sender job closed first): a report of zeros, never an IndexError
        return sorted(self.seconds)[len(self.seconds) // 2] if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        med = self.median_s
        return {"role": self.role, "strategy": self.strategy, "steps": len(self.seconds), "seconds": self.seconds,
                "median_s": med, "moved_bytes": self.moved_bytes, "reshard_moved_bytes": self.reshard_moved_bytes,
                "broadcast_moved_bytes": self.broadcast_moved_bytes,
                "gb_per_s": self.moved_bytes / med / 1e9 if med else 0, "verified": self.verified,
                "transport": self.transport, "saved": self.saved,
                "peak_buffer_bytes": max((st.peak_buffer_bytes for st in self.steps), default=0), "delta": self.delta,
                "quantized": self.quantized, **({"replicas": self.replicas} if self.replicas is not None else {})}

    def text(self) -> str:
        med = self.median_s
        rate = self.moved_bytes / med / 1e9 if med else 0
        return (f"refit {self.role} ({self.strategy}): {len(self.seconds)} step(s), median {med:.3f} s, best "
                f"{min(self.seconds, default=0.0):.3f} s, {self.moved_bytes / 1e9:.3f} GB moved ({rate:.2f} GB/s); reshard moves "
                f"{self.reshard_moved_bytes / 1e9:.3f} GB vs gather-broadcast {self.broadcast_moved_bytes / 1e9:.3f} GB"
                + ("; checksums verified" if self.verified else "") + (f"; saved to {self.saved}" if self.saved else "")
                + (_delta_text(self.delta) if self.delta else "") + (_quant_text(self.quantized) if self.quantized else "")
                + (_replicas_text(self.replicas) if self.replicas is not None else ""))


@dataclass
class RefitJob:
    role: str | None
    #: this side's manifest (None: it did not load, and ``refusal`` says why)
    manifest: Manifest | None
    rendezvous: str | None = None
    transport: str | None = None
    control: str = "auto"
    timeout: float = 300.0
    steps: int = 1
    save: str | None = None
    options: RefitOptions = field(default_factory=RefitOptions)
    #: sender job closes the session (store plane; ``steps`` then does not end the loop)
    stay: bool = False
    #: receivers: join as this inference replica of a trainer serving several (store plane)
    replica: str | None = None
    #: senders: serve every inference replica that joins through ``rendezvous`` (store plane)
    replicas: bool = False
    on_push_failed: Callable[[PushFailed], None] | None = None  # None: one line on stderr per job
    #: what this rank refused before the job (its manifest, an option): every rank of both jobs
    #: then ends with it (``ops.agree``)
    refusal: Refusal | None = None
    #: called with a launch's verdict as soon as its own ranks agree on it (the CLI prints it)
    announce: Callable[[AgreedRefusal], None] | None = None
    #: the open session (set by ``run``): the CLI posts an abort through its group on failure
    session: RefitSession | None = None
    _lock: Lock | None = None

    def run(self) -> RefitReport:
        if self.replica is not None and self.role != "recv":
            raise UsageError("--replica is for refit recv (an inference replica); a trainer serving replicas "
                             "runs refit send --replicas")
        self._check_replicas()
        if self.replica is not None and self.control == "auto":
            self.control = "store"  # replicas join and leave on the store plane only
        if self.stay and (self.role != "recv" or self.control == "mpi" or (self.control == "auto" and launched_by_mpi())):
            raise UsageError("--stay is for refit recv on the store control plane (--control store, or a job not "
                             "started by mpiexec): under MPI a peer's death ends the whole launch (docs/resilience.md)")
        checks = LocalChecks(self.refusal)
        with checks.capture():
            if self.save and self.role != "recv":
                raise UsageError("--save is for the receiving side (refit recv)")
        try:
            options = replace(self.options, planned_steps=max(self.steps, self.options.planned_steps))
            session = RefitSession.open(self.manifest, self.role or "", rendezvous=self.rendezvous,
                                        transport=self.transport, control=self.control, timeout=self.timeout,
                                        options=options, refusal=checks.refusal, announce=self.announce,
                                        prepare=self._open_save, replica=self.replica, replicas=self.replicas)
            self.session = session
            with session:
                return self._run(session)
        finally:
            if self._lock is not None:  # (a finished save removed its state already)
                remove_state(Path(str(self.save)), self._lock)
                self._lock.release()

    def _check_replicas(self) -> None:
        if not self.replicas:
            return
        if self.role != "send":
            raise UsageError("--replicas is for refit send (the trainer); an inference replica joins with "
                             "refit recv --replica NAME")
        if self.control == "mpi":
            raise UsageError("--replicas: replicas join and leave on the store control plane only (under MPI a "
                             "peer's death ends the launch); drop --control mpi")
        if self.transport not in (None, "gloo"):
            raise UsageError(f"refit send --replicas moves host tensors over gloo, not --transport {self.transport} "
                             "(from Python: RefitSession.open(..., replicas=True))")

    def _open_save(self, group: Group) -> None:
        """Receiver rank 0, before anyone waits: ``--save DIR`` must be empty (or new) and not
        being written by another run; it holds the lock until the save is complete."""
        if self.save is not None and group.role == "recv" and group.role_rank == 0:
            self._lock = open_output(Path(self.save), False, flag="--save", resumable=False)

    def _run(self, session: RefitSession) -> RefitReport:
        from streamer.refit.persist import alloc_local, load_local

        rank = session.local_rank
        manifest = session.manifest
        tensors: dict[str, Any] = {}
        problems: list[str] = []
        try:
            tensors = load_local(manifest, rank) if self.role == "send" else alloc_local(manifest, rank)
        except ShardstreamError as e:  # refused in the first push's agreement, on every rank
            problems = [f"{session.group.name(session.group.rank)}: {p}" for p in e.problems or [str(e)]]
        tensors = _on_device(tensors, session.transport, session.local_tensors())
        seconds = [self._timed_step(session, tensors, problems) for _ in range(session.options.planned_steps)] \
            if self.role == "send" else self._pulls(session, tensors, problems)
        save = Path(self.save) if self.save else None
        if save is not None:
            session.save(save, tensors)
        delta = _delta_totals(session) if session.options.delta else None
        quantized = _quant_totals(session)
        # the whole-plan figures are whole-plan work: only the job's reporter computes them (a
        # trainer serving replicas: summed over the replicas it serves at the end)
        plans = [sub.plan for sub in session.replica_sessions.values()] if self.replicas else [session.plan]
        stats = [p.stats() for p in plans] if rank == 0 else []
        reshard, broadcast = sum(s.moved_bytes for s in stats), sum(s.broadcast_moved_bytes for s in stats)
        replicas = [[{"name": r.name, "version": r.version, "error": r.error, "joined": r.joined} for r in st.replicas]
                    for st in session.steps] if self.replicas else None
        kind = getattr(session.transport, "name", "?")
        if self.replicas:  # the replicas' transport, not the trainer's own store
            kind = next((getattr(sub.transport, "name", "?") for sub in session.replica_sessions.values()), "gloo")
        return RefitReport(str(self.role), session.options.strategy, kind, seconds, list(session.steps),
                           reshard if session.options.strategy == "reshard" else broadcast, reshard, broadcast,
                           session.options.verify, str(save) if save else None, rank == 0, delta, quantized, replicas)

    def _timed_step(self, session: RefitSession, tensors: dict[str, Any], problems: list[str]) -> float:
        """One push, timed from a barrier of this job to its slowest rank."""
        role_t = session.group.role_control
        role_t.barrier(self.timeout)
        if problems:
            session.refuse(problems)
        t0 = time.perf_counter()
        session.push(tensors) if self.role == "send" else session.pull(tensors)
        times = role_t.allgather_bytes(f"{time.perf_counter() - t0:.9f}".encode(), self.timeout)
        return max(float(x) for x in times)

    def _pulls(self, session: RefitSession, tensors: dict[str, Any], problems: list[str]) -> list[float]:
        """Receivers: ``steps`` pulls, fewer when the sender job closes the session first, or
        (``stay``) every push until it does; the seconds of each pull on the job's slowest rank."""
        mine: list[float] = []
        while self.stay or len(mine) < session.options.planned_steps:
            if problems:
                session.refuse(problems)
            t0 = time.perf_counter()
            try:
                st = session.pull(tensors)
            except PushFailed as e:
                if not self.stay:
                    raise
                if self.on_push_failed is not None:
                    self.on_push_failed(e)
                elif session.group.role_rank == 0:
                    print(f"{e} (--stay: waiting for the next push)", file=sys.stderr, flush=True)
                continue
            if st is None:
                break
            mine.append(time.perf_counter() - t0)
        every = [json.loads(x) for x in session.group.role_control.allgather_bytes(json.dumps(mine).encode(),
                                                                                      self.timeout)]
        counts = [len(t) for t in every]
        if len(set(counts)) > 1:  # a push is collective: ranks that disagree must not report a median
            raise TransportError(f"the receiver ranks pulled different numbers of pushes ({counts}, by rank): "
                                 "the sender job closed the session while some were still pulling")
        return [max(t[i] for t in every) for i in range(counts[0])]


def _delta_totals(session: RefitSession) -> list[dict[str, Any]]:
    """Per step, over this job's ranks: bytes on the wire against full bytes, the fraction of
    elements changed (weighted by the bytes each sender sent), the slowest rank's encode, decode
    and checksum seconds, and the senders' base copies."""
    side = "sent" if session.role == "send" else "received"
    mine = [{"wire": getattr(st, f"bytes_{side}"), "full": getattr(st, f"full_bytes_{side}"),
             "changed": st.changed_fraction, "encode_s": st.encode_seconds, "decode_s": st.decode_seconds,
             "verify_s": st.verify_seconds, "base": st.base_bytes} for st in session.steps]
    ranks = [json.loads(x) for x in session.group.role_control.allgather_bytes(json.dumps(mine).encode(),
                                                                               session.timeout)]
    out = []
    for i in range(len(mine)):
        rows = [r[i] for r in ranks]
        weighed = [(r["changed"], r["full"]) for r in rows if r["changed"] is not None]
        weight = sum(w for _, w in weighed)
        out.append({"step": i, "wire_bytes": sum(r["wire"] for r in rows), "full_bytes": sum(r["full"] for r in rows),
                    "changed_fraction": sum(c * w for c, w in weighed) / weight if weight else None,
                    "encode_s": max(r["encode_s"] for r in rows), "decode_s": max(r["decode_s"] for r in rows),
                    "verify_s": max(r["verify_s"] for r in rows), "base_bytes": sum(r["base"] for r in rows)})
    return out


def _delta_text(delta: list[dict[str, Any]]) -> str:
    parts = []
    for d in delta:
        ratio = d["wire_bytes"] / d["full_bytes"] if d["full_bytes"] else 0.0
        changed = "" if d["changed_fraction"] is None else f", {d['changed_fraction']:.2%} of elements changed"
        parts.append(f"step {d['step']}: {d['wire_bytes'] / 1e6:.3f} of {d['full_bytes'] / 1e6:.3f} MB "
                     f"({ratio:.1%}){changed}, encode {d['encode_s']:.3f} s, decode {d['decode_s']:.3f} s")
    base = max(d["base_bytes"] for d in delta)
    return "\ndelta: " + "; ".join(parts) + (f"; senders keep {base / 1e6:.3f} MB of last-sent bytes" if base else "")


def _replicas_text(pushes: list[list[dict[str, Any]]]) -> str:
    """Per push, each replica: ``a`` (received it), ``c (joined)``, ``b (dropped: why)``."""
    def one(r: dict[str, Any]) -> str:
        return str(r["name"]) + (f" (dropped: {r['error']})" if r["error"] else " (joined)" if r["joined"] else "")

    return "\nreplicas: " + "; ".join(f"push {i}: {', '.join(one(r) for r in rs)}" for i, rs in enumerate(pushes))


def _quant_totals(session: RefitSession) -> dict[str, Any] | None:
    """The session's quantization report, with this job's slowest rank's seconds per step and its
    ranks' staging buffers (receivers)."""
    if session.quant is None:
        return None
    mine = json.dumps({"s": [st.quantize_seconds for st in session.steps], "staging": session.staging_bytes})
    ranks = [json.loads(x) for x in session.group.role_control.allgather_bytes(mine.encode(), session.timeout)]
    # the report's byte figures are whole-plan work: only the job's reporter computes them
    rep = session.quant_report() if session.group.role_control.rank == 0 else None
    if rep is None:
        return None
    return {**rep, "quantize_seconds": [max(r["s"][i] for r in ranks) for i in range(len(session.steps))],
            "staging_bytes": sum(r["staging"] for r in ranks)}


def _quant_text(q: dict[str, Any]) -> str:
    secs = q["quantize_seconds"]
    return (f"\nquantized: {len(q['arrays'])} arrays to FP8 ({q['on_sender']} by the senders, {q['on_receiver']} "
            f"by the receivers), {q['wire_bytes_saved'] / 1e6:.3f} MB fewer on the wire per push; "
            f"slowest rank quantizing {max(secs):.3f} s a push"
            + (f"; {q['staging_bytes'] / 1e6:.3f} MB of staging buffers" if q["staging_bytes"] else ""))


def _on_device(tensors: dict[str, Any], transport: Any, specs: Any) -> dict[str, Any]:
    """NCCL and cuda-ipc move GPU memory: stage the local tensors on the transport's device, in
    the manifest's dtype (numpy holds bfloat16 / fp8 in their uint16 / uint8 storage)."""
    device = getattr(transport, "device", None)
    if device is None:
        return tensors
    import torch

    return {n: torch.from_numpy(v).view(getattr(torch, specs[n].data_type)).to(device) if n in specs
            else torch.from_numpy(v).to(device) for n, v in tensors.items()}
