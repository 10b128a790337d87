"""The benchmark commands at tiny size: what they measure is right (not how fast)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from streamer import bench
from streamer.cli import main


def test_bench_plan_sweep_and_exponent() -> None:
    r = bench.bench_plan((24, 96))
    assert [x["chunks"] for x in r["sweep"]] == [24, 96]  # 12 chunks per array: 8 source + 4 destination
    assert all(x["problems"] == 0 and x["transfers"] > 0 and x["peak_bytes"] > 0 for x in r["sweep"])
    assert r["sweep"][1]["transfers"] == 4 * r["sweep"][0]["transfers"]
    assert math.isfinite(r["plan_exponent"]) and math.isfinite(r["validate_exponent"])


def test_bench_validate_counts_chunks() -> None:
    r = bench.bench_validate(2000)
    assert r["chunks"] == 2000 and r["problems"] == 0 and r["total_s"] > 0


def test_bench_convert_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "convert", "--preset", "qwen3-tiny", "--repeats", "1", "--work", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    files = sorted((tmp_path / "tp4").glob("*.safetensors"))
    assert r["bytes"] == sum(f.stat().st_size for f in files)  # the floor copies exactly these bytes
    assert r["convert_s"] > 0 and r["floor_s"] > 0
    assert r["ratio_to_floor"] == pytest.approx(r["convert_s"] / r["floor_s"])
    assert r["bytes_read"] >= sum(f.stat().st_size for f in files) - 8 * 1024 * len(files)  # headers aside
