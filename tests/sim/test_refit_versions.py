"""Push versions over the loopback transport (every rank a thread): ``push(version=N)`` numbers a
push, later pushes count up from the last, every rank's ``StepStats.version`` and a receiver's
``version`` say what it holds; a version that does not follow, or differs across sender ranks,
is refused on every rank; a delta push whose header arrives wrong applies nothing (staged)."""

from __future__ import annotations

from typing import Any

import numpy as np
from helpers import check_dest_tensors, empty_dest_tensors, lay_out, make_source_tensors, run_sessions

from formats.layouts import Mesh, Shard
from streamer.execute.delta import DeltaChecksumError
from streamer.refit.session import RefitSession, RefusedError

SHAPES = {"w": (64, 48), "v": (40, 32)}


def _pair() -> tuple[Any, Any]:
    arrays = {n: (s, "float32") for n, s in SHAPES.items()}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {n: (Shard(0),) for n in SHAPES})
    dst = lay_out(arrays, Mesh(("tp",), (3,)), {n: (Shard(1),) for n in SHAPES})
    return src, dst


def _full(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def test_versions_named_counted_and_refused() -> None:
    src, dst = _pair()
    fulls = [_full(i) for i in range(4)]
    srcs = [make_source_tensors(src, f) for f in fulls]
    dsts = empty_dest_tensors(dst)

    def act(s: RefitSession, r: int) -> list[Any]:
        out: list[Any] = [s.version]
        plan = [(0, 10), (1, 20), (2, None), (3, 21)]  # the last repeats 21: refused everywhere
        for i, v in plan:
            try:
                st = s.push(srcs[i][r], version=v) if s.role == "send" else s.pull(dsts[r])
                assert st is not None
                out.append((st.version, s.version))
            except RefusedError as e:
                out.append(str(e))
        if s.role == "send":  # unequal versions across sender ranks: refused too
            try:
                s.push(srcs[3][r], version=30 + r)
            except RefusedError as e:
                out.append(str(e))
        else:
            try:
                s.pull(dsts[r])
            except RefusedError as e:
                out.append(str(e))
        return out

    results, errors = run_sessions(src, dst, act, join_timeout=60)
    assert not errors, errors
    S = src.world_size
    for g, out in results.items():
        assert out[0] is None  # nothing pushed yet
        assert out[1:4] == [(10, 10), (20, 20), (21, 21)], (g, out)
        assert "push(version=21) does not follow this session's last version 21" in out[4], out[4]
        assert "the sender ranks pushed different versions [30, 31]" in out[5], out[5]
    got = {g - S: dsts[g - S] for g in results if g >= S}
    assert check_dest_tensors(dst, got, fulls[2]) == []  # the refused pushes changed nothing


def test_a_delta_push_with_a_bad_header_applies_nothing() -> None:
    """Every delta message but one arrives intact; the one's header says another base: the
    receiver applies none of them (they were staged), and says it holds no known version."""
    src, dst = _pair()
    v1 = _full(0)
    v2 = {n: a.copy() for n, a in v1.items()}
    for a in v2.values():
        a.reshape(-1)[::7] += 1.0
    srcs = [make_source_tensors(src, f) for f in (v1, v2)]
    dsts = empty_dest_tensors(dst)
    hits: list[int] = []

    def corrupt(s: int, d: int, tag: int, data: bytearray) -> None:
        if 16 <= tag < 32 and not hits and d == src.world_size:  # a delta header to receiver 0
            data[24] ^= 0x01  # its base version
            hits.append(d)

    def act(s: RefitSession, r: int) -> list[Any]:
        out: list[Any] = []
        for i in range(2):
            try:
                st = s.push(srcs[i][r]) if s.role == "send" else s.pull(dsts[r])
                out.append(st.version if st is not None else None)
            except DeltaChecksumError as e:
                out.append(e)
        out.append(s.version)
        return out

    results, errors = run_sessions(src, dst, act, join_timeout=60, corrupt=corrupt, delta=True,
                                   bucket_size=1 << 10, link_gbps=0.001)  # a slow link: deltas encoded
    assert not errors, errors
    assert hits
    S = src.world_size
    r0 = results[S]
    assert r0[0] == 1 and isinstance(r0[1], DeltaChecksumError) and r0[2] is None, r0
    assert "carries version 2 over base 0, expected 2 over 1" in str(r0[1].problems), r0[1].problems
    # receiver 0 still holds version 1 exactly: none of the other, intact deltas was applied
    assert _holds(dst, dsts[0], 0, v1)
    for g in results:
        if g > S:
            assert results[g] == [1, 2, 2], results[g]


def _holds(dst: Any, local: dict[str, np.ndarray], rank: int, full: dict[str, np.ndarray]) -> bool:
    """Whether ``rank``'s local tensors hold ``full`` exactly."""
    for fqn, _, c in dst.iter_chunks():
        if rank in c.holders:
            sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
            dl = tuple(slice(o, o + s) for o, s in zip(c.local_box.offsets, c.local_box.sizes))
            if local[c.tensor(fqn)][dl].tobytes() != np.ascontiguousarray(full[fqn][sl]).tobytes():
                return False
    return True


def _broken_second_push(**options: Any) -> tuple[dict[int, Any], dict[int, BaseException], Any, Any, Any]:
    """A delta session whose second push breaks off: sender 1 fails on its first message to receiver
    0. Returns the results (each receiver's ``version`` after the failed pull), the errors, the
    layout, the receivers' tensors and version 1's values."""
    src, dst = _pair()
    v1 = _full(0)
    v2 = {n: a + 1.0 for n, a in v1.items()}
    srcs = [make_source_tensors(src, f) for f in (v1, v2)]
    dsts = empty_dest_tensors(dst)
    armed: set[int] = set()

    def corrupt(s: int, d: int, tag: int, data: bytearray) -> None:
        if s == 1 and s in armed and d == src.world_size:
            raise RuntimeError("the wire broke")

    def act(s: RefitSession, r: int) -> Any:
        if s.role == "send":
            s.push(srcs[0][r])
            armed.add(r)
            try:
                s.push(srcs[1][r])
            except Exception:  # noqa: BLE001 - the push that breaks off
                pass
            return None
        s.pull(dsts[r])
        try:
            s.pull(dsts[r])
        except Exception:  # noqa: BLE001 - the push that breaks off
            pass
        return s.version

    # the ranks the broken wire leaves waiting wait out the sessions' timeout: a short one
    results, errors = run_sessions(src, dst, act, join_timeout=60, timeout=3, corrupt=corrupt, delta=True, **options)
    return results, errors, dst, dsts, v1


def test_a_broken_delta_push_over_shared_memory_claims_no_version() -> None:
    """On one host a delta session moves full bytes in place (a copy beats the codec), so a push
    that breaks off may leave a receiver partly written: it must then claim no version."""
    results, _, _, _, _ = _broken_second_push()
    S = 2
    assert results[S] is None, results


def test_a_broken_delta_push_over_a_slow_link_keeps_the_last_version() -> None:
    """Over a slow link the deltas are staged: the receiver keeps version 1, byte for byte."""
    results, _, dst, dsts, v1 = _broken_second_push(link_gbps=0.001)
    S = 2
    assert results[S] == 1, results
    assert _holds(dst, dsts[0], 0, v1)


def test_the_same_memory_laid_out_otherwise_is_refused_not_read_as_before() -> None:
    """A sender hands the transpose of the square array it pushed before: the same address,
    shape and dtype, other strides. The push is refused on every rank (local tensors must be
    contiguous), not packed through the previous push's views (which would send the untransposed
    bytes); the next push of contiguous memory goes through."""
    arrays = {"w": ((8, 8), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (1,)), {"w": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    full = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    srcs = make_source_tensors(src, full)
    dsts = empty_dest_tensors(dst)

    def act(s: RefitSession, r: int) -> list[Any]:
        out: list[Any] = []
        for turn in range(3):
            try:
                if s.role == "send":  # the second push: the transpose of the same memory
                    st = s.push(srcs[r] if turn != 1 else {n: a.T for n, a in srcs[r].items()})
                else:
                    st = s.pull(dsts[r])
                assert st is not None
                out.append(st.version)
            except RefusedError as e:
                out.append(str(e))
        return out

    results, errors = run_sessions(src, dst, act, join_timeout=60)
    assert not errors, errors
    for g, out in results.items():
        assert out[0] == 1 and out[2] == 2, (g, out)
        assert "local tensor 'w' is not contiguous" in out[1], (g, out)
    assert check_dest_tensors(dst, dsts, full) == []
