"""RefitSession: plan once, push new weights every RL step over the same connection.

    # trainer rank                                   # inference rank
    s = RefitSession(train_manifest, role="send",    s = RefitSession(serve_manifest, role="recv",
                     group=connect("send"))                           group=connect("recv"))
    for step in ...:                                 for step in ...:
        s.push(local_tensors)                            s.pull(local_tensors)  # written in place

At start the two sides exchange manifests (sender rank 0 and receiver rank 0 broadcast theirs),
every rank computes the plan, and all ranks compare plan digests before any byte moves: a
trainer and a server that disagree about the model are refused with the list of mismatches.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from formats.errors import PlanError, TransportError
from formats.manifest import Manifest, dumps_manifest, loads_manifest

from .execute import DEFAULT_BUCKET, Executor, build_schedule, byte_view
from .plan import Plan, plan_transfers

__all__ = ["RefitSession", "StepStats"]


@dataclass
class StepStats:
    step: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    messages: int
    peak_buffer_bytes: int
    verified_regions: int = 0
    strategy: str = "reshard"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RefitSession:
    """One side of a refit. ``group`` comes from ``streamer.jobs.connect`` (or any object with
    ``comm``, ``n_send``, ``n_recv``, ``name``); ``transport`` defaults to MPI over ``group.comm``."""

    manifest: Manifest
    role: str
    group: Any
    transport: Any = None
    timeout: float = 300.0
    bucket_size: int = DEFAULT_BUCKET
    verify: bool = False
    strategy: str = "reshard"
    src_domain_size: int | None = None
    dst_domain_size: int | None = None
    allow_extra: bool = False
    #: pushes the CLI runs over this session; both jobs agree on the largest asked for
    planned_steps: int = 1
    steps: list[StepStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.transport is None:
            from .transport.mpi import MPITransport

            self.transport = MPITransport(self.group.comm)
        t = self.transport
        S = self.group.n_send
        # exchange manifests: sender 0 and receiver 0 broadcast theirs to everyone
        mine = dumps_manifest(self.manifest).encode()
        src_txt = t.bcast_bytes(mine if t.rank == 0 else None, 0, self.timeout)
        dst_txt = t.bcast_bytes(mine if t.rank == S else None, S, self.timeout)
        self.src = loads_manifest(src_txt, where="sender manifest")
        self.dst = loads_manifest(dst_txt, where="receiver manifest")
        problems = []
        if self.src.world_size != S:
            problems.append(f"sender manifest: world_size {self.src.world_size} but the sender job has {S} ranks")
        if self.dst.world_size != self.group.n_recv:
            problems.append(f"receiver manifest: world_size {self.dst.world_size} but the receiver job has "
                            f"{self.group.n_recv} ranks")
        if problems:
            raise PlanError(problems=problems)
        # both jobs must agree on how to move: verify if any side asks, the smallest bucket, one strategy
        import json

        cfgs = [json.loads(c) for c in t.allgather_bytes(json.dumps(
            {"verify": self.verify, "bucket": self.bucket_size, "strategy": self.strategy,
             "steps": self.planned_steps, "src_domain": self.src_domain_size,
             "dst_domain": self.dst_domain_size}).encode(), self.timeout)]
        strategies = sorted({c["strategy"] for c in cfgs})
        if len(strategies) > 1:
            raise PlanError(f"the two jobs asked for different strategies ({', '.join(strategies)}); pass the same "
                            "--strategy to both")
        self.verify = any(c["verify"] for c in cfgs)
        self.bucket_size = min(c["bucket"] for c in cfgs)
        self.planned_steps = max(c["steps"] for c in cfgs)
        for key, attr in (("src_domain", "src_domain_size"), ("dst_domain", "dst_domain_size")):
            vals = sorted({c[key] for c in cfgs if c[key] is not None})
            if len(vals) > 1:
                raise PlanError(f"the two jobs asked for different --{key.replace('_', '-')}-size values {vals}")
            setattr(self, attr, vals[0] if vals else None)
        self.plan: Plan = plan_transfers(self.src, self.dst, src_domain_size=self.src_domain_size,
                                         dst_domain_size=self.dst_domain_size, allow_extra=self.allow_extra)
        digest = self.plan.digest() + f"|bucket={self.bucket_size}"
        digests = t.allgather_bytes(digest.encode(), self.timeout)
        bad = [i for i, d in enumerate(digests) if d.decode() != digest]
        if bad:
            raise PlanError(f"ranks {bad} computed a different plan (digest mismatch): the two jobs run "
                            "different shardstream versions or read different manifests")
        # each rank orders only its own messages: a full-size plan has millions of transfers
        self.schedule = build_schedule(self.plan, self.bucket_size, self._shape_of, rank=t.rank)
        self._executor: Executor | None = None
        self._tensor_ids: tuple[int, ...] = ()

    def _shape_of(self, g: int, tensor: str, on_dst: bool) -> tuple[int, ...]:
        """Shape of local tensor ``tensor`` on global rank ``g`` (source or destination side)."""
        cache = self.__dict__.setdefault("_shapes", {})
        key = (g, on_dst)
        if key not in cache:
            if on_dst:
                cache[key] = self.dst.local_tensors(self.plan.dst_local(g))
            else:
                cache[key] = self.src.local_tensors(g)
        return tuple(cache[key][tensor].shape)

    @property
    def local_rank(self) -> int:
        return self.transport.rank if self.role == "send" else self.transport.rank - self.group.n_send

    def local_tensors(self) -> dict[str, Any]:
        """Shapes/dtypes of this rank's local tensors (from its manifest)."""
        return dict(self.manifest.local_tensors(self.local_rank))

    def _exec(self, tensors: Mapping[str, Any]) -> Executor:
        ids = tuple(id(v) for v in tensors.values())
        if self._executor is None or ids != self._tensor_ids:
            self._executor = Executor(self.transport, self.plan, self.schedule, tensors, timeout=self.timeout,
                                      verify=self.verify, peer_names=getattr(self.group, "name", None))
            self._tensor_ids = ids
        return self._executor

    def _step(self, tensors: Mapping[str, Any]) -> StepStats:
        if self.strategy == "broadcast":
            st = self._broadcast(tensors)
        else:
            es = self._exec(tensors).run()
            st = StepStats(len(self.steps), es.seconds, es.bytes_sent, es.bytes_received, es.messages,
                           es.peak_buffer_bytes, es.verified_regions)
        self.steps.append(st)
        return st

    def push(self, tensors: Mapping[str, Any]) -> StepStats:
        """Send this trainer rank's regions (``tensors``: local name -> numpy / CPU torch tensor)."""
        if self.role != "send":
            raise TransportError("push() is for the sending side; receivers call pull()")
        return self._step(tensors)

    def pull(self, tensors: Mapping[str, Any]) -> StepStats:
        """Receive into this inference rank's existing local tensors, in place."""
        if self.role != "recv":
            raise TransportError("pull() is for the receiving side; senders call push()")
        return self._step(tensors)

    # ---------------------------------------------------------- gather-broadcast baseline
    def _broadcast(self, tensors: Mapping[str, Any]) -> StepStats:
        """The baseline refit: sender 0 gathers every whole array, then broadcasts whole arrays in
        packed buckets to every receiver (NeMo RL's packed broadcast). Receivers keep the regions
        they hold."""
        from mpi4py import MPI

        from .transport.base import wait_all
        from .transport.mpi import _Req

        comm = self.group.comm
        S = self.group.n_send
        rank = comm.Get_rank()
        if not hasattr(self, "_bcomm"):
            self._bcomm = comm.Split(0 if (rank == 0 or rank >= S) else MPI.UNDEFINED, rank)
        views = {n: byte_view(v) for n, v in tensors.items()}
        t0 = time.perf_counter()
        sent = recvd = msgs = 0
        peak = 0
        # 1. gather to global rank 0, array by array
        reqs = []
        if rank == 0:
            bufs: dict[str, np.ndarray] = {}
        for fqn, a in self.src.arrays.items():
            if fqn not in self.dst.arrays:
                continue
            isz = a.dtype.itemsize
            if rank == 0:
                full = np.empty(a.shape + (isz,), dtype=np.uint8)
                bufs[fqn] = full
            for ci, c in enumerate(a.chunks):
                owner = c.holders[0]
                sl = c.region.slices
                lsl = c.local_box.slices
                if rank == 0 and 0 in c.holders:
                    full[sl] = views[c.tensor(fqn)][lsl]
                elif rank == 0:
                    tmp = np.empty(c.region.sizes + (isz,), dtype=np.uint8)
                    reqs.append((_Req(comm.Irecv([tmp.reshape(-1), MPI.BYTE], source=owner, tag=11), "recv", owner),
                                 fqn, sl, tmp))
                elif rank == owner and 0 not in c.holders:
                    data = np.ascontiguousarray(views[c.tensor(fqn)][lsl])
                    reqs.append((_Req(comm.Isend([data.reshape(-1), MPI.BYTE], dest=0, tag=11), "send", 0), fqn, sl,
                                 data))
                    sent += data.nbytes
        wait_all([r for r, *_ in reqs], self.timeout, "gather", names=self.group.name)
        if rank == 0:
            for r, fqn, sl, tmp in reqs:
                if r.kind == "recv":
                    bufs[fqn][sl] = tmp
                    recvd += tmp.nbytes
        # 2. broadcast whole arrays in packed buckets to every receiver
        if self._bcomm != MPI.COMM_NULL:
            names = [f for f in self.dst.arrays]
            i = 0
            while i < len(names):
                group = []
                size = 0
                while i < len(names) and (not group or size + self.dst.arrays[names[i]].nbytes <= self.bucket_size):
                    group.append(names[i])
                    size += self.dst.arrays[names[i]].nbytes
                    i += 1
                buf = np.empty(size, dtype=np.uint8)
                peak = max(peak, size)
                if rank == 0:
                    off = 0
                    for f in group:
                        n = self.dst.arrays[f].nbytes
                        buf[off:off + n] = bufs[f].reshape(-1)
                        off += n
                    sent += size * (self._bcomm.Get_size() - 1)
                req = self._bcomm.Ibcast([buf, MPI.BYTE], root=0)
                wait_all([_Req(req, "collective", -1)], self.timeout, "broadcast", names=lambda _p: "the broadcast group")
                msgs += 1
                if rank >= S:
                    recvd += size
                    off = 0
                    for f in group:
                        a = self.dst.arrays[f]
                        n = a.nbytes
                        full = buf[off:off + n].reshape(a.shape + (a.dtype.itemsize,))
                        for c in a.chunks:
                            if rank - S in c.holders:
                                sl = c.region.slices
                                lsl = c.local_box.slices
                                views[c.tensor(f)][lsl] = full[sl]
                        off += n
        if rank == 0:
            peak += sum(b.nbytes for b in bufs.values())
        return StepStats(len(self.steps), time.perf_counter() - t0, sent, recvd, msgs, peak, 0, "broadcast")

    def close(self) -> None:
        self._executor = None
