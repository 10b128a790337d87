"""The one-sided transport (``transport/handles.py``) with its ``shm`` backend, every rank a thread
over the loopback control plane: what the cuda-ipc backend does on a GPU, tested on any CPU.

Several pushes of changing weights land byte for byte, in place (same data pointers), with large
regions sent from the local tensors (staged) and packed ones from the buckets; the same segments
serve every push after the first; nothing stays mapped or open after close; headers and acks
keep their stream order when tested out of order; a receive buffer too small fails both ends;
and ranks on two hosts are refused."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    check_dest_tensors,
    empty_dest_tensors,
    lay_out,
    make_source_tensors,
    oracle_arrays,
    run_sessions,
)

from formats.errors import TransportError
from formats.layouts import Mesh, Replicate, Shard
from formats.manifest.wire import Manifest
from streamer.refit.session import RefitSession
from streamer.transport.base import wait_all
from streamer.transport.colocated import _colocation_problems
from streamer.transport.handles import HandleTransport
from streamer.transport.loopback import LoopbackHub
from streamer.transport.shm import ShmBackend

# "w" rows are 1 KiB: its regions (>= 256 KiB, at nonzero offsets in the local tensors) go in
# place; the rest is packed
ARRAYS = {"w": ((3072, 256), "float32"), "v": ((64, 96), "bfloat16"), "b": ((96,), "float32"), "s": ((), "int64")}


def _manifests() -> tuple[Manifest, Manifest]:
    # trainer dp=2 x tp=2 (replicas), server tp=3 with w split by columns and rows
    src = lay_out(ARRAYS, Mesh(("dp", "tp"), (2, 2)), {"w": (Replicate(), Shard(0)), "v": (Replicate(), Shard(1)),
                                                       "b": (Replicate(), Shard(0)), "s": (Replicate(), Replicate())})
    dst = lay_out(ARRAYS, Mesh(("tp",), (3,)), {"w": (Shard(0),), "v": (Shard(0),), "b": (Shard(0),),
                                                "s": (Replicate(),)})
    return src, dst


def _backends() -> tuple[dict[int, ShmBackend], Any]:
    made: dict[int, ShmBackend] = {}
    lock = threading.Lock()

    def transport_of(ep: Any) -> HandleTransport:
        b = ShmBackend()
        with lock:
            made[ep.rank] = b
        return HandleTransport(b, ep)
    return made, transport_of


def _changed(full: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """The oracle arrays with every byte XORed with ``step``."""
    return {k: (a.reshape(-1).view(np.uint8) ^ np.uint8(step)).view(a.dtype).reshape(a.shape) for k, a in full.items()}


def _memfds() -> list[str]:
    """This process's open descriptors and mappings of shardstream segments."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:shardstream" in os.readlink(f"/proc/self/fd/{fd}"):
                fds.append(f"fd {fd}")
        except OSError:
            pass
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if "memfd:shardstream" in line]
    return fds + maps


@pytest.mark.parametrize("strategy", ["reshard", "broadcast"])
def test_pushes_land_in_place_with_the_same_segments(strategy: str) -> None:
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    srcs = make_source_tensors(src, full)
    dsts = empty_dest_tensors(dst)
    ptrs = {r: {n: v.ctypes.data for n, v in ts.items()} for r, ts in dsts.items()}
    made, transport_of = _backends()
    barrier = threading.Barrier(src.world_size + dst.world_size)
    seen: dict[int, list[str]] = {}
    segments: dict[int, list[int]] = {}
    staged: dict[int, int] = {}

    def act(s: RefitSession, r: int) -> Any:
        g = s._t.rank
        for step in range(3):
            if s.role == "send":  # new weights each step, in the same memory
                for n, v in make_source_tensors(src, _changed(full, step))[r].items():
                    srcs[r][n][...] = v
                s.push(srcs[r])
            else:
                s.pull(dsts[r])
            barrier.wait(10)
            if s.role == "recv" and r == 0:
                seen[step] = check_dest_tensors(dst, dsts, _changed(full, step))
            segments.setdefault(g, []).append(made[g].segments)
            staged[g] = len(made[g].staging)
            barrier.wait(10)
    _, errors = run_sessions(src, dst, act, transport_of=transport_of, verify=True, strategy=strategy)
    assert not errors, errors
    assert seen == {0: [], 1: [], 2: []}, seen
    assert {r: {n: v.ctypes.data for n, v in ts.items()} for r, ts in dsts.items()} == ptrs
    if strategy == "reshard":
        # no segment is made after the first push; senders staged the large in-place regions
        assert all(len(set(v)) == 1 for v in segments.values()), segments
        assert any(staged[g] for g in range(src.world_size)), "nothing was staged"
    made.clear()
    gc.collect()
    assert _memfds() == [], "segments still open or mapped after close"


def test_delta_session_over_shm() -> None:
    """Delta pushes (headers and payloads of several tags) over shm: the same bytes."""
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    srcs = make_source_tensors(src, full)
    dsts = empty_dest_tensors(dst)
    _, transport_of = _backends()

    def act(s: RefitSession, r: int) -> Any:
        for _ in range(3):
            s.push(srcs[r]) if s.role == "send" else s.pull(dsts[r])
        return s.steps[-1].encodings
    res, errors = run_sessions(src, dst, act, transport_of=transport_of, verify=True, delta=True, planned_steps=3,
                               link_gbps=0.001)  # a slow link stated: deltas are encoded
    assert not errors, errors
    assert check_dest_tensors(dst, dsts, full) == []
    assert any(enc.get("same") for enc in res.values()), res


def _pair() -> tuple[HandleTransport, HandleTransport]:
    a, b = LoopbackHub(2).endpoints()
    return HandleTransport(ShmBackend(), a), HandleTransport(ShmBackend(), b)


def test_stream_order_holds_when_tested_out_of_order() -> None:
    s, r = _pair()
    bufs = [s.alloc(1000) for _ in range(3)]
    for i, b in enumerate(bufs):
        b[:] = i + 1
    foreign = np.full(5000, 9, dtype=np.uint8)  # not a bucket: staged
    sends = [s.isend(b, 1, 1) for b in bufs] + [s.isend(foreign, 1, 1)]
    outs = [np.zeros(1000, np.uint8) for _ in range(3)] + [np.zeros(5000, np.uint8)]
    recvs = [r.irecv(o, 0, 1) for o in outs]
    for _ in sends:  # senders tested last first: headers still go out in order
        for x in reversed(sends):
            assert not x.test()
    for x in recvs:  # matched on arrival, in post order (as MPI does; loopback matches when tested)
        assert x.hdr_req.test()
    wait_all(list(reversed(recvs)), 5)  # all headers are in: acks still go back in order
    wait_all(sends, 5)
    assert [int(o[0]) for o in outs] == [1, 2, 3, 9] and all((o == o[0]).all() for o in outs)
    # the staging segment went back to the pool and serves the next foreign send
    wait_all([s.isend(foreign, 1, 1), r.irecv(outs[3], 0, 1)], 5)
    assert len(s.backend.staging) == 1  # type: ignore[attr-defined]
    s.close()
    r.close()


def test_staging_stays_bounded_with_many_sends_in_flight() -> None:
    """Eight in-place sends in flight share the two staging segments, in isend order."""
    s, r = _pair()
    srcs = [np.full(3000 + i, i, dtype=np.uint8) for i in range(8)]
    outs = [np.zeros(3000 + i, np.uint8) for i in range(8)]
    reqs = [s.isend(x, 1, 2) for x in srcs] + [r.irecv(o, 0, 2) for o in outs]
    wait_all(reqs, 5)
    assert all((o == i).all() for i, o in enumerate(outs))
    assert len(s.backend.staging) <= 2  # type: ignore[attr-defined]
    s.close()
    r.close()


def test_too_small_receive_buffer_fails_both_ends() -> None:
    s, r = _pair()
    send = s.isend(s.alloc(64), 1, 1)
    recv = r.irecv(np.zeros(32, np.uint8), 0, 1)
    assert not send.test()  # the header goes out; the ack has not come
    with pytest.raises(TransportError, match="64 bytes do not fit the 32-byte receive buffer"):
        wait_all([recv], 5)
    with pytest.raises(TransportError, match="rank 1 refused"):
        wait_all([send], 5)
    s.close()
    r.close()
    del s, r, send, recv
    gc.collect()
    assert _memfds() == [], "segments still open or mapped after a failed transfer and close"


def test_ranks_on_two_hosts_are_refused() -> None:
    eps = LoopbackHub(3).endpoints()
    hosts = ["node-a", "node-a", "node-b"]
    out: dict[int, list[str]] = {}

    def rank(g: int) -> None:
        out[g] = _colocation_problems("cuda-ipc", eps[g], 5, lambda r: f"rank {r}", "", host=hosts[g])
    threads = [threading.Thread(target=rank, args=(g,)) for g in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out[0] == out[1] == out[2] == [
        "--transport cuda-ipc needs every rank of both jobs on one node, but they run on 2 hosts "
        "(node-a: rank 0, rank 1; node-b: rank 2); use nccl, gloo or mpi across nodes"]


class CpuIpc:
    """CPU tensors standing in for GPU ones in the cuda-ipc backend: "sharing" a storage registers
    it, "opening" finds it (the ranks are threads of one process), events are done at once. So the
    backend's own code (storages, offsets, the mapped views, in-place copies) runs on any CPU."""

    device_type = "cpu"
    registry: dict[int, Any] = {}

    def share(self, st: Any) -> dict[str, Any]:
        key = len(CpuIpc.registry)
        CpuIpc.registry[key] = st
        return {"handle": key, "size": st.nbytes()}

    def open(self, d: dict[str, Any]) -> Any:
        return CpuIpc.registry[d["handle"]]

    def event(self, device: Any) -> Any:
        return None

    def done(self, ev: Any) -> bool:
        return True


def test_cuda_ipc_backend_with_cpu_tensors_standing_in() -> None:
    """The cuda-ipc backend through RefitSession, torch tensors, several pushes: byte for byte,
    in place, with the trainer's own storages exposed once each (no staging)."""
    torch = pytest.importorskip("torch")
    from streamer.transport.cuda_ipc import CudaIpcBackend

    src, dst = _manifests()
    backends: dict[int, CudaIpcBackend] = {}

    def transport_of(ep: Any) -> HandleTransport:
        backends[ep.rank] = CudaIpcBackend(torch.device("cpu"), CpuIpc())
        return HandleTransport(backends[ep.rank], ep)

    def as_torch(ts: dict[str, np.ndarray]) -> dict[str, Any]:
        return {n: torch.from_numpy(v).view(torch.bfloat16) if v.dtype == np.uint16 else torch.from_numpy(v)
                for n, v in ts.items()}
    full = oracle_arrays(ARRAYS)
    src_np = make_source_tensors(src, full)
    srcs = {r: as_torch(ts) for r, ts in src_np.items()}  # the same memory
    dst_np = empty_dest_tensors(dst)
    dsts = {r: as_torch(ts) for r, ts in dst_np.items()}
    ptrs = {r: {n: v.data_ptr() for n, v in ts.items()} for r, ts in dsts.items()}
    exposed: dict[int, list[int]] = {}

    def act(s: RefitSession, r: int) -> Any:
        for step in range(3):
            if s.role == "send":
                for n, v in make_source_tensors(src, _changed(full, step))[r].items():
                    src_np[r][n][...] = v
                s.push(srcs[r])
            else:
                s.pull(dsts[r])
            exposed.setdefault(s._t.rank, []).append(len(backends[s._t.rank]._kept))
        return None
    _, errors = run_sessions(src, dst, act, transport_of=transport_of, verify=True)
    assert not errors, errors
    assert check_dest_tensors(dst, dst_np, _changed(full, 2)) == []  # the numpy views of the torch tensors
    assert {r: {n: v.data_ptr() for n, v in ts.items()} for r, ts in dsts.items()} == ptrs
    assert all(len(set(v)) == 1 for v in exposed.values()), exposed  # exposed once, in the first push
    # the trainers' tensors were exposed, not only the two bucket slots
    assert any(v[0] > 2 for g, v in exposed.items() if g < src.world_size), exposed
