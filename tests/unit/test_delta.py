"""The delta codec: every encoding round-trips, the data picks the smallest, and a payload that
cannot be what a sender encoded is an error, not a wrong write."""

from __future__ import annotations

import numpy as np
import pytest
from numcodecs import Zstd

from streamer.execute.delta import ENCODINGS, decode_into, encode


def _roundtrip(old: np.ndarray, new: np.ndarray) -> tuple[str, int]:
    x = old ^ new
    buf = new.copy()
    enc, n = encode(x, buf)
    got = old.copy()
    if ENCODINGS[enc] == "raw":
        got[:] = buf[:n]
    elif ENCODINGS[enc] != "same":
        y = np.empty_like(x)
        decode_into(enc, buf[:n].copy(), y)
        got ^= y
    assert got.tobytes() == new.tobytes()
    return ENCODINGS[enc], n


@pytest.mark.parametrize(("changed", "want"), [(0, "same"), (3, "sparse"), (2000, "zstd"), (60000, "raw")])
def test_each_encoding_roundtrips_and_is_chosen_by_the_data(changed: int, want: str) -> None:
    rng = np.random.default_rng(changed)
    old = rng.integers(0, 256, 60000, dtype=np.uint8)
    new = old.copy()
    idx = rng.choice(old.size, changed, replace=False)
    new[idx] ^= rng.integers(1, 256, changed, dtype=np.uint8)  # every chosen byte really changes
    enc, n = _roundtrip(old, new)
    assert enc == want, (enc, n)
    assert n <= old.size
    if want == "sparse":
        assert n == 5 * changed


def test_zero_runs_compress_far_below_sparse() -> None:
    old = np.zeros(1 << 20, dtype=np.uint8)
    new = old.copy()
    new[::97] = 1  # 1% of the bytes, regularly spaced: Zstd finds the pattern
    enc, n = _roundtrip(old, new)
    assert enc == "zstd" and n < 0.01 * new.size


def test_malformed_payloads_raise() -> None:
    out = np.empty(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="not whole"):
        decode_into(ENCODINGS.index("sparse"), np.zeros(7, dtype=np.uint8), out)
    bad = np.array([99, 0, 0, 0, 1], dtype=np.uint8)  # position 99 of a 10-byte message
    with pytest.raises(ValueError, match="names byte 99"):
        decode_into(ENCODINGS.index("sparse"), bad, out)
    with pytest.raises(ValueError):
        decode_into(ENCODINGS.index("zstd"), np.arange(20, dtype=np.uint8), out)
    short = np.frombuffer(Zstd(1).encode(np.ones(5, dtype=np.uint8)), dtype=np.uint8)
    with pytest.raises(ValueError, match="5 bytes for a 10-byte message"):
        decode_into(ENCODINGS.index("zstd"), short, out)
