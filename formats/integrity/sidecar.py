"""Chunk checksums of a compact (v2) manifest, in a binary sidecar file.

A v1 manifest gives ``source.checksum`` per chunk: at DeepSeek-V3 scale 1.4M JSON entries, 250 MB.
A v2 manifest keeps them in a file beside it instead: one little-endian uint64 per chunk, each
checksummed array's values in its expansion (region) order from the index its entry gives
(``{"layout": "L3", "checksums": 1234}``). The manifest names the file once::

    "checksums": {"file": "manifest.checksums", "algorithm": "xxh64", "count": 1437667,
                  "sha256": "9f2c..."}

The file is read lazily, once, and checked against its size and sha256: only expanding a
checksummed array (``validate --data``, ``convert --resume``) reads it. Checksums whose text is
not the canonical form of their value (``xxh64:`` + 16 hex digits, ``crc32c:`` + 8) stay as
explicit chunks, so a round trip never changes a string.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ManifestError

__all__ = ["ALGORITHMS", "ChecksumTable", "ChecksumWriter", "sidecar_name"]

#: algorithm -> hex digits of its canonical text
ALGORITHMS = {"xxh64": 16, "crc32c": 8}
_TABLE_KEYS = {"file", "algorithm", "count", "sha256"}


def sidecar_name(manifest_name: str) -> str:
    """The sidecar of ``manifest.json``: ``manifest.checksums``."""
    stem = manifest_name[:-5] if manifest_name.endswith(".json") else manifest_name
    return stem + ".checksums"


def _value(text: str, algorithm: str) -> int | None:
    """The value of a canonical ``algorithm:hex`` checksum, else None."""
    algo, sep, hexpart = text.partition(":")
    width = ALGORITHMS.get(algo)
    if not sep or algo != algorithm or width is None or len(hexpart) != width:
        return None
    if any(c not in "0123456789abcdef" for c in hexpart):
        return None
    return int(hexpart, 16)


class ChecksumTable:
    """The sidecar a parsed manifest names (``base_dir``: where the manifest lies; None when it
    was parsed from text, and then its checksums cannot be read)."""

    def __init__(self, file: str, algorithm: str, count: int, sha256: str, base_dir: Path | None,
                 where: str) -> None:
        self.file, self.algorithm, self.count, self.sha256 = file, algorithm, count, sha256
        self.base_dir, self.where = base_dir, where
        self._values: np.ndarray | None = None

    @staticmethod
    def parse(p: Any, v: object, base_dir: Path | None, where: str) -> ChecksumTable | None:
        """The top-level ``checksums`` object (problems reported through ``p``)."""
        if not isinstance(v, dict):
            p.bad("", f"checksums must be an object {{file, algorithm, count, sha256}}, got {v!r}"[:200])
            return None
        p.keys(v, _TABLE_KEYS, "checksums")
        file, algo, count, digest = v.get("file"), v.get("algorithm"), v.get("count"), v.get("sha256")
        ok = True
        if not isinstance(file, str) or not file or "/" in file or "\\" in file or file in (".", ".."):
            p.bad("checksums", f"file must be a file name beside the manifest, got {file!r}")
            ok = False
        if algo not in ALGORITHMS:
            p.bad("checksums", f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
            ok = False
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            p.bad("checksums", f"count must be a non-negative integer, got {count!r}")
            ok = False
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            p.bad("checksums", f"sha256 must be 64 lowercase hex digits, got {digest!r}"[:200])
            ok = False
        if not ok:
            return None
        assert isinstance(file, str) and isinstance(algo, str) and isinstance(count, int) and isinstance(digest, str)
        return ChecksumTable(file, algo, count, digest, base_dir, where)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "algorithm": self.algorithm, "count": self.count, "sha256": self.sha256}

    def problems(self) -> list[str]:
        """What is wrong with the sidecar file (empty: present, right size and digest)."""
        try:
            self._load()
        except ManifestError as e:
            return list(e.problems)
        return []

    def texts(self, start: int, n: int) -> list[str]:
        """The checksums of ``n`` chunks from index ``start``, as ``source.checksum`` text."""
        vals = self._load()[start:start + n].tolist()
        width = ALGORITHMS[self.algorithm]
        return [f"{self.algorithm}:{v:0{width}x}" for v in vals]

    def _load(self) -> np.ndarray:
        if self._values is not None:
            return self._values
        if self.base_dir is None:
            raise ManifestError(f"{self.where}: the chunk checksums are in the sidecar file {self.file!r}, which "
                                "cannot be read here (the manifest was parsed from text, not loaded from its "
                                "directory)")
        path = self.base_dir / self.file
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ManifestError(f"{path}: cannot read the checksum sidecar the manifest names "
                                f"({e.strerror or e})") from e
        if len(data) != 8 * self.count:
            raise ManifestError(f"{path}: checksum sidecar has {len(data)} bytes, the manifest says {self.count} "
                                f"checksums ({8 * self.count} bytes)")
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ManifestError(f"{path}: checksum sidecar does not match the sha256 the manifest gives "
                                "(changed or corrupt)")
        self._values = np.frombuffer(data, dtype="<u8")
        return self._values


class ChecksumWriter:
    """Collects checksums while a v2 manifest is written; ``data`` is the sidecar's bytes."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.algorithm: str | None = None
        self._values: list[int] = []

    def add(self, texts: Sequence[str]) -> int | None:
        """Append one array's checksums; their first index, or None when one is not canonical or
        uses another algorithm than the ones already taken (the array then stays explicit)."""
        algo = self.algorithm or texts[0].partition(":")[0]
        vals = [_value(t, algo) for t in texts]
        if any(v is None for v in vals):
            return None
        self.algorithm = algo
        start = len(self._values)
        self._values.extend(v for v in vals if v is not None)
        return start

    def __bool__(self) -> bool:
        return bool(self._values)

    def data(self) -> bytes:
        return np.array(self._values, dtype="<u8").tobytes()

    def table_dict(self) -> dict[str, Any]:
        return {"file": self.file, "algorithm": self.algorithm, "count": len(self._values),
                "sha256": hashlib.sha256(self.data()).hexdigest()}
