"""One refit rank's start at DeepSeek-V3 scale (issue 14): Megatron PP16xEP8xTP2 -> vLLM
DP8xTP32, 256 + 256 ranks, from the two compact manifests. Each start runs in its own process
(``python -m streamer.tools.bench_rank start``), which reports its peak RSS through ``resource``
(ru_maxrss): parsing both manifests, planning and this rank's schedule stay under 1 GiB. Marked
``slow`` (about 30 s: the two layouts, then two starts); scripts/test.sh runs it (tier scale)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2] / "workloads" / "models"  # the shipped model shapes
CONFIG = MODELS / "deepseek-v3.config.json"
GB = 1 << 30


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from streamer.tools.bench_rank import _manifests

    src, dst, _ = _manifests(tmp_path_factory.mktemp("dsv3"), "deepseek-v3", MODELS)
    return src, dst


def _start(src: Path, dst: Path, rank: int, domain: int) -> dict[str, object]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "streamer.tools.bench_rank", "start", str(src), str(dst), str(rank),
                        str(domain)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    out: dict[str, object] = json.loads(p.stdout)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 300], ids=["sender 0", "receiver 44"])
def test_one_rank_start_at_deepseek_v3_scale(manifests: tuple[Path, Path], rank: int) -> None:
    """In NVLink domains of 8 on both sides: the receiver also forwards to, and is fed by, the 7
    other ranks of its domain (phase 2)."""
    src, dst = manifests
    assert src.stat().st_size < 1_000_000 and dst.stat().st_size < 1_000_000  # compact form
    got = _start(src, dst, rank, 8)
    assert got["rank"] == rank and isinstance(got["messages"], int) and got["messages"] > 0
    if rank >= 256:
        assert got["forwards_sent"] and got["forwards_received"], got
    # ru_maxrss: this test process stays small (the manifests are written by a child), so the
    # child's figure is its own peak (Linux counts a larger parent's memory at fork in it)
    rss = got["ru_maxrss_bytes"]
    assert isinstance(rss, int) and rss <= GB, f"rank {rank}'s start peaked at {rss / 2**20:.0f} MiB (limit 1 GiB)"
