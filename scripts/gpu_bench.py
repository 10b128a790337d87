"""Short GPU benchmark for scripts/gpu_check.sh: one table of device memcpy GB/s (the floor),
block-FP8 and MXFP8 quantize GB/s with torch on the GPU, colocated cuda-ipc refit GB/s (a trainer
and a server process on one GPU, ``streamer.tools.bench_ipc``), and NCCL send/recv and NCCL refit GB/s
where >= 2 GPUs.
Run from the repository root (``python scripts/gpu_bench.py``); needs CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from quant_reference import ref_block_fp8, ref_mxfp8  # noqa: E402

GB = 1e9


def _timed(fn: Callable[[], Any], repeats: int = 10) -> float:
    """Seconds per call, CUDA events around ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / repeats


def _nccl_worker(rank: int, path: str, nbytes: int, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def step() -> None:
        (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)

    t = _timed(step, 5)
    if rank == 1:
        Path(out).write_text(f"{nbytes / t / GB:.1f}")
    dist.destroy_process_group()


def _first_gpu() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]


def _refit_row(transport: str, label: str, floor: float, env: dict[str, str]) -> tuple[str, str, str]:
    """A 1 + 1 rank refit of 512 MiB (``streamer.tools.bench_ipc`` under mpiexec), against ``floor``."""
    try:
        p = subprocess.run([sys.executable, "-m", "streamer.tools.bench_ipc", "--transport", transport, "--size", "512MiB",
                            "--repeats", "5", "--json"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, **env), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return label, "FAILED", "still running after 60 s"
    if p.returncode != 0:
        return label, "FAILED", (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1][:120]
    r = json.loads(p.stdout)
    same = "byte-identical" if r["identical"] else "BYTES DIFFER"
    return (label, f"{r['refit_gbps']:.1f}", f"{r['refit_gbps'] / floor:.2f}x the memcpy floor above; 512 MiB "
            f"trainer -> server process, {same}")


def main() -> int:
    dev = torch.cuda.get_device_name(0)
    rows: list[tuple[str, str, str]] = []
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    t = _timed(lambda: dst.copy_(src))
    floor = n / t / GB
    rows.append(("device memcpy (floor)", f"{floor:.1f}", "1 GiB D2D copy_, read+write counted once"))
    w = torch.randn((8192, 8192), device="cuda").to(torch.bfloat16)
    for name, fn in [("quantize block FP8 128x128", lambda: ref_block_fp8(w)),
                     ("quantize block FP8 ue8m0", lambda: ref_block_fp8(w, ue8m0=True)),
                     ("quantize MXFP8 1x32", lambda: ref_mxfp8(w))]:
        t = _timed(fn, 5)
        rows.append((name, f"{w.numel() * 2 / t / GB:.1f}", "bf16 bytes in / s, torch reference kernels"))
    rows.append(_refit_row("cuda-ipc", "cuda-ipc refit, 1 GPU", floor, {"CUDA_VISIBLE_DEVICES": _first_gpu()}))
    if torch.cuda.device_count() >= 2:
        rows.append(_refit_row("nccl", "NCCL refit, 2 GPUs", floor, {}))
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "gbps")
            mp.spawn(_nccl_worker, args=(os.path.join(d, "store"), 1 << 28, out), nprocs=2)
            rows.append(("NCCL send/recv, 2 GPUs", Path(out).read_text(), "256 MiB, GPU 0 -> GPU 1"))
    else:
        rows.append(("NCCL send/recv", "n/a", "needs >= 2 GPUs"))
    print(f"GPU benchmark on {dev} ({torch.cuda.device_count()} GPU(s)), torch {torch.__version__}")
    print(f"| {'what':30s} | {'GB/s':>8s} | notes")
    print(f"|{'-' * 32}|{'-' * 10}|{'-' * 44}")
    for what, gbps, note in rows:
        print(f"| {what:30s} | {gbps:>8s} | {note}")
    failed = [what for what, gbps, note in rows if gbps == "FAILED" or "BYTES DIFFER" in note]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
