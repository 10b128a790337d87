"""RefitSession: plan once, push new weights every RL step over the same connection.

    # trainer rank (torchrun or mpiexec)             # inference rank
    with RefitSession.open(train_manifest, "send",  with RefitSession.open(serve_manifest, "recv",
                           rendezvous="rv.txt",                            rendezvous="rv.txt",
                           transport="gloo") as s:                         transport="gloo") as s:
        for step in ...:                                for step in ...:
            s.push(model)  # DTensors: local shards         s.pull(local_tensors)  # in place

``open`` is the one collective entry point: it joins the two jobs (``jobs.connect``), builds the
transport, exchanges manifests (sender rank 0 and receiver rank 0 broadcast their compact form),
agrees on options, and compares the digests of the inputs (both manifests, the plan-affecting
options, the planner's version) on every rank before any byte moves: ranks that disagree are
refused, naming what differs. Each rank then plans on its own, with no communication, and expands
only its own transfers (``streamer.refit.rankstart``). Constructing the object does no communication.

Every push starts with one small agreement round: each rank checks what it was handed (names,
dtypes, shapes; with ``verify``, the checksums of replicated regions) and all ranks exchange
their findings. A refusal anywhere is then raised on every rank of both jobs with the same
message, before any byte moves, so receivers are never left half-updated by a refused push.

Quantize on refit (``streamer.execute.quant``): an FP8 destination array with a scale sibling, fed
from a bf16/fp32 trainer array, is quantized by the senders when their shards are whole blocks,
else by the receivers after the push (``fp8_block``, ``ue8m0``: the scheme, agreed by both jobs).

Delta sessions (``delta=True``) number their pushes. The agreement round also carries each rank's
version (the last push it completed, or unknown), so every rank takes the same decision: a pair
of ranks at the previous version exchanges encoded changes (``streamer.execute.delta``); any other pair
moves full bytes, which the sender keeps as its next base.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from formats.errors import PlanError, TransportError, UsageError, ValidationError
from formats.manifest import (
    COMPACT_FORMAT_VERSION,
    Manifest,
    dumps_manifest,
    load_manifest,
    loads_manifest,
    without_checksums,
)
from streamer.execute.delta import DeltaPush, DeltaState
from streamer.execute.executor import ExecStats, Executor, bucket_slots
from streamer.execute.quant import ReceiverQuant, RefitQuant, SenderQuant, refit_quant, refit_quant_report
from streamer.execute.schedule import SCHEDULE_VERSION
from streamer.execute.staging import device_name, staging_problems
from streamer.ops.agree import AgreedRefusal, LocalChecks, Refusal
from streamer.ops.agree import agree as agree_refusals
from streamer.ops.quant import FP8_BLOCK
from streamer.plan.gcpause import paused_gc
from streamer.refit.baseline import Baseline, gather_broadcast
from streamer.refit.local import check_local, collect_local
from streamer.refit.options import RefitOptions, agree
from streamer.refit.rankstart import input_digests, input_problems, plan_own
from streamer.refit.replicas import replica_digests, replica_problems
from streamer.transport.base import Transport
from streamer.transport.jobs import Group, connect

__all__ = ["RefitOptions", "RefitSession", "RefusedError", "StepStats", "make_transport", "transport_kind"]

TRANSPORTS = ("mpi", "gloo", "nccl", "shm", "cuda-ipc")


class RefusedError(ValidationError):
    """A push refused by the agreement round: raised on every rank with the same problems."""


@dataclass
class StepStats(ExecStats):
    """One push or pull on this rank: the executor's figures (``ExecStats``) plus the session's."""

    #: the push's index in this session (0, 1, ...)
    step: int = 0
    strategy: str = "reshard"
    #: the push's number in its session (1, 2, ...); delta sessions only, else 0
    version: int = 0
    #: of the elements this rank sent as deltas, the fraction that changed (None: no delta sent)
    changed_fraction: float | None = None
    #: this rank's copy of the bytes it last sent (the memory price of delta)
    base_bytes: int = 0
    #: seconds this rank spent quantizing FP8 weights (senders while packing, receivers after)
    quantize_seconds: float = 0.0

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


def make_transport(kind: str | Transport | None, group: Group, timeout: float) -> Transport:
    """The transport named ``kind`` over ``group`` (default: mpi on the MPI plane, else gloo)."""
    if kind is not None and not isinstance(kind, str):
        return kind
    kind = transport_kind(kind, group)
    if kind == "mpi":
        return group.control
    if kind in ("shm", "cuda-ipc"):  # colocated ranks: one-sided copies (transport/handles.py)
        from streamer.transport.colocated import open_handle_transport

        return open_handle_transport(kind, group, timeout)
    from streamer.transport.torch_dist import TorchDistTransport

    return TorchDistTransport(group.control, kind, store=group.store, timeout=timeout)


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
    """One side of a refit. Use ``RefitSession.open``; ``group`` comes from ``jobs.connect``."""

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
        # delta sessions: the last version pushed here, and the one this rank's tensors (and,
        # when it sends, its bases) are known to hold -- None when unknown (never pushed, new
        # buffers handed in, or a push that failed half-way)
        self._attempted = 0
        self._synced: int | None = None
        self._synced_ptrs: tuple[Any, ...] = ()
        self._delta_state: DeltaState | None = None
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
             choose_manifest: Callable[[Manifest], Manifest] | None = None) -> RefitSession:
        """Join the refit as ``role`` ("send" or "recv") and plan it: the one collective entry point.

        ``transport``: "mpi" (default under mpiexec), "gloo" (default otherwise), "nccl", "shm" or
        "cuda-ipc" (every rank on one node), or a ``Transport``. ``control``: "auto", "mpi" or
        "store" (see ``jobs.connect``). ``options``: how to move (``RefitOptions``; the two jobs
        agree on them). ``device_ops``: what stages device tensors on a host transport (tests).

        Bad input on one rank ends every rank of both jobs with the same verdict (``AgreedRefusal``,
        ``ops.agree``): a manifest that does not load here, ``refusal`` (what the caller's own
        checks refused), and ``prepare(group)`` (checks that need the group, e.g. the receivers'
        output directory) are agreed on before any other wait; ``announce`` gets a launch's verdict
        as soon as its own ranks know it (see ``jobs.connect``). ``manifest`` may be None only with
        a ``refusal`` (the caller could not load it). ``choose_manifest`` (receivers): this job's
        manifest, picked from the sender's (the field).
        """
        t0 = time.perf_counter()
        checks = LocalChecks(refusal)
        m: Manifest | None = None
        with checks.capture():  # a rank whose manifest does not load still joins, to say so
            if manifest is None and refusal is None:
                raise UsageError("RefitSession.open needs a manifest")
            m = manifest if isinstance(manifest, Manifest) or manifest is None else load_manifest(manifest)
        if group is None:
            group = connect(role, rendezvous=rendezvous, timeout=timeout, control=control, refusal=checks.refusal,
                            announce=announce)
            checks = LocalChecks()  # the group's formation carried the refusal
        try:
            kind = _agree_transport(group, transport, timeout, checks, prepare)
            assert m is not None  # a rank without its manifest refused above, on every rank
            session = cls(m, role, group, make_transport(kind, group, timeout), timeout, options or RefitOptions(),
                          device_ops, choose_manifest)
            session.start()
            session.open_seconds = time.perf_counter() - t0
        except (AgreedRefusal, PlanError, UsageError):
            group.close(timeout)  # every rank holds this verdict: they sign off together
            raise
        return session

    def __enter__(self) -> RefitSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Exchange manifests and options, agree on the inputs, and plan this rank's part."""
        if self._started:
            return
        if self.transport is None:
            self.transport = make_transport(None, self.group, self.timeout)
        with paused_gc():  # a full-size plan: ~10^6 long-lived objects (see streamer.plan.gcpause)
            self._plan_start()
        self._start_quant()
        self._started = True

    def _plan_start(self) -> None:
        self.src, self.dst = self._exchange_manifests()
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
        cfgs = [json.loads(c) for c in self._t.allgather_bytes(json.dumps(
            {"options": o.wire(), "host": host, "inputs": inputs}).encode(), self.timeout)]
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

    def push(self, tensors: Any) -> StepStats:
        """Send this trainer rank's regions. ``tensors``: a state dict (DTensors send their local
        shard, never gathered; plain tensors; numpy arrays) or an ``nn.Module``."""
        if self.role != "send":
            raise UsageError("push() is for the sending side; receivers call pull()")
        return self._step(tensors)

    def pull(self, tensors: Any) -> StepStats:
        """Receive into this inference rank's existing local tensors, in place."""
        if self.role != "recv":
            raise UsageError("pull() is for the receiving side; senders call push()")
        return self._step(tensors)

    def refuse(self, problems: list[str]) -> None:
        """Join the next push's agreement with ``problems`` (e.g. this rank could not load its
        weights): every rank of both jobs then raises ``RefusedError`` with them."""
        self._agree(problems or ["refused"], {})
        raise AssertionError("unreachable: the agreement raises")  # pragma: no cover

    def _step(self, tensors: Any) -> StepStats:
        self.start()
        local, problems = collect_local(tensors)
        who = self.group.name(self._t.rank)
        problems = [f"{who}: {p}" for p in problems]
        problems += check_local(local, self._specs, who)
        problems += self._device_problems(local, who)
        digests = {}
        if self.options.verify and self.role == "send" and not problems:
            digests = replica_digests(self.src, self.local_rank, local)
        if self._send_quant is not None:
            self._send_quant.new_push()
        if not self.options.delta:
            self._agree(problems, digests)
            es = self._baseline(local) if self.options.strategy == "broadcast" else self._exec(local).run()
        else:
            es = self._delta_step(local, problems, digests)
        quantize_s = self._recv_quant.finish(local) if self._recv_quant is not None else 0.0
        if self._send_quant is not None:
            quantize_s = self._send_quant.seconds
        st = StepStats.of(es, step=len(self.steps), strategy=self.options.strategy,
                          version=self._attempted if self.options.delta else 0,
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

    def _delta_step(self, local: Mapping[str, Any], problems: list[str], digests: Mapping[str, int]) -> ExecStats:
        """A delta push: the agreement also exchanges each rank's version, so every rank takes the
        same full-or-delta decision per pair of ranks; this rank's version is unknown until the
        push completes here (verified, with verify)."""
        ptrs = _memory_key(local)
        if self.role == "recv" and ptrs != self._synced_ptrs:
            self._synced = None  # other buffers: nothing says they hold the last version
        got = self._agree(problems, digests, {"attempted": self._attempted, "synced": self._synced})
        version = max(g["attempted"] for g in got) + 1
        stale = frozenset(r for r, g in enumerate(got) if g["synced"] != version - 1)
        self._attempted, self._synced = version, None
        if self._delta_state is None:
            self._delta_state = DeltaState()
        es = self._exec(local).run(DeltaPush(self._delta_state, version, stale))
        self._synced, self._synced_ptrs = version, ptrs
        return es

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

    def _exec(self, tensors: Mapping[str, Any]) -> Executor:
        # a new executor only when the caller hands other memory: ``model.state_dict()`` makes new
        # tensor objects every call over the same storage, and the views stay valid for those
        key = _memory_key(tensors)
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

    def close(self) -> None:
        self._executor = None
        self._slots = []  # bucket buffers may be transport memory (shm segments): released before it closes
        t = self.transport
        if t is not None and t is not self.group.control:
            t.close()
        self.group.close(self.timeout)


def _memory_key(tensors: Mapping[str, Any]) -> tuple[Any, ...]:
    """Which memory the caller handed in (names, addresses, shapes), not which tensor objects."""
    return tuple((n, _data_ptr(v), tuple(v.shape)) for n, v in tensors.items())


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
