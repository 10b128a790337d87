"""Short GPU benchmark for scripts/gpu_check.sh: one table of device memcpy GB/s (the floor),
block-FP8 and MXFP8 quantize GB/s with torch on the GPU, and NCCL send/recv GB/s where >= 2 GPUs.
Run from the repository root (``python scripts/gpu_bench.py``); needs CUDA."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
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


def main() -> int:
    dev = torch.cuda.get_device_name(0)
    rows: list[tuple[str, str, str]] = []
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    t = _timed(lambda: dst.copy_(src))
    rows.append(("device memcpy (floor)", f"{n / t / GB:.1f}", "1 GiB D2D copy_, read+write counted once"))
    w = torch.randn((8192, 8192), device="cuda").to(torch.bfloat16)
    for name, fn in [("quantize block FP8 128x128", lambda: ref_block_fp8(w)),
                     ("quantize block FP8 ue8m0", lambda: ref_block_fp8(w, ue8m0=True)),
                     ("quantize MXFP8 1x32", lambda: ref_mxfp8(w))]:
        t = _timed(fn, 5)
        rows.append((name, f"{w.numel() * 2 / t / GB:.1f}", "bf16 bytes in / s, torch reference kernels"))
    rows.append(("cuda-ipc refit", "n/a", "not implemented yet (issue 16 item 2)"))
    if torch.cuda.device_count() >= 2:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
