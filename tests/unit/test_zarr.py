"""Zarr v3 output and input (design §3, §7): ``convert --format zarr`` makes DIR a zarr group that
plain zarr-python reads (bf16 / fp8 as raw uint bits with the logical dtype in the attributes);
the chunk grid follows the destination regions (regular grids, torch.chunk-uneven splits, and
irregular splits through the sharding codec); a zarr store is a valid SRC (byte-identical round
trip) and imports; ``validate --data`` checks arrays, dtypes, shapes and checksums; hostile
``zarr.json`` files are refused with one precise line and no traceback.
"""

from __future__ import annotations

import json
import os
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

zarr = pytest.importorskip("zarr")

from formats.errors import FormatError
from formats.layouts import Mesh, Rule, Shard, apply_layout
from formats.manifest.box import Box
from formats.manifest.wire import ArraySpec, Chunk, Manifest, load_manifest, save_manifest
from formats.store import SourceStore
from formats.validate.manifest import validate_data, validate_manifest
from formats.zarr.io import (
    MAX_CHUNKS,
    ZarrReader,
    choose_layout,
    iter_units,
    list_arrays,
    parse_array_metadata,
    read_box,
    streamable,
)
from streamer.cli.app import main
from streamer.convert import ConvertOptions, cast_bytes, convert
from streamer.convert.importer import import_checkpoint
from streamer.tools.synth import PRESETS, QWEN3_TP_RULES, qwen3_arrays, tensor_data, write_checkpoint

TINY = qwen3_arrays(PRESETS["qwen3-tiny"])  # vocab 1000: TP3 splits it unevenly
MIXED = {
    "w.bf16": ((12, 8), "bfloat16"),
    "w.fp8": ((6, 10), "float8_e4m3fn"),
    "w.e5m2": ((7,), "float8_e5m2"),
    "w.f32": ((5, 3, 4), "float32"),
    "w.i64": ((9,), "int64"),
    "w.bool": ((4, 4), "bool"),
    "w.scalar": ((), "float32"),
    "w.empty": ((0, 4), "bfloat16"),
}


def run(capsys: Any, *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def make_hf(d: Path, arrays: dict[str, tuple[tuple[int, ...], str]], seed: int = 0) -> Manifest:
    write_checkpoint(d, arrays, seed=seed)
    save_manifest(import_checkpoint([d]), d / "manifest.json")
    return load_manifest(d / "manifest.json")


def tp_layout(like: Manifest, n: int, rules: list[Rule] | None = None) -> Manifest:
    if rules is None:
        rules = [Rule(r.split("=")[0], (Shard(int(r[-2])),)) for r in QWEN3_TP_RULES]
    m = apply_layout(like, Mesh(("tp",), (n,)), rules, file_pattern="rank-{rank:05d}.safetensors")
    assert validate_manifest(m, check_paths=False) == []
    return m


def hf_layout(like: Manifest) -> Manifest:
    return apply_layout(like, Mesh(("tp",), (1,)), [], file_pattern=None)


def bits(fqn: str, shape: tuple[int, ...], dt: str, seed: int = 0) -> np.ndarray:
    """The source values as zarr stores them (bf16 -> uint16, fp8 -> uint8 bits)."""
    from formats.manifest.dtypes import DTYPES, np_storage

    raw = np.ascontiguousarray(tensor_data(fqn, shape, dt, seed)).view(np.uint8).reshape(-1)
    return raw.view(np_storage(DTYPES[dt])).reshape(shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: Any) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    make_hf(root / "hf", TINY)
    return root


@pytest.fixture(scope="module")
def tp2_zarr(tiny: Path) -> Path:
    """HF -> TP2 -> zarr (once for the module; tests that corrupt it copy it first)."""
    out = tiny / "z-tp2"
    if not out.exists():
        src = load_manifest(tiny / "hf" / "manifest.json")
        save_manifest(tp_layout(src, 2), tiny / "tp2.json")
        assert main(["convert", str(tiny / "hf" / "manifest.json"), str(tiny / "tp2.json"), "--out", str(out),
                     "--format", "zarr"]) == 0
    return out


def copy_tree(a: Path, b: Path) -> Path:
    import shutil

    shutil.copytree(a, b, ignore=shutil.ignore_patterns(".shardstream"))
    return b


# ------------------------------------------------------------------ output read by plain zarr-python


def test_plain_zarr_reads_the_group(tp2_zarr: Path) -> None:
    g = zarr.open_group(str(tp2_zarr), mode="r")  # filterwarnings=error: no "not a zarr node" warnings
    assert sorted(g.array_keys()) == sorted(TINY)
    assert (tp2_zarr / "zarr.json").is_file() and (tp2_zarr / "manifest.json").is_file()
    assert (tp2_zarr / "model.layers.0.self_attn.q_proj.weight" / "zarr.json").is_file()  # dots kept
    for fqn, (shape, dt) in TINY.items():
        a = zarr.open_array(str(tp2_zarr / fqn), mode="r")
        assert a.dtype == np.dtype("uint16") and a.shape == shape
        assert a.attrs["shardstream"] == {"data_type": "bfloat16"}
        np.testing.assert_array_equal(a[...], bits(fqn, shape, dt), err_msg=fqn)
        np.testing.assert_array_equal(g[fqn][...], a[...])


def test_chunk_grid_is_the_destination_regions(tp2_zarr: Path, tiny: Path) -> None:
    dst = load_manifest(tiny / "tp2.json")
    out = load_manifest(tp2_zarr / "manifest.json")
    assert out.world_size == 2
    for fqn, spec in dst.arrays.items():
        a = zarr.open_array(str(tp2_zarr / fqn), mode="r")
        sizes = {c.region.sizes for c in spec.chunks}
        assert len(sizes) == 1 and a.chunks == next(iter(sizes)), fqn
        assert a.shards is None
        got = out.arrays[fqn]
        assert [(c.region, c.holders) for c in got.chunks] == [(c.region, c.holders) for c in spec.chunks]
        for c in got.chunks:
            assert c.source is not None and c.source.file == "." and c.source.tensor == fqn
            assert c.source.offsets == c.region.offsets and c.source.checksum.startswith("xxh64:")
    assert validate_manifest(out) == []
    assert validate_data(out) == []


def test_uneven_torch_chunk_tp3_is_a_regular_grid(tiny: Path, tmp_path: Path) -> None:
    """1000 rows over TP3 with torch.chunk: 334 + 334 + 332, zarr's regular grid with a short tail."""
    src = load_manifest(tiny / "hf" / "manifest.json")
    dst = tp_layout(src, 3)
    regions = [c.region.sizes[0] for c in dst.arrays["model.embed_tokens.weight"].chunks]
    assert regions == [334, 334, 332]
    convert(src, dst, tmp_path / "z", ConvertOptions(format="zarr"))
    a = zarr.open_array(str(tmp_path / "z" / "model.embed_tokens.weight"), mode="r")
    assert a.chunks == (334, 64) and a.shards is None
    shape, dt = TINY["model.embed_tokens.weight"]
    np.testing.assert_array_equal(a[...], bits("model.embed_tokens.weight", shape, dt))
    assert validate_data(load_manifest(tmp_path / "z" / "manifest.json")) == []


def split_rows(src: Manifest, fqn: str, rows: list[int]) -> Manifest:
    """``src`` with array ``fqn`` split along dim 0 into ``rows`` (one rank each), others on rank 0."""
    arrays = {}
    for name, a in src.arrays.items():
        if name == fqn:
            chunks, off = [], 0
            for r, n in enumerate(rows):
                chunks.append(Chunk(Box((off,) + (0,) * (len(a.shape) - 1), (n,) + a.shape[1:]), (r,)))
                off += n
            arrays[name] = ArraySpec(a.shape, a.data_type, tuple(chunks))
        else:
            arrays[name] = ArraySpec(a.shape, a.data_type, tuple(Chunk(c.region, (0,)) for c in a.chunks))
    return Manifest(world_size=len(rows), arrays=arrays)


@pytest.mark.slow  # the scale tier
def test_irregular_regions_use_the_sharding_codec(tiny: Path, tmp_path: Path) -> None:
    """334 + 333 + 333 rows is no regular grid: gcd chunks (1 row) packed into shards."""
    src = load_manifest(tiny / "hf" / "manifest.json")
    fqn = "lm_head.weight"
    dst = split_rows(src, fqn, [334, 333, 333])
    assert validate_manifest(dst, check_paths=False) == []
    convert(src, dst, tmp_path / "z", ConvertOptions(format="zarr"))
    a = zarr.open_array(str(tmp_path / "z" / fqn), mode="r")
    assert a.chunks == (1, 64) and a.shards == (334, 64)
    shape, dt = TINY[fqn]
    np.testing.assert_array_equal(a[...], bits(fqn, shape, dt))
    out = load_manifest(tmp_path / "z" / "manifest.json")
    assert [c.region.sizes[0] for c in out.arrays[fqn].chunks] == [334, 333, 333]
    assert validate_data(out) == []  # checksums (read back from the store) match
    # and back to safetensors: identical to the original
    convert(out, hf_layout(src), tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tiny / "hf" / "model.safetensors").read_bytes()


def test_dtypes_scalars_and_empty_arrays_round_trip(tmp_path: Path) -> None:
    src = make_hf(tmp_path / "hf", MIXED, seed=3)
    dst = apply_layout(src, Mesh(("tp",), (2,)), [Rule("w.bf16", (Shard(1),)), Rule("w.fp8", (Shard(0),)),
                                                   Rule("w.f32", (Shard(2),))], file_pattern=None)
    convert(src, dst, tmp_path / "z", ConvertOptions(format="zarr"))
    g = zarr.open_group(str(tmp_path / "z"), mode="r")
    for fqn, (shape, dt) in MIXED.items():
        a = g[fqn]
        assert a.attrs["shardstream"]["data_type"] == dt and a.shape == shape
        np.testing.assert_array_equal(a[...], bits(fqn, shape, dt, seed=3), err_msg=fqn)
    assert g["w.fp8"].dtype == np.dtype("uint8") and g["w.bool"].dtype == np.dtype("bool")
    out = load_manifest(tmp_path / "z" / "manifest.json")
    assert validate_data(out) == []
    convert(out, hf_layout(src), tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_zstd_and_small_memory_limit(tiny: Path, tmp_path: Path, capsys: Any) -> None:
    """--zarr-compressor zstd; a memory limit smaller than a region splits chunks (hashing still
    streams) and the output still converts back byte for byte."""
    hf = tiny / "hf" / "manifest.json"
    save_manifest(hf_layout(load_manifest(hf)), tmp_path / "hf1.json")
    rc, _, err = run(capsys, "convert", hf, tmp_path / "hf1.json", "--out", tmp_path / "z", "--format", "zarr",
                     "--zarr-compressor", "zstd", "--memory-limit", "256KiB")
    assert rc == 0, err
    a = zarr.open_array(str(tmp_path / "z" / "lm_head.weight"), mode="r")
    assert a.chunks == (500, 64)  # 128 KB array, 64 KiB units: two 500-row chunks
    assert [c.to_dict()["name"] for c in a.metadata.codecs] == ["bytes", "zstd"]
    out = load_manifest(tmp_path / "z" / "manifest.json")
    assert len(out.arrays["lm_head.weight"].chunks) == 1
    assert validate_data(out) == []
    rc, _, err = run(capsys, "convert", tmp_path / "z", tmp_path / "hf1.json", "--out", tmp_path / "back")
    assert rc == 0, err
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tiny / "hf" / "model.safetensors").read_bytes()


def test_cast_matches_the_safetensors_path(tmp_path: Path) -> None:
    arrays = {"a": ((6, 8), "float32"), "b": ((5,), "float32"), "n": ((3,), "int32")}
    src = make_hf(tmp_path / "hf", arrays, seed=1)
    dst = apply_layout(src, Mesh(("tp",), (2,)), [Rule("a", (Shard(0),))], file_pattern=None)
    convert(src, dst, tmp_path / "z", ConvertOptions(format="zarr", cast="bfloat16"))
    g = zarr.open_group(str(tmp_path / "z"), mode="r")
    for fqn, (shape, dt) in arrays.items():
        want_dt = "bfloat16" if dt == "float32" else dt
        assert g[fqn].attrs["shardstream"]["data_type"] == want_dt
        raw = np.ascontiguousarray(tensor_data(fqn, shape, dt, 1)).view(np.uint8).reshape(-1)
        want = cast_bytes(raw, dt, want_dt) if want_dt != dt else raw
        assert np.ascontiguousarray(g[fqn][...]).view(np.uint8).reshape(-1).tobytes() == want.tobytes(), fqn
    assert validate_data(load_manifest(tmp_path / "z" / "manifest.json")) == []


# ------------------------------------------------------------------ zarr as a source


def test_zarr_output_is_a_source_byte_identical(tp2_zarr: Path, tiny: Path, tmp_path: Path, capsys: Any) -> None:
    save_manifest(hf_layout(load_manifest(tiny / "hf" / "manifest.json")), tmp_path / "hf1.json")
    rc, _, err = run(capsys, "convert", tp2_zarr, tmp_path / "hf1.json", "--out", tmp_path / "back")
    assert rc == 0, err
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tiny / "hf" / "model.safetensors").read_bytes()
    # zarr -> zarr as well (TP2 -> TP3)
    src = load_manifest(tp2_zarr / "manifest.json")
    convert(src, tp_layout(load_manifest(tiny / "hf" / "manifest.json"), 3), tmp_path / "z3",
            ConvertOptions(format="zarr"))
    assert validate_data(load_manifest(tmp_path / "z3" / "manifest.json")) == []


def test_import_a_zarr_group_without_manifest(tp2_zarr: Path, tiny: Path, tmp_path: Path, capsys: Any) -> None:
    z = copy_tree(tp2_zarr, tmp_path / "store.zarr")
    (z / "manifest.json").unlink()
    rc, _, err = run(capsys, "import", z, "-o", tmp_path / "m.json")
    assert rc == 0, err
    m = load_manifest(tmp_path / "m.json")
    assert sorted(m.arrays) == sorted(TINY) and m.world_size == 1
    for fqn, a in m.arrays.items():  # one chunk per array, read by zarr slicing
        (c,) = a.chunks
        assert c.source.file == "store.zarr" and c.source.tensor == fqn and a.data_type == "bfloat16"
    rc, _, err = run(capsys, "validate", tmp_path / "m.json", "--data")
    assert rc == 0, err
    # the import lists arrays by name; lay the HF file out in the original order to compare bytes
    save_manifest(hf_layout(load_manifest(tiny / "hf" / "manifest.json")), tmp_path / "hf1.json")
    rc, _, err = run(capsys, "convert", tmp_path / "m.json", tmp_path / "hf1.json", "--out", tmp_path / "back")
    assert rc == 0, err
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tiny / "hf" / "model.safetensors").read_bytes()


def test_import_a_foreign_zarr_group(tmp_path: Path) -> None:
    """A group written by plain zarr-python, with a sub-group: fqn = path with '/' read as '.'."""
    g = zarr.open_group(str(tmp_path / "g"), mode="w")
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    g.create_array("top", data=x, chunks=(3, 4))
    sub = g.create_group("layer")
    y = np.arange(10, dtype=np.int16)
    sub.create_array("w", data=y, chunks=(4,), compressors=zarr.codecs.ZstdCodec())
    m = import_checkpoint([tmp_path / "g"])
    assert sorted(m.arrays) == ["layer.w", "top"]
    assert m.arrays["layer.w"].chunks[0].source.tensor == "layer/w"
    assert m.arrays["layer.w"].chunks[0].source.file == "."
    assert validate_data(m) == []
    with SourceStore(m) as store:
        rt = store.resolve("top", m.arrays["top"].chunks[0], 0)
        got = store.read(rt, Box((1, 2), (2, 3)))
        assert got.view(np.float32).reshape(2, 3).tolist() == x[1:3, 2:5].tolist()
        rt = store.resolve("layer.w", m.arrays["layer.w"].chunks[0], 0)
        assert store.read(rt, Box((3,), (5,))).view(np.int16).tolist() == y[3:8].tolist()


# ------------------------------------------------------------------ validate --data


def test_validate_detects_a_corrupted_chunk(tp2_zarr: Path, tmp_path: Path, capsys: Any) -> None:
    z = copy_tree(tp2_zarr, tmp_path / "z")
    rc, _, err = run(capsys, "validate", z / "manifest.json", "--data")
    assert rc == 0, err
    fqn = "model.layers.1.mlp.down_proj.weight"  # S(1): chunk c/0/1 is rank 1's region
    chunk = z / fqn / "c" / "0" / "1"
    b = bytearray(chunk.read_bytes())
    b[17] ^= 0x40
    chunk.write_bytes(bytes(b))
    rc, _, err = run(capsys, "validate", z / "manifest.json", "--data")
    assert rc == 1 and "Traceback" not in err
    bad = [ln for ln in err.splitlines() if ln.strip()]
    assert len(bad) == 1, bad
    assert bad[0].startswith(f"{z / 'manifest.json'}: {fqn}: checksum mismatch for chunk 1")
    assert "region [0:64, 80:160]" in bad[0] and "on rank 1" in bad[0]


def test_validate_reports_missing_arrays_and_wrong_dtypes(tp2_zarr: Path, tmp_path: Path) -> None:
    import shutil

    z = copy_tree(tp2_zarr, tmp_path / "z")
    shutil.rmtree(z / "model.norm.weight")
    meta = z / "lm_head.weight" / "zarr.json"
    obj = json.loads(meta.read_text())
    obj["attributes"] = {}  # plain uint16 now
    meta.write_text(json.dumps(obj))
    problems = validate_data(load_manifest(z / "manifest.json"), where="M")
    assert any(p.startswith("M: model.norm.weight: chunk 0: zarr array 'model.norm.weight' not found") for p in
               problems), problems
    assert any(p.startswith("M: lm_head.weight: chunk 0: zarr array 'lm_head.weight' in '.' has the wrong data_type "
                            "(expected bfloat16, got uint16)") for p in problems), problems
    assert len(problems) == 2, problems


def test_compressed_corruption_is_a_problem_not_a_crash(tiny: Path, tmp_path: Path, capsys: Any) -> None:
    src = load_manifest(tiny / "hf" / "manifest.json")
    convert(src, hf_layout(src), tmp_path / "z", ConvertOptions(format="zarr", zarr_compressor="zstd"))
    chunk = tmp_path / "z" / "model.norm.weight" / "c" / "0"
    chunk.write_bytes(b"\x00garbage" * 3)
    rc, _, err = run(capsys, "validate", tmp_path / "z" / "manifest.json", "--data")
    assert rc == 1 and "Traceback" not in err
    assert "model.norm.weight: chunk 0: cannot read zarr array 'model.norm.weight'" in err


# ------------------------------------------------------------------ hostile metadata


def _meta(shape: list[int], chunks: list[int], **kw: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"zarr_format": 3, "node_type": "array", "shape": shape, "data_type": "uint16",
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
                         "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                         "fill_value": 0, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                         "attributes": {"shardstream": {"data_type": "bfloat16"}}}
    m.update(kw)
    return m


HOSTILE = [
    (_meta([4, 8], [0, 8]), "chunk_grid chunk_shape [0, 8]: entry 0 is 0 (expected integers >= 1)"),
    (_meta([4, 8], [2, -3]), "chunk_grid chunk_shape [2, -3]: entry 1 is -3 (expected integers >= 1)"),
    (_meta([4, 8], [4]), "chunk_grid chunk_shape [4] has 1 entries (expected 2, one per dim of the array)"),
    (_meta([4, 8], [2.5, 8]), "chunk_grid chunk_shape must be a list of integers"),
    (_meta([1 << 40, 1 << 20], [1, 1]), f"makes {1 << 60} chunks (expected at most {MAX_CHUNKS})"),
    (_meta([1 << 62, 1 << 62], [1 << 20, 1 << 20]), "bytes of bfloat16 (expected at most 9223372036854775807"),
    (_meta([4, 8], [1 << 31, 8]), "bytes per chunk (expected at most 4294967296"),
    (_meta([4, -8], [2, 8]), "shape [4, -8]: entry 1 is -8 (expected integers >= 0)"),
    (_meta([4, 8], [2, 8], data_type="bfloat16", attributes={}), "unsupported data_type \"bfloat16\""),
    (_meta([4, 8], [2, 8], codecs=[{"name": "evil_pickle"}]), "unsupported codec 'evil_pickle'"),
    (_meta([4, 8], [2, 8], attributes={"shardstream": {"data_type": "float32"}}),
     ("attributes.shardstream.data_type 'float32' does not match the stored data_type (expected 'float32', got "
      "'uint16')")),
    (_meta([4, 8], [4, 8], codecs=[{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [3, 8], "codecs": [{"name": "bytes"}]}}]), "does not divide the shard shape [4, 8] in dim 0"),
    (_meta([4, 8], [4, 8], codecs=[{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [0, 8], "codecs": [{"name": "bytes"}]}}]), "sharding_indexed chunk_shape [0, 8]: entry 0 is 0"),
    (_meta([4, 8], [2, 8], zarr_format=2), "zarr_format is 2 (expected 3"),
    (_meta([4, 8], [2, 8], chunk_key_encoding={"name": "default", "configuration": {"separator": "/../"}}),
     "chunk_key_encoding {\"name\": \"default\", \"configuration\": {\"separator\": \"/../\"}} is not supported"),
]


@pytest.mark.parametrize("meta,expect", HOSTILE, ids=lambda v: v if isinstance(v, str) else "")
def test_hostile_zarr_json_is_refused_by_import(tmp_path: Path, capsys: Any, meta: dict[str, Any],
                                                expect: str) -> None:
    g = tmp_path / "g"
    (g / "w").mkdir(parents=True)
    (g / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    (g / "w" / "zarr.json").write_text(json.dumps(meta))
    rc, _, err = run(capsys, "import", g, "-o", tmp_path / "m.json")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"{g / 'w' / 'zarr.json'}: ") and expect in lines[0], lines[0]
    assert not (tmp_path / "m.json").exists()


def test_hostile_zarr_json_in_a_source_and_in_validate(tp2_zarr: Path, tiny: Path, tmp_path: Path,
                                                       capsys: Any) -> None:
    z = copy_tree(tp2_zarr, tmp_path / "z")
    meta = z / "model.norm.weight" / "zarr.json"
    obj = json.loads(meta.read_text())
    obj["chunk_grid"]["configuration"]["chunk_shape"] = [0]
    meta.write_text(json.dumps(obj))
    rc, _, err = run(capsys, "validate", z / "manifest.json", "--data")
    assert rc == 1 and "Traceback" not in err
    assert "model.norm.weight: chunk 0: zarr array 'model.norm.weight' in '.' is unusable" in err
    assert "chunk_shape [0]: entry 0 is 0 (expected integers >= 1)" in err
    save_manifest(hf_layout(load_manifest(tiny / "hf" / "manifest.json")), tmp_path / "hf1.json")
    rc, _, err = run(capsys, "convert", z, tmp_path / "hf1.json", "--out", tmp_path / "out")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0] == (f"{meta}: chunk_grid chunk_shape [0]: entry 0 is 0 (expected integers >= 1)")
    assert not (tmp_path / "out").exists()


def test_hostile_files_in_a_zarr_group(tp2_zarr: Path, tmp_path: Path) -> None:
    z = copy_tree(tp2_zarr, tmp_path / "z")
    chunk = z / "model.norm.weight" / "c" / "0"
    chunk.unlink()
    chunk.symlink_to("/dev/zero")  # read whole, it would never end
    (z / "zarr.json").write_text("{" * 100000)  # the group's metadata is not read by a chunk reader
    m = load_manifest(z / "manifest.json")
    problems = validate_data(m, where="M")
    assert len(problems) == 1 and "model.norm.weight" in problems[0] and "outside the zarr group" in problems[0]
    big = z / "lm_head.weight" / "zarr.json"
    with open(big, "wb") as f:
        f.truncate(17 << 20)
    with pytest.raises(FormatError, match="bytes of zarr metadata"):
        ZarrReader().open(z, "lm_head.weight")
    with pytest.raises(FormatError, match="outside the zarr group|'..' component"):
        ZarrReader().open(z, "../z/lm_head.weight")
    with pytest.raises(FormatError, match="not valid JSON"):  # 100000 nested braces: no RecursionError escapes
        list_arrays(z)


def test_parse_array_metadata_accepts_what_zarr_writes(tmp_path: Path) -> None:
    g = zarr.open_group(str(tmp_path / "g"), mode="w")
    g.create_array("s", shape=(8, 6), dtype="uint8", chunks=(2, 3), shards=(4, 6),
                   compressors=zarr.codecs.ZstdCodec(), attributes={"shardstream": {"data_type": "float8_e5m2"}})
    info = parse_array_metadata(json.loads((tmp_path / "g" / "s" / "zarr.json").read_text()), where="x")
    assert info.data_type == "float8_e5m2" and info.chunk_shape == (4, 6) and info.inner_chunk_shape == (2, 3)
    assert "zstd" in info.codecs and "sharding_indexed" in info.codecs


# ------------------------------------------------------------------ resume, usage


def test_finished_group_holds_no_state(tp2_zarr: Path) -> None:
    """The lock and completion records go once the manifest is written: a finished output is the
    group's metadata, its arrays and the manifest."""
    assert sorted(p.name for p in tp2_zarr.iterdir()) == sorted([*TINY, "manifest.json", "zarr.json"])


def test_resume_reuses_intact_arrays_and_rewrites_damaged_ones(tiny: Path, tmp_path: Path) -> None:
    src = load_manifest(tiny / "hf" / "manifest.json")
    dst = tp_layout(src, 2)
    out = tmp_path / "z"
    convert(src, dst, out, ConvertOptions(format="zarr"))
    first = (out / "manifest.json").read_bytes()
    listing = sorted(p.name for p in out.iterdir())
    # a finished output, one array damaged since: its manifest's checksums stand for the records
    chunk = out / "model.norm.weight" / "c" / "0"
    chunk.write_bytes(b"\x00" * chunk.stat().st_size)
    rep = convert(src, dst, out, ConvertOptions(format="zarr", resume=True))
    assert rep.files_written == 1 and rep.files_skipped == len(TINY) - 1
    assert (out / "manifest.json").read_bytes() == first
    assert validate_data(load_manifest(out / "manifest.json")) == []
    assert sorted(p.name for p in out.iterdir()) == listing
    # another compressor: every array is written again
    rep = convert(src, dst, out, ConvertOptions(format="zarr", resume=True, zarr_compressor="zstd"))
    assert rep.files_written == len(TINY) and rep.files_skipped == 0


def test_resume_after_a_failed_run(tiny: Path, tmp_path: Path, monkeypatch: Any) -> None:
    """A run that dies after some arrays keeps their completion records (and no manifest); a
    resumed run reuses exactly those and ends with no state left."""
    from streamer.convert.zarr_sink import ZarrSink

    src = load_manifest(tiny / "hf" / "manifest.json")
    dst = tp_layout(src, 2)
    ref = tmp_path / "ref"
    convert(src, dst, ref, ConvertOptions(format="zarr"))
    real = ZarrSink.write
    calls: list[str] = []

    def dies_at_the_fourth(self: ZarrSink, *a: Any) -> dict[str, str]:
        calls.append(a[1].fqn)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, *a)

    out = tmp_path / "z"
    monkeypatch.setattr(ZarrSink, "write", dies_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, out, ConvertOptions(format="zarr"))
    monkeypatch.undo()
    assert not (out / "manifest.json").exists()
    assert len(list((out / ".shardstream").glob("*.done.json"))) == 3
    rep = convert(src, dst, out, ConvertOptions(format="zarr", resume=True))
    assert rep.files_skipped == 3 and rep.files_written == len(TINY) - 3
    assert (out / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert not (out / ".shardstream").exists()


def test_usage_errors(tp2_zarr: Path, tiny: Path, tmp_path: Path, capsys: Any) -> None:
    hf = tiny / "hf" / "manifest.json"
    for extra in (["--zarr-compressor", "zstd"], ["--format", "zarr", "--max-shard-size", "1MB"],
                  ["--format", "zarr", "--zarr-compressor", "lz77"]):
        rc, _, err = run(capsys, "convert", hf, tiny / "tp2.json", "--out", tmp_path / "o", *extra)
        assert rc == 2 and "Traceback" not in err and err.strip(), extra
        assert not (tmp_path / "o").exists()
    rc, _, err = run(capsys, "convert", hf, tiny / "tp2.json", "--out", tp2_zarr, "--format", "zarr")
    assert rc == 2 and "not empty" in err


def test_bad_array_names_are_refused_before_writing(tmp_path: Path) -> None:
    src = make_hf(tmp_path / "hf", {"ok": ((2,), "float32"), "__bad": ((2,), "float32")})
    with pytest.raises(Exception, match="__bad: cannot be a zarr array name"):
        convert(src, hf_layout(src), tmp_path / "z", ConvertOptions(format="zarr"))
    assert not (tmp_path / "z").exists()


# ------------------------------------------------------------------ the chunk-grid rule


def test_choose_layout_rules() -> None:
    R = Box
    # regular, with a short trailing region in both dims
    lay = choose_layout((10, 7), [R((0, 0), (4, 4)), R((0, 4), (4, 3)), R((4, 0), (4, 4)), R((4, 4), (4, 3)),
                                  R((8, 0), (2, 4)), R((8, 4), (2, 3))], 2, max_unit_bytes=1 << 20)
    assert (lay.chunks, lay.shards, lay.rule) == ((4, 4), None, "regions")
    # irregular, gcd not tiny: 4 + 8 + 4 -> chunks of 4, no sharding
    lay = choose_layout((16,), [R((0,), (4,)), R((4,), (8,)), R((12,), (4,))], 4, max_unit_bytes=1 << 20)
    assert (lay.chunks, lay.shards, lay.rule) == ((4,), None, "gcd")
    # a region larger than the memory bound: split by a divisor, boundaries kept
    lay = choose_layout((1200, 100), [R((0, 0), (600, 100)), R((600, 0), (600, 100))], 2, max_unit_bytes=50_000)
    assert lay.chunks == (200, 100) and lay.rule == "regions+split" and 600 % lay.chunks[0] == 0
    # one whole-array region: any split, spread evenly
    lay = choose_layout((1000, 64), [R((0, 0), (1000, 64))], 2, max_unit_bytes=1 << 16)
    assert lay.chunks == (500, 64)
    # a single row over the bound: split the next dim
    lay = choose_layout((2, 100_000), [R((0, 0), (2, 100_000))], 4, max_unit_bytes=1 << 16)
    assert lay.chunks[0] == 1 and lay.chunks[1] * 4 <= 1 << 16
    assert choose_layout((), [R((), ())], 4, max_unit_bytes=1 << 16).chunks == ()
    assert choose_layout((0, 5), [], 4, max_unit_bytes=1 << 16).chunks == (1, 1)


@st.composite
def tilings(draw: Any) -> tuple[tuple[int, ...], list[Box]]:
    nd = draw(st.integers(1, 3))
    cuts = []
    shape = []
    for _ in range(nd):
        n = draw(st.integers(1, 40))
        k = draw(st.integers(1, min(n, 4)))
        pts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=k - 1)))) if n > 1 else []
        if draw(st.booleans()):  # torch.chunk: a regular grid
            c = -(-n // k)
            pts = list(range(c, n, c))
        cuts.append([0, *pts, n])
        shape.append(n)
    import itertools

    regions = [Box(tuple(c[i] for c, i in zip(cuts, idx)), tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx)))
               for idx in itertools.product(*(range(len(c) - 1) for c in cuts))]
    return tuple(shape), regions


@given(tilings(), st.sampled_from([1, 2, 4]), st.integers(8, 4096))
def test_choose_layout_properties(t: tuple[tuple[int, ...], list[Box]], isz: int, limit: int) -> None:
    shape, regions = t
    lay = choose_layout(shape, regions, isz, max_unit_bytes=limit)
    unit = lay.unit
    assert all(c >= 1 for c in lay.chunks) and len(lay.chunks) == len(shape)
    assert prod(unit) * isz <= max(limit, isz) or lay.chunks == (1,) * len(shape)
    if lay.shards is not None:
        assert all(s % c == 0 for s, c in zip(lay.shards, lay.chunks))
    # every region is a union of chunks (each region reads exactly its own chunks)
    for r in regions:
        for d in range(len(shape)):
            assert r.offsets[d] % lay.chunks[d] == 0
            assert r.stops[d] % lay.chunks[d] == 0 or r.stops[d] == shape[d]
    if lay.rule.startswith("regions") and lay.shards is None:
        assert streamable(shape, regions, unit)
    # the units tile the array
    assert sum(u.volume for u in iter_units(shape, unit)) == prod(shape)


def test_read_box_through_the_reader(tp2_zarr: Path) -> None:
    za = ZarrReader().open(tp2_zarr, "model.embed_tokens.weight")
    shape, dt = TINY["model.embed_tokens.weight"]
    want = bits("model.embed_tokens.weight", shape, dt)
    got = read_box(za, Box((498, 10), (5, 7)))
    assert got.view(np.uint16).reshape(5, 7).tolist() == want[498:503, 10:17].tolist()
    assert os.path.basename(za.info.where) == "zarr.json"
