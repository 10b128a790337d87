"""The ``shm`` backend of the one-sided transport (``handles``): host memory shared on one node.

Segments are anonymous memory files (``memfd_create``). A peer maps one by opening
``/proc/<pid>/fd/<fd>`` of its owner once per session, so there is no name in ``/dev/shm`` to
clean up: the kernel frees a segment when its last descriptor and mapping go, also when a rank
is killed. (Linux only; both processes must see each other's ``/proc``, i.e. share a PID
namespace, which ranks launched on one node by one launcher do.) Nor is the size bounded by a
container's small ``/dev/shm``.

``alloc`` buckets live in segments, so a packed message is exposed where it was packed. Any
other buffer (a large region sent in place from a local tensor, a delta header) is first copied
into one of at most ``STAGING_SLOTS`` staging segments, as large as the largest bucket, which
the acks free: after the first push the same segments serve every push.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.errors import TransportError
from streamer.transport.handles import Exposure

__all__ = ["ShmBackend", "Segment"]

_PREFIX = "shardstream"
#: staging segments in use at once: with the executor's two bucket slots, a sender's extra
#: memory stays at four buckets whatever the number of in-place messages in flight
STAGING_SLOTS = 2


@dataclass
class Segment:
    """One memfd segment owned by this process (``fd`` stays open: peers open it through /proc)."""

    id: int
    fd: int
    mem: mmap.mmap
    nbytes: int
    address: int

    def view(self) -> np.ndarray:
        """The segment's bytes (a new view: the segment keeps no export, so it can be unmapped)."""
        return np.frombuffer(self.mem, dtype=np.uint8, count=self.nbytes)

    def descriptor(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "fd": self.fd, "ino": os.fstat(self.fd).st_ino,
                           "nbytes": self.nbytes}).encode()

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        _unmap(self.mem)


def _unmap(mem: mmap.mmap) -> None:
    try:
        mem.close()
    except BufferError:
        pass  # a numpy view still uses it: unmapped when that view goes


def _new_segment(seg_id: int, nbytes: int) -> Segment:
    if not hasattr(os, "memfd_create"):
        raise TransportError("--transport shm needs Linux (memfd_create); use mpi or gloo here")
    size = max(nbytes, 1)  # an empty mapping is not allowed
    fd = os.memfd_create(f"{_PREFIX}-{seg_id}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mem = mmap.mmap(fd, size)
    except OSError as e:
        os.close(fd)
        raise TransportError(f"could not allocate a {size}-byte shared segment ({e}); use a smaller --bucket-size")
    return Segment(seg_id, fd, mem, nbytes, _address(np.frombuffer(mem, dtype=np.uint8, count=nbytes)))


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _host_flat(buf: Any) -> np.ndarray:
    """``buf`` (numpy, or a CPU torch tensor) as a flat uint8 numpy view, never a copy."""
    a = buf if isinstance(buf, np.ndarray) else buf.numpy()
    if not a.flags.c_contiguous:
        raise TransportError("the shm transport moves contiguous buffers only (a bug: please report)")
    return a.reshape(-1).view(np.uint8)


class ShmBackend:
    """Host buffers in memfd segments; copies with numpy."""

    name = "shm"
    device: Any = None

    def __init__(self) -> None:
        self._ids = itertools.count()
        #: alloc'd buckets, by id (a bucket lives as long as the caller holds its array)
        self.buckets: dict[int, Segment] = {}
        #: staging segments: all of them, and the free ones
        self.staging: list[Segment] = []
        self._free: list[Segment] = []
        #: foreign buffers waiting for a staging segment, in isend order
        self._waiting: deque[Exposure] = deque()
        self._largest = 0
        #: peers' segments mapped here: (peer, segment id) -> (mapping, bytes)
        self._mapped: dict[tuple[int, int], tuple[mmap.mmap, np.ndarray]] = {}
        self._closed = False

    # -- buffers
    def byte_view(self, tensor: Any) -> np.ndarray:
        from streamer.ops.buffers import byte_view

        return byte_view(tensor)

    def alloc(self, nbytes: int) -> np.ndarray:
        seg = _new_segment(next(self._ids), nbytes)
        self.buckets[seg.id] = seg
        self._largest = max(self._largest, nbytes)
        array = seg.view()
        weakref.finalize(array, self._drop_bucket, seg.id)
        return array

    def _drop_bucket(self, seg_id: int) -> None:
        seg = self.buckets.pop(seg_id, None)
        if seg is not None:
            seg.close()

    @property
    def segments(self) -> int:
        """Segments this process owns (buckets and staging)."""
        return len(self.buckets) + len(self.staging)

    # -- sending: expose a buffer
    def _bucket_of(self, flat: np.ndarray) -> Segment | None:
        addr = _address(flat)
        for seg in self.buckets.values():
            if seg.address <= addr and addr + flat.nbytes <= seg.address + seg.nbytes:
                return seg
        return None

    def expose(self, buf: Any) -> Exposure:
        flat = _host_flat(buf)
        seg = self._bucket_of(flat)
        if seg is not None:
            off = _address(flat) - seg.address
            return Exposure(seg.id, off, flat.nbytes, seg.descriptor())
        # staged in isend order (FIFO), when a staging segment is free: the earliest message
        # always gets one, so waiting cannot deadlock (the executor's order argument)
        exp = Exposure(-1, 0, flat.nbytes, b"", pending=flat)
        self._waiting.append(exp)
        self._stage_waiting()
        return exp

    def _stage_waiting(self) -> None:
        while self._waiting:
            exp = self._waiting[0]
            stage = self._take_staging(exp.nbytes)
            if stage is None:
                return
            np.copyto(stage.view()[:exp.nbytes], exp.pending)
            exp.segment, exp.descriptor, exp.staged, exp.pending = stage.id, stage.descriptor(), stage, None
            self._waiting.popleft()

    def _take_staging(self, nbytes: int) -> Segment | None:
        """A free staging segment of at least ``nbytes`` (at most ``STAGING_SLOTS`` exist, each as
        large as the largest bucket, so they are made once), or None while all are in use."""
        fits = [s for s in self._free if s.nbytes >= nbytes]
        if fits:
            seg = min(fits, key=lambda s: s.nbytes)
            self._free.remove(seg)
            return seg
        if len(self.staging) >= STAGING_SLOTS:
            if not self._free:
                return None
            small = self._free.pop()  # too small for this message: make a larger one instead
            self.staging.remove(small)
            small.close()
        seg = _new_segment(next(self._ids), max(nbytes, self._largest))
        self._largest = max(self._largest, seg.nbytes)
        self.staging.append(seg)
        return seg

    def ready(self, exp: Exposure) -> bool:
        if exp.pending is not None:
            self._stage_waiting()
        return exp.pending is None  # numpy copies are complete when they return

    def release(self, exp: Exposure) -> None:
        if exp.staged is not None:
            self._free.append(exp.staged)
            self._stage_waiting()

    # -- receiving: map a peer's segment once, copy out of it
    def attach(self, peer: int, segment: int, descriptor: bytes) -> None:
        if (peer, segment) in self._mapped:
            return
        d = json.loads(descriptor)
        path = f"/proc/{d['pid']}/fd/{d['fd']}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise TransportError(f"cannot open its shared segment {path} ({e.strerror}): the shm transport needs "
                                 "both processes on one node, in one PID namespace, run by one user") from e
        try:
            if os.fstat(fd).st_ino != d["ino"]:
                raise TransportError(f"{path} is no longer the segment it described (a bug: please report)")
            mem = mmap.mmap(fd, max(int(d["nbytes"]), 1), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._mapped[(peer, segment)] = (mem, np.frombuffer(mem, dtype=np.uint8, count=int(d["nbytes"])))

    def attached(self, peer: int, segment: int) -> bool:
        return (peer, segment) in self._mapped

    def copy(self, dst: Any, peer: int, segment: int, offset: int, nbytes: int) -> Any:
        src = self._mapped[(peer, segment)][1]
        if offset < 0 or offset + nbytes > src.size:
            raise TransportError(f"bytes [{offset}, {offset + nbytes}) lie outside its {src.size}-byte segment")
        np.copyto(_host_flat(dst)[:nbytes], src[offset:offset + nbytes])
        return None

    def copied(self, token: Any) -> bool:
        return True

    def close(self) -> None:
        """Unmap the peers' segments and free ours (idempotent)."""
        if self._closed:
            return
        self._closed = True
        maps = [mem for mem, _ in self._mapped.values()]
        self._mapped.clear()  # drop our views first: a mapping with views cannot be closed
        for mem in maps:
            _unmap(mem)
        for seg in [*self.buckets.values(), *self.staging]:
            seg.close()
        self.buckets.clear()
        self.staging.clear()
        self._free.clear()
        self._waiting.clear()
