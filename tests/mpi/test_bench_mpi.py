"""The benchmarks' code paths under mpiexec at tiny size (``shardstream bench refit``): the JSON
keys and planned bytes, a real FSDP2 trainer as the source, and ``--delta`` with real AdamW steps.
(Figures come from the commands themselves, never from tests: BENCHMARKS.md.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_helpers import REPO, have

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("source", ["files", "fsdp2"])
def test_bench_refit_tiny(tmp_path: Path, source: str) -> None:
    """bench refit at tiny size: the JSON has the documented keys and the planned bytes; with
    ``--source fsdp2`` the trainer is a real fp32 FSDP2 model and every array is cast to bf16."""
    import json

    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # 2 + 2 ranks with a real trainer (each rank imports torch and builds its model), 4 + 4 otherwise
    ranks = ["--senders", "2", "--receivers", "2", "--serve-mesh", "tp=2"] if source == "fsdp2" else []
    p = subprocess.run([sys.executable, "-m", "streamer", "bench", "refit", "--preset", "qwen3-tiny", "--repeats", "2",
                        "--work", str(tmp_path), "--json", "--source", source, *ranks], capture_output=True, text=True,
                       timeout=300, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    for k in ("reshard_s", "broadcast_s", "floor_s", "speedup_vs_broadcast", "ratio_to_floor", "bytes_moved", "first_push_s",
              "bucket_bytes", "peak_extra_bytes_per_rank"):
        assert k in r, k
    assert 0 < r["bytes_moved"] < r["broadcast_bytes_moved"]
    assert r["peak_extra_bytes_per_rank"] <= 2 * r["bucket_bytes"]
    assert r["source"] == source and (r["cast_arrays"] > 0) == (source == "fsdp2")


@pytest.mark.skipif(not have("transformers"), reason="transformers missing")
def test_bench_refit_delta_tiny(tmp_path: Path) -> None:
    """bench refit --delta: one real AdamW step at lr 1e-6 changes a few % of the bf16 weights;
    encoded, the push carries a few % of the full bytes; as a user gets it (one host: shared
    memory, encoding loses to a copy) the delta session sends full bytes and keeps no base; the
    break-even link speed is reported. 1 + 1 ranks (each imports torch and transformers and builds
    the model; delta pushes between many ranks: test_transports.py::test_delta_refit_over_transport)."""
    import json

    env = dict(os.environ, HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    p = subprocess.run([sys.executable, "-m", "streamer", "bench", "refit", "--delta", "--senders", "1", "--receivers",
                        "1", "--repeats", "1", "--lr", "1e-6",
                        "--work", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    (run,) = r["runs"]
    first, later = run["rows"]
    assert first["encoded_wire_bytes"] == r["full_bytes"] > 0  # the first push is full
    assert 0.001 < run["changed_fraction"] < 0.1 and run["delta_bytes_ratio"] < 0.1, run
    assert run["encode_gbps_per_core"] > 0 and run["decode_gbps_per_core"] > 0 and r["base_bytes"] == r["full_bytes"]
    assert later["delta_wire_bytes"] == later["delta_full_bytes"] == r["full_bytes"]  # auto: full bytes
    assert 0 < run["break_even_gbps"] < 10 and run["delta_vs_full"] > 0 and run["encoded_vs_full"] > 0


def test_bench_refit_codec_tiny(tmp_path: Path) -> None:
    """bench refit --delta --codec at 64 MiB: both delta sessions deliver the same bytes as the full
    one (the bench checks every array), in framed Zstd, with a fraction of the full bytes."""
    import json

    p = subprocess.run([sys.executable, "-m", "streamer", "bench", "refit", "--delta", "--codec", "--size", "64MiB",
                        "--repeats", "1", "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["encodings"].get("zstd-frames", 0) > 0, r["encodings"]
    assert 0 < r["delta-all_wire_ratio"] < 0.2 and r["full_wire_ratio"] == 1.0
    assert r["all_vs_one"] > 0 and len(r["recv"]) == 2


def test_bench_refit_codec_needs_delta() -> None:
    p = subprocess.run([sys.executable, "-m", "streamer", "bench", "refit", "--codec"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert p.returncode == 2 and "pass --delta with it" in p.stderr and "Traceback" not in p.stderr
