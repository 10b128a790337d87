"""The delta codec on several threads: framed Zstd round-trips on any thread count, a damaged
frame table is an error, threaded scans count what a single thread counts, and the thread pool
runs no more pieces at once than it was asked for."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from streamer.execute.codec import ENV, FRAME, codec_threads, pmap
from streamer.execute.delta import ENCODINGS, decode_into, encode, xor_scan


def _message(n: int, frac: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n, dtype=np.uint8)
    new = old.copy()
    hit = rng.random(n // 2) < frac
    new.view(np.uint16)[hit] ^= rng.integers(1, 8, int(hit.sum()), dtype=np.uint16)
    return old, new


@pytest.mark.parametrize("threads", [1, 3])
def test_a_message_of_several_frames_round_trips_on_any_thread_count(threads: int) -> None:
    old, new = _message(3 * FRAME + 1234, 0.05)
    x = old ^ new
    buf = new.copy()
    enc, n = encode(x, buf, threads=threads)
    assert ENCODINGS[enc] == "zstd-frames" and n < 0.2 * new.size
    for dec_threads in (1, 4):  # the receiver's thread count is its own
        y = np.empty_like(x)
        decode_into(enc, buf[:n].copy(), y, dec_threads)
        assert (old ^ y).tobytes() == new.tobytes()


def test_a_damaged_frame_table_is_refused_by_what_it_says() -> None:
    old, new = _message(2 * FRAME + 10, 0.05)
    x = old ^ new
    buf = new.copy()
    enc, n = encode(x, buf)
    good = buf[:n].copy()
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="no frame table"):
        decode_into(enc, good[:8], out)
    wrong_count = good.copy()
    wrong_count[:8] = np.array([7], dtype=np.uint64).view(np.uint8)
    with pytest.raises(ValueError, match="announces 7 frames"):
        decode_into(enc, wrong_count, out)
    with pytest.raises(ValueError, match="add up to"):
        decode_into(enc, good[:-1], out)
    for_smaller = np.empty(FRAME, dtype=np.uint8)  # a payload for another message size
    with pytest.raises(ValueError, match="announces 3 frames"):
        decode_into(enc, good, for_smaller)
    torn = good.copy()
    torn[40:60] ^= 0xFF  # inside the first frame
    with pytest.raises(ValueError):
        decode_into(enc, torn, out)


def test_threaded_scans_count_and_copy_what_one_thread_does() -> None:
    old, new = _message(2 * FRAME + 6, 0.3, seed=4)
    sizes = [(FRAME + 2, 2), (FRAME + 4, 4)]
    got = []
    for threads in (1, 3):
        base, x = old.copy(), np.empty_like(old)
        got.append(xor_scan(new, base, x, sizes, threads))
        assert base.tobytes() == new.tobytes() and x.tobytes() == (old ^ new).tobytes()
    assert got[0] == got[1] and got[0][1] == int(np.count_nonzero(old ^ new))


def test_pmap_keeps_order_raises_the_first_error_and_runs_at_most_its_threads() -> None:
    running, peak, lock = [0], [0], threading.Lock()

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return i * i

    assert pmap(work, list(range(12)), 3) == [i * i for i in range(12)]
    assert 1 < peak[0] <= 3
    peak[0] = 0
    pmap(work, list(range(6)), 8)  # a pool grown earlier: still at most what is asked
    assert peak[0] <= 6

    def bad(i: int) -> int:
        if i == 5:
            raise ValueError("piece 5")
        return i

    with pytest.raises(ValueError, match="piece 5"):
        pmap(bad, list(range(9)), 2)


def test_codec_threads_share_the_cores_and_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert codec_threads() == 16 and codec_threads(8) == 2 and codec_threads(32) == 1
    monkeypatch.setenv(ENV, "3")
    assert codec_threads(8) == 3
    for bad in ("0", "many"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(Exception, match=ENV):
            codec_threads()


def test_a_jobs_ranks_on_one_host_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamer.execute.codec import job_threads

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    hosts = ("a", "a", "a", "a", "b", "b", "a")  # 4 senders on host a; receivers: 2 on b, 1 on a
    assert [job_threads(hosts, r, 4) for r in range(7)] == [4, 4, 4, 4, 8, 8, 16]
    assert job_threads((), 0, 1) == 16
