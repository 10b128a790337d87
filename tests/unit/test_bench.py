"""The benchmark commands at tiny size: what they measure is right (not how fast)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from formats.errors import UsageError
from streamer.cli.app import _refit_meshes, main
from streamer.tools import bench


def test_bench_plan_sweep_and_exponent() -> None:
    r = bench.bench_plan((24, 96))
    assert [x["chunks"] for x in r["sweep"]] == [24, 96]  # 12 chunks per array: 8 source + 4 destination
    assert all(x["problems"] == 0 and x["transfers"] > 0 and x["peak_bytes"] > 0 for x in r["sweep"])
    assert r["sweep"][1]["transfers"] == 4 * r["sweep"][0]["transfers"]
    assert math.isfinite(r["plan_exponent"]) and math.isfinite(r["validate_exponent"])


def test_bench_validate_counts_chunks() -> None:
    r = bench.bench_validate(2000)
    assert r["chunks"] == 2000 and r["problems"] == 0 and r["total_s"] > 0


@pytest.mark.slow  # the scale tier
def test_bench_convert_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TP2 -> TP3 (uneven) at tiny size, with the DCP path: 2 gloo ranks dcp.save, 3 dcp.load."""
    pytest.importorskip("torch.distributed.checkpoint")  # the optional [torch] extra; --no-dcp is tested below
    assert main(["bench", "convert", "--preset", "qwen3-tiny", "--repeats", "1", "--src-tp", "2",
                 "--dst-tp", "3", "--work", str(tmp_path), "--json"]) == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    files = sorted((tmp_path / "tp2").glob("*.safetensors"))
    assert len(files) == 2
    assert r["bytes"] == sum(f.stat().st_size for f in files)  # the floor copies exactly these bytes
    assert r["convert_s"] > 0 and r["floor_s"] > 0
    assert r["ratio_to_floor"] == pytest.approx(r["convert_s"] / r["floor_s"])
    assert r["bytes_read"] >= sum(f.stat().st_size for f in files) - 8 * 1024 * len(files)  # headers aside
    # the DCP path ran, and its output is convert's, tensor by tensor (bench_dcp.compare_outputs)
    assert r["dcp_matches_convert"] is True
    c = r["dcp_compared"]
    assert c["files"] == 3 and c["tensors"] > 0
    assert c["bytes"] >= r["bytes"] - 8 * 1024 * len(files)  # every tensor byte of the target compared
    for k in ("dcp_s", "dcp_load_s", "dcp_write_s", "dcp_wall_s", "dcp_save_s", "dcp_save_wall_s",
              "dcp_peak_rss_bytes", "dcp_peak_rss_max_bytes", "dcp_rss_before_load_bytes",
              "dcp_save_peak_rss_bytes", "dcp_bytes_read", "dcp_checkpoint_bytes", "speedup_vs_dcp",
              "memory_ratio_vs_dcp"):
        assert r[k] > 0, k
    assert r["dcp_wall_s"] >= r["dcp_s"] >= r["dcp_load_s"]
    assert r["dcp_peak_rss_bytes"] >= r["dcp_peak_rss_max_bytes"]
    assert r["dcp_bytes_read"] >= c["bytes"]  # DCP reads whole saved chunks, at least what it lands
    assert r["speedup_vs_dcp"] == pytest.approx(r["dcp_s"] / r["convert_s"])
    assert r["memory_ratio_vs_dcp"] == pytest.approx(r["dcp_peak_rss_bytes"] / r["convert_peak_rss_bytes"])
    assert "speedup vs DCP" in cap.err and "memory vs DCP" in cap.err  # the table (stderr with --json)
    assert not (tmp_path / "dcp").exists() and not (tmp_path / "dcp-tp3").exists()  # scratch removed


def test_bench_convert_no_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    from streamer.tools import bench_dcp

    monkeypatch.setattr(bench_dcp, "dcp_missing",
                        lambda: "torch.distributed.checkpoint is not importable (test)")
    args = ["bench", "convert", "--preset", "qwen3-tiny", "--repeats", "1", "--work", str(tmp_path)]
    assert main(args) == 1  # no silent skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--no-dcp" in err[0]
    assert "torch.distributed.checkpoint is not importable" in err[0]
    assert not (tmp_path / "tp4").exists()  # said so before building anything
    assert main(args + ["--no-dcp", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "dcp_s" not in r and r["convert_s"] > 0


def test_dcp_placements_from_manifest() -> None:
    """Replicate for one chunk held by all, Shard(d) for one chunk per rank; anything else refused.
    (That DTensor's torch.chunk split is the manifest's is checked by every DCP worker.)"""
    from streamer.tools.bench_dcp import placements

    man = {"world_size": 3, "mesh": {"axes": ["tp"], "shape": [3]}, "arrays": {
        "w": {"shape": [4, 10], "data_type": "bfloat16", "chunks": [
            {"region": {"offsets": [0, o], "sizes": [4, n]}, "holders": [r]}
            for r, (o, n) in enumerate([(0, 4), (4, 4), (8, 2)])]},
        "n": {"shape": [10], "data_type": "bfloat16",
              "chunks": [{"region": {"offsets": [0], "sizes": [10]}, "holders": [0, 1, 2]}]}}}
    p = placements(man)
    assert p["w"][2] == 1 and p["n"][2] is None
    assert p["w"][3][2] == ([0, 8], [4, 2])
    man["arrays"]["w"]["chunks"][2]["holders"] = [1]
    with pytest.raises(ValueError, match="more than one chunk"):
        placements(man)


def test_dcp_compare_outputs_fails_loudly(tmp_path: Path) -> None:
    import numpy as np

    from formats.errors import ValidationError
    from formats.manifest.dtypes import DTYPES
    from formats.safetensors.io import SafetensorsWriter
    from streamer.tools.bench_dcp import compare_outputs

    def write(d: Path, data: bytes) -> None:
        d.mkdir()
        w = SafetensorsWriter(d / "rank-00000.safetensors", [("t", DTYPES["uint8"], (len(data),))])
        w.write("t", 0, np.frombuffer(data, dtype=np.uint8))
        w.commit()

    write(tmp_path / "a", b"abcd")
    write(tmp_path / "b", b"abcd")
    write(tmp_path / "c", b"abce")
    assert compare_outputs(tmp_path / "a", tmp_path / "b")["bytes"] == 4
    with pytest.raises(ValidationError, match="differs"):
        compare_outputs(tmp_path / "a", tmp_path / "c")


def test_refit_result_reports_the_first_push_apart() -> None:
    """bench refit: the cold first round is reported on its own; medians are over the rounds after it."""
    from helpers import lay_out

    from formats.layouts import Mesh, Shard
    from streamer.plan.planner import plan_transfers
    from streamer.tools.bench import _refit_result

    arrays = {"w": ((8, 4), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("tp",), (4,)), {"w": (Shard(0),)})
    stats = plan_transfers(src, dst).stats()
    times = {"reshard": [0.8, 0.11, 0.10, 0.12], "broadcast": [2.0, 1.0, 1.2, 1.1], "floor": [0.3, 0.1, 0.09, 0.1]}
    r = _refit_result(times, senders=2, receivers=4, stats=stats, bucket_size=1 << 20, peaks=[5, 7], rss=[1])
    assert r["first_push_s"] == 0.8 and r["first_runs"] == {"reshard": 0.8, "broadcast": 2.0, "floor": 0.3}
    assert r["repeats"] == 3 and r["runs"]["reshard"] == [0.11, 0.10, 0.12]
    assert r["reshard_s"] == 0.11 and r["floor_s"] == 0.1 and r["broadcast_s"] == 1.1
    assert abs(r["ratio_to_floor"] - 1.1) < 1e-9 and abs(r["first_push_ratio_to_floor"] - 8.0) < 1e-9
    assert abs(r["first_push_ratio_to_steady"] - 0.8 / 0.11) < 1e-9 and r["open_s"] == 0.0
    assert r["bytes_moved"] == stats.moved_bytes and r["peak_extra_bytes_per_rank"] == 7


def test_against_prints_each_ratio_beside_its_reference(tmp_path: Path) -> None:
    """bench refit --against: the committed reference parses, and each figure is judged in the
    right direction (a ratio to the floor is better smaller, a speedup larger)."""
    from streamer.tools.bench_against import against_table, load_reference

    root = Path(__file__).resolve().parents[2]
    ref = load_reference(str(root / "benchmarks" / "refit-reference.json"))
    result = {"ratio_to_floor": 1.5, "first_push_ratio_to_steady": 1.0, "speedup_vs_broadcast": 30.0}
    text = against_table(result, ref, "ref.json")
    lines = {ln.split()[0] + " " + ln.split()[1]: ln for ln in text.splitlines()[2:] if ln.startswith("  ")}
    assert lines["steady push"].endswith("WORSE") and "1.50" in lines["steady push"]
    assert lines["first push"].endswith("ok") and lines["gather-broadcast /"].endswith("ok")
    bad = tmp_path / "bad.json"
    bad.write_text('{"config": {"preset": "x", "colour": 1}, "reference": {}}')
    with pytest.raises(UsageError, match="unknown keys \\['colour'\\]"):
        load_reference(str(bad))


def test_bench_replicas_needs_a_joiner(tmp_path: Path) -> None:
    from streamer.tools.bench_replicas import bench_replicas

    with pytest.raises(UsageError, match="N >= 2"):
        bench_replicas(str(tmp_path), replicas=1)


@pytest.mark.parametrize(("argv", "says"), [
    (["--senders", "2", "--receivers", "2", "--serve-mesh", "tp=4"], "--serve-mesh tp=4 has 4 ranks but --receivers is 2"),
    (["--senders", "2", "--train-mesh", "pp=2,tp=2"], "--train-mesh pp=2,tp=2 has 4 ranks but --senders is 2"),
    (["--delta", "--senders", "1", "--train-mesh", "tp=2"], "--train-mesh tp=2 has 2 ranks but --senders is 1"),
])
def test_bench_refit_mesh_of_another_size_is_refused_before_a_launch(tmp_path: Path, argv: list[str], says: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Meshes default to the rank counts (2 + 2 ranks ran into the 4-rank defaults with a traceback
    from inside the launch); one given of another size is one line and exit 2, nothing started."""
    assert main(["bench", "refit", *argv, "--work", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"shardstream: {says}"
    assert list(tmp_path.iterdir()) == []
    ns = argparse.Namespace(train_mesh=None, serve_mesh=None, senders=2, receivers=3, source="files")
    assert _refit_meshes(ns) == ("tp=2", "tp=3")
    ns.senders = ns.receivers = 4
    assert _refit_meshes(ns) == ("pp=2,tp=2", "tp=4")  # the documented default
