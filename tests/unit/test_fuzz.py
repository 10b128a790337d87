"""Fuzzing the manifest parser + validator and the safetensors reader with hostile inputs.

Every case must end in success or a ``ShardstreamError`` subclass with a message, within 2 s,
never another exception. ``scripts/fuzz.sh`` runs the same properties with many more examples
(``HYPOTHESIS_PROFILE=fuzz``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formats.errors import ShardstreamError
from formats.manifest.wire import loads_manifest
from formats.validate.manifest import validate_data, validate_manifest

N = int(os.environ.get("SHARDSTREAM_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))

SEED = {
    "format": "shardstream.manifest", "format_version": 1, "name": "seed", "world_size": 4,
    "mesh": {"axes": ["dp", "tp"], "shape": [2, 2]}, "topology": {"domain_size": 2},
    "tensors": {"1": {"w": {"shape": [4, 8], "data_type": "bfloat16"}}},
    "arrays": {
        "w": {"shape": [4, 6], "data_type": "bfloat16", "chunks": [
            {"region": {"offsets": [0, 0], "sizes": [4, 3]}, "holders": [0, 2],
             "source": {"tensor": "w", "offsets": [0, 0], "file": "rank-{rank:05d}.safetensors",
                        "checksum": "xxh64:00ff"}},
            {"region": {"offsets": [0, 3], "sizes": [4, 3]}, "holders": [1, 3],
             "source": {"file": "shared.safetensors", "byte_range": [0, 24], "stored_shape": [4, 3]}}]},
        "s": {"shape": [], "data_type": "int64", "chunks": [
            {"region": {"offsets": [], "sizes": []}, "holders": [0, 1, 2, 3]}]},
    },
}
SEED_TEXT = json.dumps(SEED).encode()


def _check(text: bytes, base: Path | None = None) -> None:
    t0 = time.perf_counter()
    try:
        m = loads_manifest(text, where="fuzz.json", base_dir=base)
        problems = validate_manifest(m, where="fuzz.json")
        assert all(isinstance(p, str) and p for p in problems)
        if base is not None and not problems:
            validate_data(m, where="fuzz.json")
    except ShardstreamError as e:
        assert str(e)
    assert time.perf_counter() - t0 < 2.0, "a single case took over 2 s"


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(SEED_TEXT) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_bytes(edits: list[tuple[int, int]]) -> None:
    b = bytearray(SEED_TEXT)
    for i, v in edits:
        b[i] = v
    _check(bytes(b))


@FUZZ
@given(st.integers(0, len(SEED_TEXT)))
def test_truncated(n: int) -> None:
    _check(SEED_TEXT[:n])


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=20)


def _replace(obj: Any, path: list[int], new: Any) -> Any:
    """Replace one node (chosen by ``path``) of the seed with an arbitrary JSON value."""
    if not path or not isinstance(obj, (dict, list)) or not obj:
        return new
    keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
    k = keys[path[0] % len(keys)]
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[k] = _replace(obj[k], path[1:], new)
    return out


@FUZZ
@given(st.lists(st.integers(0, 50), max_size=7), _json)
def test_structural_replacement(path: list[int], new: Any) -> None:
    _check(json.dumps(_replace(SEED, path, new), allow_nan=True).encode())


@FUZZ
@given(st.sampled_from(["shape", "sizes", "offsets"]), st.integers(-2**64, 2**64), st.integers(0, 1))
def test_huge_and_negative_numbers(field: str, value: int, dim: int) -> None:
    m = json.loads(SEED_TEXT)
    a = m["arrays"]["w"]
    if field == "shape":
        a["shape"][dim] = value
    else:
        a["chunks"][0]["region"][field][dim] = value
    _check(json.dumps(m).encode())


def test_overflowing_products() -> None:
    m = json.loads(SEED_TEXT)
    m["arrays"]["w"]["shape"] = [2**40, 2**40]
    m["arrays"]["w"]["chunks"][0]["region"]["sizes"] = [2**40, 2**40]
    with pytest.raises(ShardstreamError):
        raise ShardstreamError(problems=validate_manifest(loads_manifest(json.dumps(m))) or ["no problem found"])
    assert any("int64" in p for p in validate_manifest(loads_manifest(json.dumps(m))))


@pytest.mark.parametrize("depth", [100, 10_000, 200_000])
def test_deeply_nested(depth: int) -> None:
    _check(b'{"format": "shardstream.manifest", "format_version": 1, "world_size": 1, "arrays": '
           + b"[" * depth + b"]" * depth + b"}")
    _check(b"[" * depth)


def test_nan_and_infinity_rejected() -> None:
    for v in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(ShardstreamError):
            loads_manifest(b'{"format": "shardstream.manifest", "format_version": 1, "world_size": ' + v +
                           b', "arrays": {}}')


@pytest.mark.slow  # the scale tier
def test_a_million_arrays_is_fast_enough() -> None:
    """Many arrays (10^6 under scripts/fuzz.sh): parse + validate stays linear (seconds, not minutes)."""
    n = int(os.environ.get("SHARDSTREAM_FUZZ_BIG", "200000"))
    one = '{"shape":[2],"data_type":"uint8","chunks":[{"region":{"offsets":[0],"sizes":[2]},"holders":[0]}]}'
    text = ('{"format":"shardstream.manifest","format_version":1,"world_size":1,"arrays":{'
            + ",".join(f'"a{i}":{one}' for i in range(n)) + "}}")
    t0 = time.perf_counter()
    m = loads_manifest(text)
    assert len(m.arrays) == n
    assert validate_manifest(m, check_paths=False) == []
    assert time.perf_counter() - t0 < 120


def test_with_real_files(tmp_path: Path) -> None:
    """Mutated manifests pointing at real (and hostile) files: --data never crashes."""
    import numpy as np

    from formats.safetensors.io import save_tensors

    save_tensors(tmp_path / "rank-00000.safetensors", {"w": np.zeros((4, 3), np.uint16)})
    (tmp_path / "shared.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "evil").symlink_to("/etc/passwd")
    for text in (SEED_TEXT, SEED_TEXT.replace(b"shared.safetensors", b"evil"),
                 SEED_TEXT.replace(b"shared.safetensors", b"../x"), SEED_TEXT.replace(b"shared.safetensors", b"/dev/zero")):
        _check(text, tmp_path)
