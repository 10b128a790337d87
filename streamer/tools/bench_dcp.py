"""The DCP path of ``bench convert``: what a PyTorch trainer does without shardstream.

1. **save**: N processes (one per source rank, gloo process group on localhost, CPU), each
   holding its local shards as DTensors on a 1-D ``DeviceMesh('cpu', ...)`` with the source
   layout's placements, call ``torch.distributed.checkpoint.save``;
2. **reshard**: M processes build empty DTensors with the target placements and call
   ``torch.distributed.checkpoint.load`` (DCP reshards on load);
3. **write**: each writes its local tensors with ``safetensors.torch.save_file`` (fsynced, as
   shardstream's output is).

Placements come from the shardstream manifests of the two layouts (a single chunk held by
every rank is ``Replicate()``, one chunk per rank split along dim d is ``Shard(d)``), and every
rank checks that DTensor's own local offsets and sizes (``torch.chunk`` semantics) are the
manifest's region for that rank, so both paths move the same shards. ``compare_outputs``
checks the DCP output against shardstream's, tensor by tensor, byte for byte.

The workers run as ``python -m streamer.tools.bench_dcp save|load ...`` with ``RANK``,
``WORLD_SIZE`` and ``SHARDSTREAM_DCP_INIT`` (a ``file://`` rendezvous path) in the environment.
Only the workers import torch; the parent (``launch``) does not.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["compare_outputs", "dcp_missing", "launch", "placements"]


def dcp_missing() -> str | None:
    """Why the DCP path cannot run here (one line), or None.

    Cheap: finds the modules without importing torch (that takes seconds); a torch that is
    installed but does not import is reported by the workers, also in one line (``MISSING``).
    """
    import importlib.util

    for m in ("torch", "safetensors"):
        try:
            spec = importlib.util.find_spec(m)
        except (ImportError, ValueError) as e:
            return f"{m} is not importable ({e})"
        if spec is None:
            return f"torch.distributed.checkpoint is not importable (no module named {m!r})"
        if m == "torch":
            roots = [Path(p) for p in (spec.submodule_search_locations or [])]
            for sub in ("distributed/checkpoint", "distributed/tensor"):
                if not any((r / sub / "__init__.py").exists() for r in roots):
                    return f"torch.{sub.replace('/', '.')} is not importable (this torch build has no {sub})"
    return None


#: a worker's exit status when torch.distributed.checkpoint does not import
MISSING = 86


# ----------------------------------------------------------------------------- layouts


def placements(manifest: dict[str, Any]) -> dict[str, tuple[list[int], str, int | None, dict[int, Any]]]:
    """name -> (global shape, data_type, shard dim or None for replicate, {rank: (offsets, sizes)}).

    Only what a 1-D TP mesh can express: every array replicated on all ranks (one chunk) or split
    along one dim, one chunk per rank. Anything else raises ``ValueError`` naming the array.
    """
    world = int(manifest["world_size"])
    mesh = manifest.get("mesh") or {}
    if len(mesh.get("shape", [world])) != 1:
        raise ValueError(f"the DCP path handles 1-D meshes only, got mesh {mesh}")
    out: dict[str, tuple[list[int], str, int | None, dict[int, Any]]] = {}
    for name, a in manifest["arrays"].items():
        shape = [int(x) for x in a["shape"]]
        regions: dict[int, Any] = {}
        for c in a["chunks"]:
            for h in c["holders"]:
                if h in regions:
                    raise ValueError(f"{name}: rank {h} holds more than one chunk (not a 1-D DTensor layout)")
                reg = c["region"]
                regions[int(h)] = ([int(x) for x in reg["offsets"]], [int(x) for x in reg["sizes"]])
        if sorted(regions) != list(range(world)):
            raise ValueError(f"{name}: held by ranks {sorted(regions)}, not every one of {world}")
        if len(a["chunks"]) == 1:
            dim = None
        else:
            dims = {d for off, _ in regions.values() for d, o in enumerate(off) if o}
            sized = {d for _, sz in regions.values() for d, s in enumerate(sz) if s != shape[d]}
            dims |= sized
            if len(dims) != 1:
                raise ValueError(f"{name}: chunks split along dims {sorted(dims)}, not one Shard(d)")
            dim = dims.pop()
        out[name] = (shape, a["data_type"], dim, regions)
    return out


# ----------------------------------------------------------------------------- workers


def _io() -> dict[str, int]:
    """This process's /proc/self/io counters (rchar: bytes read() returned, read_bytes: from storage)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except OSError:
        return {}


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _worker_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m streamer.tools.bench_dcp")
    ap.add_argument("mode", choices=["save", "load"])
    ap.add_argument("--manifest", required=True, help="the layout of this side (shardstream manifest)")
    ap.add_argument("--ckpt", required=True, help="the DCP checkpoint directory")
    ap.add_argument("--data", help="save: the source ranks' safetensors (the trainer's memory)")
    ap.add_argument("--out", help="load: where each rank writes rank-NNNNN.safetensors")
    return ap.parse_args(argv)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Side:
    """One rank of a DCP save or load: its mesh and the manifest's placements."""

    def __init__(self, rank: int, mesh: Any, specs: dict[str, Any]) -> None:
        self.rank, self.mesh, self.specs = rank, mesh, specs

    def placement(self, dim: int | None) -> Any:
        from torch.distributed.tensor import Replicate, Shard

        return Replicate() if dim is None else Shard(dim)

    def check(self, name: str, dt: Any) -> None:
        """The DTensor's own offsets/sizes (what DCP records and reads) are the manifest's."""
        (chunk,) = dt.__create_chunk_list__()
        got = (list(chunk.offsets), list(chunk.sizes))
        want = self.specs[name][3][self.rank]
        if got != (list(want[0]), list(want[1])) or list(dt.to_local().shape) != list(want[1]):
            raise SystemExit(f"{name}: DTensor gives rank {self.rank} offsets {got[0]} sizes {got[1]} (local "
                             f"{list(dt.to_local().shape)}), the manifest {want[0]} {want[1]}")


def _save(a: argparse.Namespace, side: _Side, res: dict[str, Any]) -> None:
    """The trainer side: wrap the source shards as DTensors and ``dcp.save`` them."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.tensor import DTensor

    t0 = time.perf_counter()
    local = load_file(str(Path(a.data) / f"rank-{side.rank:05d}.safetensors"))
    res["read_source_s"] = time.perf_counter() - t0
    sd = {}
    for name, (shape, _, dim, _) in side.specs.items():
        stride: list[int] = []
        s = 1
        for d in reversed(shape):
            stride.insert(0, s)
            s *= d
        dt = DTensor.from_local(local[name], side.mesh, [side.placement(dim)], run_check=False,
                                shape=torch.Size(shape), stride=tuple(stride))
        side.check(name, dt)
        sd[name] = dt
    dist.barrier()
    io0, t0 = _io(), time.perf_counter()
    dcp_save(sd, checkpoint_id=a.ckpt)  # ends in a collective: every rank's files are written (fsynced)
    res["save_s"] = time.perf_counter() - t0
    res["write_bytes"] = _io().get("wchar", 0) - io0.get("wchar", 0)


def _load(a: argparse.Namespace, side: _Side, res: dict[str, Any]) -> None:
    """The generator side: ``dcp.load`` into DTensors of the target placements, then write them
    as safetensors; the step runs from the barrier to every rank's file fsynced."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.tensor import empty as dtensor_empty

    sd = {}
    for name, (shape, dtype, dim, _) in side.specs.items():
        tdt = getattr(torch, dtype, None)
        if not isinstance(tdt, torch.dtype):
            raise SystemExit(f"{name}: data type {dtype} has no torch dtype")
        dt = dtensor_empty(shape, dtype=tdt, device_mesh=side.mesh, placements=[side.placement(dim)])
        side.check(name, dt)
        sd[name] = dt
    res["rss_before_load_bytes"] = _rss()
    dist.barrier()
    io0, t0 = _io(), time.perf_counter()
    dcp_load(sd, checkpoint_id=a.ckpt)
    io1, t1 = _io(), time.perf_counter()
    res["load_s"] = t1 - t0
    res["rchar"] = io1.get("rchar", 0) - io0.get("rchar", 0)
    res["read_bytes"] = io1.get("read_bytes", 0) - io0.get("read_bytes", 0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank-{side.rank:05d}.safetensors"
    save_file({name: dt.to_local() for name, dt in sd.items()}, str(path))
    _fsync(path)
    res["write_s"] = time.perf_counter() - t1
    if side.rank == 0:
        _fsync(out)
    dist.barrier()
    res["step_s"] = time.perf_counter() - t0


def _worker(argv: list[str]) -> int:
    a = _worker_args(argv)

    from datetime import timedelta

    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint  # noqa: F401  (what the DCP path needs, checked up front)
        from safetensors.torch import load_file, save_file  # noqa: F401
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as e:
        print(f"{e.name or 'torch.distributed.checkpoint'} is not importable ({e})", file=sys.stderr)
        return MISSING

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from formats.manifest.wire import load_manifest

    man = load_manifest(a.manifest).to_dict()  # the v1 form (every chunk listed), whichever was written
    if int(man["world_size"]) != world:
        raise SystemExit(f"{a.manifest} has world_size {man['world_size']}, launched with {world}")
    specs = placements(man)
    timeout = timedelta(seconds=float(os.environ.get("SHARDSTREAM_DCP_TIMEOUT", "900")))
    dist.init_process_group("gloo", init_method="file://" + os.environ["SHARDSTREAM_DCP_INIT"], rank=rank,
                            world_size=world, timeout=timeout)
    side = _Side(rank, DeviceMesh("cpu", list(range(world))), specs)
    res: dict[str, Any] = {"rank": rank}
    (_save if a.mode == "save" else _load)(a, side, res)
    dist.destroy_process_group()
    print(json.dumps(res), flush=True)
    return 0


# ----------------------------------------------------------------------------- launcher


def launch(mode: str, world: int, *, manifest: str, ckpt: str, data: str | None = None,
           out: str | None = None, timeout: float = 1800.0) -> dict[str, Any]:
    """Run ``world`` worker processes of ``mode`` side by side; return wall time, per-rank results and
    each process's own peak RSS (``os.wait4``). Any rank failing ends the others and raises."""
    args = [sys.executable, "-m", "streamer.tools.bench_dcp", mode, "--manifest", manifest, "--ckpt", ckpt]
    args += ["--data", data] if data else []
    args += ["--out", out] if out else []
    with tempfile.TemporaryDirectory(prefix="shardstream-dcp-") as tmp, contextlib.ExitStack() as files:
        env = dict(os.environ, WORLD_SIZE=str(world), SHARDSTREAM_DCP_INIT=str(Path(tmp) / "rendezvous"))
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        logs = [(files.enter_context(open(Path(tmp) / f"{r}.out", "w+")),
                 files.enter_context(open(Path(tmp) / f"{r}.err", "w+"))) for r in range(world)]
        procs: list[subprocess.Popen[str]] = []
        rss: dict[int, int] = {}
        t0 = time.perf_counter()
        try:
            for r in range(world):
                procs.append(subprocess.Popen(args, stdout=logs[r][0], stderr=logs[r][1], text=True,
                                              env=dict(env, RANK=str(r))))
            while len(rss) < world:
                for r, p in enumerate(procs):
                    if r in rss:
                        continue
                    pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                    if pid:
                        p.returncode = os.waitstatus_to_exitcode(status)
                        rss[r] = ru.ru_maxrss * 1024
                        if p.returncode != 0:
                            logs[r][1].seek(0)
                            tail = logs[r][1].read().strip()[-2000:]
                            if p.returncode == MISSING:
                                from formats.errors import ShardstreamError

                                raise ShardstreamError(f"bench convert: {tail.splitlines()[-1]}; pass "
                                                       "--no-dcp to bench without the DCP path")
                            raise RuntimeError(f"DCP {mode} rank {r} of {world} failed ({p.returncode}): "
                                               f"{tail}")
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"DCP {mode} with {world} ranks ran past {timeout:.0f} s")
                time.sleep(0.005)
            wall = time.perf_counter() - t0
        finally:
            for r, p in enumerate(procs):
                if r not in rss and p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
        ranks = []
        for r in range(world):
            logs[r][0].seek(0)
            lines = logs[r][0].read().strip().splitlines()
            ranks.append(json.loads(lines[-1]))
    return {"wall_s": wall, "ranks": ranks, "peak_rss_bytes": [rss[r] for r in range(world)]}


# ----------------------------------------------------------------------------- the check


def compare_outputs(got_dir: str | os.PathLike[str], want_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Check that every ``rank-*.safetensors`` of got_dir holds exactly the tensors of want_dir's
    (names, dtypes, shapes, bytes). Returns counts; raises ``ValidationError`` listing what differs."""
    from formats.errors import ValidationError
    from formats.safetensors.io import read_header

    got, want = Path(got_dir), Path(want_dir)
    gf = sorted(p.name for p in got.glob("rank-*.safetensors"))
    wf = sorted(p.name for p in want.glob("rank-*.safetensors"))
    problems: list[str] = []
    if gf != wf or not wf:
        raise ValidationError(f"DCP output files {gf} are not shardstream's {wf}",
                              problems=[f"bench convert: DCP output files {gf} are not shardstream's {wf}"])
    n_tensors = n_bytes = 0
    identical = True
    for name in wf:
        hg, hw = read_header(got / name), read_header(want / name)
        if set(hg.tensors) != set(hw.tensors):
            only_g = sorted(set(hg.tensors) - set(hw.tensors))
            only_w = sorted(set(hw.tensors) - set(hg.tensors))
            problems.append(f"{name}: tensors differ: only DCP {only_g[:5]}, only shardstream {only_w[:5]}")
            continue
        with open(got / name, "rb", buffering=0) as fg, open(want / name, "rb", buffering=0) as fw:
            for t, sw in hw.tensors.items():
                sg = hg.tensors[t]
                if (sg.dtype.name, sg.shape) != (sw.dtype.name, sw.shape):
                    problems.append(f"{name}: {t}: DCP {sg.dtype.name}{list(sg.shape)}, shardstream "
                                    f"{sw.dtype.name}{list(sw.shape)}")
                    continue
                if sg.start != sw.start:
                    identical = False
                step = 64 << 20
                for off in range(0, sw.nbytes, step):
                    n = min(step, sw.nbytes - off)
                    if os.pread(fg.fileno(), n, sg.start + off) != os.pread(fw.fileno(), n, sw.start + off):
                        problems.append(f"{name}: {t}: bytes differ (in [{off}, {off + n}))")
                        break
                n_tensors += 1
                n_bytes += sw.nbytes
        if (got / name).stat().st_size != (want / name).stat().st_size:
            identical = False
    if problems:
        raise ValidationError("DCP output differs from shardstream convert's",
                              problems=["bench convert: the DCP output differs from shardstream convert's:"]
                              + [f"  {p}" for p in problems[:20]])
    return {"files": len(wf), "tensors": n_tensors, "bytes": n_bytes, "same_file_layout": identical}


if __name__ == "__main__":
    rc = _worker(sys.argv[1:])
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
