"""Colocated refit benchmark: one trainer rank and one inference rank on one node (one GPU for
cuda-ipc), refit GB/s against the memcpy floor of the same bytes measured in the same run.

    python -m streamer.tools.bench_ipc --transport cuda-ipc --size 1GiB     # device memcpy is the floor
    python -m streamer.tools.bench_ipc --transport shm --size 256MiB        # host memcpy is the floor

It launches ``mpiexec -n 2`` of itself (``--worker``): rank 0 pushes eight bfloat16 arrays of
``size / 8`` bytes (the same layout on both sides: every byte is one device-to-device or host
copy away), rank 1 pulls them into its own tensors. After a first push (which maps the peer's
buffers), ``repeats`` pushes are timed from a barrier; the receiver then times ``copy_`` of the
same bytes between two of its own buffers, and checks that what it received is byte-identical
to what was sent. Any transport can be named (mpi, gloo, nccl with two GPUs) for comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["bench_ipc", "ipc_text"]

ARRAYS = 8
ROW = 8192  # bytes per row: 4096 bfloat16


def _layout(nbytes: int) -> Any:
    from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh

    rows = max(1, nbytes // ARRAYS // ROW)
    base = manifest_from_arrays({f"w{i}": ((rows, ROW // 2), "bfloat16") for i in range(ARRAYS)})
    return apply_layout(base, parse_mesh("tp=1"), [], file_pattern=None)


def _sync(device: Any) -> None:
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _payload(m: Any, device: Any, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in sorted(m.local_tensors(0).items()):
        raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(torch.bfloat16).reshape(tuple(spec.shape)).to(device or "cpu")
    return out


def _floor(tensors: dict[str, Any], device: Any, repeats: int) -> float:
    """Seconds to copy the same bytes once between two buffers of this process (median)."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    a = torch.empty(nbytes, dtype=torch.uint8, device=device or "cpu")
    b = torch.empty_like(a)
    a.fill_(1)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def worker(args: argparse.Namespace) -> int:
    """Under ``mpiexec -n 2``: rank 0 sends, rank 1 receives; rank 1 prints the JSON result."""
    import torch
    from mpi4py import MPI

    from streamer.refit.options import RefitOptions
    from streamer.refit.session import RefitSession

    role = "send" if MPI.COMM_WORLD.Get_rank() == 0 else "recv"
    m = _layout(args.size)
    with RefitSession.open(m, role, transport=args.transport, timeout=args.timeout,
                           options=RefitOptions(bucket_size=args.bucket_size)) as s:
        t = s._t
        device = t.device
        mine = _payload(m, device, seed=1) if role == "send" else {
            n: torch.zeros(tuple(v.shape), dtype=torch.bfloat16, device=device or "cpu")
            for n, v in m.local_tensors(0).items()}
        times = []
        for _ in range(args.repeats + 1):
            t.barrier(args.timeout)
            t0 = time.perf_counter()
            s.push(mine) if role == "send" else s.pull(mine)
            _sync(device)
            times.append(time.perf_counter() - t0)
        if role == "recv":
            want = _payload(m, device, seed=1)
            same = all(torch.equal(mine[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
            floor = _floor(mine, device, args.repeats)
            nbytes = sum(v.nbytes for v in m.local_tensors(0).values())
            refit = sorted(times[1:])[len(times[1:]) // 2]
            name = torch.cuda.get_device_name(device) if device is not None else "host"
            print(json.dumps({"transport": t.name, "device": name, "bytes": nbytes, "repeats": args.repeats,
                              "bucket_bytes": s.options.bucket_size, "first_push_s": times[0], "refit_s": refit,
                              "refit_gbps": nbytes / refit / 1e9, "floor_s": floor,
                              "floor_gbps": nbytes / floor / 1e9, "ratio_to_floor": floor / refit,
                              "identical": bool(same)}))
    return 0


def bench_ipc(transport: str, *, size: int = 256 << 20, repeats: int = 5, bucket_size: int = 64 << 20,
              timeout: float = 120.0) -> dict[str, Any]:
    """Run the benchmark under ``mpiexec -n 2`` and return the receiver's result."""
    py = sys.executable
    mpiexec = shutil.which("mpiexec") or str(Path(py).parent / "mpiexec")
    env = dict(os.environ, HYDRA_LAUNCHER=os.environ.get("HYDRA_LAUNCHER", "fork"))
    cmd = [mpiexec, "-n", "2", py, "-m", "streamer.tools.bench_ipc", "--worker", "--transport", transport, "--size",
           str(size), "--repeats", str(repeats), "--bucket-size", str(bucket_size), "--timeout", str(timeout)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        from formats.errors import TransportError

        err = TransportError(f"bench ipc ({transport}) failed: "
                             f"{(p.stderr.strip().splitlines() or [f'exit code {p.returncode}'])[-1]}")
        err.exit_code = p.returncode if p.returncode in (1, 2) else 3  # refused (no CUDA, two nodes): 1
        raise err
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def ipc_text(r: dict[str, Any]) -> str:
    return (f"{r['transport']} refit on {r['device']}: {r['bytes'] / 1e6:.0f} MB in {r['refit_s'] * 1e3:.2f} ms "
            f"({r['refit_gbps']:.2f} GB/s; first push {r['first_push_s'] * 1e3:.1f} ms); memcpy floor "
            f"{r['floor_gbps']:.2f} GB/s; {r['ratio_to_floor']:.2f}x the floor; "
            f"{'byte-identical' if r['identical'] else 'DIFFERENT BYTES'}")


def main(argv: list[str] | None = None) -> int:
    from streamer.cli.args import parse_size, positive_int

    ap = argparse.ArgumentParser(prog="python -m streamer.tools.bench_ipc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="shm", choices=["shm", "cuda-ipc", "mpi", "gloo", "nccl"])
    ap.add_argument("--size", type=parse_size, default=256 << 20, metavar="SIZE")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--bucket-size", type=parse_size, default=64 << 20, metavar="SIZE")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from formats.errors import ShardstreamError

    try:
        if args.worker:
            return worker(args)
        r = bench_ipc(args.transport, size=args.size, repeats=args.repeats, bucket_size=args.bucket_size,
                      timeout=args.timeout)
    except ShardstreamError as e:  # the worker's line becomes the launcher's message
        print(str(e) if args.worker else f"shardstream: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(r) if args.json else ipc_text(r))
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    rc = main()
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
