"""``bench plan --model CFG`` at scale (issue 14): one refit rank's start and the whole plan's
figures, each timed in a fresh process with its own peak RSS.

One rank's start is what ``RefitSession.start`` computes after the two compact manifests have
arrived: parse both, digest the inputs, plan (compressed, no whole-plan figures), this rank's
schedule with its peers' local tensor shapes, and its own local tensors. The whole plan is what
``shardstream plan SRC DST --json`` does from the files (load, validate, plan, figures, digest). The manifests are
written once by the presets (compact form, no files) and reused.

    python -m streamer.tools.bench_rank start SRC DST RANK [DOMAIN]   # one JSON line
    python -m streamer.tools.bench_rank plan SRC DST DOMAIN
    python -m streamer.tools.bench_rank validate MANIFEST
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from streamer.plan.gcpause import paused_gc

__all__ = ["SCALE_CASES", "bench_scale", "rank_start", "scale_case", "scale_lines", "whole_plan"]

#: (name, HF config in workloads/models, trainer mesh, Megatron first/last stage layers, server mesh)
SCALE_CASES = {
    "deepseek-v3": ("deepseek-v3.config.json", "pp=16,ep=8,tp=2", (3, 2), "dp=8,tp=32"),
    "qwen3-235b-a22b": ("qwen3-235b-a22b.config.json", "pp=8,ep=8,tp=2", (11, 11), "dp=16,tp=8"),
    # 1.03T parameters, 384 experts: Perplexity's published refit, 256 training -> 128 FP8 serving
    # GPUs, as BENCHMARKS.md's Kimi-K2 rows (the largest model in workloads/; the layout of design
    # §9's 2.4T microbenchmark is not published)
    "kimi-k2": ("kimi-k2.config.json", "pp=16,ep=16", (3, 2), "dp=8,tp=16"),
}


def scale_case(config: str) -> str | None:
    """The case benchmarked at scale for an HF config file (by its workloads/models name), if any."""
    name = Path(config).name
    return next((k for k, v in SCALE_CASES.items() if v[0] == name), None)


def _rss() -> int:
    """This process's peak RSS: ``VmHWM`` on Linux (the peak of this program's own memory), else
    ru_maxrss, which on Linux also counts the parent's memory at fork when the parent was larger."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _maxrss()


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_start(src_path: str, dst_path: str, rank: int, domain: int | None = None,
               bucket_size: int = 256 << 20) -> dict[str, Any]:
    """One merged rank's refit start from the two compact manifest files (read as the bytes the
    broadcast would deliver); its time and this process's peak RSS."""
    src_text, dst_text = Path(src_path).read_bytes(), Path(dst_path).read_bytes()
    with paused_gc():  # as RefitSession.start
        return _rank_start(src_text, dst_text, src_path, dst_path, rank, domain, bucket_size)


def _rank_start(src_text: bytes, dst_text: bytes, src_path: str, dst_path: str, rank: int, domain: int | None,
                bucket_size: int) -> dict[str, Any]:
    from formats.manifest.wire import loads_manifest
    from streamer.refit.rankstart import input_digests, plan_own

    rss0, t0, c0 = _rss(), time.perf_counter(), time.process_time()
    src = loads_manifest(src_text, where=src_path)
    dst = loads_manifest(dst_text, where=dst_path)
    t1 = time.perf_counter()
    input_digests(src_text, dst_text, {"bucket_size": bucket_size, "src_domain_size": domain,
                                       "dst_domain_size": domain})
    plan, schedule = plan_own(src, dst, rank, bucket_size=bucket_size, src_domain_size=domain,
                              dst_domain_size=domain)
    S = src.world_size
    own = src.local_tensors(rank) if rank < S else dst.local_tensors(rank - S)
    t2 = time.perf_counter()
    mine = [m for m in schedule if rank in (m.src, m.dst)]
    return {"rank": rank, "seconds": t2 - t0, "cpu_seconds": time.process_time() - c0, "parse_seconds": t1 - t0,
            "plan_seconds": t2 - t1,
            "peak_rss_bytes": _rss(), "ru_maxrss_bytes": _maxrss(), "rss_before_bytes": rss0, "messages": len(mine),
            "bytes": sum(m.nbytes for m in mine), "local_tensors": len(own),
            "forwards_sent": sum(1 for m in mine if m.phase == 2 and m.src == rank),
            "forwards_received": sum(1 for m in mine if m.phase == 2 and m.dst == rank)}


def _manifests(work: Path, name: str, models: Path) -> tuple[Path, Path, float]:
    """The case's compact manifests, written once by ``shardstream layout`` in a child process (a
    parent grown by a preset would count in its later children's ru_maxrss); seconds spent."""
    import subprocess

    cfg, train, (first, last), serve = SCALE_CASES[name]
    src, dst = work / f"{name}-train.json", work / f"{name}-serve.json"
    t0 = time.perf_counter()
    for out, args in ((src, ["--preset", "megatron", "--mesh", train, "--first-stage-layers", str(first),
                             "--last-stage-layers", str(last)]),
                      (dst, ["--preset", "vllm", "--mesh", serve])):
        if not out.exists():
            subprocess.run([sys.executable, "-m", "streamer", "layout", "--model", str(models / cfg), *args,
                            "--no-files", "-o", str(out)], check=True, capture_output=True, timeout=900)
    return src, dst, time.perf_counter() - t0


def whole_plan(src_path: str, dst_path: str, domain: int) -> dict[str, Any]:
    """What ``shardstream plan SRC DST --json`` does (load, validate both, plan with the figures,
    digest), in this process; its figures, time and peak RSS."""
    with paused_gc():  # as ``shardstream plan``
        return _whole_plan(src_path, dst_path, domain)


def _whole_plan(src_path: str, dst_path: str, domain: int) -> dict[str, Any]:
    from formats.manifest.wire import load_manifest
    from formats.validate.manifest import validate_manifest
    from streamer.plan.planner import plan_transfers

    t0, c0 = time.perf_counter(), time.process_time()
    src, dst = load_manifest(src_path), load_manifest(dst_path)
    problems = validate_manifest(src, check_paths=False) + validate_manifest(dst, check_paths=False)
    if problems:
        raise RuntimeError(f"{src_path} / {dst_path}: {problems[:3]}")
    t1 = time.perf_counter()
    plan = plan_transfers(src, dst, src_domain_size=domain, dst_domain_size=domain)
    st = plan.stats()
    t2 = time.perf_counter()
    digest = plan.digest()
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "load_validate_seconds": t1 - t0, "plan_seconds": t2 - t1,
            "peak_rss_bytes": _rss(), "ru_maxrss_bytes": _maxrss(), "transfers": st.transfers,
            "moved_bytes": st.moved_bytes, "max_send_bytes": st.max_send_bytes, "digest": digest}


def bench_scale(work: str, models: str, *, names: tuple[str, ...] = tuple(SCALE_CASES),
                domain: int = 8) -> dict[str, Any]:
    """Per case: one sender's and one receiver's start, and the whole plan's figures, each in its
    own process (``_sh`` reads the child's own peak RSS)."""
    from streamer.tools.bench import _sh

    out: dict[str, Any] = {}
    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    for name in names:
        src, dst, layout_s = _manifests(w, name, Path(models))
        row: dict[str, Any] = {"train": SCALE_CASES[name][1], "serve": SCALE_CASES[name][3], "domain": domain,
                               "layout_seconds": layout_s, "manifest_bytes": [src.stat().st_size, dst.stat().st_size]}
        for side, path in (("train", src), ("serve", dst)):  # what `shardstream validate` does
            wall, _, text = _sh([sys.executable, "-m", "streamer.tools.bench_rank", "validate", str(path)])
            row[f"validate_{side}"] = dict(json.loads(text), wall_seconds=wall)
        S = json.loads(src.read_text())["world_size"]
        for role, rank in (("sender", 0), ("receiver", S)):
            wall, _, text = _sh([sys.executable, "-m", "streamer.tools.bench_rank", "start", str(src), str(dst),
                                 str(rank), str(domain)])
            row[f"{role}_start"] = dict(json.loads(text), wall_seconds=wall)
        wall, _, text = _sh([sys.executable, "-m", "streamer.tools.bench_rank", "plan", str(src), str(dst), str(domain)])
        row["whole_plan"] = dict(json.loads(text), wall_seconds=wall)
        out[name] = row
    return out


def scale_lines(r: dict[str, Any]) -> list[str]:
    """The human lines of ``bench_scale``'s result."""
    lines = []
    for name, row in r.items():
        lines.append(f"  {name}: Megatron {row['train']} -> vLLM {row['serve']}, domain {row['domain']}, "
                     f"compact manifests {row['manifest_bytes'][0] / 1e3:.0f} + {row['manifest_bytes'][1] / 1e3:.0f} KB")
        for role in ("sender", "receiver"):
            s = row[f"{role}_start"]
            lines.append(f"    one {role}'s start (rank {s['rank']}): {s['seconds']:.2f} s ({s['cpu_seconds']:.2f} s CPU; parse "
                         f"{s['parse_seconds']:.2f}"
                         f" + plan and schedule {s['plan_seconds']:.2f}), peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB, "
                         f"{s['messages']} messages (target <= 5 s, <= 1 GB)")
        v = [row[f"validate_{side}"] for side in ("train", "serve")]
        lines.append(f"    validate: {v[0]['seconds']:.2f} s and {v[1]['seconds']:.2f} s, peak RSS "
                     f"{max(x['peak_rss_bytes'] for x in v) / 2**20:.0f} MiB (target <= 2 s, <= 300 MB)")
        p = row["whole_plan"]
        lines.append(f"    whole plan stats (`plan --json` from the files): {p['seconds']:.2f} s ({p['cpu_seconds']:.2f} s CPU), "
                     f"peak RSS {p['peak_rss_bytes'] / 2**20:.0f} MiB, {p['transfers']} transfers "
                     f"(target <= 10 s, <= 2 GB)")
    return lines


def validate(path: str) -> dict[str, Any]:
    """What ``shardstream validate PATH`` does (load, validate), in this process; its time and
    peak RSS (``VmHWM``: a parent's memory at fork does not count)."""
    from formats.manifest.wire import load_manifest
    from formats.validate.manifest import validate_manifest

    t0, c0 = time.perf_counter(), time.process_time()
    problems = validate_manifest(load_manifest(path), where=path)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "peak_rss_bytes": _rss(), "problems": len(problems)}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "validate":
        print(json.dumps(validate(argv[1])))
        return 0
    if len(argv) >= 4 and argv[0] == "start":
        domain = int(argv[4]) if len(argv) > 4 else None
        print(json.dumps(rank_start(argv[1], argv[2], int(argv[3]), domain)))
        return 0
    if len(argv) == 4 and argv[0] == "plan":
        print(json.dumps(whole_plan(argv[1], argv[2], int(argv[3]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
