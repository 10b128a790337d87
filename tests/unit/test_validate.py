"""formats.validate.manifest: every bad-input kind, property tests on tilings, real safetensors files."""

from __future__ import annotations

import itertools
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formats.manifest.box import Box
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source, parse_manifest
from formats.validate.manifest import (
    MAX_PER_KIND,
    check_file_path,
    validate_data,
    validate_manifest,
)
from formats.validate.overlap import analyze_boxes

W = "t.json"
FQN = "model.layers.0.q_proj.weight"


# ------------------------------------------------------------------ helpers


def chunk(off: list[int], sizes: list[int], holders: list[int] | None = None, **source: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"region": {"offsets": off, "sizes": sizes}, "holders": holders or [0]}
    if source:
        d["source"] = source
    return d


def manifest(arrays: dict[str, Any], *, world_size: int = 4, base_dir: Path | None = None,
             **top: Any) -> Manifest:
    obj = {"format": "shardstream.manifest", "format_version": 1, "world_size": world_size,
           "arrays": arrays, **top}
    return parse_manifest(obj, where=W, base_dir=base_dir)


def one(chunks: list[dict[str, Any]], shape: list[int] | None = None, data_type: str = "float32",
        **kw: Any) -> Manifest:
    return manifest({FQN: {"shape": [4, 8] if shape is None else shape, "data_type": data_type,
                           "chunks": chunks}}, **kw)


def rows(n: int = 2, shape: tuple[int, int] = (4, 8)) -> list[dict[str, Any]]:
    """A valid row split of ``shape`` over ranks 0..n-1."""
    step = shape[0] // n
    return [chunk([i * step, 0], [step, shape[1]], [i]) for i in range(n)]


def has(problems: list[str], text: str) -> bool:
    return any(text in p for p in problems)


def assert_has(problems: list[str], text: str) -> None:
    assert has(problems, text), f"{text!r} not in:\n" + "\n".join(problems)


def no_internal(problems: list[str]) -> None:
    assert not has(problems, "internal error"), problems


# ------------------------------------------------------------------ valid manifests


def test_valid_manifests_give_no_problems() -> None:
    assert validate_manifest(one(rows(2)), where=W) == []
    assert validate_manifest(one(rows(4)), where=W) == []
    # 2x2 grid; chunk 0 is replicated on ranks 0 and 3, where it shares local tensor "qkv" with chunk 3
    grid = [chunk([0, 0], [2, 4], [0, 3], tensor="qkv"),
            chunk([0, 4], [2, 4], [1], tensor="qkv"),
            chunk([2, 0], [2, 4], [2], tensor="qkv"),
            chunk([2, 4], [2, 4], [3], tensor="qkv", offsets=[2, 0])]
    assert validate_manifest(one(grid), where=W) == []
    grid[3]["source"]["offsets"] = [1, 0]
    assert validate_manifest(one(grid), where=W) == [
        f"{W}: {FQN}: chunks 0 and 3 write overlapping ranges of local tensor 'qkv' on rank 3 (overlap [1:2, 0:4])"]


def test_valid_fused_local_tensor() -> None:
    # q, k, v arrays in one local tensor "qkv" on each rank, at distinct offsets
    arrays = {}
    for i, name in enumerate(["q", "k", "v"]):
        arrays[name] = {"shape": [8, 4], "data_type": "bfloat16", "chunks": [
            chunk([r * 4, 0], [4, 4], [r], tensor="qkv", offsets=[i * 4, 0]) for r in range(2)]}
    assert validate_manifest(manifest(arrays, world_size=2), where=W) == []


def test_zero_size_array_needs_no_chunks() -> None:
    assert validate_manifest(one([], shape=[0, 8]), where=W) == []


# ------------------------------------------------------------------ bounds, sizes, holders


def test_region_out_of_bounds_names_the_dim() -> None:
    ch = [chunk([0, 0], [2, 4], [0]), chunk([2, 0], [2, 4], [1]), chunk([2, 4], [2, 4], [2]),
          chunk([0, 4], [2, 5], [3])]
    p = validate_manifest(one(ch), where=W)
    assert_has(p, f"{W}: {FQN}: chunk 3 region [0:2, 4:9] exceeds shape [4, 8] in dim 1 (stop 9 > 8)")
    # the part inside the array tiles it, so no gap or overlap is reported on top
    assert not has(p, "gap") and not has(p, "overlap"), p


def test_int64_overflow_of_array_and_region() -> None:
    big = 1 << 62
    p = validate_manifest(one([chunk([0, 0], [big, 4])], shape=[big, 4]), where=W)
    assert_has(p, f"{FQN}: array size overflows int64 (expected at most {2**63 - 1} bytes, got {big * 16} bytes")
    p = validate_manifest(one([chunk([0, 0], [big, 8])], shape=[4, 8]), where=W)
    assert_has(p, "chunk 0: region [0:4611686018427387904, 0:8] size overflows int64")
    # exactly at the limit is fine: 2**63-1 elements of one byte
    n = 2**63 - 1
    assert validate_manifest(one([chunk([0], [n])], shape=[n], data_type="uint8"), where=W) == []


def test_holders_sorted_unique_in_range() -> None:
    ch = rows(2)
    ch[0]["holders"] = [1, 0]
    ch[1]["holders"] = [2, 2, 7]
    p = validate_manifest(one(ch), where=W)
    assert_has(p, "chunk 0: holders must be sorted and unique (expected [0, 1], got [1, 0])")
    assert_has(p, "chunk 1: holders must be sorted and unique (expected [2, 7], got [2, 2, 7])")
    assert_has(p, "chunk 1: holder rank 7 is out of range (expected 0 <= rank < world_size 4, got 7)")


def test_tensors_rank_out_of_range() -> None:
    m = one(rows(2), tensors={"9": {FQN: {"shape": [2, 8], "data_type": "float32"}}})
    assert_has(validate_manifest(m, where=W),
               f"{W}: tensors.9: rank 9 is out of range (expected 0 <= rank < world_size 4, got 9)")


# ------------------------------------------------------------------ coverage


def test_empty_region_listed() -> None:
    p = validate_manifest(one(rows(2) + [chunk([0, 0], [0, 8], [2])]), where=W)
    assert_has(p, "chunk 2: empty region listed [0:0, 0:8] (expected sizes >= 1 in every dim, got sizes [0, 8])")
    assert len(p) == 1, p


def test_overlap_is_reported_with_region() -> None:
    ch = [chunk([0, 0], [3, 8], [0]), chunk([2, 0], [2, 8], [1])]
    p = validate_manifest(one(ch), where=W)
    assert_has(p, f"{W}: {FQN}: chunks 0 and 1 overlap in region [2:3, 0:8]")


def test_gap_is_reported_with_location() -> None:
    ch = [chunk([0, 0], [2, 8], [0]), chunk([2, 0], [2, 4], [1])]
    p = validate_manifest(one(ch), where=W)
    assert p == [f"{W}: {FQN}: chunks cover 24 of 32 elements (gap of 8 elements; first uncovered region [2:4, 4:8])"]


def test_no_chunks_is_a_gap_unless_partial() -> None:
    assert_has(validate_manifest(one([]), where=W), "chunks cover 0 of 32 elements (gap of 32 elements")
    assert validate_manifest(one([], partial=True), where=W) == []


def test_partial_allows_gaps_not_overlaps() -> None:
    assert validate_manifest(one([chunk([0, 0], [2, 8])], partial=True), where=W) == []
    p = validate_manifest(one([chunk([0, 0], [2, 8], [0]), chunk([1, 0], [1, 8], [1])], partial=True), where=W)
    assert p == [f"{W}: {FQN}: chunks 0 and 1 overlap in region [1:2, 0:8]"]


def test_zero_d_arrays() -> None:
    c0 = chunk([], [], [0])
    assert validate_manifest(one([c0], shape=[]), where=W) == []
    assert validate_manifest(one([], shape=[], partial=True), where=W) == []
    assert_has(validate_manifest(one([], shape=[]), where=W),
               "0-d array needs exactly one chunk with region offsets [] sizes [] (expected 1 chunk, got 0)")
    p = validate_manifest(one([c0, chunk([], [], [1])], shape=[], partial=True), where=W)
    assert_has(p, "(expected 1 chunk, got 2)")


def test_flood_is_capped_per_kind() -> None:
    n = 100
    ch = [chunk([0, 0], [4, 8], [0])] + [chunk([i % 4, 0], [1, 9], [1 + i % 3]) for i in range(n)]
    p = validate_manifest(one(ch), where=W)
    oob = [x for x in p if "exceeds shape" in x]
    assert len(oob) == MAX_PER_KIND
    assert_has(p, f"{W}: {FQN}: ... and {n - MAX_PER_KIND} more out-of-bounds regions")
    assert_has(p, "more overlaps")
    assert len(p) < 100


# ------------------------------------------------------------------ local tensors


def test_local_tensor_overlap_same_rank() -> None:
    arrays = {
        "a": {"shape": [4, 4], "data_type": "float32", "chunks": [chunk([0, 0], [4, 4], [0], tensor="fused")]},
        "b": {"shape": [4, 4], "data_type": "float32",
              "chunks": [chunk([0, 0], [4, 4], [0], tensor="fused", offsets=[2, 0])]},
    }
    p = validate_manifest(manifest(arrays), where=W)
    assert p == [(f"{W}: a: chunk 0 and b chunk 0 write overlapping ranges of local tensor 'fused' on rank 0 "
                  f"(overlap [2:4, 0:4])")]
    # same local offsets on different ranks: fine
    arrays["b"]["chunks"][0]["holders"] = [1]
    assert validate_manifest(manifest(arrays), where=W) == []
    # partially shared holders: reported for the common rank only
    arrays["a"]["chunks"][0]["holders"] = [0, 1]
    arrays["b"]["chunks"][0]["holders"] = [1, 2]
    assert_has(validate_manifest(manifest(arrays), where=W), "local tensor 'fused' on rank 1 (overlap")


def test_default_local_offsets_collide_on_one_rank() -> None:
    # two row chunks on rank 0 with no source: both at local offset 0 of local tensor FQN
    p = validate_manifest(one([chunk([0, 0], [2, 8], [0]), chunk([2, 0], [2, 8], [0])]), where=W)
    assert_has(p, f"chunks 0 and 1 write overlapping ranges of local tensor {FQN!r} on rank 0")


def test_local_tensor_mixed_dtypes() -> None:
    arrays = {
        "a": {"shape": [4], "data_type": "float32", "chunks": [chunk([0], [4], [0], tensor="buf")]},
        "b": {"shape": [4], "data_type": "bfloat16", "chunks": [chunk([0], [4], [0], tensor="buf", offsets=[4])]},
    }
    p = validate_manifest(manifest(arrays), where=W)
    assert_has(p, "local tensor 'buf' on rank 0 is shared by arrays of different data_type without a 'tensors' "
                  "declaration (expected one data_type, got float32 (a chunk 0) and bfloat16 (b chunk 0))")
    m = manifest(arrays, tensors={"0": {"buf": {"shape": [8], "data_type": "uint8"}}})
    assert validate_manifest(m, where=W) == []


def test_declared_local_tensor_must_contain_chunks() -> None:
    ch = [chunk([0, 0], [2, 8], [0], tensor="w", offsets=[1, 0]), chunk([2, 0], [2, 8], [1], tensor="w")]
    m = one(ch, tensors={"0": {"w": {"shape": [2, 8], "data_type": "float32"}},
                         "1": {"w": {"shape": [2, 8, 1], "data_type": "float32"}}})
    p = validate_manifest(m, where=W)
    assert_has(p, "chunk 0: local box [1:3, 0:8] does not fit local tensor 'w' declared on rank 0 with shape "
                  "[2, 8] in dim 0 (stop 3 > 2)")
    assert_has(p, "chunk 1: local tensor 'w' declared on rank 1 has 3 dims (expected 2, got 3)")
    # padding (declared bigger than the chunks) is fine
    m = one(rows(2), tensors={"0": {FQN: {"shape": [3, 8], "data_type": "float32"}}})
    assert validate_manifest(m, where=W) == []


def test_stored_shape_and_byte_range() -> None:
    ok = chunk([0, 0], [2, 8], [0], file="x.distcp", byte_range=[100, 100 + 2 * 8 * 4], stored_shape=[2, 8])
    assert validate_manifest(one([ok, rows(2)[1]]), where=W) == []
    small = chunk([0, 0], [2, 8], [0], file="x.distcp", byte_range=[0, 2 * 7 * 4], stored_shape=[2, 7])
    p = validate_manifest(one([small, rows(2)[1]]), where=W)
    assert_has(p, "chunk 0: local box [0:2, 0:8] exceeds source.stored_shape [2, 7] in dim 1 (stop 8 > 7)")
    badlen = chunk([0, 0], [2, 8], [0], file="x.distcp", byte_range=[0, 10], stored_shape=[2, 8])
    p = validate_manifest(one([badlen, rows(2)[1]]), where=W)
    assert_has(p, "chunk 0: source.byte_range [0, 10] holds 10 bytes but source.stored_shape [2, 8] of float32 "
                  "needs 64 (expected 64 bytes, got 10)")


def test_domain_size_is_accepted() -> None:
    assert validate_manifest(one(rows(2), topology={"domain_size": 8}), where=W) == []


# ------------------------------------------------------------------ paths


@pytest.mark.parametrize(("path", "text"), [
    ("/etc/passwd", "is absolute"),
    ("C:/x.safetensors", "is absolute"),
    ("../up.safetensors", "contains '..'"),
    ("a/../../b", "contains '..'"),
    ("a//b.safetensors", "has an empty component"),
    ("dir/", "has an empty component"),
    ("a\\..\\b", "contains a backslash"),
    ("rank-{rnk}.safetensors", "uses field {rnk}"),
    ("rank-{0}.safetensors", "uses field {0}"),
    ("rank-{rank.__class__}.st", "uses field {rank.__class__}"),
    ("rank-{rank!r}.st", "uses conversion !r"),
    ("rank-{rank:s}.st", "does not format with an integer rank"),
    ("rank-{rank.st", "is not a valid format string"),
])
def test_bad_paths(path: str, text: str) -> None:
    ch = rows(2)
    ch[0]["source"] = {"file": path}
    p = validate_manifest(one(ch), where=W)
    assert_has(p, f"{W}: {FQN}: chunk 0: ")
    assert_has(p, text)
    assert validate_manifest(one(ch), where=W, check_paths=False) == []


def test_good_paths() -> None:
    for f in ["rank-{rank:05d}.safetensors", "model.safetensors", "sub/dir/x.safetensors", ".", "a{{b}}.st"]:
        ch = rows(2)
        for c in ch:
            c["source"] = {"file": f}
        assert validate_manifest(one(ch), where=W) == [], f
    assert check_file_path(None, "rank-00000.safetensors") is None


def test_symlink_escape(tmp_path: Path) -> None:
    base = tmp_path / "ckpt"
    base.mkdir()
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"x")
    (base / "evil.safetensors").symlink_to(outside)
    (base / "sub").symlink_to(tmp_path)
    (base / "fine.safetensors").write_bytes(b"x")
    (base / "inner.safetensors").symlink_to(base / "fine.safetensors")
    assert_has([check_file_path(base, "evil.safetensors") or ""], "resolves outside the manifest's directory")
    assert_has([check_file_path(base, "sub/secret.safetensors") or ""], "resolves outside")
    assert check_file_path(base, "inner.safetensors") is None
    assert check_file_path(base, "fine.safetensors") is None
    assert check_file_path(base, "not-there-yet.safetensors") is None
    ch = rows(2)
    ch[0]["source"] = {"file": "evil.safetensors"}
    ch[1]["source"] = {"file": "inner.safetensors"}
    p = validate_manifest(one(ch, base_dir=base), where=W)
    assert len(p) == 1 and "chunk 0: source.file: path 'evil.safetensors' resolves outside" in p[0], p
    # per-holder patterns are checked for each holder's rank
    (base / "rank-1.safetensors").symlink_to(outside)
    ch = rows(2)
    for c in ch:
        c["source"] = {"file": "rank-{rank}.safetensors"}
    p = validate_manifest(one(ch, base_dir=base), where=W)
    assert len(p) == 1 and "source.file for rank 1: path 'rank-1.safetensors' resolves outside" in p[0], p


def test_special_files_rejected(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.safetensors")
    assert_has([check_file_path(tmp_path, "pipe.safetensors") or ""],
               "is a named pipe (expected a regular file or a directory)")
    (tmp_path / "store.zarr").mkdir()
    assert check_file_path(tmp_path, "store.zarr") is None


# ------------------------------------------------------------------ geometry properties


@st.composite
def grid_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    nd = draw(st.integers(0, 5))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=nd, max_size=nd)))
    cuts = []
    for n in shape:
        inner = draw(st.sets(st.integers(1, n - 1), max_size=3)) if n > 1 else set()
        cuts.append([0, *sorted(inner), n])
    boxes = []
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        off = tuple(cuts[d][i] for d, i in enumerate(cell))
        stop = tuple(cuts[d][i + 1] for d, i in enumerate(cell))
        boxes.append((off, stop))
    draw(st.randoms()).shuffle(boxes)
    return shape, boxes


def boxes_manifest(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
                   **kw: Any) -> Manifest:
    # every chunk in its own local tensor so that only coverage is exercised
    chunks = tuple(Chunk(Box(o, tuple(b - a for a, b in zip(o, e))), (i % 4,), Source(tensor=f"t{i}"))
                   for i, (o, e) in enumerate(boxes))
    return Manifest(world_size=4, arrays={"x": ArraySpec(shape, "int8", chunks)}, **kw)


_prop = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_prop
@given(grid_tilings())
def test_grid_tilings_validate_clean(t: tuple[tuple[int, ...], list[Any]]) -> None:
    shape, boxes = t
    assert validate_manifest(boxes_manifest(shape, boxes)) == []


@_prop
@given(grid_tilings(), st.data())
def test_removing_a_chunk_leaves_a_gap(t: tuple[tuple[int, ...], list[Any]], data: st.DataObject) -> None:
    shape, boxes = t
    k = data.draw(st.integers(0, len(boxes) - 1))
    o, e = boxes[k]
    p = validate_manifest(boxes_manifest(shape, boxes[:k] + boxes[k + 1:]), where=W)
    if shape == ():
        assert p == [(f"{W}: x: 0-d array needs exactly one chunk with region offsets [] sizes [] "
                      "(expected 1 chunk, got 0)")]
        return
    vol = prod_(b - a for a, b in zip(o, e))
    total = prod_(shape)
    assert len(p) == 1, p
    assert f"chunks cover {total - vol} of {total} elements (gap of {vol} elements; first uncovered region" in p[0]
    # the reported gap location lies inside the removed box
    loc = p[0].rsplit("region ", 1)[1].rstrip(")")
    lo = [int(x.split(":")[0]) for x in loc.strip("[]").split(", ")]
    assert all(a <= v < b for v, a, b in zip(lo, o, e)), (loc, o, e)


@_prop
@given(grid_tilings(), st.data())
def test_duplicating_or_enlarging_a_chunk_overlaps(t: tuple[tuple[int, ...], list[Any]], data: st.DataObject) -> None:
    shape, boxes = t
    k = data.draw(st.integers(0, len(boxes) - 1))
    p = validate_manifest(boxes_manifest(shape, boxes + [boxes[k]]), where=W)
    if shape == ():
        assert_has(p, "(expected 1 chunk, got 2)")
    else:
        assert_has(p, f"chunks {k} and {len(boxes)} overlap in region {Box(boxes[k][0], tuple(b - a for a, b in zip(*boxes[k])))}")
        assert not has(p, "gap")
    # enlarge a box that does not touch the far end of the array in some dim
    growable = [(i, d) for i, (o, e) in enumerate(boxes) for d in range(len(shape)) if e[d] < shape[d]]
    if not growable:
        return
    i, d = data.draw(st.sampled_from(growable))
    o, e = boxes[i]
    bigger = (o, tuple(x + (1 if j == d else 0) for j, x in enumerate(e)))
    p = validate_manifest(boxes_manifest(shape, boxes[:i] + [bigger] + boxes[i + 1:]), where=W)
    assert_has(p, "overlap in region")
    assert not has(p, "exceeds shape") and not has(p, "gap"), p


@st.composite
def guillotine_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Recursive cuts: regions that tile exactly but are not a grid."""
    nd = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=nd, max_size=nd)))
    rnd = draw(st.randoms())
    out = []
    todo = [((0,) * nd, shape)]
    while todo:
        o, e = todo.pop()
        splittable = [d for d in range(nd) if e[d] - o[d] > 1]
        if not splittable or rnd.random() < 0.25 or len(out) + len(todo) > 40:
            out.append((o, e))
            continue
        d = rnd.choice(splittable)
        cut = rnd.randint(o[d] + 1, e[d] - 1)
        todo.append((o, e[:d] + (cut,) + e[d + 1:]))
        todo.append((o[:d] + (cut,) + o[d + 1:], e))
    return shape, out


def brute_pairs(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[int, int]]:
    out = []
    for i, j in itertools.combinations(range(len(boxes)), 2):
        (oa, ea), (ob, eb) = boxes[i], boxes[j]
        if all(max(a, b) < min(c, d) for a, b, c, d in zip(oa, ob, ea, eb)):
            out.append((i, j))
    return out


@_prop
@given(guillotine_tilings(), st.data())
def test_guillotine_tilings_every_method(t: tuple[tuple[int, ...], list[Any]], data: st.DataObject) -> None:
    shape, boxes = t
    assert validate_manifest(boxes_manifest(shape, boxes)) == []
    # add a few random boxes, then compare every method against brute force
    extra = []
    for _ in range(data.draw(st.integers(0, 4))):
        o = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
        e = tuple(data.draw(st.integers(a + 1, n)) for a, n in zip(o, shape))
        extra.append((o, e))
    allb = boxes + extra
    want = brute_pairs(allb)
    offs = [o for o, _ in allb]
    stops = [e for _, e in allb]
    covered = len({c for o, e in allb for c in itertools.product(*(range(a, b) for a, b in zip(o, e)))})
    for kw in ({}, {"small": 0}, {"small": 0, "cell_budget": 0}):
        g = analyze_boxes(offs, stops, len(shape), shape=shape, **kw)
        assert g.pairs == want, kw
        assert not g.truncated
        if g.union is not None:
            assert g.union == covered, kw


def test_sweep_matches_cells_on_random_boxes() -> None:
    rnd = random.Random(7)
    for _ in range(30):
        nd = rnd.randint(1, 4)
        boxes = []
        for _ in range(rnd.randint(50, 200)):
            o = tuple(rnd.randint(0, 40) for _ in range(nd))
            boxes.append((o, tuple(a + rnd.randint(1, 6) for a in o)))
        offs = [o for o, _ in boxes]
        stops = [e for _, e in boxes]
        a = analyze_boxes(offs, stops, nd, max_pairs=10**6)
        b = analyze_boxes(offs, stops, nd, max_pairs=10**6, cell_budget=0)
        assert a.pairs == b.pairs
        if len(boxes) <= 80:
            assert a.pairs == brute_pairs(boxes)


def test_overlap_enumeration_is_bounded() -> None:
    # 3000 identical chunks: ~4.5M overlapping pairs; the report stays short and fast
    n = 3000
    chunks = tuple(Chunk(Box((0,), (8,)), (0,), Source(tensor=f"t{i}")) for i in range(n))
    m = Manifest(world_size=1, arrays={"x": ArraySpec((8,), "int8", chunks)})
    t0 = time.perf_counter()
    p = validate_manifest(m, where=W)
    assert time.perf_counter() - t0 < 10
    assert len([x for x in p if "overlap in region" in x]) == MAX_PER_KIND
    assert_has(p, "... and more than")


def prod_(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


# ------------------------------------------------------------------ scale


@pytest.mark.slow  # the scale tier
def test_100k_chunk_manifest_validates(capsys: pytest.CaptureFixture[str]) -> None:
    # one 2-d array in a 250 x 400 grid (100k chunks) over 8 ranks, per-rank files, fused local tensors
    rs, cs, nr, nc = 2, 3, 250, 400
    chunks = tuple(
        Chunk(Box((i * rs, j * cs), (rs, cs)), ((i * nc + j) % 8,),
              Source(tensor=f"t{j}", offsets=(i * rs, 0), file="rank-{rank:05d}.safetensors"))
        for i in range(nr) for j in range(nc))
    big = Manifest(world_size=8, arrays={"w": ArraySpec((nr * rs, nc * cs), "bfloat16", chunks)})
    # and 1250 arrays x 80 chunks (TP8 rows x 10 column blocks)
    arrays = {}
    for a in range(1250):
        arrays[f"a{a}"] = ArraySpec((128, 320), "bfloat16", tuple(
            Chunk(Box((tp * 16, c * 32), (16, 32)), (tp,), Source(tensor=f"a{a}", offsets=(0, c * 32)))
            for tp in range(8) for c in range(10)))
    many = Manifest(world_size=8, arrays=arrays)
    for name, m in (("single-array", big), ("1250-array", many)):
        t0 = time.perf_counter()
        p = validate_manifest(m, where=W)
        dt = time.perf_counter() - t0
        assert p == []
        with capsys.disabled():
            print(f"\n100k-chunk {name} manifest validated in {dt:.2f} s")
    # a broken one: drop a chunk and duplicate another
    broken = Manifest(world_size=8, arrays={"w": ArraySpec((nr * rs, nc * cs), "bfloat16",
                                                           chunks[1:] + (chunks[500],))})
    t0 = time.perf_counter()
    p = validate_manifest(broken, where=W)
    with capsys.disabled():
        print(f"100k-chunk broken manifest validated in {time.perf_counter() - t0:.2f} s")
    assert_has(p, "chunks 499 and 99999 overlap in region [2:4, 300:303]")
    assert_has(p, "(gap of 6 elements; first uncovered region [0:2, 0:3])")


# ------------------------------------------------------------------ validate_data


def _xxh(a: np.ndarray[Any, Any]) -> str:
    return "xxh64:" + xxhash.xxh64(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, np.ndarray[Any, Any]]:
    """Two per-rank safetensors files holding row halves of a 4x8 float32 array, and a raw file."""
    from safetensors.numpy import save_file

    full = np.arange(32, dtype=np.float32).reshape(4, 8)
    for r in range(2):
        save_file({FQN: full[2 * r:2 * r + 2], "other": np.zeros(3, dtype=np.int8)},
                  str(tmp_path / f"rank-{r:05d}.safetensors"))
    (tmp_path / "raw.bin").write_bytes(b"\0" * 16 + full.tobytes())
    return tmp_path, full


def data_manifest(base: Path, chunks: list[dict[str, Any]], data_type: str = "float32", **kw: Any) -> Manifest:
    return manifest({FQN: {"shape": [4, 8], "data_type": data_type, "chunks": chunks}}, base_dir=base, **kw)


def per_rank(full: np.ndarray[Any, Any], **extra: Any) -> list[dict[str, Any]]:
    return [chunk([2 * r, 0], [2, 8], [r], file="rank-{rank:05d}.safetensors",
                  checksum=_xxh(full[2 * r:2 * r + 2]), **extra) for r in range(2)]


def test_data_valid(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    m = data_manifest(base, per_rank(full))
    assert validate_manifest(m, where=W) == []
    assert validate_data(m, where=W) == []


def test_data_shared_file_and_sub_regions(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    # rank 0's file holds rows 0:2; describe it as two column chunks inside that one stored tensor
    ch = [chunk([0, 0], [2, 3], [0], file="rank-00000.safetensors", offsets=[0, 0], checksum=_xxh(full[0:2, 0:3])),
          chunk([0, 3], [2, 5], [0], file="rank-00000.safetensors", offsets=[0, 3], checksum=_xxh(full[0:2, 3:8])),
          chunk([2, 0], [2, 8], [1], file="rank-00001.safetensors", checksum=_xxh(full[2:4]))]
    m = data_manifest(base, ch)
    assert validate_manifest(m, where=W) == []
    assert validate_data(m, where=W) == []


def test_data_missing_file(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    ch = per_rank(full)
    ch[1]["holders"] = [1, 2]
    m = data_manifest(base, ch)
    p = validate_data(m, where=W)
    assert p == [(f"{W}: {FQN}: chunk 1: file 'rank-00002.safetensors' for rank 2 not found "
                  f"(expected a file at {base / 'rank-00002.safetensors'})")]


def test_data_missing_tensor(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    ch = per_rank(full, tensor="nope")
    p = validate_data(data_manifest(base, ch), where=W)
    assert_has(p, "chunk 0: tensor 'nope' not found in 'rank-00000.safetensors' for rank 0 "
                  "(available: 'model.layers.0.q_proj.weight', 'other')")


def test_data_wrong_dtype(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    p = validate_data(data_manifest(base, per_rank(full), data_type="bfloat16"), where=W)
    assert_has(p, "chunk 0: stored tensor 'model.layers.0.q_proj.weight' in 'rank-00000.safetensors' for rank 0 "
                  "has the wrong data_type (expected bfloat16, got float32)")
    # a tensors declaration overrides the array's data_type
    m = data_manifest(base, per_rank(full), data_type="bfloat16",
                      tensors={str(r): {FQN: {"shape": [2, 8], "data_type": "float32"}} for r in range(2)})
    assert validate_data(m, where=W) == []


def test_data_shape_too_small(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    ch = per_rank(full, offsets=[1, 0])
    p = validate_data(data_manifest(base, ch), where=W)
    assert_has(p, "chunk 0: stored tensor 'model.layers.0.q_proj.weight' in 'rank-00000.safetensors' for rank 0 "
                  "is too small for local box [1:3, 0:8] (expected shape >= [3, 8] in every dim, got [2, 8])")


def test_data_checksum_mismatch(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    ch = per_rank(full)
    good = ch[1]["source"]["checksum"]
    ch[1]["source"]["checksum"] = "xxh64:0123456789abcdef"
    m = data_manifest(base, ch)
    p = validate_data(m, where=W)
    assert p == [(f"{W}: {FQN}: checksum mismatch for chunk 1 region [2:4, 0:8] on rank 1 in "
                  f"'rank-00001.safetensors' (expected xxh64:0123456789abcdef, got {good})")]
    assert validate_data(m, where=W, verify_checksums=False) == []


def test_data_crc32c_checksum(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    crc32c = pytest.importorskip("crc32c")
    base, full = ckpt
    ch = per_rank(full)
    for r, c in enumerate(ch):
        c["source"]["checksum"] = f"crc32c:{crc32c.crc32c(full[2 * r:2 * r + 2].tobytes()):08x}"
    assert validate_data(data_manifest(base, ch), where=W) == []


def test_data_byte_range(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, full = ckpt
    ch = [chunk([0, 0], [4, 8], [0], file="raw.bin", byte_range=[16, 16 + 128], stored_shape=[4, 8],
                checksum=_xxh(full))]
    m = data_manifest(base, ch)
    assert validate_manifest(m, where=W) == [] and validate_data(m, where=W) == []
    # a sub-region of the raw tensor, checksummed over its own bytes
    ch2 = [chunk([0, 0], [4, 3], [0], file="raw.bin", byte_range=[16, 144], stored_shape=[4, 8],
                 checksum=_xxh(full[:, :3])),
           chunk([0, 3], [4, 5], [0], file="raw.bin", byte_range=[16, 144], stored_shape=[4, 8],
                 offsets=[0, 3], checksum=_xxh(full[:, 3:]))]
    m = data_manifest(base, ch2)
    assert validate_manifest(m, where=W) == [] and validate_data(m, where=W) == []
    past = [chunk([0, 0], [4, 8], [0], file="raw.bin", byte_range=[32, 160], stored_shape=[4, 8])]
    p = validate_data(data_manifest(base, past), where=W)
    assert p == [(f"{W}: {FQN}: chunk 0: source.byte_range [32, 160] is past the end of 'raw.bin' "
                  f"(expected stop <= file size 144, got 160)")]


def test_data_bad_files_never_raise(ckpt: tuple[Path, np.ndarray[Any, Any]]) -> None:
    base, _full = ckpt
    (base / "garbage.safetensors").write_bytes(b"\xff" * 64)
    (base / "short.safetensors").write_bytes(b"\x01")
    (base / "store.zarr").mkdir()
    ch = [chunk([0, 0], [1, 8], [0], file="garbage.safetensors"),
          chunk([1, 0], [1, 8], [1], file="short.safetensors"),
          chunk([2, 0], [2, 8], [2], file="store.zarr")]
    p = validate_data(data_manifest(base, ch), where=W)
    no_internal(p)
    assert_has(p, "chunk 0: 'garbage.safetensors' is not a valid safetensors file")
    assert_has(p, "chunk 1: 'short.safetensors' is not a valid safetensors file")
    assert_has(p, f"chunk 2: zarr array {FQN!r} not found in 'store.zarr'")  # a directory is a zarr group
    assert len(p) == 3, p


def test_data_skips_unsafe_paths(ckpt: tuple[Path, np.ndarray[Any, Any]], tmp_path_factory: pytest.TempPathFactory) -> None:
    base, full = ckpt
    other = tmp_path_factory.mktemp("outside")
    (base / "link.safetensors").symlink_to(other / "x.safetensors")
    ch = per_rank(full)
    ch[0]["source"]["file"] = "link.safetensors"
    m = data_manifest(base, ch)
    assert_has(validate_manifest(m, where=W), "resolves outside")
    assert validate_data(m, where=W) == []  # never opened, reported by validate_manifest only


def test_data_header_read_once(ckpt: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    import formats.safetensors.header as sio

    base, _full = ckpt
    calls: list[str] = []
    real = sio.read_header

    def counting(path: Any) -> Any:
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(sio, "read_header", counting)
    ch = [chunk([0, c], [2, 1], [0], file="rank-00000.safetensors", offsets=[0, c]) for c in range(8)]
    ch += [chunk([2, 0], [2, 8], [1], file="rank-00001.safetensors")]
    assert validate_data(data_manifest(base, ch), where=W) == []
    assert sorted(calls) == sorted({str(base / "rank-00000.safetensors"), str(base / "rank-00001.safetensors")})


def test_data_scalar_and_bfloat16_checksums(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    s = torch.tensor(7, dtype=torch.int64)
    save_file({"w": w, "s": s}, str(tmp_path / "m.safetensors"))
    wb = w.view(torch.uint16).numpy()
    arrays = {
        "w": {"shape": [3, 4], "data_type": "bfloat16", "chunks": [
            chunk([0, 0], [3, 2], [0], file="m.safetensors", checksum=_xxh(wb[:, :2])),
            chunk([0, 2], [3, 2], [1], file="m.safetensors", offsets=[0, 2], checksum=_xxh(wb[:, 2:]))]},
        "s": {"shape": [], "data_type": "int64", "chunks": [
            chunk([], [], [0, 1], file="m.safetensors", checksum=_xxh(s.numpy()))]},
    }
    m = manifest(arrays, world_size=2, base_dir=tmp_path)
    assert validate_manifest(m, where=W) == []
    assert validate_data(m, where=W) == []
    arrays["s"]["chunks"][0]["source"]["checksum"] = _xxh(np.array(8, dtype=np.int64))
    p = validate_data(manifest(arrays, world_size=2, base_dir=tmp_path), where=W)
    assert len(p) == 1 and "checksum mismatch for chunk 0 region [] on rank 0" in p[0], p


def test_programmatic_manifests_never_raise() -> None:
    # things the parser would refuse, built directly: validation reports them instead of crashing
    bad = Manifest(world_size=2, arrays={
        "rank": ArraySpec((4, 4), "float32", (Chunk(Box((0,), (4,)), (0,)),)),
        "dtype": ArraySpec((4,), "float99", (Chunk(Box((0,), (4,)), (0,)),)),
        "holders": ArraySpec((4,), "int8", (Chunk(Box((0,), (4,)), ()),)),
        "offs": ArraySpec((4,), "int8", (Chunk(Box((0,), (4,)), (1,), Source(offsets=(0, 0))),)),
        "br": ArraySpec((4,), "int8", (Chunk(Box((0,), (4,)), (1,), Source(file="x", byte_range=(0, 4))),)),
    })
    p = validate_manifest(bad, where=W)
    no_internal(p)
    assert_has(p, "rank: chunk 0: region has 1 dims (expected 2, got 1)")
    assert_has(p, "dtype: unknown data_type 'float99'")
    assert_has(p, "holders: chunk 0: holders is empty")
    assert_has(p, "offs: chunk 0: source.offsets has 2 entries (expected 1, one per dim, got 2)")
    assert_has(p, "br: chunk 0: source.byte_range and source.stored_shape must be given together")
    no_internal(validate_data(bad, where=W))
