"""Cluster cost model: how long a refit (trainer job -> inference job) would take on a real
cluster, for shardstream's reshard plan and for the gather-broadcast baseline.

No I/O, no MPI, no torch: ``formats`` + :mod:`streamer.plan.planner` only. Nothing is allocated: the
manifests describe full-size models, the planner is the real one, and the seconds come from
the formulas below applied to the plan's bytes per rank pair.

Layouts
-------
Trainer: Megatron-core (``formats.layouts.models.manifest_from_parallel``): ranks ``tp``
fastest, then ``cp``, ``fsdp``, ``dp``, ``pp`` slowest; non-expert arrays by the generic
Megatron rules (column-parallel ``S(0)``, row-parallel ``S(1)``, vocab-parallel embeddings),
experts whole on their ``ep`` block (parallel folding, ETP = 1). Generator: vLLM
``dp × tp`` (``pp`` too if given), experts TP-sharded (``ep = 1``) or on ``ep`` blocks.
Global ranks: trainers ``0..S-1``, generators ``S..S+D-1``; both jobs are cut into NVLink
domains of the cluster's ``domain_size`` and never share one (separate nodes).

Reshard cost (:func:`reshard_cost`)
-----------------------------------
* A message is one bucket (``bucket_size``, default 256 MiB, as ``refit``) from one rank to one
  peer in one phase: a rank pair in a phase exchanging ``b`` bytes sends ``ceil(b / bucket)``
  messages (the executor packs a pair's transfers into buckets the same way).
* Each message costs ``bytes / bandwidth(link class) + latency``. Link classes: *network* (the
  two ranks are in different domains: one NIC per GPU, ``nic`` bytes/s) and *nvlink* (same
  domain: per-GPU NVLink, unidirectional = half the published bidirectional figure).
* A rank's sends serialise, and so do its receives, separately: in a phase a rank takes
  ``max(send time, recv time)``; the phase takes as long as its busiest rank.
* Phase 2 (fan-out inside a destination domain) is pipelined with phase 1 bucket by bucket:
  ``total = max(p1, p2) + one bucket of the other phase``, i.e. ``p1 + min(p2, B/nvlink + lat)``
  when phase 1 dominates and ``p2 + min(p1, B/nic + lat)`` when phase 2 does.

Gather-broadcast baseline (:func:`broadcast_cost`)
--------------------------------------------------
What NeMo RL does without ``nccl_reshard``: trainer rank 0 (the root) gathers every array, and
a pipelined ring broadcasts each to every generator rank that needs it.

* Gather: the root pulls each source chunk it does not hold from a holder in its own domain when
  there is one (NVLink) or over its NIC. Its receives serialise:
  ``Tg = local_bytes / nvlink + network_bytes / nic + chunks · latency``.
* Broadcast: one ring (``broadcast_rings`` > 1 models NCCL spreading the ring over several
  NICs) through the root and the ``L`` generator ranks, domain by domain. The ring's speed is
  its slowest link, ``bw = min(rings · nic, nvlink)`` (the ring always crosses the job
  boundary once). Pipelined in chunks ``c`` (NCCL-style, 1 MiB) it takes
  ``Tb = M / bw + (L - 1)(c / bw + latency) + n_buckets · latency`` for ``M`` total bytes.
* Gather and broadcast are double-buffered by bucket:
  ``T = max(Tg, Tb) + min(Tg, Tb) / n_buckets``.

Scaling identical layers (``planning="scaled"``, the default)
-------------------------------------------------------------
A full DeepSeek-V3 plan has 14 million transfers; the planner makes it in about 1.5 s, but the
scale tables go to 1024 GPUs and to Kimi-K2 (1.03T parameters), where the whole plan grows. So by
default the simulator plans *one representative layer of each kind* (same array
names after ``layers.{i}``, same shapes and dtypes, same generator pipeline stage) with the
real planner, on manifests holding just that layer, plus one plan for the arrays outside the
layers (embeddings, final norm, ``lm_head``). A layer on another trainer stage is the
representative with every source rank shifted by ``(stage - stage0) · ranks_per_stage``:
the planner orders and breaks ties by rank, so a uniform shift gives the same plan shifted.
The simulated plan is therefore exactly the union of independent per-layer plans (each made by
``plan_transfers``), a valid plan that moves the same bytes per link class as one whole-model
plan; only the greedy balancing differs (the whole plan balances across layers too).
``tests/unit/test_simulate.py`` checks on small models that the scaled figures equal the
per-layer union exactly and the whole-model plan's bytes exactly. ``planning="whole"`` runs
one ``plan_transfers`` over the full manifests (exact).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from formats.errors import UsageError
from formats.layouts.models import manifest_from_parallel, parallel_meshes
from formats.layouts.rules import layer_index, stage_of_layer
from formats.manifest.wire import Manifest
from streamer.cli.args import emit, parse_size, positive_int
from streamer.plan.gcpause import paused_gc
from streamer.plan.model import Plan
from streamer.plan.planner import plan_transfers

__all__ = [
    "CLUSTERS",
    "PLANNING_MODES",
    "Cluster",
    "broadcast_cost",
    "delta_cost",
    "group_layers",
    "reshard_cost",
    "simulate",
    "with_overrides",
]

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """Link speeds of one GPU. Figures are bytes per second (1 GB/s = 1e9 B/s)."""

    name: str
    #: GPUs per NVLink domain
    domain_size: int
    #: per-GPU NVLink, one direction (half the published bidirectional figure)
    nvlink_bytes_per_s: float
    #: per-GPU NIC, one direction
    nic_bytes_per_s: float
    #: fixed cost of one message (one bucket to one peer); an assumption, not a published spec
    latency_s: float = 10e-6
    #: refit bucket (one message at most), as ``shardstream refit --bucket-size``
    bucket_bytes: int = 256 << 20
    #: parallel rings of the broadcast baseline (1: one NIC per inter-domain hop)
    broadcast_rings: int = 1
    #: pipeline chunk of the baseline's ring broadcast (NCCL-style)
    broadcast_chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for k in ("domain_size", "bucket_bytes", "broadcast_rings", "broadcast_chunk_bytes"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"cluster {self.name}: {k} must be an integer >= 1, got {v!r}")
        for k in ("nvlink_bytes_per_s", "nic_bytes_per_s"):
            if not getattr(self, k) > 0:
                raise UsageError(f"cluster {self.name}: {k} must be > 0, got {getattr(self, k)!r}")
        if not self.latency_s >= 0:
            raise UsageError(f"cluster {self.name}: latency must be >= 0, got {self.latency_s!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nvlink_gb_per_s"] = self.nvlink_bytes_per_s / GB
        d["nic_gb_per_s"] = self.nic_bytes_per_s / GB
        d["latency_us"] = self.latency_s * 1e6
        return d


#: public specs (workloads/README.md). DGX H100: 8 GPUs per NVLink domain, NVLink
#: 900 GB/s per GPU bidirectional (450 one way), one 400 Gb/s (50 GB/s) InfiniBand NIC per GPU.
#: GB200 NVL72: 72 GPUs per domain, NVLink 1.8 TB/s per GPU bidirectional (900 one way), one
#: 400 Gb/s NIC per GPU (ConnectX-7; pass --nic-gbps 100 for 800 Gb/s ConnectX-8).
CLUSTERS: dict[str, Cluster] = {
    "dgx-h100": Cluster("dgx-h100", 8, 450 * GB, 50 * GB),
    "gb200-nvl72": Cluster("gb200-nvl72", 72, 900 * GB, 50 * GB),
}

#: how the plan is built: one representative per layer kind (default), every layer planned on its
#: own (verification), or one plan of the whole model (exact, small models only)
PLANNING_MODES = ("scaled", "per-layer", "whole")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")


# ---------------------------------------------------------------- grouping


def _kind_name(fqn: str) -> str:
    m = _LAYER_RE.search(fqn)
    if m is None:
        return fqn
    return fqn[: m.start(1)] + "{L}" + fqn[m.end(1):]


def group_layers(arrays: Mapping[str, tuple[Sequence[int], str]]) -> tuple[list[str], dict[Any, list[int]]]:
    """``(arrays outside any layer, {layer kind: [layer indices]})``. A kind is the sorted tuple of
    ``(name with the layer index replaced by {L}, shape, data_type)`` of one layer's arrays."""
    misc: list[str] = []
    per_layer: dict[int, list[tuple[str, tuple[int, ...], str]]] = defaultdict(list)
    for fqn, (shape, dt) in arrays.items():
        li = layer_index(fqn)
        if li is None:
            misc.append(fqn)
        else:
            per_layer[li].append((_kind_name(fqn), tuple(shape), dt))
    kinds: dict[Any, list[int]] = defaultdict(list)
    for li in sorted(per_layer):
        kinds[tuple(sorted(per_layer[li]))].append(li)
    return misc, dict(kinds)


# ---------------------------------------------------------------- plan -> pair bytes


_ADDITIVE = ("total_bytes", "moved_bytes", "lower_bound_bytes", "network_bytes", "local_bytes",
             "min_network_bytes", "transfers", "phase2_transfers")


@dataclass
class _Accum:
    pairs: dict[tuple[int, int, int], int]
    totals: Counter[str]
    plans: int = 0
    plan_seconds: float = 0.0
    manifest_seconds: float = 0.0
    max_transfers: int = 0

    def add(self, plan: Plan, *, S: int, shifts: Mapping[int, int]) -> None:
        """Add ``plan`` once per layer: ``shifts`` maps a source-rank shift to a layer count."""
        n = sum(shifts.values())
        st = plan.stats()
        for k in _ADDITIVE:
            self.totals[k] += getattr(st, k) * n
        self.max_transfers = max(self.max_transfers, st.transfers)
        for (ph, s, d), b in plan.pair_bytes().items():
            for sh, cnt in shifts.items():
                src = s + sh if s < S else s  # phase 2 starts on a generator: not shifted
                self.pairs[(ph, src, d)] += b * cnt


# ---------------------------------------------------------------- costs


def _link(src: int, dst: int, S: int, ds: int) -> str:
    """``network`` or ``nvlink`` between two global ranks (separate jobs never share a domain)."""
    if (src < S) != (dst < S):
        return "network"
    a, b = (src, dst) if src < S else (src - S, dst - S)
    return "nvlink" if a // ds == b // ds else "network"


def reshard_cost(pairs: Mapping[tuple[int, int, int], int], *, S: int, cluster: Cluster) -> dict[str, Any]:
    """Seconds of a plan given its bytes per ``(phase, src, dst)`` (see the module docstring)."""
    bw = {"network": cluster.nic_bytes_per_s, "nvlink": cluster.nvlink_bytes_per_s}
    lat, bucket, ds = cluster.latency_s, cluster.bucket_bytes, cluster.domain_size
    # (phase, rank, direction) -> [seconds, bytes, link]
    load: dict[tuple[int, int, str], list[Any]] = {}
    by_class: Counter[str] = Counter()
    for (ph, s, d), b in pairs.items():
        link = _link(s, d, S, ds)
        by_class[link] += b
        t = b / bw[link] + math.ceil(b / bucket) * lat
        for key in ((ph, s, "send"), (ph, d, "recv")):
            cur = load.get(key)
            if cur is None:
                load[key] = [t, b, link]
            else:
                cur[0] += t
                cur[1] += b
                if cur[2] != link:
                    cur[2] = "mixed"
    phase_s = {1: 0.0, 2: 0.0}
    busiest: dict[int, dict[str, Any]] = {}
    for (ph, r, direction), (t, b, link) in sorted(load.items()):
        if ph not in busiest or t > phase_s[ph]:
            phase_s[ph] = t
            busiest[ph] = {"rank": r, "job": "trainer" if r < S else "generator",
                           "job_rank": r if r < S else r - S, "phase": ph, "direction": direction,
                           "link": link, "seconds": t, "bytes": b}
    p1, p2 = phase_s.get(1, 0.0), phase_s.get(2, 0.0)
    if p1 >= p2:
        total = p1 + min(p2, bucket / cluster.nvlink_bytes_per_s + lat)
    else:
        total = p2 + min(p1, bucket / cluster.nic_bytes_per_s + lat)
    top = max(busiest.values(), key=lambda x: x["seconds"], default=None)
    send: Counter[int] = Counter()
    recv: Counter[int] = Counter()
    for (_, s, d), b in pairs.items():
        send[s] += b
        recv[d] += b
    return {"seconds": total, "phase1_s": p1, "phase2_s": p2, "network_bytes": by_class["network"],
            "local_bytes": by_class["nvlink"], "busiest": top, "busiest_by_phase": busiest,
            "max_send_bytes": max(send.values(), default=0), "max_recv_bytes": max(recv.values(), default=0),
            "messages": sum(math.ceil(b / bucket) for b in pairs.values())}


def delta_cost(pairs: Mapping[tuple[int, int, int], int], *, S: int, cluster: Cluster, fraction: float,
               encode_bytes_per_s: float) -> dict[str, Any]:
    """Seconds of a delta refit (``refit --delta``): ``fraction`` of every rank pair's bytes
    crosses, encoded; each GPU encodes the full bytes it sends and decodes the full bytes it
    receives at ``encode_bytes_per_s``, pipelined with the wire bucket by bucket. So the refit
    takes the slower of the wire and the busiest GPU's coding, plus the coding of one bucket at
    each end (the first encode and the last decode, which nothing hides)."""
    if not 0 <= fraction <= 1:
        raise UsageError(f"delta fraction must be between 0 and 1, got {fraction!r}")
    if not encode_bytes_per_s > 0:
        raise UsageError(f"encode rate must be > 0, got {encode_bytes_per_s!r}")
    wire = reshard_cost({k: math.ceil(b * fraction) for k, b in pairs.items()}, S=S, cluster=cluster)
    coded: Counter[int] = Counter()
    for (_, s, d), b in pairs.items():
        coded[s] += b
        coded[d] += b
    coding = max(coded.values(), default=0) / encode_bytes_per_s
    ends = 2 * min(cluster.bucket_bytes, max(pairs.values(), default=0)) / encode_bytes_per_s
    return {"seconds": max(wire["seconds"], coding) + ends, "wire_s": wire["seconds"], "coding_s": coding,
            "fraction": fraction, "encode_gb_per_s": encode_bytes_per_s / GB,
            "network_bytes": wire["network_bytes"], "local_bytes": wire["local_bytes"]}


def broadcast_cost(*, gather_local_bytes: int, gather_network_bytes: int, gather_chunks: int, total_bytes: int,
                   ring_ranks: int, cluster: Cluster) -> dict[str, Any]:
    """Seconds of the gather-broadcast baseline (formulas in the module docstring). ``ring_ranks``
    is the number of generator ranks on the ring (``L``)."""
    lat = cluster.latency_s
    tg = (gather_local_bytes / cluster.nvlink_bytes_per_s + gather_network_bytes / cluster.nic_bytes_per_s
          + gather_chunks * lat)
    bw = min(cluster.broadcast_rings * cluster.nic_bytes_per_s, cluster.nvlink_bytes_per_s)
    c = min(cluster.broadcast_chunk_bytes, max(total_bytes, 1))
    n_buckets = max(1, math.ceil(total_bytes / cluster.bucket_bytes))
    tb = total_bytes / bw + max(ring_ranks - 1, 0) * (c / bw + lat) + n_buckets * lat
    total = max(tg, tb) + min(tg, tb) / n_buckets
    return {"seconds": total, "gather_s": tg, "broadcast_s": tb, "ring_gb_per_s": bw / GB, "buckets": n_buckets}


# ---------------------------------------------------------------- simulate


def _stage(li: int, num_layers: int, pp: int) -> int:
    return stage_of_layer(li, num_layers, pp) if pp > 1 else 0


def _mesh_text(par: Mapping[str, Any]) -> str:
    ne, ex = parallel_meshes(par)
    return str(ne) + (f" (experts {ex})" if ex is not None else "")


def _cluster(cluster: Cluster | str, planning: str) -> Cluster:
    if isinstance(cluster, str):
        if cluster not in CLUSTERS:
            raise UsageError(f"unknown cluster {cluster!r} (known: {', '.join(CLUSTERS)})")
        cluster = CLUSTERS[cluster]
    if planning not in PLANNING_MODES:
        raise UsageError(f"planning {planning!r}: expected one of {', '.join(PLANNING_MODES)}")
    return cluster


@dataclass
class _Groups:
    """What to plan: each group is (array names of a representative, {source-rank shift: layers})."""

    groups: list[tuple[list[str], dict[int, int]]]
    layers: int  # distinct layer indices


def _groups(arrays: Mapping[str, tuple[Sequence[int], str]], train: Mapping[str, Any],
            generation: Mapping[str, Any], planning: str, num_layers: int) -> _Groups:
    """The plans to make: the whole model, every layer, or one representative per layer kind and
    generator stage whose copies on other trainer stages are the same plan shifted."""
    misc, kinds = group_layers(arrays)
    layers_of: dict[int, list[str]] = defaultdict(list)
    for fqn in arrays:
        li = layer_index(fqn)
        if li is not None:
            layers_of[li].append(fqn)
    if planning == "whole":
        return _Groups([(list(arrays), {0: 1})], len(layers_of))
    groups: list[tuple[list[str], dict[int, int]]] = [(misc, {0: 1})] if misc else []
    for layers in kinds.values():
        by_gen: dict[int, list[int]] = defaultdict(list)
        for li in layers:
            by_gen[_stage(li, num_layers, generation["pp"])].append(li)
        for members in by_gen.values():
            if planning == "per-layer":
                groups.extend((layers_of[li], {0: 1}) for li in members)
                continue
            rep = members[0]
            s0 = _stage(rep, num_layers, train["pp"])
            by_shift: Counter[int] = Counter()
            for li in members:
                by_shift[(_stage(li, num_layers, train["pp"]) - s0) * train["ranks_per_stage"]] += 1
            groups.append((layers_of[rep], dict(by_shift)))
    return _Groups(groups, len(layers_of))


@dataclass
class _Gather:
    """The baseline's gather to trainer rank 0: chunks and bytes it pulls, by link class."""

    local_bytes: int = 0
    network_bytes: int = 0
    chunks: int = 0

    def add(self, src: Manifest, shifts: Mapping[int, int], domain_size: int, root: int = 0) -> None:
        """``src``'s chunks once per layer (holders shifted by each of ``shifts``)."""
        for a in src.arrays.values():
            isz = a.dtype.itemsize
            for c in a.chunks:
                nb = c.region.volume * isz
                for sh, cnt in shifts.items():
                    hs = [h + sh for h in c.holders]
                    if root in hs:
                        continue
                    self.chunks += cnt
                    if any(h // domain_size == root // domain_size for h in hs):
                        self.local_bytes += nb * cnt
                    else:
                        self.network_bytes += nb * cnt


def _plan_groups(arrays: Mapping[str, tuple[Sequence[int], str]], groups: _Groups, train: Mapping[str, Any],
                 generation: Mapping[str, Any], domain_size: int, *, direct: bool,
                 num_layers: int) -> tuple[_Accum, _Accum, _Gather]:
    """Plan every group with the real planner; add its pair bytes once per layer it stands for
    (and, with ``direct``, plan it again without destination domains)."""
    acc = _Accum(defaultdict(int), Counter())
    acc_direct = _Accum(defaultdict(int), Counter())
    gather = _Gather()
    S = train["num_gpus"]
    for names, shifts in groups.groups:
        sub = {n: arrays[n] for n in names}
        t0 = time.perf_counter()
        src = manifest_from_parallel(sub, train, num_layers=num_layers)
        dst = manifest_from_parallel(sub, generation, num_layers=num_layers)
        acc.manifest_seconds += time.perf_counter() - t0
        for dst_ds, into in ((domain_size, acc), (1, acc_direct)) if direct else ((domain_size, acc),):
            with paused_gc():
                t0 = time.perf_counter()
                plan = plan_transfers(src, dst, src_domain_size=domain_size, dst_domain_size=dst_ds)
                into.plan_seconds += time.perf_counter() - t0
                into.plans += 1
                into.add(plan, S=S, shifts=shifts)
                del plan
        gather.add(src, shifts, domain_size)
    return acc, acc_direct, gather


def simulate(arrays: Mapping[str, tuple[Sequence[int], str]], train: Mapping[str, Any],
             generation: Mapping[str, Any], cluster: Cluster | str, *, planning: str = "scaled",
             direct: bool = False, num_layers: int | None = None, delta_fraction: float | None = None,
             encode_gbps: float | None = None) -> dict[str, Any]:
    """Simulated refit of ``arrays`` from a trainer laid out by ``train`` to a generator laid out
    by ``generation`` (sizes as :func:`formats.layouts.models.parallel_from_dict` returns them)
    on ``cluster``. Returns a JSON-able dict: ``reshard_s``, ``broadcast_s``, ``speedup``,
    ``network_bytes``, ``local_bytes``, the busiest link, bytes per GPU, and how it was planned.
    ``direct`` also plans without destination domains (every generator rank fed over the
    network, NCCL M2N's DIRECT algorithm) and reports ``direct_s``. ``delta_fraction`` (with
    ``encode_gbps`` per GPU; default ``delta.ENCODE_GBPS``, one CPU core as ``bench refit --delta``
    measures it) also reports ``delta``: a delta refit's time (:func:`delta_cost`)."""
    if encode_gbps is not None and delta_fraction is None:
        raise UsageError("simulate: --encode-gbps goes with --delta-fraction")
    if delta_fraction is not None and encode_gbps is None:
        from streamer.execute.delta import ENCODE_GBPS

        encode_gbps = ENCODE_GBPS
    cluster = _cluster(cluster, planning)
    if num_layers is None:
        idx = [li for li in (layer_index(n) for n in arrays) if li is not None]
        num_layers = max(idx) + 1 if idx else 1
    groups = _groups(arrays, train, generation, planning, num_layers)
    acc, acc_direct, gather = _plan_groups(arrays, groups, train, generation, cluster.domain_size,
                                           direct=direct, num_layers=num_layers)
    out = _report(arrays, train, generation, cluster, acc, gather)
    out["planning"] = planning
    out["plans"] = acc.plans
    out["plan_seconds"] = acc.plan_seconds
    out["manifest_seconds"] = acc.manifest_seconds
    out["largest_plan_transfers"] = acc.max_transfers
    out["constants"] = cluster.to_dict()
    if planning == "scaled":
        out["approximation"] = (f"planned {acc.plans} representative group(s) (one per layer kind + the "
                                f"non-layer arrays) and multiplied them over {groups.layers} layers; identical "
                                f"layers give identical transfers, shifted by pipeline stage")
    if direct:
        dcost = reshard_cost(acc_direct.pairs, S=train["num_gpus"], cluster=cluster)
        out["direct_s"] = dcost["seconds"]
        out["direct_network_bytes"] = dcost["network_bytes"]
        out["direct_max_recv_bytes"] = dcost["max_recv_bytes"]
        out["plan_seconds"] += acc_direct.plan_seconds
    if delta_fraction is not None and encode_gbps is not None:
        out["delta"] = delta_cost(acc.pairs, S=train["num_gpus"], cluster=cluster, fraction=delta_fraction,
                                  encode_bytes_per_s=encode_gbps * GB)
    return out


def _report(arrays: Mapping[str, tuple[Sequence[int], str]], train: Mapping[str, Any],
            generation: Mapping[str, Any], cluster: Cluster, acc: _Accum, gather: _Gather) -> dict[str, Any]:
    """The costs of both strategies and the bytes behind them (``simulate``'s figures)."""
    S, D, ds = train["num_gpus"], generation["num_gpus"], cluster.domain_size
    total_model = sum(_nbytes(s, dt) for s, dt in arrays.values())
    cost = reshard_cost(acc.pairs, S=S, cluster=cluster)
    bc = broadcast_cost(gather_local_bytes=gather.local_bytes, gather_network_bytes=gather.network_bytes,
                        gather_chunks=gather.chunks, total_bytes=total_model, ring_ranks=D, cluster=cluster)
    gen_domains = -(-D // ds)
    totals = dict(acc.totals)
    return {
        "cluster": cluster.name,
        "train_mesh": _mesh_text(train),
        "generation_mesh": _mesh_text(generation),
        "train_gpus": S,
        "generation_gpus": D,
        "reshard_s": cost["seconds"],
        "broadcast_s": bc["seconds"],
        "speedup": bc["seconds"] / cost["seconds"] if cost["seconds"] else None,  # None: nothing to move
        "network_bytes": cost["network_bytes"],
        "local_bytes": cost["local_bytes"],
        "phase1_s": cost["phase1_s"],
        "phase2_s": cost["phase2_s"],
        "busiest": cost["busiest"],
        "model_bytes": total_model,
        "total_bytes": totals.get("total_bytes", 0),
        "moved_bytes": totals.get("moved_bytes", 0),
        "min_network_bytes": totals.get("min_network_bytes", 0),
        "max_send_bytes": cost["max_send_bytes"],
        "max_recv_bytes": cost["max_recv_bytes"],
        "bytes_per_generator_gpu": totals.get("total_bytes", 0) / D,
        "transfers": totals.get("transfers", 0),
        "messages": cost["messages"],
        "broadcast": {**bc, "gather_local_bytes": gather.local_bytes, "gather_network_bytes": gather.network_bytes,
                      "gather_chunks": gather.chunks,
                      "broadcast_network_bytes": total_model * gen_domains,
                      "broadcast_local_bytes": total_model * (D - gen_domains)},
    }


def _nbytes(shape: Sequence[int], data_type: str) -> int:
    from formats.manifest.dtypes import by_name

    n = by_name(data_type).itemsize
    for s in shape:
        n *= s
    return n


def with_overrides(cluster: Cluster, *, nvlink_gbps: float | None = None, nic_gbps: float | None = None,
                   latency_us: float | None = None, bucket_bytes: int | None = None,
                   broadcast_rings: int | None = None) -> Cluster:
    """``cluster`` with some constants replaced (GB/s = 1e9 bytes/s, microseconds)."""
    kw: dict[str, Any] = {}
    if nvlink_gbps is not None:
        kw["nvlink_bytes_per_s"] = nvlink_gbps * GB
    if nic_gbps is not None:
        kw["nic_bytes_per_s"] = nic_gbps * GB
    if latency_us is not None:
        kw["latency_s"] = latency_us * 1e-6
    if bucket_bytes is not None:
        kw["bucket_bytes"] = bucket_bytes
    if broadcast_rings is not None:
        kw["broadcast_rings"] = broadcast_rings
    return replace(cluster, **kw) if kw else cluster


# ---------------------------------------------------------------- command line (``shardstream simulate``)


def _sizes(text: str, what: str) -> dict[str, int]:
    """``num_gpus=256,pp=16,ep=16`` -> an M2N side dict (``pp`` -> ``pp_size``)."""
    out: dict[str, int] = {}
    for part in text.split(","):
        k, eq, v = part.strip().partition("=")
        k = k.strip()
        if not eq or not k or not v.strip().isdigit():
            raise UsageError(f"--{what} {text!r}: expected KEY=N,... (num_gpus, tp, cp, ep, pp, fsdp, dp)")
        key = k if k == "num_gpus" or k.endswith("_size") else f"{k}_size"
        out[key] = int(v)
    return out


def add_simulate_parser(sub: Any) -> None:
    """Register ``shardstream simulate`` on the CLI's subparsers."""
    p = sub.add_parser("simulate", help="simulated refit time on a cluster: reshard plan vs gather-broadcast")
    p.add_argument("--model", required=True, metavar="CFG", help="HF config.json or NCCL M2N model JSON")
    p.add_argument("--system", metavar="SYSTEM.json", help="NCCL M2N system JSON (train + generation sizes)")
    p.add_argument("--train", metavar="K=N,...", help="trainer sizes instead of --system, e.g. num_gpus=256,pp=16,ep=16")
    p.add_argument("--generation", metavar="K=N,...", help="generator sizes instead of --system, e.g. num_gpus=256,tp=32,dp=8")
    p.add_argument("--cluster", required=True, choices=sorted(CLUSTERS))
    p.add_argument("--nvlink-gbps", type=float, metavar="X", help="per-GPU NVLink, one direction, in GB/s (bytes)")
    p.add_argument("--nic-gbps", type=float, metavar="Y", help="per-GPU NIC in GB/s (bytes: 400 Gb/s = 50)")
    p.add_argument("--latency-us", type=float, metavar="Z", help="cost of one message (default 10)")
    p.add_argument("--bucket-size", type=parse_size, metavar="SIZE", help="message size (default 256MiB)")
    p.add_argument("--broadcast-rings", type=positive_int, metavar="N", help="baseline rings over N NICs (default 1)")
    p.add_argument("--fp8", action="store_true", help="HF config: block-FP8 linear weights + weight_scale_inv")
    p.add_argument("--include-mtp", action="store_true", help="HF config: DeepSeek-V3 MTP layers too")
    p.add_argument("--direct", action="store_true", help="also plan without destination domains (M2N DIRECT)")
    p.add_argument("--delta-fraction", type=float, metavar="F",
                   help="also a delta refit: F of the bytes cross the network (refit --delta)")
    p.add_argument("--encode-gbps", type=float, metavar="G",
                   help="delta encode and decode rate per GPU, GB/s (default: one CPU core as bench refit --delta "
                        "measured it, streamer.execute.delta.ENCODE_GBPS)")
    p.add_argument("--planning", choices=PLANNING_MODES, default="scaled",
                   help="scaled (default): one plan per layer kind; whole: one exact plan (small models)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: Any) -> int:
    from formats.layouts.models import arrays_from_model, parallel_from_dict, parse_m2n_system

    if args.system and (args.train or args.generation):
        raise UsageError("simulate: give --system or --train/--generation, not both")
    if args.system:
        train, gen = parse_m2n_system(args.system)
    elif args.train and args.generation:
        train = parallel_from_dict(_sizes(args.train, "train"), where="--train")
        gen = parallel_from_dict(_sizes(args.generation, "generation"), where="--generation")
    else:
        raise UsageError("simulate needs --system SYSTEM.json (or both --train and --generation)")
    cluster = with_overrides(CLUSTERS[args.cluster], nvlink_gbps=args.nvlink_gbps, nic_gbps=args.nic_gbps,
                             latency_us=args.latency_us, bucket_bytes=args.bucket_size,
                             broadcast_rings=args.broadcast_rings)
    t0 = time.perf_counter()
    arrays = arrays_from_model(args.model, fp8=args.fp8, include_mtp=args.include_mtp)
    r = simulate(arrays, train, gen, cluster, planning=args.planning, direct=args.direct,
                 delta_fraction=args.delta_fraction, encode_gbps=args.encode_gbps)
    r["model"] = str(args.model)
    r["seconds"] = time.perf_counter() - t0
    emit(args, r, format_report(r))
    return 0


def format_report(r: Mapping[str, Any]) -> str:
    """Human summary of :func:`simulate`'s result."""
    c = r["constants"]
    b = r["busiest"] or {}
    bc = r["broadcast"]
    lines = [
        (f"simulate {r.get('model', '')} on {r['cluster']} (domain {c['domain_size']} GPUs, NVLink "
        f"{c['nvlink_gb_per_s']:g} GB/s, NIC {c['nic_gb_per_s']:g} GB/s per GPU, latency {c['latency_us']:g} us, "
        f"bucket {c['bucket_bytes'] / 2**20:g} MiB)"),
        f"  trainer     {r['train_gpus']:5d} GPUs  {r['train_mesh']}",
        f"  generator   {r['generation_gpus']:5d} GPUs  {r['generation_mesh']}",
        f"  model       {r['model_bytes'] / GB:10.1f} GB",
        (f"  reshard     {r['reshard_s']:10.3f} s   (phase 1 network {r['phase1_s']:.3f} s, phase 2 NVLink "
        f"{r['phase2_s']:.3f} s, pipelined)"),
        (f"  broadcast   {r['broadcast_s']:10.3f} s   (gather {bc['gather_s']:.3f} s, ring broadcast "
        f"{bc['broadcast_s']:.3f} s at {bc['ring_gb_per_s']:g} GB/s, double-buffered)"),
        f"  speedup     {r['speedup']:10.2f} x" if r["speedup"] is not None else "  speedup     (nothing moves)",
    ]
    if "direct_s" in r:
        lines.append(f"  direct      {r['direct_s']:10.3f} s   (no domains: every generator rank fed over the network)")
    if "delta" in r:
        d = r["delta"]
        lines.append(f"  delta       {d['seconds']:10.3f} s   ({d['fraction']:.1%} of the bytes on the wire: "
                     f"{d['wire_s']:.3f} s; coding {d['coding_s']:.3f} s at {d['encode_gb_per_s']:g} GB/s per GPU, "
                     "pipelined)")
    lines += [
        (f"  bytes       network {r['network_bytes'] / GB:.1f} GB (minimum {r['min_network_bytes'] / GB:.1f}), "
        f"NVLink {r['local_bytes'] / GB:.1f} GB; per generator GPU {r['bytes_per_generator_gpu'] / GB:.2f} GB; "
        f"max send {r['max_send_bytes'] / GB:.2f} GB, max recv {r['max_recv_bytes'] / GB:.2f} GB"),
        (f"  busiest     {b.get('job', '-')} rank {b.get('job_rank', '-')} {b.get('direction', '')} over "
        f"{b.get('link', '-')} in phase {b.get('phase', '-')}: {b.get('bytes', 0) / GB:.2f} GB, "
        f"{b.get('seconds', 0.0):.3f} s"),
        (f"  planning    {r['planning']}: {r['plans']} plan(s), {r['transfers']} transfers, "
        f"{r['plan_seconds']:.2f} s planning + {r['manifest_seconds']:.2f} s manifests"),
    ]
    if "approximation" in r:
        lines.append(f"  note        {r['approximation']}")
    return "\n".join(lines)
