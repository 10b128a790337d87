"""Load: 200 consecutive pushes over one RefitSession, 4 + 4 ranks (issue: reliability)."""

from __future__ import annotations

import json

import pytest
from mpi_helpers import BIN, MPIEXEC, REPO, ok, run

pytestmark = pytest.mark.mpi


def test_200_pushes_no_growth_byte_exact(ckpt, tmp_path) -> None:  # type: ignore[no-untyped-def]
    expected = tmp_path / "expected"
    ok(["shardstream", "convert", ckpt.hf_manifest, ckpt.serve, "--out", expected])
    cmd = [MPIEXEC, "-n", "8", str(BIN / "python"), str(REPO / "tests/mpi/load_worker.py"),
           str(ckpt.train / "manifest.json"), str(ckpt.serve), str(expected / "manifest.json"), "4", "200"]
    rc, out, err = run(cmd, timeout=400)
    assert rc == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    for r in res["ranks"]:
        assert r["bad"] == 0, f"rank {r['rank']}: {r['bad']} tensors differ from the expected bytes"
        assert r["rss_end"] <= r["rss10"] * 1.05, f"rank {r['rank']}: RSS grew {r['rss10']} -> {r['rss_end']}"
        assert r["fd_end"] <= r["fd10"], f"rank {r['rank']}: file descriptors grew {r['fd10']} -> {r['fd_end']}"
    print("push 10 vs 200 RSS (MiB):", [(r["rank"], round(r["rss10"] / 2**20, 1), round(r["rss_end"] / 2**20, 1))
                                        for r in res["ranks"]])
