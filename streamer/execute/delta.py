"""Delta refit: what a sender keeps, how a message's change is encoded, and the wire header.

A delta message carries the change of one packed message since the previous push: the XOR of
its new bytes (destination dtype, after any cast) with the bytes the sender sent last time,
which the receiver's tensors still hold. The data picks the encoding, per message:

- ``SAME``: nothing changed; the header alone travels.
- ``SPARSE``: the positions (uint32) of the changed bytes, then their XOR bytes. Chosen when
  it is smaller than the compressed XOR (changes few and scattered).
- ``ZSTD``: the XOR compressed with numcodecs Zstd level 1. Measured on bf16 weights where 2%
  of the elements changed: 2.6% of the full size at about 0.3-1 GB/s on one core, where LZ4
  gave 5.5% and Blosc (byte or bit shuffle) 3.6-7.5% at lower speed, so Zstd alone is kept.
- ``ZSTD_FRAMES``: the same, in independent frames of ``FRAME`` raw bytes behind a table of
  their sizes, for messages of two frames or more: each rank encodes and decodes them on the
  threads of ``streamer.execute.codec``.
- ``RAW``: the new bytes themselves, when no encoding is smaller (most elements changed).

Sizes vary, and gloo, NCCL and the loopback transport receive exactly the posted size, so a
delta message travels as a fixed 32-byte header (``HEADER_WORDS`` uint64: encoding, payload
bytes, version, base version) followed by the payload, which the receiver posts once the header
told it the size. A payload is never larger than the message's raw bytes, so it fits the
receiver's bucket slot.

Auto: raw bytes where encoding loses to the link. Encoding costs CPU time (``ENCODE_GBPS`` and
``DECODE_GBPS`` per core); a message of ``n`` bytes whose encoded form is a fraction ``r`` of it
saves ``(1 - r) n / link`` on the wire and pays ``n / encode + n / decode``, so a delta wins only
on links slower than ``break_even_gbps(r)`` (at most about 0.3 GB/s on one core). A pair of
ranks whose link is faster than the break-even of an unchanged message never sends deltas (full
bytes, in place, no base kept: a delta push then costs what a full push costs); on a slower link
each message is XOR-scanned (memory-bound, chunked) and sent ``RAW`` without trying the codec
when its changed bytes say the codec would not pay. ``pair_link`` says what link a pair has: the
one the user stated (``RefitOptions.link_gbps``), else shared memory between ranks on one host
(fast) and unknown across hosts (always encoded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from formats.errors import TransportError, UsageError
from streamer.execute.codec import FRAME, pmap

__all__ = ["DECODE_GBPS", "ENCODE_GBPS", "ENCODINGS", "HEADER_WORDS", "DeltaChecksumError", "DeltaPush", "DeltaRecv",
           "DeltaSend", "DeltaState", "break_even_gbps", "decode_into", "encode", "host_array", "pair_link", "xor_scan"]

RAW, SAME, SPARSE, ZSTD, ZSTD_FRAMES = 0, 1, 2, 3, 4
ENCODINGS = ("raw", "same", "sparse", "zstd", "zstd-frames")
HEADER_WORDS = 4
#: headers of phase p travel on tag HEADER_TAG + p; each payload on its own tag (see payload_tag)
HEADER_TAG = 16
_PAYLOAD_TAG = 4096  # above the abort tag (0x5AB); the largest stays under MPI's minimum TAG_UB
_PAYLOAD_TAGS = 8192
#: below this many changed bytes, skip the Zstd attempt: the sparse form is already tiny
_SPARSE_ONLY = 64
#: positions are uint32: larger messages never use the sparse form
_SPARSE_MAX = 1 << 32
#: GB/s of one core encoding (XOR scan + Zstd) and decoding a message of bf16 weights a real AdamW
#: step changed (``bench refit --delta``, lr 1e-6 and 1e-5, on a shared 2-core machine)
ENCODE_GBPS = 0.5
DECODE_GBPS = 1.0
#: bytes XOR-scanned at a time: the new bytes, the base and the XOR stay in cache between the
#: XOR, the base update and the counts (one pass over memory, no whole-message temporaries)
SCAN_CHUNK = 256 << 10
#: the link of two ranks on one host (shared memory): faster than any break-even
SHARED_MEMORY_GBPS = float("inf")


class DeltaChecksumError(TransportError):
    """After a delta push a region differs from the sender's (its checksum, or a delta that does
    not decode). The bytes arrived; what they were applied to, or what they said, was wrong: the
    weights are not served, and this exits 1 like any data error. The receiver's base becomes
    unknown, so the next push sends it full bytes."""

    exit_code = 1


def break_even_gbps(wire_ratio: float, encode_gbps: float = ENCODE_GBPS, decode_gbps: float = DECODE_GBPS) -> float:
    """The link speed (GB/s) below which sending a delta that is ``wire_ratio`` of the full bytes
    beats sending the full bytes: ``n/link > n/encode + r n/link + n/decode``. 0 when nothing is
    saved (``wire_ratio >= 1``)."""
    if encode_gbps <= 0 or decode_gbps <= 0:
        raise ValueError(f"encode and decode speeds must be positive, got {encode_gbps} and {decode_gbps}")
    return max(0.0, 1.0 - wire_ratio) / (1.0 / encode_gbps + 1.0 / decode_gbps)


def pair_link(hosts: tuple[str, ...], link_gbps: float | None, src: int, dst: int) -> float | None:
    """The link (GB/s) between ranks ``src`` and ``dst``: the stated one, else shared memory on one
    host, else None (unknown: deltas are always encoded)."""
    if link_gbps is not None:
        return link_gbps
    if hosts and hosts[src] == hosts[dst]:
        return SHARED_MEMORY_GBPS
    return None


def xor_scan(new: np.ndarray, base: np.ndarray, xor: np.ndarray, sizes: list[tuple[int, int]],
             threads: int = 1) -> tuple[int, int]:
    """``xor = new ^ base``, then ``base = new``, in ``SCAN_CHUNK`` pieces (on ``threads``
    threads: the pieces are disjoint). ``sizes``: (bytes, itemsize) of the message's transfers in
    order. Returns (changed elements, changed bytes)."""
    pieces, off = [], 0
    for n, isz in sizes:
        step = max(isz, SCAN_CHUNK - SCAN_CHUNK % isz)
        step *= max(1, FRAME // step) if threads > 1 else 1  # a thread's piece: about a frame
        pieces += [(s, min(off + n, s + step), isz) for s in range(off, off + n, step)]
        off += n

    def scan(piece: tuple[int, int, int]) -> tuple[int, int]:
        s0, e0, isz = piece
        elements = nbytes = 0
        step = max(isz, SCAN_CHUNK - SCAN_CHUNK % isz)
        for s in range(s0, e0, step):
            e = min(e0, s + step)
            x = xor[s:e]
            np.bitwise_xor(new[s:e], base[s:e], out=x)
            base[s:e] = new[s:e]
            c = int(np.count_nonzero(x))
            nbytes += c
            if c:
                elements += _changed(x, isz)
        return elements, nbytes

    counts = pmap(scan, pieces, threads)
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def _changed(x: np.ndarray, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes with a nonzero byte in the XOR ``x`` (flat uint8)."""
    if itemsize in (2, 4, 8):
        return int(np.count_nonzero(x.view(f"<u{itemsize}")))
    return int(np.count_nonzero(x.reshape(-1, itemsize).any(axis=1)))


def payload_tag(phase: int, index: int) -> int:
    """A tag per in-flight payload: receivers post payloads as headers arrive, in any order."""
    return _PAYLOAD_TAG + 2 * (index % _PAYLOAD_TAGS) + (phase - 1)


def host_array(buf: Any) -> np.ndarray:
    """A numpy view of a host buffer (numpy, or a CPU torch tensor from gloo's ``alloc``)."""
    return buf if isinstance(buf, np.ndarray) else buf.numpy()


class DeltaSend:
    """A delta message going out: its header, then its payload (none for ``SAME``)."""

    kind = "send"

    def __init__(self, t: Any, m: Any, encoding: int, payload: Any, version: int, base: int) -> None:
        self.peer = m.dst
        self.hdr = np.array([encoding, payload.shape[0], version, base], dtype=np.uint64)
        self.wire = self.hdr.nbytes + payload.shape[0]
        self.reqs = [t.isend(self.hdr, m.dst, HEADER_TAG + m.phase)]
        if payload.shape[0]:
            self.reqs.append(t.isend(payload, m.dst, payload_tag(m.phase, m.index)))

    def test(self) -> bool:
        self.reqs = [r for r in self.reqs if not r.test()]
        return not self.reqs

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancel()


class DeltaRecv:
    """A delta message coming in: the header first, then a payload of the size it announces,
    received into ``buf`` (the message's bucket slot)."""

    kind = "recv"

    def __init__(self, t: Any, m: Any, buf: Any) -> None:
        self.t, self.m, self.buf, self.peer = t, m, buf, m.src
        self.hdr = np.zeros(HEADER_WORDS, dtype=np.uint64)
        self.req = t.irecv(self.hdr, m.src, HEADER_TAG + m.phase)
        self.payload: Any = None
        self.wire = self.hdr.nbytes

    @property
    def encoding(self) -> int:
        return int(self.hdr[0])

    @property
    def versions(self) -> tuple[int, int]:
        return int(self.hdr[2]), int(self.hdr[3])

    def test(self) -> bool:
        if self.payload is None:
            if not self.req.test():
                return False
            # a header damaged in flight cannot overrun the slot: the message then reads as empty
            n = int(self.hdr[1]) if int(self.hdr[1]) <= self.m.nbytes else 0
            self.payload = self.buf[:n]
            self.wire += n
            if not n:
                return True
            self.req = self.t.irecv(self.payload, self.m.src, payload_tag(self.m.phase, self.m.index))
        return bool(self.req.test())

    def cancel(self) -> None:
        self.req.cancel()


def _zstd() -> Any:
    try:
        from numcodecs import Zstd  # type: ignore[import-untyped]  # no stubs
    except ImportError as e:
        raise UsageError("delta refit compresses with numcodecs, which is not installed: "
                         "pip install 'shardstream[delta]'") from e
    return Zstd(level=1)


def encode(xor: np.ndarray, new: np.ndarray, *, changed: int | None = None,
           link_gbps: float | None = None, threads: int = 1) -> tuple[int, int]:
    """Encode a message whose change is ``xor`` (flat uint8) and whose new bytes are ``new`` (a
    buffer of the same size, overwritten with the payload). Return (encoding, payload bytes).
    ``changed``: the nonzero bytes of ``xor`` when known. ``link_gbps``: the link's speed; when
    it is faster than the break-even of a message whose payload were its changed bytes alone (the
    least any encoding sends), the codec is not tried: ``RAW``. A message of two frames or more
    is compressed as ``ZSTD_FRAMES``, one frame per ``FRAME`` bytes, on ``threads`` threads."""
    n = xor.size
    if changed is None:
        changed = int(np.count_nonzero(xor))
    if changed == 0:
        return SAME, 0
    if link_gbps is not None and link_gbps >= break_even_gbps(changed / n):
        return RAW, n
    sparse = 5 * changed if n < _SPARSE_MAX else n + 1
    if sparse > _SPARSE_ONLY:
        if n >= 2 * FRAME:
            got = _encode_frames(xor, new, min(sparse, n), threads)
            if got:
                return ZSTD_FRAMES, got
        else:
            z = _zstd().encode(xor)
            if len(z) < min(sparse, n):
                new[:len(z)] = np.frombuffer(z, dtype=np.uint8)
                return ZSTD, len(z)
    if sparse < n:
        pos = np.flatnonzero(xor).astype(np.uint32)
        new[:4 * changed] = pos.view(np.uint8)
        new[4 * changed:sparse] = xor[pos]
        return SPARSE, sparse
    return RAW, n


def _encode_frames(xor: np.ndarray, new: np.ndarray, limit: int, threads: int) -> int:
    """``xor`` as Zstd frames of ``FRAME`` raw bytes each, written to ``new`` behind their table
    (uint64: frame count, frame size, then each frame's compressed bytes); the payload's size, or
    0 when it would not be smaller than ``limit``."""
    n = xor.size
    k = -(-n // FRAME)
    frames = pmap(lambda i: _zstd().encode(xor[i * FRAME:(i + 1) * FRAME]), range(k), threads)
    table = np.array([k, FRAME] + [len(f) for f in frames], dtype=np.uint64)
    size = table.nbytes + sum(len(f) for f in frames)
    if size >= limit:
        return 0
    new[:table.nbytes] = table.view(np.uint8)
    off = table.nbytes
    for f in frames:
        new[off:off + len(f)] = np.frombuffer(f, dtype=np.uint8)
        off += len(f)
    return size


def decode_into(encoding: int, payload: np.ndarray, xor: np.ndarray, threads: int = 1) -> None:
    """The XOR of a ``SPARSE``, ``ZSTD`` or ``ZSTD_FRAMES`` payload, written into ``xor`` (flat
    uint8, full size; frames on ``threads`` threads). Raises ``ValueError`` when the payload
    cannot be what a sender encoded."""
    if encoding == ZSTD:
        _unzstd(payload, xor)
    elif encoding == ZSTD_FRAMES:
        frames = _frames(payload, xor.size)
        pmap(lambda f: _unzstd(payload[f[0]:f[1]], xor[f[2]:f[3]]), frames, threads)
    elif encoding == SPARSE:
        if payload.size % 5:
            raise ValueError(f"a sparse delta of {payload.size} bytes is not whole (5 bytes per change)")
        k = payload.size // 5
        pos = np.frombuffer(payload[:4 * k].tobytes(), dtype=np.uint32)
        if k and int(pos.max()) >= xor.size:
            raise ValueError(f"a sparse delta names byte {int(pos.max())} of a {xor.size}-byte message")
        xor[:] = 0
        xor[pos] = payload[4 * k:]
    else:
        raise ValueError(f"unknown delta encoding {encoding}")


def _unzstd(payload: np.ndarray, xor: np.ndarray) -> None:
    try:
        raw = _zstd().decode(payload)
    except RuntimeError as e:  # numcodecs' word for a damaged frame
        raise ValueError(str(e)) from e
    # a frame may decode to fewer bytes than its message: decoding into ``xor`` would hide it
    if len(raw) != xor.size:
        raise ValueError(f"a Zstd delta of {len(raw)} bytes for a {xor.size}-byte message")
    xor[:] = np.frombuffer(raw, dtype=np.uint8)


def _frames(payload: np.ndarray, n: int) -> list[tuple[int, int, int, int]]:
    """(payload start, end, message start, end) of each frame of a ``ZSTD_FRAMES`` payload for an
    ``n``-byte message, its table checked against both sizes."""
    if payload.size < 16:
        raise ValueError(f"a framed Zstd delta of {payload.size} bytes has no frame table")
    k, size = (int(v) for v in np.frombuffer(payload[:16].tobytes(), dtype=np.uint64))
    if size < 1 or k != -(-n // size) or payload.size < 8 * (2 + k):
        raise ValueError(f"a framed Zstd delta announces {k} frames of {size} bytes for a {n}-byte message")
    lens = np.frombuffer(payload[16:8 * (2 + k)].tobytes(), dtype=np.uint64).tolist()
    if 8 * (2 + k) + sum(lens) != payload.size:
        raise ValueError(f"a framed Zstd delta's frames add up to {8 * (2 + k) + sum(lens)} bytes, "
                         f"not its {payload.size}")
    out, off = [], 8 * (2 + k)
    for i, ln in enumerate(lens):
        out.append((off, off + ln, i * size, min(n, (i + 1) * size)))
        off += ln
    return out


@dataclass
class DeltaState:
    """What one rank keeps between pushes: the bytes it last sent per message (its *bases*, the
    memory price of delta) and one scratch message for XORs."""

    bases: dict[int, np.ndarray] = field(default_factory=dict)
    scratch: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint8))
    #: this rank's codec threads (``codec.job_threads``)
    threads: int = 1

    def base(self, uid: int, nbytes: int) -> np.ndarray:
        b = self.bases.get(uid)
        if b is None:
            b = self.bases[uid] = np.empty(nbytes, dtype=np.uint8)
        return b

    def xor_buffer(self, nbytes: int) -> np.ndarray:
        if self.scratch.size < nbytes:
            self.scratch = np.empty(nbytes, dtype=np.uint8)
        return self.scratch[:nbytes]

    @property
    def base_bytes(self) -> int:
        return sum(b.nbytes for b in self.bases.values())


@dataclass
class DeltaPush:
    """One push of a delta session: its version, the version its deltas apply to (``base``; None:
    every message full), and the ranks not at ``base`` (they send and receive full bytes: a delta
    is never applied to, or computed from, a wrong base). ``stage``: a transactional push, one
    that breaks off leaves the receiver's tensors at ``base``: XOR deltas are applied as they
    arrive and undone (applied again) if it breaks off, RAW ones only once every message arrived."""

    state: DeltaState
    version: int
    stale: frozenset[int]
    base: int | None = None
    stage: bool = False

    #: every rank's host name (``pair_link``) and the link the jobs stated (GB/s; None: measured)
    hosts: tuple[str, ...] = ()
    link_gbps: float | None = None

    def link(self, src: int, dst: int) -> float | None:
        return pair_link(self.hosts, self.link_gbps, src, dst)

    def keeps_base(self, src: int, dst: int) -> bool:
        """Whether the pair may ever send deltas: not when its link beats the break-even of an
        unchanged message (it then moves full bytes, in place, and no base is kept)."""
        link = self.link(src, dst)
        return link is None or link < break_even_gbps(0.0)

    def is_delta(self, src: int, dst: int) -> bool:
        return (self.base is not None and src not in self.stale and dst not in self.stale
                and self.keeps_base(src, dst))
