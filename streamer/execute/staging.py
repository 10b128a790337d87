"""Device tensors on host transports (MPI, gloo, loopback): staged through pinned host buckets.

A host transport moves host memory only. When the local tensors live on a device, every message
goes through a *slot*: a device bucket and a pinned host bucket, both allocated once. Sending:
the regions are gathered on the device into the device bucket, copied device->host into the
pinned bucket, and the wire send is posted once that copy's event has fired. Receiving: the wire
fills the pinned bucket, which is copied host->device and scattered into the local tensors, in
place. With two slots (double buffering) the device copies of one message overlap the wire of
the other.

Packing uses torch ops over views, never a Python loop per region on the hot path: consecutive
transfers of one local tensor become one ``index_select`` (sending) or ``index_copy_``
(receiving) over fixed-length rows, with index tensors built on the device at the first push
and reused; a lone transfer is one strided ``copy_``; a lone contiguous one goes straight
between the tensor and the pinned bucket. After the first push nothing is allocated: the same
buckets, events, stream and index tensors serve every push.

The device is a ``DeviceOps`` (``streamer.ops.device_ops``): ``CudaOps``, or ``FakeDeviceOps``
where CPU tensors stand in for device tensors, so that the same code is tested without a GPU.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.errors import ValidationError
from formats.manifest.box import Box, uniform_runs
from streamer.ops.device_ops import CudaOps, DeviceOps

__all__ = ["Part", "Program", "Stager", "build_program", "device_ops_for", "staging_problems"]

#: consecutive transfers of one local tensor share one index op when their rows are at least this
#: long: the index (8 bytes a row) then costs at most 8/256 = 3% of the bytes it moves
MIN_ROW_BYTES = 256


# --------------------------------------------------------------------------- copy programs


@dataclass(frozen=True)
class Part:
    """One transfer as one side sees it: ``box`` of a local tensor (its byte view ``view``, shaped
    ``shape + (itemsize,)``), at ``off`` in the bucket, ``nbytes`` on the wire; ``cast``: (source,
    destination) data_type when a sender casts while packing."""

    view: Any
    box: Box
    off: int
    nbytes: int
    cast: tuple[str, str] | None = None


@dataclass(frozen=True)
class _Copy:
    """A lone transfer: one strided copy (or cast) between its region and its bucket bytes."""

    region: Any
    off: int
    nbytes: int
    cast: tuple[str, str] | None

    def pack(self, bucket: Any) -> None:
        dst = bucket[self.off:self.off + self.nbytes].view(tuple(self.region.shape[:-1]) + (-1,))
        if self.cast is None:
            dst.copy_(self.region)
        else:
            from streamer.ops.cast import cast_into

            cast_into(dst, self.region, *self.cast)

    def unpack(self, bucket: Any) -> None:
        self.region.copy_(bucket[self.off:self.off + self.nbytes].view(self.region.shape))


@dataclass(frozen=True)
class _Gather:
    """Consecutive transfers of one local tensor: ``rows`` (the tensor as overlapping rows of
    ``width`` words, one starting at every word) indexed by ``index``, packed back to back."""

    rows: Any
    index: Any
    off: int
    nbytes: int
    word: Any
    width: int

    def _bucket_rows(self, bucket: Any) -> Any:
        return bucket[self.off:self.off + self.nbytes].view(self.word).view(-1, self.width)

    def pack(self, bucket: Any) -> None:
        import torch

        torch.index_select(self.rows, 0, self.index, out=self._bucket_rows(bucket))

    def unpack(self, bucket: Any) -> None:
        self.rows.index_copy_(0, self.index, self._bucket_rows(bucket))


@dataclass(frozen=True)
class Program:
    """How one side moves one message between its tensors and a bucket. ``direct``: the region
    itself (one contiguous transfer), copied straight to or from the pinned bucket."""

    steps: tuple[_Copy | _Gather, ...]
    nbytes: int
    direct: Any = None

    @property
    def ops(self) -> int:
        return len(self.steps)


def _run_starts(p: Part) -> tuple[np.ndarray, int]:
    """Byte offsets in ``p.view`` of the region's contiguous runs, and their length in bytes."""
    isz = int(p.view.shape[-1])
    shape = tuple(int(d) for d in p.view.shape[:-1])
    starts: list[np.ndarray] = []
    length = 0
    for start, count, stride, n in uniform_runs(p.box, shape):
        starts.append((start + np.arange(count, dtype=np.int64) * stride) * isz)
        length = n * isz
    return (np.concatenate(starts) if starts else np.zeros(0, np.int64)), length


def _word(align: int) -> tuple[Any, int]:
    import torch

    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if align % w == 0:
            return dt, w
    return torch.uint8, 1


def _gather(parts: Sequence[Part], runs: Sequence[tuple[np.ndarray, int]], row: int, ops: DeviceOps) -> _Gather:
    rows = np.concatenate([(s[:, None] + np.arange(n // row, dtype=np.int64) * row).reshape(-1) for s, n in runs])
    flat = parts[0].view.reshape(-1)
    nbytes = sum(p.nbytes for p in parts)
    # the widest word that every row start, the row length and the bucket offset are multiples of
    word, w = _word(math.gcd(row, parts[0].off, int(flat.numel()), int(flat.data_ptr()), int(np.gcd.reduce(rows))))
    words = flat.view(word)
    return _Gather(words.unfold(0, row // w, 1), ops.index(rows // w), parts[0].off, nbytes, word, row // w)


def _segments(parts: Sequence[Part]) -> list[tuple[list[Part], list[tuple[np.ndarray, int]], int]]:
    """Consecutive parts of one local tensor (no cast) whose rows stay at least ``MIN_ROW_BYTES``."""
    out: list[tuple[list[Part], list[tuple[np.ndarray, int]], int]] = []
    for p in parts:
        runs = _run_starts(p) if p.cast is None else (np.zeros(0, np.int64), 0)
        if out and p.cast is None and out[-1][0][-1].cast is None and out[-1][0][-1].view is p.view:
            row = math.gcd(out[-1][2], runs[1])
            if row >= MIN_ROW_BYTES:
                out[-1][0].append(p)
                out[-1][1].append(runs)
                out[-1] = (out[-1][0], out[-1][1], row)
                continue
        out.append(([p], [runs], runs[1]))
    return out


def build_program(parts: Sequence[Part], ops: DeviceOps) -> Program:
    """The copy program of one message (its parts in bucket order), index tensors included."""
    nbytes = sum(p.nbytes for p in parts)
    if len(parts) == 1 and parts[0].cast is None:
        p = parts[0]
        region = p.view[p.box.slices] if p.box.ndim else p.view
        if region.is_contiguous():
            return Program((), nbytes, region.reshape(-1))
    steps: list[_Copy | _Gather] = []
    for seg, runs, row in _segments(parts):
        if len(seg) == 1:
            p = seg[0]
            steps.append(_Copy(p.view[p.box.slices] if p.box.ndim else p.view, p.off, p.nbytes, p.cast))
        else:
            steps.append(_gather(seg, runs, row, ops))
    return Program(tuple(steps), nbytes)


# --------------------------------------------------------------------------- slots and requests


class _StagedSend:
    """A send whose bytes are still on their way to the pinned bucket: the wire send is posted
    (in message order) once the device->host copy completed."""

    kind = "send"

    def __init__(self, stager: Stager, m: Any, slot: int) -> None:
        self.stager, self.m, self.slot, self.peer = stager, m, slot, m.dst
        self.req: Any = None

    @property
    def on_device(self) -> bool:
        return self.req is None

    def test(self) -> bool:
        if self.req is None:
            self.stager.flush_sends()
            if self.req is None:
                return False
        return bool(self.req.test())

    def cancel(self) -> None:
        if self.req is not None:
            self.req.cancel()


class _StagedRecv:
    """A receive into the pinned bucket, then host->device and the scatter into the tensors."""

    kind = "recv"

    def __init__(self, stager: Stager, m: Any, slot: int, program: Program) -> None:
        self.stager, self.m, self.slot, self.program, self.peer = stager, m, slot, program, m.src
        self.req = stager.t.irecv(stager.wire[slot][:m.nbytes], m.src, m.phase)
        self.unpacking = False

    @property
    def on_device(self) -> bool:
        return self.unpacking

    def test(self) -> bool:
        if not self.unpacking:
            if not self.req.test():
                return False
            self.stager.unpack(self.program, self.slot)
            self.unpacking = True
        return self.stager.ops.ready(self.stager.events[self.slot])

    def cancel(self) -> None:
        if not self.unpacking:
            self.req.cancel()


class Stager:
    """The slots (device bucket, pinned host bucket, its wire view, one event each) of one
    executor, and the order its wire sends are posted in."""

    def __init__(self, ops: DeviceOps, transport: Any, slots: int, nbytes: int) -> None:
        self.ops, self.t = ops, transport
        self.device = [ops.device_buffer(nbytes) for _ in range(slots)]
        self.host = [ops.host_buffer(nbytes) for _ in range(slots)]
        # the transport's own kind over the same pinned memory (numpy for MPI, torch for gloo)
        self.wire = [transport.byte_view(h).reshape(-1) for h in self.host]
        self.events = [ops.event() for _ in range(slots)]
        self._sends: deque[_StagedSend] = deque()
        self.staged_bytes = 0

    def send(self, m: Any, slot: int, program: Program) -> _StagedSend:
        dev, host, n = self.device[slot], self.host[slot], program.nbytes
        ops = self.ops

        def pack() -> None:
            if program.direct is not None:
                ops.copy(host[:n], program.direct)
                return
            for step in program.steps:
                step.pack(dev)
            ops.copy(host[:n], dev[:n])

        ops.submit(pack, self.events[slot])
        self.staged_bytes += n
        s = _StagedSend(self, m, slot)
        self._sends.append(s)
        return s

    def flush_sends(self) -> None:
        """Post the wire sends whose bytes reached the pinned bucket, in message order: MPI and
        gloo match messages between two ranks in the order they are posted."""
        while self._sends and self.ops.ready(self.events[self._sends[0].slot]):
            s = self._sends.popleft()
            s.req = self.t.isend(self.wire[s.slot][:s.m.nbytes], s.m.dst, s.m.phase)

    def recv(self, m: Any, slot: int, program: Program) -> _StagedRecv:
        return _StagedRecv(self, m, slot, program)

    def unpack(self, program: Program, slot: int) -> None:
        dev, host, n = self.device[slot], self.host[slot], program.nbytes
        ops = self.ops

        def scatter() -> None:
            if program.direct is not None:
                ops.copy(program.direct, host[:n])
                return
            ops.copy(dev[:n], host[:n])
            for step in program.steps:
                step.unpack(dev)

        ops.submit(scatter, self.events[slot])
        self.staged_bytes += n


def device_name(v: Any) -> str:
    """The device a local tensor is on, as torch names it ("cpu" for host memory and numpy)."""
    dev = getattr(v, "device", None)
    return "cpu" if getattr(dev, "type", "cpu") == "cpu" else str(dev)


def staging_problems(transport: Any, tensors: Sequence[Mapping[str, Any]], device_ops: DeviceOps | None) -> list[str]:
    """Why ``tensors`` cannot be moved over ``transport``, one line each (none: host memory, or
    tensors the transport or the stager can move)."""
    if getattr(transport, "device", None) is not None:
        return [f"the {transport.name} transport moves device buffers itself: it does not stage"] \
            if device_ops is not None else []
    every = [(n, v) for ts in tensors for n, v in ts.items()]
    if device_ops is not None:
        return [f"local tensor {n!r} is not on the {device_ops.name} device the other local tensors are on: hand "
                "every local tensor on one device, or all in host memory" for n, v in every if not device_ops.owns(v)]
    devices = sorted({device_name(v) for _, v in every} - {"cpu"})
    other = [f"local tensor {n!r} is on {device_name(v)}: host transports stage CUDA tensors only (hand host memory or "
             "CUDA tensors)" for n, v in every if device_name(v) != "cpu" and not device_name(v).startswith("cuda")]
    if other or not devices:
        return other
    if len(devices) > 1:
        return [f"local tensors on several devices ({', '.join(devices)}): one rank stages through one device"]
    return [f"local tensor {n!r} is in host memory, the others on {devices[0]}: hand every local tensor on one "
            "device, or all in host memory" for n, v in every if device_name(v) == "cpu"]


def device_ops_for(transport: Any, tensors: Sequence[Mapping[str, Any]], device_ops: DeviceOps | None,
                   rank: int) -> DeviceOps | None:
    """The device ops that stage ``tensors`` over ``transport``, or None when they need none.

    ``device_ops`` given: every local tensor must be its kind. Otherwise CUDA tensors over a host
    transport are staged through ``CudaOps``. A transport with a device of its own (NCCL) moves
    device buffers directly and never stages. Anything else is refused, one line per problem.
    """
    problems = staging_problems(transport, tensors, device_ops)
    if problems:
        raise ValidationError(problems=[f"rank {rank}: {p}" for p in problems[:50]])
    if getattr(transport, "device", None) is not None or device_ops is not None:
        return device_ops
    devices = sorted({device_name(v) for ts in tensors for v in ts.values()} - {"cpu"})
    return CudaOps(devices[0]) if devices else None
