"""RefitSession: plan once, push new weights every RL step over the same connection.

    # trainer rank (torchrun or mpiexec)             # inference rank
    with RefitSession.open(train_manifest, "send",  with RefitSession.open(serve_manifest, "recv",
                           rendezvous="rv.txt",                            rendezvous="rv.txt",
                           transport="gloo") as s:                         transport="gloo") as s:
        for step in ...:                                for step in ...:
            s.push(model)  # DTensors: local shards         s.pull(local_tensors)  # in place

``open`` is the one collective entry point: it joins the two jobs (``rendezvous.join``), builds the
transport, exchanges manifests (sender rank 0 and receiver rank 0 broadcast their compact form),
agrees on options, and compares the digests of the inputs (both manifests, the plan-affecting
options, the planner's version) on every rank before any byte moves: ranks that disagree are
refused, naming what differs. Each rank then plans on its own, with no communication, and expands
only its own transfers (``streamer.refit.rankstart``). Constructing the object does no communication.

Every push starts with one small agreement round: each rank checks what it was handed (names,
dtypes, shapes; with ``verify``, the checksums of replicated regions) and all ranks exchange
their findings. A refusal anywhere is then raised on every rank of both jobs with the same
message, before any byte moves, so receivers are never left half-updated by a refused push.

Quantize on refit (``streamer.execute.quant``): FP8 arrays with a scale sibling, fed from bf16/fp32, are quantized
by the senders (whole blocks) or else the receivers; ``fp8_block`` and ``ue8m0``, the scheme, agreed by both jobs.

Versions: every push carries one (``push(state, version=N)``, else one more than the last). The
agreement round also carries each rank's version (the one its tensors, or a sender's delta bases,
hold completely, or unknown), so every rank takes the same decision: in a delta session a pair of
ranks at the senders' base version exchanges encoded changes (``streamer.execute.delta``); any other
pair moves full bytes, which the sender keeps as its next base. A receiver's ``version`` is the
version its tensors hold completely: None while a full push is under way and after one broke off;
a delta push is transactional (``DeltaPush.stage``): a broken one leaves it unchanged.

On the store control plane the receivers outlive the trainer (``docs/resilience.md``): a push
that breaks off raises ``PushFailed`` from ``pull()`` and the session stays open; the next
``pull()`` waits for a new sender job (``streamer.transport.epochs``), whose first push is full.
A sender's ``close()`` ends the session for good: waiting ``pull()`` calls return None.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from formats.errors import (
    PeerTimeoutError,
    PlanError,
    PushFailed,
    TransportError,
    UsageError,
    ValidationError,
)
from formats.manifest.wire import (
    COMPACT_FORMAT_VERSION,
    Manifest,
    dumps_manifest,
    load_manifest,
    loads_manifest,
    without_checksums,
)
from streamer.execute.codec import job_threads
from streamer.execute.delta import DeltaChecksumError, DeltaPush, DeltaState
from streamer.execute.executor import ExecStats, Executor, bucket_slots
from streamer.execute.quant import ReceiverQuant, RefitQuant, SenderQuant, refit_quant, refit_quant_report
from streamer.execute.schedule import SCHEDULE_VERSION
from streamer.execute.staging import device_name, staging_problems
from streamer.ops.agree import AgreedRefusal, LocalChecks, Refusal
from streamer.ops.agree import agree as agree_refusals
from streamer.ops.quant import FP8_BLOCK
from streamer.plan.gcpause import paused_gc
from streamer.plan.open_rows import bind_open_rows
from streamer.refit.baseline import Baseline, gather_broadcast
from streamer.refit.fleet import Fleet, ReplicaResult, check_fleet_args
from streamer.refit.local import check_local, collect_local
from streamer.refit.options import RefitOptions, agree
from streamer.refit.rankstart import input_digests, input_problems, plan_own
from streamer.refit.replicas import replica_digests, replica_problems
from streamer.transport.base import PeerClosedError, Transport
from streamer.transport.jobs import Group
from streamer.transport.rendezvous import join, rejoin

__all__ = ["PushFailed", "RefitOptions", "RefitSession", "RefusedError", "ReplicaResult", "StepStats", "make_transport", "transport_kind"]

TRANSPORTS = ("mpi", "gloo", "nccl", "shm", "cuda-ipc")
#: how a receiver whose wait for the next push timed out tells the others (they time out too)
NO_PUSH = "no push came within the timeout: "
#: a receiver on the MPI plane does not outlive a failed push: the line that says so
MPI_NOTE = ("(receivers end with a failed push on the MPI control plane, where a peer's death ends the launch; "
            "on the store control plane they outlive it: docs/resilience.md)")


class RefusedError(ValidationError):
    """A push refused by the agreement round: raised on every rank with the same problems."""


@dataclass
class StepStats(ExecStats):
    """One push or pull on this rank: the executor's figures (``ExecStats``) plus the session's."""

    #: the push's index in this session (0, 1, ...)
    step: int = 0
    strategy: str = "reshard"
    #: the version this push delivered (``push(version=N)``, else one more than the last)
    version: int = 0
    #: of the elements this rank sent as deltas, the fraction that changed (None: no delta sent)
    changed_fraction: float | None = None
    #: this rank's copy of the bytes it last sent (the memory price of delta)
    base_bytes: int = 0
    #: seconds this rank spent quantizing FP8 weights (senders while packing, receivers after)
    quantize_seconds: float = 0.0
    #: a trainer serving replicas (``open(..., replicas=True)``): what each replica received
    replicas: list[ReplicaResult] = field(default_factory=list)

    @classmethod
    def of(cls, es: ExecStats, **session: Any) -> StepStats:
        """``es`` with the session's fields; the fraction changed comes from its element counts."""
        changed = es.changed_elements / es.delta_elements if es.delta_elements else None
        return cls(**{f.name: getattr(es, f.name) for f in fields(ExecStats)}, changed_fraction=changed, **session)


def transport_kind(kind: str | None, group: Group) -> str:
    """The transport ``kind`` names on ``group`` (default: mpi on the MPI plane, else gloo), or
    the usage error that refuses it."""
    kind = kind or ("mpi" if group.plane == "mpi" else "gloo")
    if kind not in TRANSPORTS:
        raise UsageError(f"unknown transport {kind!r} (one of {', '.join(TRANSPORTS)})")
    if kind == "mpi" and group.plane != "mpi":
        raise UsageError("--transport mpi needs jobs launched by mpiexec on the MPI control plane; "
                         "use --transport gloo (CPU) or nccl (GPU)")
    return kind


def make_transport(kind: str | Transport | None, group: Group, timeout: float, device: Any = None) -> Transport:
    """The transport named ``kind`` over ``group`` (default: mpi on the MPI plane, else gloo);
    ``device``: the CUDA device of nccl and cuda-ipc when the caller owns the choice."""
    if kind is not None and not isinstance(kind, str):
        return kind
    kind = transport_kind(kind, group)
    if kind == "mpi":
        return group.control
    if kind in ("shm", "cuda-ipc"):  # colocated ranks: one-sided copies (transport/handles.py)
        from streamer.transport.colocated import open_handle_transport

        return open_handle_transport(kind, group, timeout, device)
    from streamer.transport.torch_dist import TorchDistTransport

    return TorchDistTransport(group.control, kind, store=group.store, timeout=timeout,
                              prefix=f"{group.prefix}shardstream", device=device)


def _agree_transport(group: Group, transport: str | Transport | None, timeout: float, checks: LocalChecks,
                     prepare: Callable[[Group], None] | None) -> str | Transport | None:
    """The first round once the group exists: this rank's transport and ``prepare`` checks, and
    every rank's transport kind. A refusal, or kinds that differ between the jobs, end every
    rank here, before any transport is built (their set-ups are collectives of their own)."""
    kind: str | None = None
    with checks.capture():
        if transport is None or isinstance(transport, str):
            kind = transport_kind(transport, group)
        if prepare is not None:
            prepare(group)
    kinds = agree_refusals(group.control, checks.refusal, timeout, extra=kind)
    sides = {side: sorted({str(k) for k in ks if k is not None})
             for side, ks in (("senders", kinds[:group.n_send]), ("receivers", kinds[group.n_send:]))}
    if len({k for ks in sides.values() for k in ks}) > 1:
        asked = "; ".join(f"{side}: {' and '.join(ks)}" for side, ks in sides.items())
        raise UsageError(f"the two jobs asked for different transports ({asked}); pass the same --transport to both")
    return kind if kind is not None else transport


@dataclass
class RefitSession:
    """One side of a refit. Use ``RefitSession.open``; ``group`` comes from ``rendezvous.join``."""

    manifest: Manifest
    role: str
    group: Group
    transport: Transport | None = None
    timeout: float = 300.0
    #: this job's options; after ``start``, the ones both jobs agreed on
    options: RefitOptions = field(default_factory=RefitOptions)
    #: what stages device tensors over mpi/gloo (``streamer.execute.staging``); None: CUDA tensors are
    #: staged through pinned host buckets on their device (tests pass a ``device_ops.FakeDeviceOps``)
    device_ops: Any = None
    #: receivers only: picks this job's manifest once the sender's is known (every receiver rank
    #: calls it with the same sender manifest; it must answer alike on all of them). Used where one
    #: set of local tensors can publish two array namings (MoE experts fused or one per expert)
    choose_manifest: Callable[[Manifest], Manifest] | None = None
    steps: list[StepStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.role not in ("send", "recv"):
            raise UsageError(f"role must be send or recv, got {self.role!r}")
        self._started = False
        self._executor: Executor | None = None
        self._tensor_key: tuple[Any, ...] = ()
        # the last version pushed here, and the one this rank's tensors (and, when it sends in a
        # delta session, its bases) are known to hold -- None when unknown (never pushed, new
        # buffers handed in, or a push that failed half-way)
        self._last: int | None = None
        self._synced: int | None = None
        self._proposed: int | None = None  # push(version=N)
        self._pushing: int | None = None  # the version of the push under way
        # store plane: the session outlives a failed sender job (see transport/epochs.py)
        self._broken = False
        self._closed = False
        self._kind: str | None = None  # the transport asked for (None: the plane's default)
        self._reopenable = False  # open() built the transport: it can build one for a new sender job
        self._replica: str | None = None  # receivers: this replica's name
        self._device: Any = None  # open(device=): the CUDA device of nccl / cuda-ipc, for reopening
        self._receipt = ""  # a replica's receiver: the store key of its last receipt (``_post_receipt``)
        self._fleet: Fleet | None = None  # a trainer serving replicas: its per-replica sessions
        self._synced_ptrs: tuple[Any, ...] = ()
        self._checked: tuple[Any, ...] = ()  # the memory key of the tensors that last passed the local checks
        self._delta_state: DeltaState | None = None
        self.hostnames: tuple[str, ...] = ()  # every rank's host, from open (a delta's shared-memory pairs)
        self.held_at_start: tuple[int | None, ...] = ()
        self.quant: RefitQuant | None = None
        self._send_quant: SenderQuant | None = None
        self._recv_quant: ReceiverQuant | None = None
        #: seconds ``open`` took on this rank (joining, planning, buffers faulted in)
        self.open_seconds = 0.0

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, manifest: Manifest | str | Path | None, role: str, *, rendezvous: str | None = None,
             transport: str | Transport | None = None, control: str = "auto", timeout: float = 300.0,
             group: Group | None = None, options: RefitOptions | None = None, device_ops: Any = None,
             refusal: Refusal | None = None, announce: Callable[[AgreedRefusal], None] | None = None,
             prepare: Callable[[Group], None] | None = None,
             choose_manifest: Callable[[Manifest], Manifest] | None = None, replica: str | None = None,
             replicas: bool = False, device: Any = None) -> RefitSession:
        """Join the refit as ``role`` ("send" or "recv") and plan it: the one collective entry point.

        ``transport``: "mpi" (default under mpiexec), "gloo" (default otherwise), "nccl", "shm" or
        "cuda-ipc" (every rank on one node), or a ``Transport``. ``control``: "auto", "mpi" or
        "store" (see ``rendezvous.join``). ``options``: how to move (``RefitOptions``; the two jobs
        agree on them). ``device_ops``: what stages device tensors on a host transport (tests).

        Bad input on one rank ends every rank of both jobs with the same verdict (``AgreedRefusal``,
        ``ops.agree``): a manifest that does not load here, ``refusal`` (what the caller's own
        checks refused), and ``prepare(group)`` (checks that need the group, e.g. the receivers'
        output directory) are agreed on before any other wait; ``announce`` gets a launch's verdict
        as soon as its own ranks know it (see ``rendezvous.join``). ``manifest`` may be None only with
        a ``refusal`` (the caller could not load it). ``choose_manifest`` (receivers): this job's
        manifest, picked from the sender's (the field).

        Replicas (store plane, ``docs/resilience.md``): each inference replica's receiver job opens
        with ``replica="NAME"`` and the same ``rendezvous``; the trainer opens with ``replicas=True``
        and pushes to every replica that joins (``streamer.refit.fleet``).

        ``device``: the CUDA device the nccl and cuda-ipc transports use, for a process whose
        device someone else chose (a vLLM worker passes its own); used as given, the current device
        left alone. Default: the launcher's local rank, made current (``transport.device``).
        """
        t0 = time.perf_counter()
        if replicas:  # a bad argument here is refused before any wait: no peer needs to hear of it
            check_fleet_args(role, rendezvous, transport)
        checks = LocalChecks(refusal)
        m = _loaded(manifest, refusal, checks)
        if group is None:
            group = join(role, rendezvous, timeout=timeout, control=control, refusal=checks.refusal, announce=announce,
                         replica=replica, replicas=replicas)
            checks = LocalChecks()  # the group's formation carried the refusal
        if replicas:
            return cls._over_replicas(m, group, rendezvous, transport, timeout, options, device_ops, t0)
        try:
            kind = _agree_transport(group, transport, timeout, checks, prepare)
            assert m is not None  # a rank without its manifest refused above, on every rank
            session = cls(m, role, group, make_transport(kind, group, timeout, device), timeout,
                          options or RefitOptions(), device_ops, choose_manifest)
            session._device = device
            session._kind = kind if isinstance(kind, str) else None
            session._reopenable = not (transport is not None and not isinstance(transport, str))
            session._replica = replica
            session.start()
            session.open_seconds = time.perf_counter() - t0
        except (AgreedRefusal, PlanError, UsageError):
            group.close(timeout)  # every rank holds this verdict: they sign off together
            raise
        return session

    @classmethod
    def _over_replicas(cls, m: Manifest | None, group: Group, rendezvous: str | None, transport: Any, timeout: float,
                       options: RefitOptions | None, device_ops: Any, t0: float) -> RefitSession:
        """The trainer's session over every replica that joins through ``rendezvous`` (``group``: the
        trainer's own ranks): waits (up to ``timeout``) for the first replicas and joins them
        (``streamer.refit.fleet``)."""
        assert m is not None and rendezvous is not None  # else join() raised every rank's refusal, or check_fleet_args
        owner = cls(m, "send", group, group.control, timeout, options or RefitOptions(), device_ops)
        owner._fleet = Fleet(owner, cls.open, rendezvous, transport)
        try:
            owner._fleet.fresh = owner._fleet.admit({}, wait=True)
        except BaseException:
            owner.close(done=False)
            raise
        owner.open_seconds = time.perf_counter() - t0
        return owner

    def __enter__(self) -> RefitSession:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(done=exc_type is None)

    def start(self) -> None:
        """Exchange manifests and options, agree on the inputs, and plan this rank's part."""
        if self._started:
            return
        if self.transport is None:
            self.transport = make_transport(None, self.group, self.timeout, self._device)
        with paused_gc():  # a full-size plan: ~10^6 long-lived objects (see streamer.plan.gcpause)
            self._plan_start()
        self._start_quant()
        self._started = True

    def _plan_start(self) -> None:
        src, self.dst = self._exchange_manifests()
        self.src = bind_open_rows(src, self.dst)  # a padded vocabulary takes the receivers' rows
        self._agree_options()
        # FP8 destinations fed from float sources: the plan moves between the quantizing manifests
        self.quant = refit_quant(self.src, self.dst, block=self.options.fp8_block or FP8_BLOCK, ue8m0=self.options.ue8m0)
        self._psrc, self._pdst = (self.quant.src, self.quant.dst) if self.quant else (self.src, self.dst)
        # every rank plans from the same inputs with the same planner: no plan is compared, and each
        # rank expands only its own transfers and orders only its own messages
        self.plan, self.schedule = plan_own(self._psrc, self._pdst, self._t.rank, bucket_size=self.options.bucket_size,
                                            src_domain_size=self.options.src_domain_size,
                                            dst_domain_size=self.options.dst_domain_size, allow_extra=self.options.allow_extra)
        # what every push is checked against: computed once (a full-size manifest has many chunks)
        self._specs = self.manifest.local_tensors(self.local_rank)
        self._checked = ()
        # the bucket buffers, faulted in now: the first push then costs what the others do
        self._slots = bucket_slots(self._t, self.schedule) if self.options.strategy == "reshard" else []

    def _start_quant(self) -> None:
        if self.quant is None:
            return
        if self.options.strategy != "reshard":
            raise UsageError("quantize on refit works with --strategy reshard only")
        if getattr(self.transport, "device", None) is not None:
            raise UsageError("quantize on refit runs on the host: use --transport mpi or gloo (nccl: not yet)")
        if self.role == "send":
            self._send_quant = SenderQuant(self.quant, self.src)
        else:
            self._recv_quant = ReceiverQuant(self.quant, self.dst, self.local_rank)

    @property
    def staging_bytes(self) -> int:
        """This receiver's staging buffers for weights it quantizes (0 elsewhere)."""
        return self._recv_quant.staging_bytes if self._recv_quant is not None else 0

    def quant_report(self) -> dict[str, Any] | None:
        """Which arrays this refit quantizes, where, and the bytes saved (None: none)."""
        return refit_quant_report(self.quant, self.dst, self.plan) if self.quant is not None else None

    def _exchange_manifests(self) -> tuple[Manifest, Manifest]:
        t = self._t
        S = self.group.n_send
        # the two roots send the compact form (format_version 2: megabytes, not hundreds of them at
        # DeepSeek-V3 scale); the other ranks serialise nothing
        # (without chunk checksums: a refit reads no file's checksum, and peers have no sidecar)
        def text(m: Manifest) -> bytes:
            return dumps_manifest(without_checksums(m), format_version=COMPACT_FORMAT_VERSION).encode()

        src_txt = t.bcast_bytes(text(self.manifest) if t.rank == 0 else None, 0, self.timeout)
        src = loads_manifest(src_txt, where="sender manifest")
        if self.role == "recv" and self.choose_manifest is not None:
            self.manifest = self.choose_manifest(src)
        dst_txt = t.bcast_bytes(text(self.manifest) if t.rank == S else None, S, self.timeout)
        self._texts = (src_txt, dst_txt)  # their digests are what the two jobs agree on
        dst = loads_manifest(dst_txt, where="receiver manifest")
        problems = []
        if src.world_size != S:
            problems.append(f"sender manifest: world_size {src.world_size} but the sender job has {S} ranks")
        if dst.world_size != self.group.n_recv:
            problems.append(f"receiver manifest: world_size {dst.world_size} but the receiver job has "
                            f"{self.group.n_recv} ranks")
        if problems:
            raise PlanError(problems=problems)
        return src, dst

    def _agree_options(self) -> None:
        """One allgather at start. Both jobs must agree on how to move (verify if any side asks,
        the smallest bucket, one strategy, ...: negotiated below) and on what is planned: the
        input digests (both manifests, the options not negotiated, the planner's and the bucket
        layout's versions), where a difference is refused on every rank, by name, before any plan."""
        o = self.options
        inputs = input_digests(self._texts[0], self._texts[1],
                               {"allow_extra": o.allow_extra, "schedule": SCHEDULE_VERSION})
        host = getattr(self.transport, "device", None) is None
        held = self._synced if self.role == "recv" else None
        cfgs = [json.loads(c) for c in self._t.allgather_bytes(json.dumps(
            {"options": o.wire(), "host": host, "inputs": inputs, "hostname": socket.gethostname(),
             "held": held}).encode(), self.timeout)]
        self.hostnames = tuple(str(c["hostname"]) for c in cfgs)
        #: the versions the receiver ranks held when this sender job joined them (None: none)
        self.held_at_start = tuple(c["held"] for c in cfgs[self.group.n_send:])
        self.options = agree([c["options"] for c in cfgs], [c["host"] for c in cfgs])
        problems = input_problems([c["inputs"] for c in cfgs], lambda r: f"rank {r}")
        if problems:
            raise PlanError(problems=problems)
        self.inputs_digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()

    @property
    def _t(self) -> Transport:
        if self.transport is None:
            raise UsageError("the session has no transport: use RefitSession.open(...)")
        return self.transport

    # ------------------------------------------------------------------ pushing
    @property
    def local_rank(self) -> int:
        return self._t.rank if self.role == "send" else self._t.rank - self.group.n_send

    def local_tensors(self) -> dict[str, Any]:
        """Shapes/dtypes of this rank's local tensors (from its manifest)."""
        return dict(self.manifest.local_tensors(self.local_rank))

    def push(self, tensors: Any, *, version: int | None = None) -> StepStats:
        """Send this trainer rank's regions. ``tensors``: a state dict (DTensors send their local
        shard, never gathered; plain tensors; numpy arrays) or an ``nn.Module``. ``version``: the
        number this push carries (e.g. the training step; greater than this session's last),
        the same on every sender rank; without it, one more than the last version pushed."""
        if self.role != "send":
            raise UsageError("push() is for the sending side; receivers call pull()")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise UsageError(f"push(version=...) takes a number >= 0, got {version!r}")
        self._proposed = version
        if self._fleet is None:
            return self._step(tensors)
        es, v, results, parts = self._fleet.push(tensors, version)
        st = StepStats.of(es, step=len(self.steps), strategy=self.options.strategy, version=v, replicas=results,
                          base_bytes=sum(p.base_bytes for p in parts),
                          quantize_seconds=sum(p.quantize_seconds for p in parts))
        self._last = v
        self.steps.append(st)
        return st

    def pull(self, tensors: Any, *, holds_last: bool = False) -> StepStats | None:
        """Receive into this inference rank's existing local tensors, in place. Returns None once
        the sender job closed the session. On the store control plane a push that breaks off
        raises ``PushFailed`` and the session stays open: the next call waits for the next push,
        from this sender job or a new one (``docs/resilience.md``).

        ``holds_last``: ``tensors`` are other memory than the last pull's, holding a byte copy of
        what it received (a receiver that rotates buffers): in a delta session they are its base,
        so the push sends changes instead of full bytes. Without it, other memory means full bytes."""
        if self.role != "recv":
            raise UsageError("pull() is for the receiving side; senders call push()")
        if self._closed:
            return None
        try:
            if self._broken:
                self._reopen()
            st = self._step(tensors, adopt=holds_last)
            if self._replica is not None:
                self._post_receipt(st.version)
            return st
        except PeerClosedError:
            self._closed = True
            return None
        except (RefusedError, DeltaChecksumError):
            raise  # every rank's verdict, or wrong data over a working connection: the session stands
        except TransportError as e:
            if not self._survives():
                if self.group.plane == "mpi":  # say why this receiver goes down with its trainer
                    e.problems = [*(e.problems or [str(e)]), MPI_NOTE]
                raise
            raise self._failed(e) from e

    def _post_receipt(self, version: int) -> None:
        """A replica's receiver rank, once a push completed here: say so on the replica's store
        (the trainer waits for every rank's receipt: ``await_receipts``)."""
        key = f"{self.group.prefix}got/{version}/{self.local_rank}"
        try:
            self.group.store.set(key, "1")
            if self._receipt:
                self.group.store.delete_key(self._receipt)
        except Exception:  # noqa: BLE001 - the store's rank 0 is gone: the trainer finds it, this rank at its next pull
            pass
        self._receipt = key

    def await_receipts(self, version: int) -> None:
        """A trainer's session with one replica (``Fleet``; its rank 0): wait (up to the timeout)
        until every receiver rank of the replica holds ``version``. Its bytes may have left this
        rank before the replica died: the push to it is complete only with the receipts."""
        control = self.group.control
        if self.group.role_rank != 0 or not hasattr(control, "wait_keys"):
            return
        n, s = self.group.n_recv, self.group.n_send
        control.wait_keys([f"{self.group.prefix}got/{version}/{r}" for r in range(n)], self.timeout,
                          f"the receipts of version {version}", range(s, s + n))

    @property
    def replica_sessions(self) -> dict[str, RefitSession]:
        """A trainer serving replicas: the session of each replica it serves now, by name (else empty)."""
        return dict(self._fleet.subs) if self._fleet is not None else {}

    def waiting_replicas(self) -> list[str]:
        """A trainer serving replicas: the replicas waiting now to be joined at the next push (not a
        collective: what this rank reads from the files or the registry)."""
        return sorted(self._fleet.waiting()) if self._fleet is not None else []

    def await_replicas(self, names: Iterable[str], timeout: float | None = None) -> None:
        """A trainer serving replicas: wait (up to ``timeout``, default the session's) until every
        replica named was joined or waits to be joined at the next push (``PeerTimeoutError``)."""
        if self._fleet is None:
            raise UsageError("await_replicas is for a trainer that opened with replicas=True")
        self._fleet.await_names(set(names), self.timeout if timeout is None else timeout)

    @property
    def version(self) -> int | None:
        """The version this rank's tensors hold completely (receivers: the last buffers pulled
        into), or None: nothing received yet, or a full push broke off (or is under way)."""
        return self._synced

    def _survives(self) -> bool:
        """Whether this receiver outlives its sender job: on the store plane, with a transport
        it builds itself (so it can build one for the next sender job)."""
        return self.group.plane == "store" and self._reopenable

    def _failed(self, e: TransportError) -> TransportError:
        """A push broke off here: leave this opening of the session (its other ranks end too) and
        say why; the next ``pull()`` waits for a new one."""
        if self._broken:  # waiting for a new sender job timed out: nothing else changed
            return e
        reason = "; ".join(e.problems) if e.problems else str(e)
        self._broken, version, self._pushing = True, self._pushing, None
        # no push came within the timeout (here, or on the receiver whose notice ended this wait)
        timed_out = version is None and (isinstance(e, PeerTimeoutError) or NO_PUSH in reason)
        self.group.leave(f"{self.group.name(self._t.rank)}: {NO_PUSH if timed_out else ''}{reason}")
        self._drop_transport()
        if timed_out:
            return e if isinstance(e, PeerTimeoutError) else PeerTimeoutError(reason)
        return PushFailed(reason, version)

    def _drop_transport(self) -> None:
        self._executor = None
        self._slots = []  # bucket buffers may be transport memory (shm segments): released before it closes
        t, self.transport = self.transport, None
        if t is not None and t is not self.group.control:
            t.close()

    def _reopen(self) -> None:
        """Receivers: wait for a new sender job (the timeout bounds it) and plan again with it."""
        self.group = rejoin(self.group, self.timeout)
        kind = _agree_transport(self.group, self._kind, self.timeout, LocalChecks(), None)  # as open() does
        self._broken = False
        self.transport = make_transport(kind, self.group, self.timeout, self._device)
        self._started, self._delta_state, self._executor = False, None, None
        self._recv_quant = None
        self.start()

    def refuse(self, problems: list[str]) -> None:
        """Join the next push's agreement with ``problems`` (e.g. this rank could not load its
        weights): every rank of both jobs then raises ``RefusedError`` with them."""
        self._agree(problems or ["refused"], {})
        raise AssertionError("unreachable: the agreement raises")  # pragma: no cover

    def _step(self, tensors: Any, adopt: bool = False) -> StepStats:
        self.start()
        local, problems = collect_local(tensors)
        key = _memory_key(local)
        who = self.group.name(self._t.rank)
        problems = [f"{who}: {p}" for p in problems]
        if problems or key != self._checked:  # the memory handed last time passed these checks already
            problems += check_local(local, self._specs, who)
            problems += self._device_problems(local, who)
            self._checked = () if problems else key
        digests = {}
        if self.options.verify and self.role == "send" and not problems:
            digests = replica_digests(self.src, self.local_rank, local)
        if self._send_quant is not None:
            self._send_quant.new_push()
        if adopt and self._synced is not None:
            self._synced_ptrs = key  # the caller copied the last version's bytes here
        es = self._versioned_step(local, problems, digests, key)
        quantize_s = self._recv_quant.finish(local) if self._recv_quant is not None else 0.0
        if self._send_quant is not None:
            quantize_s = self._send_quant.seconds
        st = StepStats.of(es, step=len(self.steps), strategy=self.options.strategy, version=self._last or 0,
                          base_bytes=self._delta_state.base_bytes if self._delta_state else 0,
                          quantize_seconds=quantize_s)
        self.steps.append(st)
        return st

    def _device_problems(self, local: Mapping[str, Any], who: str) -> list[str]:
        """Device tensors on a host transport: what the stager cannot take (refused on every rank
        before any byte moves); only the reshard executor stages."""
        on_device = sorted({device_name(v) for v in local.values()} - {"cpu"})
        if self.device_ops is None and (not on_device or getattr(self._t, "device", None) is not None):
            return []
        problems = staging_problems(self._t, [local], self.device_ops)
        if problems:
            return [f"{who}: {p}" for p in problems]
        what = f"device tensors ({', '.join(on_device) or self.device_ops.name})"
        if self.options.delta:
            return [f"{who}: {what} with --delta: deltas are encoded on the host (not yet for device tensors)"]
        if self.options.strategy == "broadcast":
            return [f"{who}: {what} with --strategy broadcast: the baseline moves host memory (use reshard)"]
        return []

    def _versioned_step(self, local: Mapping[str, Any], problems: list[str], digests: Mapping[str, int],
                        ptrs: tuple[Any, ...]) -> ExecStats:
        """One push: the agreement also exchanges each rank's versions, so every rank takes the
        same decisions (the version, and in delta sessions full or delta per pair of ranks); this
        rank's version is unknown until the push completes here (verified, with verify), except a
        receiver's staged delta push, which changes nothing until it all arrived."""
        if self.role == "recv" and ptrs != self._synced_ptrs:
            self._synced = None  # other buffers: nothing says they hold the last version
        got = self._agree(problems, digests, {"proposed": self._proposed, "last": self._last, "synced": self._synced})
        version, base = self._decide(got)
        self._last = self._pushing = version
        delta = None
        if self.options.delta:
            stale = frozenset(r for r, g in enumerate(got) if base is None or g["synced"] != base)
            if self._delta_state is None:
                self._delta_state = DeltaState(threads=job_threads(self.hostnames, self._t.rank, self.group.n_send))
            ex = self._exec(local, ptrs)
            delta = DeltaPush(self._delta_state, version, stale, base, hosts=self.hostnames,
                              link_gbps=self.options.link_gbps)
            # staged (transactional) only when every message this rank receives is a delta: full
            # bytes (a stale peer, or a link where a copy beats the codec) land in place as they come
            delta.stage = (self.role == "recv" and base is not None and self._t.rank not in stale
                           and ex.receives_only_deltas(delta))
        if delta is None or not delta.stage:
            self._synced = None
        watch = getattr(self.group.control, "watch", None)  # a receiver's SenderWatch (store plane)
        if watch is not None:
            watch.in_push = True
        try:
            if self.options.strategy == "broadcast":
                es = self._baseline(local)
            else:
                es = self._exec(local, ptrs).run(delta)
        except DeltaChecksumError:
            self._synced = None  # applied, then found wrong
            raise
        finally:
            if watch is not None:
                watch.in_push = False
        self._synced, self._synced_ptrs, self._pushing = version, ptrs, None
        return es

    def _decide(self, got: list[dict[str, Any]]) -> tuple[int, int | None]:
        """(this push's version, the senders' common base version or None) from the agreement;
        a bad version is refused on every rank alike."""
        senders = got[:self.group.n_send]
        proposed = {g["proposed"] for g in senders}
        mine = [g["last"] for g in senders if g["last"] is not None]
        problems = []
        if len(proposed) > 1:
            problems.append(f"the sender ranks pushed different versions {sorted(proposed, key=str)}: pass the same "
                            "version= on every sender rank")
        version = next(iter(proposed))
        if version is None:
            version = max([g["last"] or 0 for g in got] + [g["synced"] or 0 for g in got]) + 1
        elif mine and version <= max(mine):
            problems.append(f"push(version={version}) does not follow this session's last version {max(mine)}")
        if problems:
            raise RefusedError(problems=problems)
        bases = {g["synced"] for g in senders}
        return int(version), bases.pop() if len(bases) == 1 else None

    def forget_base(self) -> None:
        """Say this rank's tensors no longer hold the last version pushed (e.g. the engine reloaded
        them): its next pull receives full bytes. Buffers other than last time's count as unknown
        without calling this."""
        self._synced = None

    def _agree(self, problems: list[str], digests: Mapping[str, int],
               state: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """One allgather: everyone's problems, replica checksums (and delta versions); raise the
        same verdict everywhere."""
        payload = json.dumps({"problems": problems, "replicas": digests, **(state or {})}).encode()
        got = [json.loads(x) for x in self._t.allgather_bytes(payload, self.timeout)]
        every: list[str] = [p for g in got for p in g["problems"]]
        if self.options.verify:
            every += replica_problems(self.src, [g["replicas"] for g in got[:self.group.n_send]], self.group.name)
        if every:
            raise RefusedError(problems=every[:200] + ([f"... and {len(every) - 200} more"] if len(every) > 200 else []))
        return got

    def _baseline(self, tensors: Mapping[str, Any]) -> ExecStats:
        """One push by the gather-broadcast baseline (``--strategy broadcast``)."""
        return gather_broadcast(Baseline(self._t, self.src, self.dst, self.plan.casts, self.group.n_send,
                                         self.group.name, self.timeout, self.options.bucket_size), tensors)

    def _exec(self, tensors: Mapping[str, Any], key: tuple[Any, ...]) -> Executor:
        # a new executor only when the caller hands other memory (``key``: ``_memory_key``):
        # ``model.state_dict()`` makes new tensor objects every call over the same storage, and
        # the views stay valid for those
        if self._executor is None or key != self._tensor_key:
            staging = self._recv_quant.staging if self._recv_quant is not None else {}
            self._executor = Executor(self._t, self.plan, self.schedule, {**tensors, **staging}, timeout=self.timeout,
                                      verify=self.options.verify, peer_names=self.group.name, quant=self._send_quant,
                                      device_ops=self.device_ops, slots=self._slots)
            self._tensor_key = key
        return self._executor

    # ------------------------------------------------------------------ after the steps
    def save(self, out_dir: str | Path, tensors: Mapping[str, Any]) -> None:
        """Receivers: write the received local tensors under ``out_dir`` (safetensors per rank,
        manifest last, with checksums). A failure on any receiver fails all of them."""
        from streamer.refit.persist import finish_save, save_local

        if self.role != "recv":
            raise UsageError("save() is for the receiving side")
        role_t = self.group.role_control
        out = Path(out_dir)
        host = {n: _host(v) for n, v in tensors.items()}
        error = ""
        sums: dict[str, str] = {}
        try:
            sums = save_local(out, self.dst, self.local_rank, host)
        except (OSError, ValueError) as e:
            error = f"{self.group.name(self._t.rank)}: saving to {out} failed: {e}"
        gathered = [json.loads(g) for g in role_t.allgather_bytes(
            json.dumps({"error": error, "sums": sums}).encode(), self.timeout)]
        errors = [g["error"] for g in gathered if g["error"]]
        if errors:
            raise TransportError(problems=errors)
        if role_t.rank == 0:
            allsums: dict[str, str] = {}
            for g in gathered:
                allsums.update(g["sums"])
            finish_save(out, self.manifest, allsums)
        role_t.barrier(self.timeout)

    def close(self, done: bool = True) -> None:
        """Leave the session. A sender job's ``close()`` (``done``; not after an error in a
        ``with`` block) ends it for good: receivers waiting in ``pull()`` get None."""
        if self._fleet is not None:
            self._fleet.close(done)
        elif done and self.role == "send":
            self.group.post_done()
        if self._replica is not None and not (self._broken or self._closed) and self.group.plane == "store":
            # a replica leaving a trainer that goes on: its next push to it ends at once, and drops
            # it; once every rank of this replica is done pulling (else the notice ends their pulls)
            try:
                self.group.role_control.barrier(self.timeout)
            except TransportError:
                pass
            self.group.leave(f"replica {self._replica} closed its session")
        self._drop_transport()
        self.group.close(self.timeout)


def _loaded(manifest: Manifest | str | Path | None, refusal: Refusal | None, checks: LocalChecks) -> Manifest | None:
    """This rank's manifest, loaded; one that does not load (or none, without a ``refusal``) is
    this rank's refusal in ``checks``: the rank joins all the same, to say so."""
    with checks.capture():
        if manifest is None and refusal is None:
            raise UsageError("RefitSession.open needs a manifest")
        return manifest if isinstance(manifest, Manifest) or manifest is None else load_manifest(manifest)
    return None


def _memory_key(tensors: Mapping[str, Any]) -> tuple[Any, ...]:
    """Which memory the caller handed in (names, kinds, addresses, shapes, strides, dtypes,
    devices), not which tensor objects: all that the local checks and the executor's views read."""
    return tuple((n, type(v), _data_ptr(v), tuple(getattr(v, "shape", ())), _strides(v), getattr(v, "dtype", None),
                  getattr(v, "device", None)) for n, v in tensors.items())


def _strides(v: Any) -> tuple[int, ...]:
    s = getattr(v, "stride", None)  # torch: a method; numpy: ``strides``
    return tuple(s()) if callable(s) else tuple(getattr(v, "strides", ()))


def _data_ptr(v: Any) -> int:
    if hasattr(v, "data_ptr"):
        return int(v.data_ptr())
    return int(v.__array_interface__["data"][0]) if hasattr(v, "__array_interface__") else 0


def _host(v: Any) -> Any:
    """Host memory for saving: GPU tensors are copied down, CPU ones are viewed."""
    dev = getattr(v, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") != "cpu":
        return v.cpu()
    return v
