"""Benchmarks as commands: every figure is a ratio of things measured side by side in one run.

``bench convert``: shardstream convert TP4 -> TP3 (uneven, strided S(1) reads) vs the raw copy
floor (read the same source files, write the same number of bytes, fsync), each in its own
process so peak RSS is measured per process, and vs the DCP path (``streamer.tools.bench_dcp``: 4 gloo
ranks ``torch.distributed.checkpoint.save`` their DTensor shards, 3 ranks ``load`` into the
target placements and write safetensors; its output is checked byte for byte against convert's).

``bench refit``: one MPMD launch of N senders + M receivers; over one session, the median of
repeated pushes for reshard, for the gather-broadcast baseline, and for a raw ``MPI_Alltoallv``
of exactly the planned bytes per rank pair (the floor). The first push of each (buffer
allocation, connection set-up) is reported on its own and left out of the medians.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from formats.errors import TransportError
from formats.manifest.limits import RANK_FILE_PATTERN

if TYPE_CHECKING:
    from formats.manifest.wire import Manifest
    from streamer.plan.model import PlanStats

__all__ = ["bench_convert", "bench_refit", "convert_table", "refit_worker"]


def _sh(cmd: list[str]) -> tuple[float, int, str]:
    """Run ``cmd``; return (wall seconds, peak RSS bytes of the child, stdout).

    Output goes to temp files, not pipes: ``os.wait4`` (which gives the child's own peak RSS)
    must not wait on a child blocked writing into a full pipe.
    """
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, etext = out.read(), err.read()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {etext.strip()[-2000:]}")
    return dt, ru.ru_maxrss * 1024, text


def _copy_floor(src_dir: str, out_dir: str, chunk: int = 64 << 20) -> None:
    """Read every safetensors file of src_dir and write the same bytes to out_dir, fsynced.

    It starts writeback after every chunk (``posix_fadvise(DONTNEED)``) as convert's writer does,
    so that the final fsync does not write the whole file while nothing else runs: the floor is
    a good sequential copy, not a naive one that convert could beat by overlap alone."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    buf = bytearray(chunk)
    mv = memoryview(buf)
    for f in sorted(Path(src_dir).glob("*.safetensors")):
        with open(f, "rb", buffering=0) as r, open(out / f.name, "wb", buffering=0) as w:
            pos = 0
            while True:
                n = r.readinto(mv)
                if not n:
                    break
                w.write(mv[:n])
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(w.fileno(), pos, n, os.POSIX_FADV_DONTNEED)
                pos += n
            os.fsync(w.fileno())


def bench_convert(work: str, *, preset: str = "qwen3-2g", memory_limit: str = "256MiB", repeats: int = 2,
                  keep: bool = False, src_tp: int = 4, dst_tp: int = 3, dcp: bool = True) -> dict[str, Any]:
    """shardstream convert TP{src_tp} -> TP{dst_tp} vs the raw copy floor and (``dcp``) the DCP path.

    The DCP path (``streamer.tools.bench_dcp``): ``src_tp`` gloo ranks save their DTensor shards with
    ``torch.distributed.checkpoint``, then ``dst_tp`` ranks load into the target placements and
    write safetensors. ``dcp_s`` is that reshard + write step (barrier to every file fsynced,
    slowest rank; torch import and process-group setup excluded, ``dcp_wall_s`` includes them);
    ``dcp_peak_rss_bytes`` is the sum of the load processes' own peaks. Its output is checked
    against convert's, tensor by tensor: a difference raises ``ValidationError``.
    """
    from formats.errors import ShardstreamError, UsageError
    from streamer.tools import bench_dcp

    if src_tp == dst_tp:
        raise UsageError(f"bench convert: source and target TP are both {src_tp}")
    if dcp:
        why = bench_dcp.dcp_missing()
        if why:
            raise ShardstreamError(f"bench convert: {why}; pass --no-dcp to bench without the DCP path")
    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    src, dst = w / f"tp{src_tp}", w / f"tp{dst_tp}"
    _convert_inputs(w, preset, src_tp, dst_tp)
    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    ckpt, dcp_out = w / "dcp", w / f"dcp-tp{dst_tp}"
    save: dict[str, Any] = {}
    if dcp:
        shutil.rmtree(ckpt, ignore_errors=True)
        save = bench_dcp.launch("save", src_tp, manifest=str(src / "manifest.json"), ckpt=str(ckpt),
                                data=str(src))
    runs = _convert_runs(w, src_tp, dst_tp, memory_limit, repeats, dcp)
    conv, floor, rss_c, rss_f, conv_out = runs.convert_s, runs.floor_s, runs.convert_rss, runs.floor_rss, runs.report
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "streamer", "validate", "--data", str(dst)], check=True,
                   stdout=subprocess.DEVNULL)
    validate_s = time.perf_counter() - t0
    res: dict[str, Any] = {
        "bytes": nbytes,
        "src_tp": src_tp,
        "dst_tp": dst_tp,
        "convert_s": min(conv),
        "floor_s": min(floor),
        "ratio_to_floor": min(conv) / min(floor),
        "convert_gb_per_s": nbytes / min(conv) / 1e9,
        "floor_gb_per_s": nbytes / min(floor) / 1e9,
        "convert_peak_rss_bytes": max(rss_c),
        "floor_peak_rss_bytes": max(rss_f),
        "memory_limit": memory_limit,
        "bytes_read": conv_out.get("bytes_read"),
        "reads": conv_out.get("reads"),
        "validate_data_s": validate_s,
        "runs": {"convert_s": conv, "floor_s": floor},
    }
    if dcp:
        # the DCP output must be the same tensors, byte for byte, as convert's (raises if not)
        check = bench_dcp.compare_outputs(dcp_out, dst)
        _add_dcp_figures(res, runs.dcp_loads, save, ckpt, nbytes, dst_tp, check)
    if not keep:
        for d in (dst, w / "floor", ckpt, dcp_out):
            shutil.rmtree(d, ignore_errors=True)
    return res


@dataclass
class _ConvertRuns:
    convert_s: list[float] = field(default_factory=list)
    floor_s: list[float] = field(default_factory=list)
    convert_rss: list[int] = field(default_factory=list)
    floor_rss: list[int] = field(default_factory=list)
    dcp_loads: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)  # the last convert's --json


def _convert_runs(w: Path, src_tp: int, dst_tp: int, memory_limit: str, repeats: int, dcp: bool) -> _ConvertRuns:
    """``repeats`` rounds of: the copy floor, shardstream convert, and (``dcp``) the DCP load."""
    from streamer.tools import bench_dcp

    py = sys.executable
    src, dst, dst_layout = w / f"tp{src_tp}", w / f"tp{dst_tp}", w / f"tp{dst_tp}.json"
    runs = _ConvertRuns()
    for _ in range(repeats):
        shutil.rmtree(w / "floor", ignore_errors=True)
        dt, rss, _ = _sh([py, "-c", (f"from streamer.tools.bench import _copy_floor; _copy_floor({str(src)!r}, "
                                     f"{str(w / 'floor')!r})")])
        runs.floor_s.append(dt)
        runs.floor_rss.append(rss)
        shutil.rmtree(dst, ignore_errors=True)
        dt, rss, out = _sh([py, "-m", "streamer", "convert", str(src), str(dst_layout), "--out", str(dst),
                            "--memory-limit", memory_limit, "--json"])
        runs.convert_s.append(dt)
        runs.convert_rss.append(rss)
        runs.report = json.loads(out)
        if dcp:
            dcp_out = w / f"dcp-tp{dst_tp}"
            shutil.rmtree(dcp_out, ignore_errors=True)
            runs.dcp_loads.append(bench_dcp.launch("load", dst_tp, manifest=str(dst_layout), ckpt=str(w / "dcp"),
                                                   out=str(dcp_out)))
    return runs


def _convert_inputs(w: Path, preset: str, src_tp: int, dst_tp: int) -> None:
    """A synthetic ``preset`` checkpoint at TP``src_tp`` in ``w/tp{src_tp}`` (kept between runs) and
    the TP``dst_tp`` layout ``w/tp{dst_tp}.json`` to convert it to."""
    from streamer.tools.synth import QWEN3_TP_RULES

    ss = [sys.executable, "-m", "streamer"]
    rules = [a for r in QWEN3_TP_RULES for a in ("--rule", r)]
    src = w / f"tp{src_tp}"
    if not (src / "manifest.json").exists():
        subprocess.run(ss + ["synth", "--preset", preset, "--out", str(w / "hf")], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(ss + ["import", str(w / "hf"), "-o", str(w / "hf" / "manifest.json")], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(ss + ["layout", "--like", str(w / "hf" / "manifest.json"), "--mesh", f"tp={src_tp}",
                             *rules, "-o", str(w / f"tp{src_tp}.json")], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(ss + ["convert", str(w / "hf" / "manifest.json"), str(w / f"tp{src_tp}.json"), "--out",
                             str(src)], check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(w / "hf")
    subprocess.run(ss + ["layout", "--like", str(src), "--mesh", f"tp={dst_tp}", *rules, "-o",
                         str(w / f"tp{dst_tp}.json")], check=True, stdout=subprocess.DEVNULL)


def _add_dcp_figures(res: dict[str, Any], loads: list[dict[str, Any]], save: dict[str, Any], ckpt: Path,
                     nbytes: int, dst_tp: int, check: Any) -> None:
    """The DCP path's figures (best of the load runs) next to convert's, in ``res``."""
    conv_s, conv_rss = res["convert_s"], res["convert_peak_rss_bytes"]
    steps = [max(x["step_s"] for x in ld["ranks"]) for ld in loads]
    best = loads[steps.index(min(steps))]
    dcp_s = min(steps)
    dcp_rss = max(sum(ld["peak_rss_bytes"]) for ld in loads)
    res.update({
        "dcp_s": dcp_s,
        "dcp_load_s": max(x["load_s"] for x in best["ranks"]),
        "dcp_write_s": max(x["write_s"] for x in best["ranks"]),
        "dcp_wall_s": min(ld["wall_s"] for ld in loads),
        "dcp_gb_per_s": nbytes / dcp_s / 1e9,
        "dcp_save_s": max(x["save_s"] for x in save["ranks"]),
        "dcp_save_wall_s": save["wall_s"],
        "dcp_checkpoint_bytes": sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file()),
        "dcp_peak_rss_bytes": dcp_rss,
        "dcp_peak_rss_max_bytes": max(max(ld["peak_rss_bytes"]) for ld in loads),
        "dcp_peak_rss_of": f"sum of the {dst_tp} load processes' own peaks",
        "dcp_rss_before_load_bytes": sum(x["rss_before_load_bytes"] for x in best["ranks"]),
        "dcp_save_peak_rss_bytes": sum(save["peak_rss_bytes"]),
        "dcp_bytes_read": sum(x["rchar"] for x in best["ranks"]),
        "dcp_storage_read_bytes": sum(x["read_bytes"] for x in best["ranks"]),
        "speedup_vs_dcp": dcp_s / conv_s,
        "memory_ratio_vs_dcp": dcp_rss / conv_rss,
        "dcp_matches_convert": True,
        "dcp_compared": check,
    })
    res["runs"]["dcp_s"] = steps
    res["runs"]["dcp_wall_s"] = [ld["wall_s"] for ld in loads]


def convert_table(r: dict[str, Any]) -> str:
    """The human table of a ``bench_convert`` result."""
    mib, gb = 2**20, 1e9

    def row(label: str, rest: str) -> str:
        return f"  {label:<24} {rest}"

    def path(label: str, k: str, read: float | None = None) -> str:
        tail = "" if read is None else f"  read {read / gb:6.2f} GB"
        return row(label, f"{r[k + '_s']:8.2f} s  {r[k + '_gb_per_s']:6.2f} GB/s  peak RSS "
                   f"{r[k + '_peak_rss_bytes'] / mib:7.0f} MiB{tail}")

    lines = [(f"bench convert ({r['bytes'] / gb:.2f} GB, TP{r['src_tp']} -> TP{r['dst_tp']}, --memory-limit "
              f"{r['memory_limit']}):"),
             path("shardstream convert", "convert", r["bytes_read"] or 0),
             path("raw copy floor", "floor")]
    if "dcp_s" in r:
        lines += [
            path("DCP load + safetensors", "dcp", r["dcp_bytes_read"]),
            (f"    {r['dst_tp']} ranks: load {r['dcp_load_s']:.2f} s + write {r['dcp_write_s']:.2f} s "
             f"(slowest rank), {r['dcp_wall_s']:.2f} s with torch import + gloo setup;"),
            (f"    RSS: sum of the {r['dst_tp']} processes' peaks (largest "
             f"{r['dcp_peak_rss_max_bytes'] / mib:.0f} MiB; "
             f"{r['dcp_rss_before_load_bytes'] / mib:.0f} MiB of the sum before load)"),
            row(f"DCP save ({r['src_tp']} ranks)",
                f"{r['dcp_save_s']:8.2f} s  ({r['dcp_checkpoint_bytes'] / gb:.2f} GB; "
                f"{r['dcp_save_wall_s']:.2f} s with startup, peak RSS sum "
                f"{r['dcp_save_peak_rss_bytes'] / mib:.0f} MiB)"),
        ]
    lines.append(row("ratio to floor", f"{r['ratio_to_floor']:8.2f} x   (target <= 1.3)"))
    if "dcp_s" in r:
        c = r["dcp_compared"]
        lines += [row("speedup vs DCP", f"{r['speedup_vs_dcp']:8.2f} x   (target >= 2)"),
                  row("memory vs DCP", f"{r['memory_ratio_vs_dcp']:8.2f} x less (target >= 10)"),
                  row("DCP output", f"== convert's: {c['tensors']} tensors, {c['bytes'] / gb:.2f} GB in "
                      f"{c['files']} files, byte for byte")]
    else:
        lines.append(row("DCP path", "not run (--no-dcp)"))
    lines.append(row("validate --data", f"{r['validate_data_s']:8.2f} s"))
    return "\n".join(lines)


def bench_validate(n_chunks: int = 100_000) -> dict[str, Any]:
    """Time parse + validate of a manifest with ``n_chunks`` chunks (a 1-D grid per array)."""
    from formats.manifest.wire import loads_manifest
    from formats.validate.manifest import validate_manifest

    per = 100
    arrays: dict[str, dict[str, Any]] = {}
    for a in range(n_chunks // per):
        arrays[f"a{a}"] = {"shape": [per * 8, 16], "data_type": "bfloat16", "chunks": [
            {"region": {"offsets": [i * 8, 0], "sizes": [8, 16]}, "holders": [i % 8],
             "source": {"file": RANK_FILE_PATTERN, "tensor": f"a{a}", "offsets": [0, 0]}}
            for i in range(per)]}
    # each rank holds several chunks of one array in one local tensor: give distinct offsets
    for spec in arrays.values():
        for i, c in enumerate(spec["chunks"]):
            c["source"]["offsets"] = [(i // 8) * 8, 0]
    text = json.dumps({"format": "shardstream.manifest", "format_version": 1, "world_size": 8, "arrays": arrays})
    t0 = time.perf_counter()
    m = loads_manifest(text)
    t1 = time.perf_counter()
    problems = validate_manifest(m, check_paths=False)
    t2 = time.perf_counter()
    return {"chunks": n_chunks, "parse_s": t1 - t0, "validate_s": t2 - t1, "total_s": t2 - t0,
            "problems": len(problems), "manifest_bytes": len(text)}


# ------------------------------------------------------------------ refit

def _refit_args(argv: list[str]) -> Any:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--serve", required=True)
    ap.add_argument("--senders", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=5, help="steady-state rounds, after the first (cold) one")
    ap.add_argument("--bucket-size", type=int, default=256 << 20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--source", choices=SOURCES, default="files")
    ap.add_argument("--preset", default="qwen3-small")
    return ap.parse_args(argv)


#: where bench refit's trainer state comes from: the rank files of ``convert``, or a real FSDP2
#: model (``fully_shard``, fp32 master weights, cast to the server's bf16 on the way)
SOURCES = ("files", "fsdp2")


def _fsdp2_trainer(preset: str, role_comm: Any) -> tuple[Any, Manifest]:
    """A transformers Qwen3 shaped like ``preset``, fp32, under ``fully_shard`` on the sender ranks
    (their own gloo default group, as a torchrun trainer has), and its manifest."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from streamer.refit.torch_state import manifest_from_state_dict
    from streamer.tools.synth import PRESETS
    from streamer.transport.torch_dist import free_port

    s = PRESETS[preset]
    port = role_comm.bcast(free_port() if role_comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=role_comm.Get_rank(),
                            world_size=role_comm.Get_size())
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
                         vocab_size=s.vocab, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         head_dim=s.head_dim, tie_word_embeddings=False)
    model: Any = Qwen3ForCausalLM(config)
    model = model.float()  # fp32 master weights
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, manifest_from_state_dict(model.state_dict(), name=f"fsdp2-{preset}")


def _alltoallv_floor(world: Any, pair_bytes: dict[tuple[int, int, int], int]) -> Callable[[], float]:
    """One ``MPI_Alltoallv`` of exactly the planned bytes per (sender, receiver) pair, timed."""
    import numpy as np
    from mpi4py import MPI

    rank, W = world.Get_rank(), world.Get_size()
    counts = np.zeros((W, W), dtype=np.int64)
    for (_phase, s, d), nbytes in pair_bytes.items():
        counts[s, d] += nbytes
    scount = counts[rank].astype(np.int64)
    rcount = counts[:, rank].astype(np.int64)
    sbuf = np.ones(int(scount.sum()), dtype=np.uint8)
    rbuf = np.empty(int(rcount.sum()), dtype=np.uint8)
    sdis = np.concatenate([[0], np.cumsum(scount)[:-1]])
    rdis = np.concatenate([[0], np.cumsum(rcount)[:-1]])

    def step() -> float:
        world.Barrier()
        t0 = time.perf_counter()
        world.Alltoallv([sbuf, (scount.tolist(), sdis.tolist()), MPI.BYTE],
                        [rbuf, (rcount.tolist(), rdis.tolist()), MPI.BYTE])
        return time.perf_counter() - t0

    return step


def _refit_rounds(world: Any, steps: dict[str, Callable[[], tuple[float, int]]],
                  rounds: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of each step per round (slowest rank), interleaved one of each per round so that
    load changes on a shared machine hit all alike; and the largest extra buffer a step reported."""
    from mpi4py import MPI

    times_of: dict[str, list[float]] = {n: [] for n in steps}
    peak_extra = 0
    for _ in range(rounds):
        for name, step in steps.items():
            dt, extra = step()
            peak_extra = max(peak_extra, extra)
            times_of[name].append(world.allreduce(dt, op=MPI.MAX))
    return times_of, peak_extra


def _refit_result(times_of: dict[str, list[float]], *, senders: int, receivers: int, stats: PlanStats,
                  bucket_size: int, peaks: list[int], rss: list[int], open_s: float = 0.0) -> dict[str, Any]:
    """The bench refit figures: the first (cold) round apart, medians over the rounds after it."""
    first = {n: t[0] for n, t in times_of.items()}
    steady = {n: t[1:] for n, t in times_of.items()}
    r, b, f = (median(steady[n]) for n in ("reshard", "broadcast", "floor"))
    return {"senders": senders, "receivers": receivers, "repeats": len(steady["reshard"]),
            "reshard_s": r, "broadcast_s": b, "floor_s": f,
            "speedup_vs_broadcast": b / r, "ratio_to_floor": r / f,
            "first_push_s": first["reshard"], "first_push_ratio_to_floor": first["reshard"] / f,
            "first_push_ratio_to_steady": first["reshard"] / r, "open_s": open_s,
            "first_broadcast_s": first["broadcast"], "first_floor_s": first["floor"],
            "bytes_moved": stats.moved_bytes, "broadcast_bytes_moved": stats.broadcast_moved_bytes,
            "bucket_bytes": bucket_size, "peak_extra_bytes_per_rank": max(peaks or [0]),
            "rss_growth_bytes_max": max(rss or [0]),
            "runs": steady, "first_runs": first}


def refit_worker(argv: list[str]) -> int:
    """Runs inside ``mpiexec -n N+M``: ranks < N send, the rest receive. One first round (buffer
    allocation, connection set-up) is timed apart; ``--repeats`` steady-state rounds follow."""
    from mpi4py import MPI

    from formats.manifest.wire import load_manifest
    from streamer.refit.options import RefitOptions
    from streamer.refit.persist import alloc_local, load_local
    from streamer.refit.session import RefitSession
    from streamer.transport.jobs import Group

    a = _refit_args(argv)
    world = MPI.COMM_WORLD
    S = a.senders
    rank = world.Get_rank()
    role = "send" if rank < S else "recv"
    role_comm = world.Split(0 if role == "send" else 1, rank)
    group = Group.from_mpi(world, role_comm, role, S, world.Get_size() - S)
    rr = role_comm.Get_rank()
    tensors: Any
    if role == "send" and a.source == "fsdp2":
        tensors, m = _fsdp2_trainer(a.preset, role_comm)  # push(model): DTensors send their shards
    else:
        m = load_manifest(a.train if role == "send" else a.serve)
        tensors = load_local(m, rr) if role == "send" else alloc_local(m, rr)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sess = {}
    open_s = 0.0
    for strategy in ("reshard", "broadcast"):
        world.Barrier()
        t0 = time.perf_counter()
        sess[strategy] = RefitSession.open(m, role, group=group, timeout=600,
                                           options=RefitOptions(bucket_size=a.bucket_size, strategy=strategy))
        if strategy == "reshard":  # the slowest rank's open(): joining, planning, buffers faulted in
            open_s = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    plan = sess["reshard"].plan
    floor = _alltoallv_floor(world, plan.pair_bytes())

    def push(name: str) -> Callable[[], tuple[float, int]]:
        def step() -> tuple[float, int]:
            world.Barrier()
            t0 = time.perf_counter()
            st = sess[name].push(tensors) if role == "send" else sess[name].pull(tensors)
            dt = time.perf_counter() - t0
            if st is None:
                raise TransportError("the sender job closed the session before the bench ended")
            return dt, st.peak_buffer_bytes if name == "reshard" else 0
        return step

    steps = {"reshard": push("reshard"), "broadcast": push("broadcast"), "floor": lambda: (floor(), 0)}
    times_of, peak_extra = _refit_rounds(world, steps, 1 + max(1, a.repeats))
    peaks = world.gather(peak_extra, root=0)
    rss = world.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0, root=0)
    if rank == 0:
        out = _refit_result(times_of, senders=S, receivers=world.Get_size() - S, stats=plan.stats(),
                            bucket_size=a.bucket_size, peaks=peaks or [], rss=rss or [], open_s=open_s)
        out.update(source=a.source, cast_arrays=len(plan.casts))
        Path(a.out).write_text(json.dumps(out))
    return 0


def bench_refit(work: str, *, senders: int = 4, receivers: int = 4, preset: str = "qwen3-small",
                train_mesh: str = "pp=2,tp=2", serve_mesh: str = "tp=4", repeats: int = 5,
                bucket_size: int = 64 << 20, source: str = "files") -> dict[str, Any]:
    """Reshard vs gather-broadcast vs the ``MPI_Alltoallv`` floor, one run. ``source="fsdp2"``:
    the trainer is a real FSDP2 model in fp32 (``train_mesh`` then unused: FSDP2 over all senders)."""
    from streamer.tools.synth import QWEN3_TP_RULES

    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    ss = [py, "-m", "streamer"]

    def rules(mesh: str) -> list[str]:
        axes = [x.split("=")[0] for x in mesh.split(",")]
        out = []
        for r in QWEN3_TP_RULES:
            glob, pl = r.split("=", 1)
            out += ["--rule", f"{glob}=" + ",".join(pl if ax == "tp" else "R" for ax in axes)]
        return out

    if not (w / "hf" / "manifest.json").exists():
        subprocess.run(ss + ["synth", "--preset", preset, "--out", str(w / "hf")], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(ss + ["import", str(w / "hf"), "-o", str(w / "hf" / "manifest.json")], check=True,
                       stdout=subprocess.DEVNULL)
    subprocess.run(ss + ["layout", "--like", str(w / "hf" / "manifest.json"), "--mesh", train_mesh,
                         *rules(train_mesh), "-o", str(w / "train.json")], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(w / "train", ignore_errors=True)
    subprocess.run(ss + ["convert", str(w / "hf" / "manifest.json"), str(w / "train.json"), "--out", str(w / "train")],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(ss + ["layout", "--like", str(w / "hf" / "manifest.json"), "--mesh", serve_mesh,
                         *rules(serve_mesh), "--no-files", "-o", str(w / "serve.json")], check=True,
                   stdout=subprocess.DEVNULL)
    mpiexec = shutil.which("mpiexec") or str(Path(py).parent / "mpiexec")
    env = dict(os.environ, HYDRA_LAUNCHER=os.environ.get("HYDRA_LAUNCHER", "fork"), OMP_NUM_THREADS="1")
    res_path = w / "refit.json"
    cmd = [mpiexec, "-n", str(senders + receivers), py, "-c",
           "import gc, sys; from streamer.tools.bench import refit_worker; rc = refit_worker(sys.argv[1:]); gc.freeze(); sys.exit(rc)",
           "--train", str(w / "train" / "manifest.json"), "--serve", str(w / "serve.json"),
           "--senders", str(senders), "--repeats", str(repeats), "--bucket-size", str(bucket_size),
           "--out", str(res_path), "--source", source, "--preset", preset]
    subprocess.run(cmd, check=True, env=env, timeout=3600)
    out: dict[str, Any] = json.loads(res_path.read_text())
    out.update({"preset": preset, "train_mesh": train_mesh if source == "files" else f"fsdp={senders}",
                "serve_mesh": serve_mesh})
    return out


def bench_plan(sizes: tuple[int, ...] = (1_200, 4_800, 19_200, 102_400), *, model: str | None = None,
               train: str = "pp=16,ep=16", serve: str = "dp=8,tp=32", domain: int = 8) -> dict[str, Any]:
    """Planner and validator time and peak memory vs the number of chunks.

    The sweep uses synthetic models of ``n/12`` arrays (2-D, bf16, each of its own shape; 8 source
    + 4 destination chunks each) laid out TP8 -> TP4xDP2 with uneven shards; times are taken without allocation tracing,
    then peak memory in a second, traced pass; the scaling exponent is the least-squares slope of log(time) over log(chunks).
    With ``model`` (an HF config.json), the full-size trainer -> generator plan is timed as well.
    """
    import math
    import tracemalloc

    from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule
    from formats.validate.manifest import validate_manifest
    from streamer.plan.planner import plan_transfers

    # the full-size plan first: its peak RSS is not masked by the sweep's traced pass
    mres: dict[str, Any] | None = None
    if model:
        from formats.layouts import manifest_from_arrays as mfa
        from formats.layouts.models import arrays_from_model, generic_rules

        t0 = time.perf_counter()
        arrays = arrays_from_model(model)
        base = mfa(arrays)
        ms, md = parse_mesh(train), parse_mesh(serve)
        src = apply_layout(base, ms, [parse_rule(r, ms) for r in generic_rules(ms.axes)], file_pattern=None)
        dst = apply_layout(base, md, [parse_rule(r, md) for r in generic_rules(md.axes)], file_pattern=None)
        import resource

        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t1 = time.perf_counter()
        plan = plan_transfers(src, dst, src_domain_size=domain, dst_domain_size=domain)
        t2 = time.perf_counter()
        # peak RSS growth while planning (ru_maxrss: no tracing, which would slow the plan down)
        grew = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
        st = plan.stats()
        mres = {"config": model, "train": train, "serve": serve, "arrays": len(arrays),
                        "plan_peak_rss_growth_bytes": grew,
                        "src_chunks": src.chunk_count(),
                        "dst_chunks": dst.chunk_count(),
                        "manifests_s": t1 - t0, "plan_s": t2 - t1, "transfers": plan.num_transfers,
                        "moved_bytes": st.moved_bytes, "broadcast_moved_bytes": st.broadcast_moved_bytes}
    rows = []
    for n in sizes:
        # a distinct shape per array: no two arrays share a template (the planner's worst case)
        arrays = {f"model.layers.{i}.w": ((4099 + i, 1024), "bfloat16") for i in range(max(1, n // 12))}
        base = manifest_from_arrays(arrays)
        ms, md = parse_mesh("tp=8"), parse_mesh("dp=2,tp=4")
        src = apply_layout(base, ms, [parse_rule("*=S(0)", ms)], file_pattern=None)
        dst = apply_layout(base, md, [parse_rule("*=R,S(1)", md)], file_pattern=None)
        chunks = src.chunk_count() + dst.chunk_count()
        t0 = time.perf_counter()
        p1 = validate_manifest(src, check_paths=False) + validate_manifest(dst, check_paths=False)
        t1 = time.perf_counter()
        plan = plan_transfers(src, dst, dst_domain_size=domain)
        t2 = time.perf_counter()
        del plan
        tracemalloc.start()
        plan = plan_transfers(src, dst, dst_domain_size=domain)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append({"chunks": chunks, "transfers": plan.num_transfers, "validate_s": t1 - t0, "plan_s": t2 - t1,
                     "peak_bytes": peak, "problems": len(p1)})

    def slope(key: str) -> float:
        xs = [math.log(r["chunks"]) for r in rows]
        ys = [math.log(max(r[key], 1e-9)) for r in rows]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs) or 1.0
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den

    out: dict[str, Any] = {"sweep": rows, "plan_exponent": slope("plan_s"), "validate_exponent": slope("validate_s")}
    if mres is not None:
        out["model"] = mres
    return out


def require_matplotlib() -> None:
    """Refuse ``--plot`` up front when matplotlib is missing (the optional ``plot`` extra)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from formats.errors import UsageError

        raise UsageError("--plot needs matplotlib: pip install 'shardstream[plot]'")


def plot(result: dict[str, Any], kind: str, path: str) -> None:
    """A PNG of a bench result (matplotlib, optional)."""
    require_matplotlib()
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    if kind == "convert":
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
    if kind == "plan":
        xs = [r["chunks"] for r in result["sweep"]]
        ax.loglog(xs, [r["plan_s"] for r in result["sweep"]], "o-", label=f"plan (slope {result['plan_exponent']:.2f})")
        ax.loglog(xs, [r["validate_s"] for r in result["sweep"]], "s-",
                  label=f"validate (slope {result['validate_exponent']:.2f})")
        ax.set_xlabel("chunks")
        ax.set_ylabel("seconds")
    elif kind == "convert":
        paths = [(lbl, k) for lbl, k in (("floor", "floor"), ("shardstream", "convert"), ("DCP", "dcp"))
                 if f"{k}_s" in result]
        ax.bar([lbl for lbl, _ in paths], [result[f"{k}_s"] for _, k in paths])
        ax.set_ylabel("seconds")
        ax2.bar([lbl for lbl, _ in paths], [result[f"{k}_peak_rss_bytes"] / 2**20 for _, k in paths])
        ax2.set_ylabel("peak RSS, MiB (DCP: sum over ranks)")
        ax2.set_title("memory")
    else:
        keys = [k for k in ("reshard_s", "broadcast_s", "floor_s", "convert_s") if k in result]
        ax.bar(keys, [result[k] for k in keys])
        ax.set_ylabel("seconds")
    ax.legend() if kind == "plan" else None
    ax.set_title(f"shardstream bench {kind}")
    fig.tight_layout()
    fig.savefig(path)


def refit_table(r: dict[str, Any]) -> str:
    """The text of ``bench refit``."""
    return (f"bench refit ({r['senders']}+{r['receivers']} ranks, {r['source']} {r['train_mesh']} -> "
            f"{r['serve_mesh']}{', cast to bf16 on the way' if r['cast_arrays'] else ''}, "
            f"{r['bytes_moved'] / 1e9:.3f} GB planned, median of {r['repeats']} after the first push):\n"
            f"  open()               {r['open_s']:8.3f} s  (join, plan, buffers faulted in)\n"
            f"  reshard              {r['reshard_s']:8.3f} s  (steady push, median)\n"
            f"  first push           {r['first_push_s']:8.3f} s  ({r['first_push_ratio_to_steady']:.2f} x the steady "
            f"push, target <= 2)\n"
            f"  gather-broadcast     {r['broadcast_s']:8.3f} s  ({r['broadcast_bytes_moved'] / 1e9:.3f} GB)\n"
            f"  Alltoallv floor      {r['floor_s']:8.3f} s\n"
            f"  speedup vs broadcast {r['speedup_vs_broadcast']:8.2f} x   (target >= 3)\n"
            f"  ratio to floor       {r['ratio_to_floor']:8.2f} x   (target <= 1.2)\n"
            f"  peak extra / rank    {r['peak_extra_bytes_per_rank'] / 2**20:8.1f} MiB (bucket "
            f"{r['bucket_bytes'] / 2**20:.0f} MiB, target <= 2 buckets)")
