"""Offline conversion (design §7, §8): round trips, rank files, bounded memory, checksums, HF
sharding, resume after SIGKILL, the output lock and the non-empty --out rule.

The CLI runs in-process (``streamer.cli.app.main``) except where a real process matters (SIGKILL).
"""

from __future__ import annotations

import fcntl
import filecmp
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from formats.layouts import Mesh, Replicate, Rule, Shard, apply_layout
from formats.manifest.wire import Manifest, load_manifest, save_manifest
from formats.safetensors.io import SafetensorsReader, read_header
from formats.validate.manifest import validate_data, validate_manifest
from streamer.cli.app import main
from streamer.convert import ConvertOptions, convert, plan_files
from streamer.convert.importer import import_checkpoint
from streamer.tools.synth import PRESETS, QWEN3_TP_RULES, qwen3_arrays, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PATTERN = "rank-{rank:05d}.safetensors"
ROUND_TRIP_DTYPES = ("bfloat16", "float8_e4m3fn", "int64", "bool", "float32")


# ------------------------------------------------------------------ helpers


def make_hf(d: Path, arrays: dict[str, tuple[tuple[int, ...], str]], seed: int = 0,
            max_shard_size: int | None = None) -> Manifest:
    """An HF checkpoint of seeded ``arrays`` in ``d`` with its manifest beside it."""
    write_checkpoint(d, arrays, seed=seed, max_shard_size=max_shard_size)
    save_manifest(import_checkpoint([d]), d / "manifest.json")
    return load_manifest(d / "manifest.json")


def lay_out(like: Manifest, mesh: Mesh, rules: list[Rule], file_pattern: str | None = PATTERN) -> Manifest:
    m = apply_layout(like, mesh, rules, file_pattern=file_pattern)
    assert validate_manifest(m, check_paths=False) == []
    return m


def hf_layout(like: Manifest) -> Manifest:
    """One rank, no files named: convert writes HF names (model.safetensors, or shards)."""
    return lay_out(like, Mesh(("tp",), (1,)), [], file_pattern=None)


def tensors_of(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with SafetensorsReader(path) as r:
        return {n: (r.tensor(n).dtype.name, tuple(r.tensor(n).shape), r.read(n).tobytes()) for n in r.names()}


def header_order(path: Path) -> list[str]:
    return list(read_header(path).tensors)


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Same tensors (names, dtypes, shapes, bytes); and the same file bytes when the order is the same."""
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for n in ta:
        assert ta[n] == tb[n], n
    if header_order(a) == header_order(b):
        assert filecmp.cmp(a, b, shallow=False), f"{a} and {b} hold the same tensors in the same order but differ"


def global_array(hf: Path, fqn: str) -> np.ndarray:
    with SafetensorsReader(hf / "model.safetensors") as r:
        return r.read(fqn)


def check_rank_files(out: Path, dst: Manifest, hf_dir: Path) -> None:
    """Every rank file holds exactly its rank's whole local tensors, under their local names, and
    each chunk's bytes equal the global array's region."""
    for rank in range(dst.world_size):
        local = dst.local_tensors(rank)
        path = out / PATTERN.format(rank=rank)
        if not local:
            continue
        with SafetensorsReader(path) as r:
            assert set(r.names()) == set(local), rank
            for name, ts in local.items():
                assert tuple(r.tensor(name).shape) == tuple(ts.shape)
                assert r.tensor(name).dtype.name == ts.data_type
        for fqn, a, c in dst.iter_chunks():
            if rank not in c.holders:
                continue
            g = global_array(hf_dir, fqn)
            # the trailing Ellipsis keeps a 0-d region an array (a numpy scalar would canonicalise bool bytes)
            sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes)) + (Ellipsis,)
            with SafetensorsReader(path) as r:
                got = r.read(c.tensor(fqn), c.local_box)
            assert got.tobytes() == np.ascontiguousarray(g[sl]).tobytes(), (rank, fqn, c.region)


def run_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ------------------------------------------------------------------ round trips (Hypothesis)


@st.composite
def arrays_and_layouts(draw: Any) -> tuple[dict[str, tuple[tuple[int, ...], str]], Mesh, list[Rule], Mesh, list[Rule]]:
    n = draw(st.integers(1, 3))
    arrays: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(n):
        nd = draw(st.integers(0, 5))
        cap = 7 if nd <= 2 else 3
        shape = tuple(draw(st.lists(st.integers(1, cap), min_size=nd, max_size=nd)))
        arrays[f"model.layers.{i}.w"] = (shape, draw(st.sampled_from(ROUND_TRIP_DTYPES)))

    def mesh_and_rules(axes_pool: list[str]) -> tuple[Mesh, list[Rule]]:
        k = draw(st.integers(1, 2))
        axes = draw(st.permutations(axes_pool))[:k]
        shape = tuple(draw(st.integers(1, 3)) for _ in axes)
        mesh = Mesh(tuple(axes), shape)
        rules = []
        for fqn, (shp, _) in arrays.items():
            opts: list[Any] = [Replicate()] + [Shard(d) for d in range(len(shp))]
            # two axes may pick the same dim: nested sharding
            rules.append(Rule(fqn, tuple(draw(st.sampled_from(opts)) for _ in axes)))
        return mesh, rules

    mesh_a, rules_a = mesh_and_rules(["dp", "tp", "fsdp"])
    mesh_b, rules_b = mesh_and_rules(["tp", "cp", "dp"])
    return arrays, mesh_a, rules_a, mesh_b, rules_b


@settings(max_examples=20)
@given(case=arrays_and_layouts(), seed=st.integers(0, 2**16), memory_limit=st.sampled_from([1 << 16, 1 << 30]))
def test_round_trip_random_layouts_byte_identical(case: Any, seed: int, memory_limit: int) -> None:
    arrays, mesh_a, rules_a, mesh_b, rules_b = case
    opts = ConvertOptions(memory_limit=memory_limit, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        hf = make_hf(t / "hf", arrays, seed=seed)
        dst_a = lay_out(hf, mesh_a, rules_a)
        convert(hf, dst_a, t / "a", opts)
        check_rank_files(t / "a", dst_a, t / "hf")
        a = load_manifest(t / "a")
        assert validate_manifest(a) == [] and validate_data(a) == []
        convert(a, lay_out(a, mesh_b, rules_b), t / "b", opts)
        b = load_manifest(t / "b")
        convert(b, hf_layout(b), t / "back", opts)
        assert sorted(p.name for p in (t / "back").iterdir()) == ["manifest.checksums", "manifest.json", "model.safetensors"]
        assert_same_checkpoint(t / "hf" / "model.safetensors", t / "back" / "model.safetensors")


def test_round_trip_odd_shapes_and_empty_arrays(tmp_path: Path) -> None:
    """0-d, 5-d, uneven nested shards, and zero-size arrays (which the HF file keeps)."""
    arrays = {"s": ((), "float8_e4m3fn"), "e": ((0, 3), "int64"), "f": ((5, 0, 2), "bool"),
              "g": ((3, 5, 1, 2, 3), "bfloat16"), "h": ((7,), "float32"), "i": ((5, 3), "bool")}
    hf = make_hf(tmp_path / "hf", arrays, seed=2)
    dst_a = lay_out(hf, Mesh(("dp", "tp"), (2, 3)),
                    [Rule("g", (Shard(0), Shard(0))), Rule("h", (Replicate(), Shard(0))),
                     Rule("i", (Shard(1), Shard(0)))])
    convert(hf, dst_a, tmp_path / "a")
    check_rank_files(tmp_path / "a", dst_a, tmp_path / "hf")
    a = load_manifest(tmp_path / "a")
    convert(a, lay_out(a, Mesh(("tp",), (4,)), [Rule("g", (Shard(4),)), Rule("h", (Shard(0),))]), tmp_path / "b")
    b = load_manifest(tmp_path / "b")
    convert(b, hf_layout(b), tmp_path / "back")
    assert header_order(tmp_path / "back" / "model.safetensors") == list(arrays)
    assert filecmp.cmp(tmp_path / "hf" / "model.safetensors", tmp_path / "back" / "model.safetensors", shallow=False)


def qwen3_rules(mesh: str) -> list[str]:
    out = []
    for r in QWEN3_TP_RULES:
        out += ["--rule", r]
    return ["--mesh", mesh] + out


def test_cli_example_flow_tp4_tp3_hf(tmp_path: Path, capsys: Any) -> None:
    d = tmp_path
    assert run_cli(capsys, "synth", "--preset", "qwen3-tiny", "--out", d / "hf")[0] == 0
    assert run_cli(capsys, "import", d / "hf", "-o", d / "hf" / "manifest.json")[0] == 0
    assert run_cli(capsys, "layout", "--like", d / "hf" / "manifest.json", *qwen3_rules("tp=4"),
                   "-o", d / "tp4.json")[0] == 0
    assert run_cli(capsys, "convert", d / "hf" / "manifest.json", d / "tp4.json", "--out", d / "tp4")[0] == 0
    assert run_cli(capsys, "layout", "--like", d / "tp4", *qwen3_rules("tp=3"), "-o", d / "tp3.json")[0] == 0
    assert run_cli(capsys, "convert", d / "tp4", d / "tp3.json", "--out", d / "tp3")[0] == 0
    assert run_cli(capsys, "layout", "--like", d / "tp3", "-o", d / "hf1.json")[0] == 0
    rc, out, err = run_cli(capsys, "convert", d / "tp3", d / "hf1.json", "--out", d / "back", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["files_written"] == 1 and rep["files_skipped"] == 0
    assert filecmp.cmp(d / "hf" / "model.safetensors", d / "back" / "model.safetensors", shallow=False)
    assert sorted(p.name for p in (d / "tp3").glob("*.safetensors")) == [PATTERN.format(rank=r) for r in range(3)]


# ------------------------------------------------------------------ rank files load on their own


def test_rank_files_load_with_safetensors_and_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import load_file

    arrays = {"w.bf16": ((6, 5), "bfloat16"), "w.fp8": ((5, 4), "float8_e4m3fn"), "w.i64": ((7,), "int64"),
              "w.bool": ((3, 3), "bool"), "w.f32": ((2, 3, 4), "float32"), "w.scalar": ((), "float32")}
    hf = make_hf(tmp_path / "hf", arrays, seed=5)
    dst = lay_out(hf, Mesh(("dp", "tp"), (2, 2)),
                  [Rule("w.bf16", (Shard(0), Shard(1))), Rule("w.fp8", (Replicate(), Shard(0))),
                   Rule("w.i64", (Shard(0), Shard(0))), Rule("w.f32", (Shard(2), Shard(1)))])
    convert(hf, dst, tmp_path / "out")
    def raw(t: Any) -> bytes:  # bytes, not values: synthetic bool / fp8 bytes need not be canonical
        return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    want_dtype = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "int64": torch.int64,
                  "bool": torch.bool, "float32": torch.float32}
    for rank in range(4):
        path = tmp_path / "out" / PATTERN.format(rank=rank)
        local = dst.local_tensors(rank)
        loaded = load_file(str(path))
        assert set(loaded) == set(local)
        with safe_open(str(path), "pt") as f:
            assert set(f.keys()) == set(local)
            for name, ts in local.items():
                t = f.get_tensor(name)
                assert tuple(t.shape) == tuple(ts.shape)
                assert t.dtype == want_dtype[ts.data_type]
                with SafetensorsReader(path) as r:
                    assert raw(t) == r.read(name).tobytes()
                assert raw(loaded[name]) == raw(t)
    check_rank_files(tmp_path / "out", dst, tmp_path / "hf")


# ------------------------------------------------------------------ bounded memory


def test_small_memory_limit_is_byte_identical(tmp_path: Path, capsys: Any) -> None:
    # rows of 200 KB (> the 64 KiB limit) force split reads inside a row; S(1) makes strided reads
    arrays = {"wide.weight": ((5, 50_001), "float32"), "tall.weight": ((3001, 7), "bfloat16"),
              **{k: v for k, v in qwen3_arrays(PRESETS["qwen3-tiny"]).items() if "layers.1." not in k}}
    make_hf(tmp_path / "hf", arrays, seed=9)
    src = str(tmp_path / "hf")
    assert run_cli(capsys, "layout", "--like", src, "--mesh", "dp=2,tp=3", "--rule", "wide.weight=R,S(1)",
                   "--rule", "tall.weight=S(0),S(0)", "--rule", "*.q_proj.weight=R,S(0)",
                   "-o", tmp_path / "d.json")[0] == 0
    reports = {}
    for limit in ("64KiB", "1GiB"):
        out = tmp_path / f"out-{limit}"
        rc, o, err = run_cli(capsys, "convert", src, tmp_path / "d.json", "--out", out, "--memory-limit", limit,
                             "--json")
        assert rc == 0, err
        reports[limit] = json.loads(o)
    small, big = tmp_path / "out-64KiB", tmp_path / "out-1GiB"
    for rank in range(6):
        f = PATTERN.format(rank=rank)
        assert filecmp.cmp(small / f, big / f, shallow=False), f
    assert reports["64KiB"]["reads"] > reports["1GiB"]["reads"]  # many slabs, split reads
    # back to HF through the small limit too
    assert run_cli(capsys, "layout", "--like", small, "-o", tmp_path / "hf1.json")[0] == 0
    assert run_cli(capsys, "convert", small, tmp_path / "hf1.json", "--out", tmp_path / "back",
                   "--memory-limit", "64KiB")[0] == 0
    assert filecmp.cmp(tmp_path / "hf" / "model.safetensors", tmp_path / "back" / "model.safetensors",
                       shallow=False)


def test_slabs_are_packed_into_few_sequential_writes(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    """A file's tensors are written as one stream: many small tensors cost a few large writes,
    in file order (one pwrite per slab made the background writer wait on the filler)."""
    from formats.safetensors.io import SafetensorsWriter

    make_hf(tmp_path / "hf", {f"t{i}.weight": ((17, 3 + i), "bfloat16") for i in range(40)}, seed=3)
    assert run_cli(capsys, "layout", "--like", tmp_path / "hf", "--mesh", "tp=2", "--rule", "*=S(0)",
                   "-o", tmp_path / "d.json")[0] == 0
    writes: list[tuple[str, int, int]] = []
    real = SafetensorsWriter.write_at

    def spy(self: SafetensorsWriter, offset: int, data: Any) -> None:
        writes.append((self.path.name, offset, memoryview(data).nbytes))
        real(self, offset, data)

    monkeypatch.setattr(SafetensorsWriter, "write_at", spy)
    assert run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "d.json", "--out", tmp_path / "out")[0] == 0
    for rank in range(2):
        f = PATTERN.format(rank=rank)
        mine = [(o, n) for name, o, n in writes if name == f]
        assert len(mine) == 1, mine  # 40 tensors, one write
        hdr = read_header(tmp_path / "out" / f)
        assert mine == [(hdr.data_start, hdr.file_size - hdr.data_start)]
    assert validate_data(load_manifest(tmp_path / "out" / "manifest.json")) == []


def test_contiguous_span() -> None:
    from formats.manifest.box import Box
    from streamer.convert.fill import contiguous_span as _contiguous_span

    assert _contiguous_span(Box((1, 0), (2, 8)), (4, 8)) == (8, 16)  # whole rows
    assert _contiguous_span(Box((1, 2), (1, 3)), (4, 8)) == (10, 3)  # part of one row
    assert _contiguous_span(Box((1, 2), (2, 3)), (4, 8)) is None  # strided
    assert _contiguous_span(Box((0, 1, 0), (1, 2, 5)), (2, 3, 5)) == (5, 10)
    assert _contiguous_span(Box((0, 1, 0), (2, 2, 5)), (2, 3, 5)) is None


# ------------------------------------------------------------------ checksums


@pytest.fixture()
def tp2(tmp_path: Path, capsys: Any) -> Path:
    """qwen3-tiny converted to TP2 in tmp_path/tp2."""
    assert run_cli(capsys, "synth", "--preset", "qwen3-tiny", "--out", tmp_path / "hf")[0] == 0
    assert run_cli(capsys, "layout", "--like", tmp_path / "hf", *qwen3_rules("tp=2"), "-o", tmp_path / "tp2.json")[0] == 0
    assert run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "tp2.json", "--out", tmp_path / "tp2")[0] == 0
    return tmp_path / "tp2"


def test_output_manifest_has_checksums_and_validates(tp2: Path, capsys: Any) -> None:
    """The output manifest is compact: every array refers to a layout, its chunk checksums in the
    sidecar beside it (no per-chunk JSON), and they read back as each chunk's checksum."""
    obj = json.loads((tp2 / "manifest.json").read_text())
    assert obj["format_version"] == 2 and obj["checksums"]["file"] == "manifest.checksums"
    assert all(isinstance(a, dict) and "layout" in a and "chunks" not in a for a in obj["arrays"].values())
    assert (tp2 / "manifest.checksums").stat().st_size == 8 * obj["checksums"]["count"]
    n = 0
    for fqn, a in load_manifest(tp2).arrays.items():
        for c in a.chunks:
            assert c.source is not None and re.fullmatch(r"(xxh64|crc32c):[0-9a-f]+", c.source.checksum or ""), fqn
            n += 1
    assert n == obj["checksums"]["count"] > 25
    rc, out, err = run_cli(capsys, "validate", "--data", tp2 / "manifest.json")
    assert rc == 0, err
    assert out.startswith("ok") and "data checked" in out


def test_format_version_1_output_lists_every_chunk_with_its_checksum(tp2: Path, tmp_path: Path,
                                                                     capsys: Any) -> None:
    """``convert --format-version 1``: the explicit form, no sidecar, the same chunks."""
    assert run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "tp2.json", "--out", tmp_path / "v1",
                   "--format-version", "1")[0] == 0
    obj = json.loads((tmp_path / "v1" / "manifest.json").read_text())
    assert obj["format_version"] == 1 and not (tmp_path / "v1" / "manifest.checksums").exists()
    assert all(c["source"]["checksum"] for a in obj["arrays"].values() for c in a["chunks"])
    assert load_manifest(tmp_path / "v1").arrays == load_manifest(tp2).arrays


def test_a_changed_or_missing_checksum_sidecar_is_named(tp2: Path, tmp_path: Path, capsys: Any) -> None:
    """One line, exit 1: a sidecar changed by one byte, cut short, or gone."""
    import shutil

    for damage, said in (("flip", "does not match the sha256"), ("cut", "the manifest says"),
                         ("gone", "cannot read the checksum sidecar")):
        out = tmp_path / damage
        shutil.copytree(tp2, out)
        side = out / "manifest.checksums"
        data = bytearray(side.read_bytes())
        if damage == "flip":
            data[3] ^= 1
            side.write_bytes(bytes(data))
        elif damage == "cut":
            side.write_bytes(bytes(data[:-8]))
        else:
            side.unlink()
        rc, _, err = run_cli(capsys, "validate", out / "manifest.json")
        assert rc == 1 and said in err and "manifest.checksums" in err, (damage, err)
        assert "Traceback" not in err


def test_flipped_byte_fails_validate_data_naming_the_array(tp2: Path, capsys: Any) -> None:
    path = tp2 / "rank-00001.safetensors"
    target = "model.layers.1.mlp.up_proj.weight"
    stt = read_header(path).tensors[target]
    with open(path, "r+b") as f:
        f.seek(stt.start + 17)
        b = f.read(1)
        f.seek(stt.start + 17)
        f.write(bytes([b[0] ^ 0x40]))
    rc, out, err = run_cli(capsys, "validate", "--data", tp2 / "manifest.json")
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert target in lines[0] and "checksum mismatch" in lines[0] and "rank 1" in lines[0]
    assert "Traceback" not in err
    assert out.startswith("FAIL")
    # without --data the manifest alone is still fine
    assert run_cli(capsys, "validate", tp2 / "manifest.json")[0] == 0


# ------------------------------------------------------------------ HF shards


def test_max_shard_size_writes_hf_shards_and_index(tp2: Path, tmp_path: Path, capsys: Any) -> None:
    hf_orig = tmp_path / "hf" / "model.safetensors"
    assert run_cli(capsys, "layout", "--like", tp2, "-o", tmp_path / "hf1.json")[0] == 0
    out = tmp_path / "sharded"
    rc, _, err = run_cli(capsys, "convert", tp2, tmp_path / "hf1.json", "--out", out, "--max-shard-size", "100KB")
    assert rc == 0, err
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 1
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    want = set(qwen3_arrays(PRESETS["qwen3-tiny"]))
    assert set(wm) == want
    held: dict[str, str] = {}
    for s in shards:
        h = read_header(out / s)
        data = sum(t.nbytes for t in h.tensors.values())
        assert data <= 100_000 or len(h.tensors) == 1, (s, data)
        for name in h.tensors:
            held[name] = s
    assert held == wm
    assert index["metadata"]["total_size"] == sum(read_header(hf_orig).tensors[t].nbytes for t in want)
    # a finished output: its shards, the index and the manifest, no lock or records
    assert sorted(p.name for p in out.iterdir()) == sorted([*shards, "model.safetensors.index.json",
                                                            "manifest.json", "manifest.checksums"])
    # the manifest agrees with the index, and validates with data
    assert run_cli(capsys, "validate", "--data", out)[0] == 0
    m = load_manifest(out)
    for fqn, a, c in m.iter_chunks():
        assert c.file_for(0) == wm[fqn]
    # `import` of the directory through its index (not its manifest)
    rc, _, err = run_cli(capsys, "import", out / "model.safetensors.index.json", "-o", out / "from-index.json")
    assert rc == 0, err
    imp = load_manifest(out / "from-index.json")
    assert set(imp.arrays) == want and validate_data(imp) == []
    assert run_cli(capsys, "convert", out / "from-index.json", tmp_path / "hf1.json", "--out", tmp_path / "back")[0] == 0
    assert filecmp.cmp(hf_orig, tmp_path / "back" / "model.safetensors", shallow=False)


# ------------------------------------------------------------------ resume after SIGKILL


def _kill_set(root: Path) -> tuple[Path, Path]:
    """~50 MB of arrays and an 8-rank destination (dp=2 replicas of a tp=4 split of dim 1)."""
    arrays = {f"model.layers.{i}.w": ((768, 1024), "float32") for i in range(16)}
    src = make_hf(root / "hf", arrays, seed=3)
    dst = lay_out(src, Mesh(("dp", "tp"), (2, 4)), [Rule("*", (Replicate(), Shard(1)))])
    save_manifest(dst, root / "d8.json")
    return root / "hf", root / "d8.json"


def _convert_cmd(src: Path, dst: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "streamer", "convert", str(src), str(dst), "--out", str(out),
            "--memory-limit", "64KiB", *extra]


def _records(out: Path) -> list[str]:
    return sorted(p.name for p in (out / ".shardstream").glob("*.done.json")) if out.exists() else []


def _rank_files_equal(a: Path, b: Path) -> bool:
    return all(filecmp.cmp(a / PATTERN.format(rank=r), b / PATTERN.format(rank=r), shallow=False) for r in range(8))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _finished_listing(out: Path) -> list[str]:
    """What a finished 8-rank output holds: its rank files and the manifest, nothing else (no
    lock, no completion records, no temp files)."""
    return sorted(p.name for p in out.iterdir())


FINISHED_8 = sorted([PATTERN.format(rank=r) for r in range(8)] + ["manifest.checksums", "manifest.json"])


def _resume_and_check(out: Path, src: Path, dst: Path, ref: Path, capsys: Any) -> dict[str, Any]:
    recs = _records(out)
    finished = (out / "manifest.json").exists()
    rc, o, err = run_cli(capsys, "convert", src, dst, "--out", out, "--memory-limit", "64KiB", "--resume", "--json")
    assert rc == 0, err
    rep = json.loads(o)
    # every file an earlier run finished is reused, the rest written: a file is finished when it
    # has a completion record, or when the whole output is (its manifest stands for the records)
    assert rep["files_skipped"] == (8 if finished else len(recs))
    assert rep["files_written"] + rep["files_skipped"] == 8
    assert _rank_files_equal(out, ref)
    assert (out / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()
    assert _finished_listing(out) == FINISHED_8  # no state, no stale temp files left behind
    return rep


def test_resume_after_sigkill(tmp_path: Path, capsys: Any) -> None:
    src, dst = _kill_set(tmp_path)
    ref = tmp_path / "ref"
    t0 = time.perf_counter()
    subprocess.run(_convert_cmd(src, dst, ref), check=True, env=_env(), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    full = time.perf_counter() - t0
    assert _finished_listing(ref) == FINISHED_8
    rng = random.Random(1234)
    delays = [full * (f + rng.uniform(-0.05, 0.05)) for f in (0.35, 0.55, 0.75, 0.9)]
    for i, delay in enumerate(delays):
        out = tmp_path / f"k{i}"
        p = subprocess.Popen(_convert_cmd(src, dst, out), env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        time.sleep(delay)
        finished = p.poll() is not None
        if not finished:
            p.send_signal(signal.SIGKILL)
        p.wait()
        if finished and p.returncode == 0:
            assert _finished_listing(out) == FINISHED_8
        if (out / "manifest.json").exists():
            # the manifest is written last: it is there only once every file is complete
            assert _rank_files_equal(out, ref)
        else:
            assert not finished or p.returncode != 0
        _resume_and_check(out, src, dst, ref, capsys)
    # one kill right after the first file is finished, so a partial state is certainly tested
    out = tmp_path / "k-first"
    p = subprocess.Popen(_convert_cmd(src, dst, out), env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not _records(out) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "manifest.json").exists()
    assert 1 <= len(_records(out)) < 8 and (out / ".shardstream" / "lock").exists()
    rep = _resume_and_check(out, src, dst, ref, capsys)
    assert rep["files_skipped"] >= 1 and rep["files_written"] >= 1


def test_resume_rewrites_a_corrupted_finished_file(tp2: Path, tmp_path: Path, capsys: Any) -> None:
    ref = {p.name: p.read_bytes() for p in tp2.glob("*.safetensors")}
    path = tp2 / "rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    rc, o, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "tp2.json", "--out", tp2, "--resume", "--json")
    assert rc == 0, err
    rep = json.loads(o)
    assert (rep["files_written"], rep["files_skipped"]) == (1, 1)
    assert {p.name: p.read_bytes() for p in tp2.glob("*.safetensors")} == ref


def test_resume_without_the_checksum_sidecar_rewrites_everything(tp2: Path, tmp_path: Path, capsys: Any) -> None:
    """A finished output whose sidecar is gone: nothing is reused on trust, every file is
    rewritten, and the output is whole again (sidecar included)."""
    ref = {p.name: p.read_bytes() for p in tp2.glob("*.safetensors")}
    (tp2 / "manifest.checksums").unlink()
    rc, o, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "tp2.json", "--out", tp2, "--resume", "--json")
    assert rc == 0, err
    rep = json.loads(o)
    assert (rep["files_written"], rep["files_skipped"]) == (len(ref), 0)
    assert {p.name: p.read_bytes() for p in tp2.glob("*.safetensors")} == ref
    assert validate_manifest(load_manifest(tp2)) == [] and validate_data(load_manifest(tp2)) == []


def test_kill_between_manifest_and_cleanup_resumes(tp2: Path, tmp_path: Path, capsys: Any,
                                                   monkeypatch: Any) -> None:
    """Killed after the manifest landed but before the state went: the output is complete, and a
    resumed run reuses every file and leaves it clean."""
    import streamer.convert.pipeline as pipeline

    ref = {p.name: p.read_bytes() for p in tp2.iterdir()}
    out = tmp_path / "again"

    def killed(*a: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "remove_state", killed)
    with pytest.raises(KeyboardInterrupt):
        convert(import_checkpoint([tmp_path / "hf"]), load_manifest(tmp_path / "tp2.json"), out,
                ConvertOptions(progress=False))
    monkeypatch.undo()
    assert (out / "manifest.json").exists() and (out / ".shardstream" / "lock").exists()
    rc, o, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "tp2.json", "--out", out, "--resume", "--json")
    assert rc == 0, err
    assert (json.loads(o)["files_written"], json.loads(o)["files_skipped"]) == (0, 2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == ref


# ------------------------------------------------------------------ lock and --out rules


def test_lock_held_exits_3(tmp_path: Path, capsys: Any) -> None:
    make_hf(tmp_path / "hf", {"w": ((4, 4), "float32")})
    assert run_cli(capsys, "layout", "--like", tmp_path / "hf", "--mesh", "tp=2", "--rule", "w=S(0)",
                   "-o", tmp_path / "d.json")[0] == 0
    out = tmp_path / "out"
    (out / ".shardstream").mkdir(parents=True)
    fd = os.open(out / ".shardstream" / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for extra in ([], ["--resume"]):
            rc, _, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "d.json", "--out", out, *extra)
            assert rc == 3
            assert "lock" in err and str(out) in err and "Traceback" not in err
            assert len(err.strip().splitlines()) == 1
            assert sorted(p.name for p in out.iterdir()) == [".shardstream"]
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "d.json", "--out", out)[0] == 0


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(d.rglob("*"))}


def test_non_empty_out_without_resume_is_usage_error(tp2: Path, tmp_path: Path, capsys: Any) -> None:
    # a directory of someone else's files
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    # and a finished conversion
    for out in (other, tp2):
        before = _snapshot(out)
        rc, _, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "tp2.json", "--out", out)
        assert rc == 2
        assert "--resume" in err and "not empty" in err and "Traceback" not in err
        assert _snapshot(out) == before


def test_plan_files_names_and_holders(tmp_path: Path) -> None:
    """Replicated chunks get one copy per holder's file; one-rank outputs get HF names."""
    hf = make_hf(tmp_path / "hf", {"a": ((4, 6), "float32"), "b": ((3,), "int64")})
    dst = lay_out(hf, Mesh(("dp", "tp"), (2, 2)), [Rule("a", (Replicate(), Shard(1)))], file_pattern=None)
    _, jobs = plan_files(dst)
    assert [j.rel for j in jobs] == [PATTERN.format(rank=r) for r in range(4)]
    for j in jobs:
        assert [t for t, _, _ in j.tensors] == ["a", "b"]
        assert j.nbytes == 4 * 3 * 4 + 3 * 8
    _, jobs1 = plan_files(hf_layout(hf), max_shard_size=50)
    assert [j.rel for j in jobs1] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert prod(len(j.tensors) for j in jobs1) == 1
