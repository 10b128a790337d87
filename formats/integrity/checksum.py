"""Streaming region checksums (``xxh64:<hex>`` / ``crc32c:<hex>``) over row-major bytes."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Hasher", "new_hasher", "DEFAULT_ALGO"]

DEFAULT_ALGO = "xxh64"


class Hasher(Protocol):
    def update(self, data: Any) -> None: ...
    def result(self) -> str: ...


class _Xxh64:
    def __init__(self) -> None:
        import xxhash

        self._h = xxhash.xxh64()

    def update(self, data: Any) -> None:
        self._h.update(memoryview(data).cast("B") if not isinstance(data, bytes) else data)

    def result(self) -> str:
        return "xxh64:" + self._h.hexdigest()


class _Crc32c:
    def __init__(self) -> None:
        import crc32c  # optional dependency

        self._mod = crc32c
        self._v = 0

    def update(self, data: Any) -> None:
        self._v = self._mod.crc32c(memoryview(data).cast("B"), self._v)

    def result(self) -> str:
        return f"crc32c:{self._v:08x}"


def new_hasher(spec: str = DEFAULT_ALGO) -> Hasher:
    """A hasher for ``spec`` (an algorithm name or a full ``algo:hex`` checksum string)."""
    algo = spec.partition(":")[0]
    if algo == "xxh64":
        return _Xxh64()
    if algo == "crc32c":
        return _Crc32c()
    raise ValueError(f"unknown checksum algorithm {algo!r}")
