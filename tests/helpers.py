"""Shared test helpers: random layout pairs (Hypothesis), oracle data, and running every rank of a
plan in threads over the loopback transport.

Oracle data: byte ``b`` of array ``fqn`` (global row-major byte index) is
``(b + (b >> 8) + salt(fqn)) % 256`` -- the global index mod 256, plus the 256-byte block number
(so a region landing a whole block off is caught) and a per-array salt (so a region landing in
the wrong array is caught). ``bool`` arrays keep only the low bit so that they stay valid bools.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from formats.layouts import (
    Mesh,
    Placement,
    Replicate,
    Shard,
    build_manifest,
)
from formats.manifest.box import Box
from formats.manifest.dtypes import DTYPES, np_storage
from formats.manifest.wire import Manifest
from streamer.execute.executor import ExecStats, Executor
from streamer.execute.schedule import build_schedule
from streamer.plan.model import Plan
from streamer.transport.loopback import LoopbackHub

__all__ = [
    "DTYPES_UNDER_TEST",
    "LayoutPair",
    "RunResult",
    "array_sets",
    "check_dest_tensors",
    "empty_dest_tensors",
    "lay_out",
    "make_source_tensors",
    "meshes",
    "n_examples",
    "oracle_arrays",
    "random_layout_pair",
    "region_slices",
    "run_plan_loopback",
    "run_sessions",
]

DTYPES_UNDER_TEST = ("bfloat16", "float32", "int64", "uint8", "bool")
AXIS_NAMES = ("dp", "tp", "cp", "fsdp")  # no pp / ep: those place arrays by name


# --------------------------------------------------------------------------- strategies


def n_examples(n: int) -> int:
    """``n`` examples under the default ``ci`` profile (40 examples), scaled with the loaded
    profile's ``max_examples`` (``HYPOTHESIS_PROFILE=thorough`` runs 12.5x more)."""
    cur = settings.default
    return max(1, n * (cur.max_examples if cur is not None else 40) // 40)


@dataclass(frozen=True)
class LayoutPair:
    arrays: dict[str, tuple[tuple[int, ...], str]]
    src: Manifest
    dst: Manifest
    src_domain_size: int | None
    dst_domain_size: int | None

    def __repr__(self) -> str:  # short, for Hypothesis' falsifying-example output
        def desc(m: Manifest) -> str:
            mesh = m.mesh or {}
            return f"{dict(zip(mesh.get('axes', []), mesh.get('shape', [])))}"

        return (
            f"LayoutPair(arrays={self.arrays}, src_mesh={desc(self.src)}, dst_mesh={desc(self.dst)}, "
            f"src_placements={self.src.name}, dst_placements={self.dst.name}, "
            f"src_domain_size={self.src_domain_size}, dst_domain_size={self.dst_domain_size})"
        )


@st.composite
def meshes(draw: Any, max_axes: int = 3, max_ranks: int = 8, max_axis: int = 3) -> Mesh:
    n = draw(st.integers(1, max_axes))
    axes = draw(st.permutations(AXIS_NAMES))[:n]
    shape: list[int] = []
    for _ in axes:
        room = max_ranks // max(1, prod(shape))
        shape.append(draw(st.integers(1, max(1, min(max_axis, room)))))
    return Mesh(tuple(axes), tuple(shape))


@st.composite
def array_sets(
    draw: Any,
    max_arrays: int = 3,
    max_ndim: int = 4,
    max_dim: int = 7,
    dtypes: Sequence[str] = DTYPES_UNDER_TEST,
    allow_empty: bool = False,
) -> dict[str, tuple[tuple[int, ...], str]]:
    n = draw(st.integers(1, max_arrays))
    lo = 0 if allow_empty else 1
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(n):
        nd = draw(st.integers(0, max_ndim))
        # keep 4-d arrays small
        cap = max_dim if nd <= 2 else max(2, max_dim // 2)
        shape = tuple(draw(st.lists(st.integers(lo, cap), min_size=nd, max_size=nd)))
        out[f"layers.{i}.w"] = (shape, draw(st.sampled_from(list(dtypes))))
    return out


def _placements(draw: Any, shape: Sequence[int], mesh: Mesh) -> tuple[Placement, ...]:
    opts: list[Placement] = [Replicate()]
    opts += [Shard(d) for d in range(len(shape))]  # two axes may shard one dim (nested)
    return tuple(draw(st.sampled_from(opts)) if len(opts) > 1 else Replicate() for _ in mesh.axes)


def lay_out(
    arrays: Mapping[str, tuple[Sequence[int], str]],
    mesh: Mesh,
    placements: Mapping[str, Sequence[Placement]],
    *,
    name: str | None = None,
    domain_size: int | None = None,
    make_chunks: Any = None,
) -> Manifest:
    """A live (in-memory) manifest of ``arrays`` on ``mesh``."""
    return build_manifest(
        arrays,
        mesh,
        placements,
        file_pattern=None,
        make_chunks=make_chunks,
        name=name,
        domain_size=domain_size,
    )


@st.composite
def random_layout_pair(
    draw: Any,
    max_arrays: int = 3,
    max_ndim: int = 4,
    max_dim: int = 7,
    max_ranks: int = 8,
    dtypes: Sequence[str] = DTYPES_UNDER_TEST,
    domains: bool = True,
    allow_empty: bool = False,
) -> LayoutPair:
    """Random arrays laid out on two random meshes with random placements (``R`` / ``S(d)``,
    nested shards of one dim, uneven shapes, replica axes), plus optional domain sizes."""
    arrays = draw(
        array_sets(
            max_arrays=max_arrays, max_ndim=max_ndim, max_dim=max_dim, dtypes=dtypes, allow_empty=allow_empty
        )
    )
    sm = draw(meshes(max_ranks=max_ranks))
    dm = draw(meshes(max_ranks=max_ranks))
    spl = {fqn: _placements(draw, shape, sm) for fqn, (shape, _) in arrays.items()}
    dpl = {fqn: _placements(draw, shape, dm) for fqn, (shape, _) in arrays.items()}
    sname = ";".join(f"{k}={','.join(map(str, v))}" for k, v in spl.items())
    dname = ";".join(f"{k}={','.join(map(str, v))}" for k, v in dpl.items())
    sds = draw(st.none() | st.integers(1, sm.size)) if domains else None
    dds = draw(st.none() | st.integers(1, dm.size)) if domains else None
    src = lay_out(arrays, sm, spl, name=sname)
    dst = lay_out(arrays, dm, dpl, name=dname)
    return LayoutPair(arrays, src, dst, sds, dds)


# --------------------------------------------------------------------------- data


def region_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def _salt(fqn: str) -> int:
    return zlib.crc32(fqn.encode()) & 0xFF


def oracle_arrays(arrays: Mapping[str, tuple[Sequence[int], str]]) -> dict[str, np.ndarray]:
    """Full global arrays (numpy storage dtype: bf16 as uint16) with the oracle byte pattern."""
    out = {}
    for fqn, (shape, data_type) in arrays.items():
        dt = DTYPES[data_type]
        shape = tuple(shape)
        nbytes = prod(shape) * dt.itemsize
        b = np.arange(nbytes, dtype=np.uint64)
        raw = ((b + (b >> np.uint64(8)) + np.uint64(_salt(fqn))) % np.uint64(256)).astype(np.uint8)
        if data_type == "bool":
            raw &= 1
        out[fqn] = raw.view(np_storage(dt)).reshape(shape)
    return out


def _zeros(shape: Sequence[int], data_type: str) -> np.ndarray:
    return np.zeros(tuple(shape), dtype=np_storage(DTYPES[data_type]))


def make_source_tensors(
    src: Manifest, full_arrays: Mapping[str, np.ndarray]
) -> dict[int, dict[str, np.ndarray]]:
    """Every source rank's local tensors (shapes from ``src.local_tensors``), each chunk's region
    copied in at its ``source.offsets`` (fused local tensors included)."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for r in range(src.world_size):
        ts = {n: _zeros(spec.shape, spec.data_type) for n, spec in src.local_tensors(r).items()}
        out[r] = ts
    for fqn, _spec, c in src.iter_chunks():
        for h in c.holders:
            out[h][c.tensor(fqn)][region_slices(c.local_box)] = full_arrays[fqn][region_slices(c.region)]
    return out


def empty_dest_tensors(dst: Manifest) -> dict[int, dict[str, np.ndarray]]:
    """Every destination rank's local tensors (destination-local rank numbers), zero-filled."""
    return {
        r: {n: _zeros(spec.shape, spec.data_type) for n, spec in dst.local_tensors(r).items()}
        for r in range(dst.world_size)
    }


def check_dest_tensors(
    dst: Manifest, dst_tensors: Mapping[int, Mapping[str, np.ndarray]], full_arrays: Mapping[str, np.ndarray]
) -> list[str]:
    """Every destination (chunk, holder) whose bytes differ from the oracle."""
    bad = []
    for fqn, _spec, c in dst.iter_chunks():
        want = np.ascontiguousarray(full_arrays[fqn][region_slices(c.region)])
        for h in c.holders:
            got = np.ascontiguousarray(dst_tensors[h][c.tensor(fqn)][region_slices(c.local_box)])
            if got.tobytes() != want.tobytes():
                bad.append(
                    f"{fqn}: region {c.region} on destination rank {h} (tensor {c.tensor(fqn)!r} at "
                    f"{list(c.local_offsets)}) differs from the oracle"
                )
    return bad


# --------------------------------------------------------------------------- running


@dataclass
class RunResult:
    stats: dict[int, ExecStats] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    finished_at: dict[int, float] = field(default_factory=dict)  # seconds after the start
    hung: list[int] = field(default_factory=list)  # threads still alive after the join timeout
    not_started: list[int] = field(default_factory=list)
    hub: LoopbackHub | None = None
    schedule: list[Any] = field(default_factory=list)
    elapsed: float = 0.0

    def raise_first(self) -> None:
        if self.hung:
            raise AssertionError(f"ranks {self.hung} still running after the join timeout")
        for g, e in sorted(self.errors.items()):
            raise AssertionError(f"rank {g} failed: {e!r}") from e


def rank_tensors(
    plan: Plan, src_tensors: Mapping[int, Mapping[str, Any]], dst_tensors: Mapping[int, Mapping[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Local tensors of every global rank. Separate jobs: sources are ``0..S-1``, destinations
    ``S..S+D-1``. Same job: rank r gets both dicts merged (names must not collide)."""
    out: dict[int, dict[str, Any]] = {g: {} for g in range(plan.world_size)}
    for r, ts in src_tensors.items():
        out[r].update(ts)
    for r, ts in dst_tensors.items():
        g = plan.dst_global(r)
        clash = sorted(set(out[g]) & set(ts))
        if clash:
            raise ValueError(f"same-job rank {g}: source and destination local tensors share names {clash}")
        out[g].update(ts)
    return out


def run_plan_loopback(
    plan: Plan,
    src: Manifest,
    dst: Manifest,
    src_tensors: Mapping[int, Mapping[str, Any]],
    dst_tensors: Mapping[int, Mapping[str, Any]],
    *,
    bucket: int = 1 << 20,
    verify: bool = True,
    timeout: float = 10.0,
    window: int = 2,
    skip_ranks: Iterable[int] = (),
    corrupt: Callable[[int, int, int, bytearray], None] | None = None,
    join_timeout: float | None = None,
    zero_copy: bool = False,
) -> RunResult:
    """Run every global rank of ``plan`` in its own thread over one ``LoopbackHub``.

    Destination tensors are written in place. ``skip_ranks`` are never started (a dead peer;
    the hub drops messages to them). Nothing is raised here: errors are collected per rank in
    the result (``raise_first`` re-raises the first), and threads that outlive ``join_timeout``
    (default ``timeout + 10``) are listed in ``hung``. ``zero_copy`` gives ``build_schedule``
    the local tensor shapes (as ``RefitSession`` does), so that large contiguous transfers go as
    their own messages, sent from and received into the local tensors.
    """
    if zero_copy:
        shapes: dict[tuple[int, bool], dict[str, Any]] = {}

        def shape_of(g: int, tensor: str, on_dst: bool) -> tuple[int, ...]:
            key = (g, on_dst)
            if key not in shapes:
                shapes[key] = dst.local_tensors(plan.dst_local(g)) if on_dst else src.local_tensors(g)
            return tuple(shapes[key][tensor].shape)

        sched = build_schedule(plan, bucket, shape_of)
    else:
        sched = build_schedule(plan, bucket)
    hub = LoopbackHub(plan.world_size)
    hub.corrupt = corrupt
    skip = set(skip_ranks)
    hub.dead = set(skip)
    eps = hub.endpoints()
    tensors = rank_tensors(plan, src_tensors, dst_tensors)
    res = RunResult(hub=hub, schedule=sched, not_started=sorted(skip))
    lock = threading.Lock()
    t0 = time.monotonic()

    def body(g: int) -> None:
        try:
            ex = Executor(eps[g], plan, sched, tensors[g], timeout=timeout, window=window, verify=verify)
            s = ex.run()
            with lock:
                res.stats[g] = s
        except BaseException as e:  # noqa: BLE001 - reported per rank
            with lock:
                res.errors[g] = e
        finally:
            with lock:
                res.finished_at[g] = time.monotonic() - t0

    threads = {
        g: threading.Thread(target=body, args=(g,), daemon=True, name=f"rank-{g}")
        for g in range(plan.world_size)
        if g not in skip
    }
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + (timeout + 10.0 if join_timeout is None else join_timeout)
    for g, t in threads.items():
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            res.hung.append(g)
    res.elapsed = time.monotonic() - t0
    return res


def run_sessions(src: Manifest, dst: Manifest, act: Callable[[Any, int], Any], *, join_timeout: float = 30.0,
                 timeout: float = 10.0, corrupt: Callable[[int, int, int, bytearray], None] | None = None,
                 options_of: Callable[[str], dict[str, Any]] | None = None,
                 transport_of: Callable[[Any], Any] | None = None,
                 **options: Any) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """Every rank of a two-job refit as a thread over the loopback transport: each opens a
    ``RefitSession`` (senders ``0..S-1`` on ``src``, receivers on ``dst``) with ``options`` and runs
    ``act(session, local rank)``; ``options_of(role)`` adds options of one side only;
    ``transport_of(endpoint)`` moves the bytes over another transport built on the loopback
    endpoint (the control plane); ``timeout``: the sessions' own (a test that breaks a push waits
    it out). Returns each global rank's result and each one's exception."""
    from streamer.refit.options import RefitOptions
    from streamer.refit.session import RefitSession
    from streamer.transport.jobs import Group

    S, D = src.world_size, dst.world_size
    hub = LoopbackHub(S + D)
    hub.corrupt = corrupt
    eps = hub.endpoints()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def rank(g: int) -> None:
        role = "send" if g < S else "recv"
        try:
            t = transport_of(eps[g]) if transport_of else eps[g]
            kw = {**options, **(options_of(role) if options_of else {})}
            device_ops = kw.pop("device_ops", None)
            with RefitSession.open(src if role == "send" else dst, role, group=Group(eps[g], eps[g], role, S, D,
                                   plane="loopback"), transport=t, timeout=timeout, options=RefitOptions(**kw),
                                   device_ops=device_ops) as s:
                results[g] = act(s, g if g < S else g - S)
        except BaseException as e:  # noqa: BLE001 - collected per rank
            errors[g] = e

    threads = [threading.Thread(target=rank, args=(g,)) for g in range(S + D)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors


def this_hosts_address() -> str | None:
    """This host's address toward the rest of the network (its route to TEST-NET-2), or None where
    there is no route off the host."""
    from streamer.transport.torch_dist import routed_address

    return routed_address("198.51.100.1")
