"""Run a plan over a Transport: buckets, pack/unpack, a bounded window of messages in flight.

Schedule. The plan's transfers between each (phase, sender, receiver) pair are cut into
messages of at most ``bucket_size`` bytes (a transfer larger than a bucket is split into
row-major slabs). All ranks order all messages the same way: phase, bucket index, then a
rotation over peers so that at each step every sender talks to a different receiver.

Window. Each rank posts its own messages in that global order with at most ``window`` (2) in
flight, so extra memory stays at two buckets per rank. This cannot deadlock: the globally
earliest unfinished message is always the earliest unfinished one of both its ranks, so both
post it. A phase-2 forward is posted only after the forwarding rank received all its phase-1
messages (which come earlier in the order).

In place. A message that is one contiguous region is sent from, or received into, the local
tensor itself; others are packed once into a bucket buffer.

Device tensors on a host transport (MPI, gloo) travel through ``streamer.execute.staging``: every
message goes through a slot (device bucket + pinned host bucket), packed on the device.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from formats.errors import PeerTimeoutError, TransportError, UsageError
from formats.manifest.box import Box
from formats.manifest.dtypes import DTYPES
from streamer.execute.delta import (
    ENCODINGS,
    RAW,
    SAME,
    DeltaChecksumError,
    DeltaPush,
    DeltaRecv,
    DeltaSend,
    decode_into,
    encode,
    host_array,
    xor_scan,
)
from streamer.execute.schedule import Message, build_schedule, is_contiguous
from streamer.execute.staging import Part, Program, Stager, build_program, device_ops_for
from streamer.ops.buffers import (
    _copy,
    _copy_host,
    _xor_into,
    byte_view,
    host_bytes,
    region_view,
    torch_byte_view,
)
from streamer.ops.cast import cast_into
from streamer.ops.cast_view import cast_view
from streamer.ops.device_ops import DeviceOps
from streamer.plan.forwards import forward_sources
from streamer.plan.model import Plan, Transfer
from streamer.transport.base import ABORT_POLL_INTERVAL, Request, Transport

if TYPE_CHECKING:
    from streamer.execute.quant import SenderQuant

__all__ = ["DEFAULT_BUCKET", "ExecStats", "Executor", "Message", "build_schedule", "byte_view", "host_bytes",
           "region_view", "torch_byte_view"]

DEFAULT_BUCKET = 256 << 20
_DIGEST_TAG = 7


#: messages one rank keeps in flight (packed ones are further limited by the bucket slots)
MAX_INFLIGHT = 8
#: longest nap between two polls of the requests in flight (seconds): MPI shared-memory transfers
#: progress only while a rank polls, so long naps stall them; zero spins and starves
#: oversubscribed ranks (A/B on 8 ranks / 2 cores: 1e-3 s mean 0.074 s a push, 5e-5 s 0.062 s)
MAX_POLL_SLEEP = 1e-4


def _poll_sleep() -> float:
    """``MAX_POLL_SLEEP``, or ``$SHARDSTREAM_POLL_SLEEP`` (seconds) when set."""
    text = os.environ.get("SHARDSTREAM_POLL_SLEEP")
    if text is None:
        return MAX_POLL_SLEEP
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v <= 1:
        raise UsageError(f"SHARDSTREAM_POLL_SLEEP={text!r}: expected seconds between 0 and 1")
    return v


def bucket_slots(transport: Transport, schedule: Sequence[Message], *, window: int = 2) -> list[Any]:
    """The bucket buffers this rank packs its messages into, allocated once and written once, so
    that their page faults happen here (``RefitSession.open``) and not during the first push."""
    rank = transport.rank
    mine = [m for m in schedule if m.src == rank or m.dst == rank]
    bucket = max((m.nbytes for m in mine), default=0)
    slots = [transport.alloc(bucket) for _ in range(min(max(1, window), len(mine)))]
    for s in slots:
        s.zero_() if hasattr(s, "zero_") else s.fill(0)
    return slots


@dataclass
class ExecStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    local_copies: int = 0
    seconds: float = 0.0
    peak_buffer_bytes: int = 0
    verified_regions: int = 0
    #: destination-sized bytes this rank cast while packing (fp32 masters -> bf16, ...)
    cast_bytes: int = 0
    #: what the messages would have carried un-encoded (equal to bytes_sent/received without delta)
    full_bytes_sent: int = 0
    full_bytes_received: int = 0
    #: delta pushes: elements in the messages sent as deltas, and how many of them changed
    delta_elements: int = 0
    changed_elements: int = 0
    #: CPU seconds this rank spent encoding / decoding deltas, its codec threads included
    #: (``time.process_time``: ranks sharing cores still measure what the codec costs)
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    verify_seconds: float = 0.0
    #: delta messages per encoding ("same", "sparse", "zstd", "zstd-frames", "raw")
    encodings: dict[str, int] = field(default_factory=dict)
    #: device tensors on a host transport: bytes copied between the device and the pinned buckets
    staged_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Active:
    msg: Message
    req: Any
    buf: np.ndarray | None
    is_recv: bool
    slot: int = -1


@dataclass
class _Run:
    """The state of one push: its stats, messages in flight, uids received, bucket bytes in use."""

    st: ExecStats
    active: list[_Active] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    in_use: int = 0
    problems: list[str] = field(default_factory=list)
    #: a transactional delta push: RAW payloads (message, encoding, payload), applied once all
    #: arrived; and the XOR deltas applied on arrival, kept to undo them if the push breaks off
    staged: list[tuple[Message, int, Any]] = field(default_factory=list)
    applied: list[tuple[Message, int, Any]] = field(default_factory=list)


class Executor:
    """Executes the part of a plan that concerns ``transport.rank``.

    ``tensors`` maps local tensor names to buffers (numpy or CPU torch): the sources on sending
    ranks, the destinations (written in place) on receiving ranks. ``dst_tensors``, when given,
    holds the destination buffers separately (a same-job reshard, where one process is both a
    source and a destination and the two layouts may use the same local names). ``quant``, on a
    sending rank, packs the FP8 bytes and scales of weights quantized on the sender
    (``quant_refit``).

    Device tensors (CUDA, or any kind ``device_ops`` stands for) over a host transport are staged
    through pinned host buckets (``streamer.execute.staging``); NCCL moves them directly.
    """

    def __init__(self, transport: Transport, plan: Plan, schedule: Sequence[Message],
                 tensors: Mapping[str, Any], *, timeout: float = 300.0, window: int = 2,
                 verify: bool = False, peer_names: Any = None,
                 dst_tensors: Mapping[str, Any] | None = None, quant: SenderQuant | None = None,
                 device_ops: DeviceOps | None = None, slots: Sequence[Any] | None = None) -> None:
        self.t = transport
        self.quant = quant
        self.plan = plan
        self.rank = transport.rank
        self.timeout = timeout
        self.window = max(1, window)
        self.verify = verify
        self.peer_names = peer_names
        self.casts: Mapping[str, tuple[str, str]] = plan.casts
        ops = device_ops_for(transport, [tensors, dst_tensors or {}], device_ops, self.rank)
        # buffers of the transport's own kind: numpy for MPI, torch (maybe on a GPU) for gloo/NCCL;
        # staged device tensors are viewed on their device
        view = transport.byte_view if ops is None else torch_byte_view
        self.src_views = {name: view(x) for name, x in tensors.items()}
        self.dst_views = self.src_views if dst_tensors is None else {n: view(x) for n, x in dst_tensors.items()}
        self.mine = [m for m in schedule if m.src == self.rank or m.dst == self.rank]
        # phase-0 copies exist only in a same-job reshard: skip the pass over the plan otherwise
        self.local = ([t for t in plan.transfers_of(self.rank) if t.phase == 0 and t.dst_rank == self.rank]
                      if plan.same_job else [])
        bucket = max((m.nbytes for m in self.mine), default=0)
        # at most `window` bucket buffers, allocated once and reused every push
        nslots = min(self.window, len(self.mine))
        self._stager = None if ops is None else Stager(ops, transport, nslots, bucket)
        self._programs: dict[tuple[int, bool], Program] = {}
        # ``slots``: made at open (``bucket_slots``), already faulted in
        usable = slots is not None and len(slots) >= nslots and all(int(s.nbytes) >= bucket for s in slots)
        self._slots = ([] if ops is not None else list(slots)[:nslots] if slots is not None and usable
                       else [transport.alloc(bucket) for _ in range(nslots)])
        self._free = list(range(nslots))  # staged: one message per slot
        # host: the slots are arenas that packed messages share (a bump offset each, reset when the
        # last message in it completes), so that small packed messages do not hold a whole bucket
        self._arena_off = [0] * len(self._slots)
        self._arena_refs = [0] * len(self._slots)
        self._arena_cur = 0
        # zero-copy views of each message's contiguous end, kept across pushes (same tensors)
        self._inplace_views: dict[tuple[int, bool], Any] = {}
        self._region_views: dict[tuple[int, bool], list[Any]] = {}  # see _regions
        self._check_tensors()

    def _check_tensors(self) -> None:
        problems = []
        need: dict[str, Box] = {}
        for m in self.mine:
            for tr in m.transfers:
                if m.src == self.rank and self._quantizes(tr):
                    assert self.quant is not None
                    name, box, isz = self.quant.source(tr)
                    views = self.src_views
                elif m.src == self.rank:
                    name, box, isz = tr.src_tensor, tr.src_box, self._src_itemsize(tr)
                    views = self.dst_views if tr.phase == 2 else self.src_views
                else:
                    name, box, isz = tr.dst_tensor, tr.dst_box, tr.itemsize
                    views = self.dst_views
                v = views.get(name)
                if v is None:
                    if name not in need:
                        problems.append(f"rank {self.rank}: local tensor {name!r} (for {tr.fqn}) was not provided")
                    need[name] = box
                    continue
                if v.shape[-1] != isz or not box.fits_in(v.shape[:-1]):
                    problems.append(f"rank {self.rank}: local tensor {name!r} has shape {list(v.shape[:-1])} "
                                    f"x {v.shape[-1]} B, too small for {tr.fqn} region at {list(box.offsets)} "
                                    f"size {list(box.sizes)} x {isz} B")
        if problems:
            from formats.errors import ValidationError

            raise ValidationError(problems=sorted(set(problems))[:50])

    # -- packing
    def _region(self, name: str, box: Box, dst: bool) -> Any:
        v = (self.dst_views if dst else self.src_views)[name]
        return v[box.slices] if box.ndim else v

    def _src(self, tr: Transfer) -> Any:
        # phase-2 forwards read what the forwarder received into its destination tensors
        return self._region(tr.src_tensor, tr.src_box, tr.phase == 2)

    def _cast_of(self, tr: Transfer) -> tuple[str, str] | None:
        """(source, destination) data_type when this transfer reads source-typed bytes to cast."""
        return self.casts.get(tr.fqn) if tr.phase != 2 else None

    def _quantizes(self, tr: Transfer) -> bool:
        """Whether this rank quantizes ``tr``'s bytes while packing them (``quant_refit``)."""
        return self.quant is not None and self.quant.handles(tr)

    def _src_itemsize(self, tr: Transfer) -> int:
        cast = self._cast_of(tr)
        return DTYPES[cast[0]].itemsize if cast else tr.itemsize

    def _src_bytes(self, tr: Transfer) -> Any:
        """What goes on the wire for ``tr``: the source region, cast to the destination's type
        (or quantized)."""
        if self._quantizes(tr):
            assert self.quant is not None
            return self.quant.wire(tr, self.src_views)
        cast = self._cast_of(tr)
        return self._src(tr) if cast is None else cast_view(self._src(tr), *cast)

    def _dst(self, tr: Transfer) -> Any:
        return self._region(tr.dst_tensor, tr.dst_box, True)

    def _regions(self, m: Message, send: bool) -> list[tuple[Any, int, int, tuple[int, ...], Any, Transfer]]:
        """(region of this rank's tensors or None when quantized, offset in the message, bytes,
        shape, cast, transfer) per transfer of ``m`` on this side: computed at its first push and
        kept, as the views stay valid for this executor's tensors."""
        key = (m.uid, send)
        got = self._region_views.get(key)
        if got is None:
            got, off = [], 0
            for tr in m.transfers:
                view = (None if self._quantizes(tr) else self._src(tr)) if send else self._dst(tr)
                got.append((view, off, tr.nbytes, tr.region.sizes + (tr.itemsize,),
                            self._cast_of(tr) if send else None, tr))
                off += tr.nbytes
            self._region_views[key] = got
        return got

    def _pack(self, m: Message, buf: np.ndarray) -> int:
        """Pack ``m``'s regions into ``buf``; return the bytes that were cast on the way."""
        cast_bytes = 0
        for view, off, n, shape, cast, tr in self._regions(m, True):
            dst = buf[off:off + n].reshape(shape)
            if view is None:  # quantized while packing
                assert self.quant is not None
                self.quant.pack(tr, dst, self.src_views)
            elif cast is None:
                _copy(dst, view)
            else:  # straight into the bucket, one pass
                cast_into(dst, view, *cast)
                cast_bytes += n
        return cast_bytes

    def _unpack(self, m: Message, buf: np.ndarray, apply: Any = _copy) -> None:
        for view, off, n, shape, _, _ in self._regions(m, False):
            apply(view, buf[off:off + n].reshape(shape))

    # -- delta messages (a delta session; see streamer/delta.py)
    def _delta_send(self, m: Message, buf: Any, delta: DeltaPush, st: ExecStats) -> DeltaSend:
        """``buf`` holds the packed new bytes: XOR them with the base, keep them as the next base,
        and encode the change in ``buf``."""
        t0 = time.process_time()
        new = host_array(buf)
        base = delta.state.bases.get(m.uid)
        if base is None:  # is_delta promised the previous push recorded it
            raise UsageError(f"rank {self.rank}: no base for a delta to rank {m.dst} (a bug: please report)")
        x = delta.state.xor_buffer(m.nbytes)
        elements, changed = xor_scan(new, base, x, [(tr.nbytes, tr.itemsize) for tr in m.transfers], delta.state.threads)
        st.changed_elements += elements
        st.delta_elements += sum(tr.nbytes // tr.itemsize for tr in m.transfers)
        enc, n = encode(x, new, changed=changed, link_gbps=delta.link(m.src, m.dst), threads=delta.state.threads)
        st.encodings[ENCODINGS[enc]] = st.encodings.get(ENCODINGS[enc], 0) + 1
        st.encode_seconds += time.process_time() - t0
        assert delta.base is not None  # is_delta
        return DeltaSend(self.t, m, enc, buf[:n], delta.version, delta.base)

    def _keep_base(self, m: Message, buf: Any, delta: DeltaPush) -> None:
        """A full message of a delta session: what it carries is the base of the next delta."""
        delta.state.base(m.uid, m.nbytes)[:] = host_array(buf).reshape(-1)

    def _delta_check(self, m: Message, r: DeltaRecv, delta: DeltaPush, st: ExecStats) -> str:
        """What is wrong with a received delta's header ("" when nothing); counts its encoding."""
        enc = r.encoding
        name = ENCODINGS[enc] if enc < len(ENCODINGS) else "unknown"
        st.encodings[name] = st.encodings.get(name, 0) + 1
        if r.versions != (delta.version, delta.base):
            return f"carries version {r.versions[0]} over base {r.versions[1]}, expected {delta.version} over " \
                   f"{delta.base}"
        if int(r.hdr[1]) != r.payload.shape[0]:
            return f"announces {int(r.hdr[1])} bytes for a {m.nbytes}-byte message"
        return ""

    def _delta_apply(self, m: Message, enc: int, payload: Any, delta: DeltaPush, st: ExecStats) -> str:
        """Decode a delta message and apply it to this rank's tensors ("" or what went wrong)."""
        t0 = time.process_time()
        why = ""
        if enc == RAW:  # the new bytes themselves; a staged payload is a host copy (numpy)
            self._unpack(m, host_array(payload), _copy_host)
        elif enc != SAME:
            x = delta.state.xor_buffer(m.nbytes)
            try:
                decode_into(enc, host_array(payload), x, delta.state.threads)
            except ValueError as e:
                why = f"does not decode ({e})"
            else:
                self._unpack(m, x, _xor_into)
        st.decode_seconds += time.process_time() - t0
        return why

    def _delta_recv(self, m: Message, r: DeltaRecv, delta: DeltaPush, run: _Run) -> None:
        """A delta arrived: apply it now. In a transactional push (``delta.stage``) keep a copy of
        its payload (its bucket slot is reused): an XOR delta is its own inverse, so one applied
        on arrival can be undone if the push breaks off; a RAW one overwrites, so it waits until
        every message of the push arrived. Decoding on arrival overlaps with the senders' encoding."""
        why = self._delta_check(m, r, delta, run.st)
        if not why and delta.stage:
            t0 = time.process_time()
            kept = (m, r.encoding, host_array(r.payload).copy())
            run.st.decode_seconds += time.process_time() - t0
            if r.encoding == RAW:
                run.staged.append(kept)
                return
            why = self._delta_apply(m, r.encoding, kept[2], delta, run.st)
            if not why:
                run.applied.append(kept)
        else:
            why = why or self._delta_apply(m, r.encoding, r.payload, delta, run.st)
        run.problems += self._delta_problems(m, why)

    def _undo(self, run: _Run, delta: DeltaPush) -> None:
        """Apply the deltas applied so far once more: XOR twice is the identity, so this rank's
        tensors hold the push's base again. Should that fail, the base is unknown: raised as a
        ``DeltaChecksumError``, which sends the next push full bytes."""
        try:
            for m, enc, payload in reversed(run.applied):
                why = self._delta_apply(m, enc, payload, delta, run.st)
                if why:
                    raise ValueError(why)
        except Exception as e:
            raise DeltaChecksumError(problems=[f"rank {self.rank}: a push broke off and undoing its applied deltas "
                                               f"failed ({e}): the next push sends full bytes"]) from e
        finally:
            run.applied.clear()

    def _delta_problems(self, m: Message, why: str) -> list[str]:
        return [f"{tr.fqn}: region {tr.region} received by rank {self.rank} from rank {m.src}: the delta {why}"
                for tr in m.transfers] if why else []

    def _apply_staged(self, run: _Run, delta: DeltaPush) -> None:
        """A staged push: every message arrived and its header checked: apply them all."""
        for m, enc, payload in run.staged:
            run.problems += self._delta_problems(m, self._delta_apply(m, enc, payload, delta, run.st))
        run.staged.clear()

    @property
    def forwards(self) -> bool:
        """Whether this rank forwards bytes it receives (phase 2): they must land before it sends."""
        return any(m.phase == 2 and m.src == self.rank for m in self.mine)

    def receives_only_deltas(self, delta: DeltaPush) -> bool:
        """Whether every message this rank receives in ``delta``'s push is a delta and it forwards
        nothing: only then can the push be staged and applied once it arrived whole."""
        return not self.forwards and all(delta.is_delta(m.src, m.dst) for m in self.mine if m.dst == self.rank)

    def _inplace(self, m: Message, send: bool) -> Any:
        if len(m.transfers) != 1:
            return None
        tr = m.transfers[0]
        if send and (self._cast_of(tr) is not None or self._quantizes(tr)):
            return None  # cast or quantized while packing: the wire carries other bytes than the tensor
        name, box = (tr.src_tensor, tr.src_box) if send else (tr.dst_tensor, tr.dst_box)
        on_dst = (not send) or tr.phase == 2
        v = (self.dst_views if on_dst else self.src_views)[name]
        if not is_contiguous(box, v.shape[:-1]):
            return None
        r = self._region(name, box, on_dst)
        if isinstance(r, np.ndarray):
            return r.reshape(-1)
        try:
            return r.view(-1)  # a view or nothing: never a silent copy we would receive into
        except RuntimeError:
            return None

    # -- main loop
    def run(self, delta: DeltaPush | None = None) -> ExecStats:
        """One push. With ``delta`` (a delta session), messages between ranks at the previous
        version travel as encoded deltas through the bucket slots; the others travel full, and
        what senders send is kept as their next base."""
        run = _Run(ExecStats())
        t0 = time.perf_counter()
        self._local_copies(run.st)
        staged0 = self._begin_staging(delta)  # after the local copies: forwards may read their bytes
        try:
            self._drive(run, delta)
        except BaseException:
            if run.applied:  # a transactional push broke off: back to its base
                assert delta is not None
                self._undo(run, delta)
            raise
        st = run.st
        undone = bool(run.applied and run.problems)
        if undone:  # a bad header or a delta that did not decode: back to the base
            assert delta is not None
            self._undo(run, delta)
        if delta is not None and delta.stage and not run.problems:
            self._apply_staged(run, delta)
        run.applied.clear()
        if self._stager is not None:
            st.staged_bytes = self._stager.staged_bytes - staged0
        if self.verify:
            t1 = time.perf_counter()
            # the digests cross the wire: exchanged even after an undo, whose regions hold the base
            st.verified_regions, bad = self._verify()
            run.problems += [] if undone else bad
            st.verify_seconds = time.perf_counter() - t1
        st.seconds = time.perf_counter() - t0
        if run.problems:
            # after a delta push a wrong region is wrong data (exit 1), else a transport failure
            raise (TransportError if delta is None else DeltaChecksumError)(problems=run.problems)
        return st

    def _drive(self, run: _Run, delta: DeltaPush | None) -> None:
        """Post this rank's messages in order and complete them as they finish (the push's loop)."""
        i = 0
        last = time.monotonic()
        sleep = 0.0
        # zero-copy messages cost no buffer: more of them may be in flight than there are bucket
        # slots, so large contiguous regions overlap with the packed ones (memory stays bounded
        # by the slots)
        max_inflight = max(self.window, MAX_INFLIGHT)
        nap = _poll_sleep()
        next_abort_poll = last + ABORT_POLL_INTERVAL
        while i < len(self.mine) or run.active:
            while len(run.active) < max_inflight and i < len(self.mine) and self._post(self.mine[i], run, delta):
                i += 1
            progressed = False
            for a in list(run.active):
                if a.req.test():
                    self._complete(a, run, delta)
                    progressed = True
            now = time.monotonic()
            if progressed:
                last = now
                sleep = 0.0
                continue
            if now > next_abort_poll:  # another rank may have given up: end with its reason
                next_abort_poll = now + ABORT_POLL_INTERVAL
                err = self.t.poll_abort()
                if err is not None:
                    raise err
            if now - last > self.timeout:
                raise self._stalled(run.active)
            if sleep:
                time.sleep(sleep)
            sleep = min(nap, sleep + 2e-5)

    def _begin_staging(self, delta: DeltaPush | None) -> int:
        """Device tensors: the staging stream waits for the caller's work on them; returns the
        bytes staged so far."""
        if self._stager is None:
            return 0
        if delta is not None:
            raise UsageError(f"rank {self.rank}: delta pushes encode on the host: device tensors are not supported "
                             "with them yet")
        self._stager.ops.begin()
        return self._stager.staged_bytes

    def _local_copies(self, st: ExecStats) -> None:
        """A same-job reshard: the bytes already on this rank move without the transport."""
        for tr in self.local:
            if (self.dst_views is not self.src_views or tr.src_tensor != tr.dst_tensor
                    or tr.src_offsets != tr.dst_offsets):
                src = self._src_bytes(tr)
                _copy(self._dst(tr), src.copy() if isinstance(src, np.ndarray) else src.clone())
            st.local_copies += 1

    def _post(self, m: Message, run: _Run, delta: DeltaPush | None) -> bool:
        """Post ``m`` (pack it first when it needs a bucket); False when it must wait: a phase-2
        forward whose bytes are still arriving, or no free bucket slot."""
        send = m.src == self.rank
        if send and m.phase == 2 and not all(d in run.done for d in m.deps):
            return False  # its bytes are still arriving (earlier in the global order)
        if self._stager is not None:
            return self._post_staged(m, send, run)
        is_delta = delta is not None and delta.is_delta(m.src, m.dst)
        buf = None if is_delta else self._inplace_view(m, send)
        slot = -1
        if buf is None:
            slot, buf = self._take(m.nbytes)
            if slot < 0:
                return False  # the bucket slots are full: wait for a message to complete
            run.in_use += m.nbytes
            if send:
                run.st.cast_bytes += self._pack(m, buf)
        run.st.peak_buffer_bytes = max(run.st.peak_buffer_bytes, run.in_use)
        req: Request | DeltaSend | DeltaRecv
        if is_delta:
            assert delta is not None
            req = self._delta_send(m, buf, delta, run.st) if send else DeltaRecv(self.t, m, buf)
        else:
            req = self.t.isend(buf, m.dst, m.phase) if send else self.t.irecv(buf, m.src, m.phase)
            if send and delta is not None and delta.keeps_base(m.src, m.dst):
                self._keep_base(m, buf, delta)
        run.active.append(_Active(m, req, buf, not send, slot))
        return True

    def _take(self, nbytes: int) -> tuple[int, Any]:
        """Room for a packed message in a bucket slot: (slot, buffer), or (-1, None) when none has
        room. Messages are posted in the global order, so those holding the slots are earlier and
        complete first: waiting cannot deadlock (see the module docstring)."""
        need = -(-nbytes // 64) * 64  # each message 64-byte aligned
        cur = self._arena_cur
        for i in [cur] + [j for j in range(len(self._slots)) if j != cur]:
            if self._arena_refs[i] and i != cur:
                continue  # only the current slot is shared; another is taken once empty (offset 0)
            off = self._arena_off[i]
            if off + nbytes <= int(self._slots[i].nbytes):
                self._arena_cur, self._arena_off[i] = i, off + need
                self._arena_refs[i] += 1
                return i, self._slots[i][off:off + nbytes]
        return -1, None

    def _release(self, slot: int) -> None:
        self._arena_refs[slot] -= 1
        if not self._arena_refs[slot]:
            self._arena_off[slot] = 0

    def _inplace_view(self, m: Message, send: bool) -> Any:
        """``_inplace``, computed once per message and side for this executor's tensors."""
        key = (m.uid, send)
        if key not in self._inplace_views:
            self._inplace_views[key] = self._inplace(m, send)
        return self._inplace_views[key]

    def _post_staged(self, m: Message, send: bool, run: _Run) -> bool:
        """A message of device tensors: through a free slot, packed or unpacked on the device."""
        if not self._free or self._stager is None:
            return False  # every slot is in use: wait for one
        slot = self._free.pop()
        run.in_use += m.nbytes
        run.st.peak_buffer_bytes = max(run.st.peak_buffer_bytes, run.in_use)
        prog = self._program(m, send)
        if send:
            run.st.cast_bytes += sum(tr.nbytes for tr in m.transfers if self._cast_of(tr) is not None)
        req = self._stager.send(m, slot, prog) if send else self._stager.recv(m, slot, prog)
        run.active.append(_Active(m, req, None, not send, slot))
        return True

    def _program(self, m: Message, send: bool) -> Program:
        """``m``'s copy program on this side, built at its first push (index tensors included)."""
        key = (m.uid, send)
        prog = self._programs.get(key)
        if prog is None:
            assert self._stager is not None
            parts, off = [], 0
            for tr in m.transfers:
                if send:
                    view = (self.dst_views if tr.phase == 2 else self.src_views)[tr.src_tensor]
                    parts.append(Part(view, tr.src_box, off, tr.nbytes, self._cast_of(tr)))
                else:
                    parts.append(Part(self.dst_views[tr.dst_tensor], tr.dst_box, off, tr.nbytes))
                off += tr.nbytes
            prog = self._programs[key] = build_program(parts, self._stager.ops)
        return prog

    def _complete(self, a: _Active, run: _Run, delta: DeltaPush | None) -> None:
        """A finished message: unpack (or apply its delta), count it, free its slot."""
        st = run.st
        wire = getattr(a.req, "wire", a.msg.nbytes)
        if a.is_recv:
            if isinstance(a.req, DeltaRecv):
                assert delta is not None
                self._delta_recv(a.msg, a.req, delta, run)
            elif a.slot >= 0 and self._stager is None:  # staged receives unpacked on the device
                self._unpack(a.msg, a.buf)  # type: ignore[arg-type]
            st.bytes_received += wire
            st.full_bytes_received += a.msg.nbytes
            run.done.add(a.msg.uid)
        else:
            st.bytes_sent += wire
            st.full_bytes_sent += a.msg.nbytes
        if a.slot >= 0:
            if self._stager is None:
                self._release(a.slot)
            else:
                self._free.append(a.slot)
            run.in_use -= a.msg.nbytes
        st.messages += 1
        run.active.remove(a)

    def _stalled(self, active: Sequence[_Active]) -> PeerTimeoutError:
        """The timeout, naming the silent peers (and, for a late forwarder, whom it waits for)."""
        stuck = [a for a in active if getattr(a.req, "on_device", False)]
        if stuck:
            for a in active:
                a.req.cancel()
            return PeerTimeoutError(f"rank {self.rank}: timed out after {self.timeout:g} s waiting for the device "
                                    f"copies of {len(stuck)} message(s) (the device is hung or too busy)")
        peers = sorted({a.msg.src if a.is_recv else a.msg.dst for a in active})
        name0 = self.peer_names or (lambda p: f"rank {p}")
        # a late forward: name whom the forwarder waits for (its phase-1 senders, from the plan)
        late = [a.msg for a in active if a.is_recv and a.msg.phase == 2]
        upstream: dict[int, set[int]] = defaultdict(set)
        sources = forward_sources(self.plan, self.rank) if late else {}
        for m in late:  # the senders of the bytes in the forwards still awaited
            for t in m.transfers:
                for region, senders in sources.get((t.fqn, m.src), ()):
                    if region.intersect(t.region) is not None:
                        upstream[m.src] |= senders

        def name(p: int) -> str:
            up = sorted(upstream.get(p, ()))
            return str(name0(p)) + (f" (which forwards bytes from {', '.join(name0(u) for u in up)})" if up else "")
        for a in active:
            a.req.cancel()
        return PeerTimeoutError(f"rank {self.rank}: timed out after {self.timeout:g} s waiting for "
                                f"{', '.join(name(p) for p in peers)} (transfer not completed; the peer "
                                "died, hung or never arrived)")

    # -- integrity without gathering
    def _digest(self, region: Any) -> int:
        import xxhash

        return xxhash.xxh64_intdigest(host_bytes(region).data)

    def _verify(self) -> tuple[int, list[str]]:
        """Senders hash the regions they sent (from their own tensors); receivers hash what landed
        in theirs; each receiver compares. Only 8 bytes per region cross the wire. Returns the
        regions checked and one problem per corrupt region."""
        reqs = []
        keep = []
        expect: list[tuple[Message, np.ndarray]] = []
        ctrl = self.t.control  # digests are host memory: NCCL cannot carry them
        for m in self.mine:
            if m.src == self.rank:
                d = np.array([self._digest(self._src_bytes(tr)) for tr in m.transfers], dtype=np.uint64)
                keep.append(d)
                reqs.append(ctrl.isend(d, m.dst, _DIGEST_TAG))
            else:
                d = np.zeros(len(m.transfers), dtype=np.uint64)
                expect.append((m, d))
                reqs.append(ctrl.irecv(d, m.src, _DIGEST_TAG))
        from streamer.transport.base import wait_all

        wait_all(reqs, self.timeout, "verify checksums", names=self.peer_names, transport=self.t)
        bad = []
        n = 0
        for m, d in expect:
            for tr, want in zip(m.transfers, d.tolist()):
                got = self._digest(self._dst(tr))
                n += 1
                if got != want:
                    bad.append(f"{tr.fqn}: region {tr.region} received by rank {self.rank} from rank {tr.src_rank} "
                               f"is corrupt (xxh64 expected {want:016x}, got {got:016x})")
        return n, bad

