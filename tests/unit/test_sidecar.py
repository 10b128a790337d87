"""Chunk checksums of compact (v2) manifests in a sidecar file (formats/integrity/sidecar.py): round trips
against the explicit form, the cases that stay explicit, and every way the sidecar or its
references can be wrong (one precise problem each, never a traceback)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import lay_out

from formats.errors import ManifestError
from formats.layouts import Mesh, Replicate, Shard
from formats.manifest.spec import Source
from formats.manifest.wire import (
    ArraySpec,
    Chunk,
    Manifest,
    dumps_manifest,
    load_manifest,
    loads_manifest,
    save_manifest,
    without_checksums,
)
from formats.validate.manifest import validate_manifest

ARRAYS = {"a.weight": ((8, 6), "bfloat16"), "b.weight": ((5,), "float32"), "c": ((), "int64"),
          "model.layers.0.mlp.experts.0.w": ((4, 4), "bfloat16"), "model.layers.0.mlp.experts.1.w": ((4, 4), "bfloat16")}


def _with_checksums(m: Manifest, texts: dict[str, list[str]] | None = None, seed: int = 0) -> Manifest:
    """``m`` with a file and a checksum on every chunk (random canonical xxh64 unless given)."""
    rng = random.Random(seed)
    arrays = {}
    for fqn, spec in m.arrays.items():
        cks = (texts or {}).get(fqn) or [f"xxh64:{rng.getrandbits(64):016x}" for _ in spec.chunks]
        arrays[fqn] = ArraySpec(spec.shape, spec.data_type, tuple(
            Chunk(c.region, c.holders, Source(file="rank-{rank}.safetensors", offsets=c.local_offsets
                                              if any(c.local_offsets) else None, checksum=ck))
            for c, ck in zip(spec.chunks, cks)))
    return Manifest(world_size=m.world_size, arrays=arrays, mesh=m.mesh)


def _layout() -> Manifest:
    return lay_out(ARRAYS, Mesh(("dp", "tp"), (2, 2)), {
        "a.weight": (Replicate(), Shard(0)), "b.weight": (Shard(0), Shard(0)), "c": (Replicate(), Replicate()),
        "model.layers.0.mlp.experts.0.w": (Replicate(), Shard(1)),
        "model.layers.0.mlp.experts.1.w": (Replicate(), Shard(1))})


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_equals_the_explicit_form(tmp_path: Path, seed: int) -> None:
    m = _with_checksums(_layout(), seed=seed)
    save_manifest(m, tmp_path / "manifest.json", format_version=2)
    obj = json.loads((tmp_path / "manifest.json").read_text())
    assert obj["checksums"]["count"] == sum(len(s.chunks) for s in m.arrays.values())
    assert all("chunks" not in a for a in obj["arrays"].values())  # no per-chunk JSON
    run = obj["arrays"]["model.layers.0.mlp.experts.{expert}"]  # the experts stay one run entry
    assert run["checksums"] == obj["arrays"]["c"]["checksums"] + len(m.arrays["c"].chunks)
    back = load_manifest(tmp_path)
    assert back.arrays == m.arrays  # every chunk's checksum, file and offsets as written
    assert dumps_manifest(back) == dumps_manifest(m)  # and as v1, byte for byte
    assert validate_manifest(back, where=str(tmp_path)) == []


def test_what_cannot_go_in_the_sidecar_stays_explicit(tmp_path: Path) -> None:
    """Another algorithm than the one taken, or a non-canonical text (upper-case hex): explicit
    chunks, and the strings come back unchanged."""
    base = _layout()
    n = {f: len(s.chunks) for f, s in base.arrays.items()}
    texts = {"b.weight": ["crc32c:0000abcd"] * n["b.weight"], "c": ["xxh64:ABCDEF0123456789"] * n["c"]}
    m = _with_checksums(base, texts)
    save_manifest(m, tmp_path / "manifest.json", format_version=2)
    arrays = json.loads((tmp_path / "manifest.json").read_text())["arrays"]
    assert "chunks" in arrays["b.weight"] and "chunks" in arrays["c"]
    assert "checksums" in arrays["a.weight"]
    assert load_manifest(tmp_path).arrays == m.arrays


def test_text_without_its_directory_names_the_sidecar_when_read(tmp_path: Path) -> None:
    """Parsed from text (a refit's exchange), a checksummed array still plans and counts, but its
    checksums cannot be read: the error says so; ``without_checksums`` leaves the layout alone."""
    m = _with_checksums(_layout())
    save_manifest(m, tmp_path / "manifest.json", format_version=2)
    text = (tmp_path / "manifest.json").read_text()
    loose = loads_manifest(text, where="sent manifest")
    assert loose.chunk_count() == m.chunk_count()
    with pytest.raises(ManifestError, match="manifest.checksums.*cannot be read here"):
        _ = loose.arrays["a.weight"].chunks
    loaded = load_manifest(tmp_path)
    _ = loaded.arrays["a.weight"].chunks  # expanded (a sender that read its files): still the layout alone
    bare = without_checksums(loaded)
    sent = json.loads(dumps_manifest(bare, format_version=2))
    assert "checksums" not in sent and all("chunks" not in a for a in sent["arrays"].values())
    assert all(c.source is None or c.source.checksum is None for s in bare.arrays.values() for c in s.chunks)


def _compact_obj(tmp_path: Path) -> dict:
    save_manifest(_with_checksums(_layout()), tmp_path / "manifest.json", format_version=2)
    return json.loads((tmp_path / "manifest.json").read_text())


@pytest.mark.parametrize(("edit", "said"), [
    (lambda o: o["checksums"].update(algorithm="md5"), "algorithm must be one of xxh64, crc32c"),
    (lambda o: o["checksums"].update(count=-1), "count must be a non-negative integer"),
    (lambda o: o["checksums"].update(sha256="xyz"), "sha256 must be 64 lowercase hex digits"),
    (lambda o: o["checksums"].update(file="../elsewhere"), "file must be a file name beside the manifest"),
    (lambda o: o["checksums"].update(extra=1), "extra"),
    (lambda o: o.pop("checksums"), "'checksums' needs the top-level 'checksums' object"),
    (lambda o: o["arrays"]["a.weight"].update(checksums=10**6), "run past the sidecar's"),
    (lambda o: o["arrays"]["a.weight"].update(checksums=-2), "checksums"),
    (lambda o: o["arrays"]["model.layers.0.mlp.experts.{expert}"].update(checksums=10**6), "past the sidecar's"),
    (lambda o: o["checksums"].update(count=3), "run past the sidecar's 3 checksums"),
])
def test_bad_references_are_parse_errors_naming_the_place(tmp_path: Path, edit, said: str) -> None:
    obj = _compact_obj(tmp_path)
    edit(obj)
    with pytest.raises(ManifestError) as e:
        loads_manifest(json.dumps(obj), where="m.json", base_dir=tmp_path)
    assert any(said in p for p in e.value.problems), e.value.problems
