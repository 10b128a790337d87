"""Delta refit over the loopback transport, every rank a thread: five versions with 0% to 100% of
the elements changed reach receivers byte for byte (uneven shards, an fp32 -> bf16 cast, a fused
local tensor, with and without intra-domain forwarding); a receiver with fresh buffers gets full
bytes; a byte flipped in a delta is caught by verify (exit 1) and healed by the next push."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import check_dest_tensors, empty_dest_tensors, lay_out, make_source_tensors, run_sessions

from formats.layouts import Mesh, Replicate, Shard
from formats.manifest.box import Box
from formats.manifest.wire import Chunk, Manifest, Source
from streamer.execute.delta import DeltaChecksumError
from streamer.ops.cast import cast_bytes
from streamer.refit.session import RefitSession, StepStats

# fp32 masters on the trainer; bf16 on the server except "e" (bf16 on both: no cast), "b", and an
# FP8 weight with its fp32 scales, quantized by the trainer (deltas are taken on bytes: any dtype)
SHAPES = {"w": (301, 96), "b": (97,), "q": (61, 64), "k": (61, 64), "e": (53, 40), "x8": (67, 32), "x8_scale": (67,)}
SRC_TYPES = {"w": "float32", "b": "float32", "q": "float32", "k": "float32", "e": "bfloat16",
             "x8": "float8_e4m3fn", "x8_scale": "float32"}
DST_TYPES = {**SRC_TYPES, "w": "bfloat16", "q": "bfloat16", "k": "bfloat16"}
FRACTIONS = (0.0, 0.001, 0.02, 0.5, 1.0)  # of the elements changed by versions 2..6
#: a link slow enough (GB/s) that every delta pays: threads on one host otherwise share memory,
#: where a delta session sends full bytes (test_shared_memory_sends_full_bytes)
SLOW_LINK = 0.001


def _fused_qk(fqn: str, region: Box, holders: tuple[int, ...]) -> list[Chunk]:
    """Server: q and k rows share one local tensor "qk" (k below q), as vLLM fuses qkv_proj."""
    if fqn not in ("q", "k"):
        return [Chunk(region, holders, None)]
    row = 0 if fqn == "q" else region.sizes[0]
    return [Chunk(region, holders, Source(tensor="qk", offsets=(row, 0)))]


def _manifests() -> tuple[Manifest, Manifest]:
    # trainer dp=2 x tp=2 (dp replicas: the planner splits regions across them); server tp=3
    # (301 and 61 rows and 97 elements split unevenly)
    src = lay_out({n: (s, SRC_TYPES[n]) for n, s in SHAPES.items()}, Mesh(("dp", "tp"), (2, 2)),
                  {"w": (Replicate(), Shard(0)), "b": (Replicate(), Shard(0)), "q": (Replicate(), Shard(1)),
                   "k": (Replicate(), Shard(0)), "e": (Replicate(), Shard(1)), "x8": (Replicate(), Shard(0)),
                   "x8_scale": (Replicate(), Shard(0))})
    dst = lay_out({n: (s, DST_TYPES[n]) for n, s in SHAPES.items()}, Mesh(("tp",), (3,)),
                  {"w": (Shard(1),), "b": (Shard(0),), "q": (Shard(0),), "k": (Shard(0),), "e": (Shard(0),),
                   "x8": (Shard(0),), "x8_scale": (Shard(0),)},
                  make_chunks=_fused_qk)
    return src, dst


def _versions(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Global source arrays for version 1, then one per fraction of changed elements."""
    rng = np.random.default_rng(seed)

    def fresh(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if SRC_TYPES[name] == "float8_e4m3fn":
            return rng.integers(0, 0x7F, shape, dtype=np.uint8)  # finite e4m3 bytes
        x = rng.standard_normal(shape).astype(np.float32)
        return x if SRC_TYPES[name] == "float32" else _bf16(x)

    out = [{name: fresh(name, s) for name, s in SHAPES.items()}]
    for f in FRACTIONS[:n - 1]:
        cur = {name: a.copy() for name, a in out[-1].items()}
        for name, a in cur.items():
            flat = a.reshape(-1)
            idx = rng.choice(flat.size, int(round(f * flat.size)), replace=False)
            flat[idx] = fresh(name, (idx.size,))
        out.append(cur)
    return out


def _bf16(x: np.ndarray) -> np.ndarray:
    return cast_bytes(x.reshape(-1).view(np.uint8), "float32", "bfloat16").view("<u2").reshape(x.shape)


def _want(full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a full push leaves on the server: each array in its destination type."""
    return {n: _bf16(a) if (SRC_TYPES[n], DST_TYPES[n]) == ("float32", "bfloat16") else a for n, a in full.items()}


def _run(src: Manifest, dst: Manifest, act: Callable[[RefitSession, int], Any],
         corrupt: Callable[[int, int, int, bytearray], None] | None = None,
         **options: Any) -> dict[int, Any]:
    options.setdefault("link_gbps", SLOW_LINK)
    results, errors = run_sessions(src, dst, act, join_timeout=60, corrupt=corrupt, **options)
    assert not errors, {g: repr(e) for g, e in errors.items()}
    return results


Step = tuple[StepStats | BaseException, dict[str, np.ndarray]]


def _pushes(src: Manifest, dst: Manifest, versions: list[dict[str, np.ndarray]],
            before_pull: Callable[[RefitSession, int, int, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
            ) -> Callable[[RefitSession, int], list[Step]]:
    """Push every version; receivers keep a copy of their tensors after each pull. A failed push
    is recorded (its error in place of the stats) and the next one runs."""
    srcs = [make_source_tensors(src, v) for v in versions]
    dsts = empty_dest_tensors(dst)

    def act(s: RefitSession, r: int) -> list[Step]:
        out: list[Step] = []
        for v in range(len(versions)):
            try:
                if s.role == "send":
                    st: StepStats | BaseException = s.push(srcs[v][r])
                else:
                    if before_pull is not None:
                        dsts[r] = before_pull(s, v, r, dsts[r])
                    st = s.pull(dsts[r])
            except DeltaChecksumError as e:
                st = e
            out.append((st, {n: a.copy() for n, a in dsts.get(r, {}).items()} if s.role == "recv" else {}))
        return out
    return act


def _check_each_version(dst: Manifest, versions: list[dict[str, np.ndarray]], results: dict[int, list[Step]],
                        S: int) -> None:
    for v, full in enumerate(versions):
        got = {g - S: results[g][v][1] for g in results if g >= S}
        bad = check_dest_tensors(dst, got, _want(full))
        assert bad == [], f"version {v + 1}: {bad[:5]}"


@pytest.mark.parametrize("dds", [None, 3])
def test_five_versions_byte_exact_and_small(dds: int | None) -> None:
    src, dst = _manifests()
    versions = _versions(1 + len(FRACTIONS))
    results = _run(src, dst, _pushes(src, dst, versions), delta=True, verify=True, bucket_size=64 << 10,
                   dst_domain_size=dds)
    S = src.world_size
    _check_each_version(dst, versions, results, S)
    steps = {g: [st for st, _ in r] for g, r in results.items()}
    assert all(isinstance(st, StepStats) for ss in steps.values() for st in ss)
    wire = [sum(ss[v].bytes_sent for ss in steps.values()) for v in range(len(versions))]
    full = [sum(ss[v].full_bytes_sent for ss in steps.values()) for v in range(len(versions))]
    assert [ss[v].version for ss in steps.values() for v in range(len(versions))] == \
        [v + 1 for _ in steps for v in range(len(versions))]
    assert wire[0] == full[0] and full[0] > 0  # the first push of a session is full
    assert full.count(full[0]) == len(full)  # the same messages every push
    by_fraction = dict(zip(FRACTIONS, wire[1:]))
    assert by_fraction[0.0] <= 32 * sum(ss[1].messages for ss in steps.values())  # headers only
    assert by_fraction[0.02] <= 0.10 * full[0], (by_fraction, full[0])
    assert by_fraction[0.001] < by_fraction[0.02] < by_fraction[0.5] <= by_fraction[1.0] <= full[0] + 32 * 200
    # the senders measured what changed and kept their last-sent bytes
    send = [steps[g] for g in range(S)]
    changed = sum(ss[3].changed_fraction or 0 for ss in send) / S
    assert 0.01 < changed < 0.03, changed
    assert all(ss[0].changed_fraction is None and ss[1].changed_fraction == 0.0 for ss in send)
    assert sum(ss[-1].base_bytes for ss in send) == full[0] - (
        sum(steps[g][0].full_bytes_sent for g in steps if g >= S))  # forwarders keep theirs too
    assert all(ss[v].verify_seconds > 0 for ss in steps.values() for v in range(len(versions)))
    recv = [steps[g] for g in steps if g >= S]
    assert all(st.decode_seconds > 0 for ss in recv for st in ss[2:])


@pytest.mark.parametrize("link", [None, 50.0])
def test_shared_memory_sends_full_bytes(link: float | None) -> None:
    """Threads of one host share memory (or a fast link is stated): encoding would lose to the
    wire, so a delta session moves full bytes in place, keeps no base and encodes nothing, and
    the receivers are exact at every version."""
    src, dst = _manifests()
    versions = _versions(4, seed=2)
    results = _run(src, dst, _pushes(src, dst, versions), delta=True, verify=True, bucket_size=64 << 10,
                   link_gbps=link)
    _check_each_version(dst, versions, results, src.world_size)
    steps = [st for r in results.values() for st, _ in r]
    assert all(isinstance(st, StepStats) for st in steps)
    assert all(st.bytes_sent == st.full_bytes_sent and st.bytes_received == st.full_bytes_received
               and st.encodings == {} and st.base_bytes == 0 and st.encode_seconds == 0 for st in steps
               if isinstance(st, StepStats))


def test_a_link_between_break_evens_sends_raw_where_the_codec_loses() -> None:
    """At 0.2 GB/s a message with 2% of its elements changed is worth encoding, one with all of
    them changed is not: it goes raw without trying the codec, and every version lands exact."""
    src, dst = _manifests()
    versions = _versions(1 + len(FRACTIONS))
    results = _run(src, dst, _pushes(src, dst, versions), delta=True, bucket_size=64 << 10, link_gbps=0.2)
    _check_each_version(dst, versions, results, src.world_size)
    sent = [[st for st, _ in results[g]] for g in range(src.world_size)]
    by_fraction = {f: {k: sum(ss[v + 1].encodings.get(k, 0) for ss in sent) for k in ("zstd", "sparse", "raw")}
                   for v, f in enumerate(FRACTIONS)}
    assert by_fraction[0.02]["zstd"] + by_fraction[0.02]["sparse"] > 0 and by_fraction[0.02]["raw"] == 0, by_fraction
    assert by_fraction[1.0]["raw"] > 0 and by_fraction[1.0]["zstd"] == by_fraction[1.0]["sparse"] == 0, by_fraction


@pytest.mark.parametrize("how", ["fresh buffers", "forget_base"])
def test_restarted_receiver_gets_a_full_push(how: str) -> None:
    src, dst = _manifests()
    versions = _versions(4, seed=1)
    victim = 1

    def restart(s: RefitSession, v: int, r: int, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # receiver 1 restarts before version 3: new zeroed buffers, or its own zeroed and said so
        if (v, r) != (2, victim):
            return tensors
        if how == "fresh buffers":
            return empty_dest_tensors(dst)[r]
        for a in tensors.values():
            a[...] = 0
        s.forget_base()
        return tensors

    results = _run(src, dst, _pushes(src, dst, versions, restart), delta=True, bucket_size=64 << 10)
    S = src.world_size
    _check_each_version(dst, versions, results, S)
    st3 = {g: results[g][2][0] for g in results}
    assert st3[S + victim].bytes_received == st3[S + victim].full_bytes_received  # full bytes, no headers
    others = [st3[g] for g in results if g >= S and g != S + victim]
    assert all(st.bytes_received < st.full_bytes_received for st in others)
    st4 = results[S + victim][3][0]
    assert st4.bytes_received < st4.full_bytes_received  # back in step: deltas again


def test_without_delta_nothing_is_kept_or_encoded() -> None:
    src, dst = _manifests()
    versions = _versions(3, seed=2)
    results = _run(src, dst, _pushes(src, dst, versions), bucket_size=64 << 10)
    S = src.world_size
    _check_each_version(dst, versions, results, S)
    for g, r in results.items():
        for i, (st, _) in enumerate(r):  # every session numbers its pushes
            assert st.version == i + 1 and st.base_bytes == 0 and st.encodings == {}
            assert (st.bytes_sent, st.bytes_received) == (st.full_bytes_sent, st.full_bytes_received)


def test_flipped_byte_in_a_delta_is_caught_by_verify_and_healed() -> None:
    src, dst = _manifests()
    versions = _versions(4, seed=3)
    S = src.world_size
    hits: list[tuple[int, int]] = []

    def corrupt(s: int, d: int, tag: int, data: bytearray) -> None:
        if not hits and tag >= 4096 and len(data) > 40:  # the first real delta payload (version 2)
            # its first byte (a Zstd frame's magic, a sparse position): a byte inside a Zstd frame may
            # move a match within a run of zeros of the XOR and decode to the same bytes
            data[0] ^= 0x10
            hits.append((s, d))

    results = _run(src, dst, _pushes(src, dst, versions), corrupt=corrupt, delta=True, verify=True,
                   bucket_size=64 << 10)
    assert hits
    s, d = hits[0]
    failed = [v for v, (st, _) in enumerate(results[d]) if isinstance(st, BaseException)]
    assert len(failed) == 1, failed  # version 3: version 2 changed nothing, its deltas were headers
    v = failed[0]
    err = results[d][v][0]
    assert isinstance(err, DeltaChecksumError) and err.exit_code == 1, err
    # named: array, region, receiving and sending rank
    assert err.problems and all(": region " in p and f"by rank {d} from rank {s}" in p for p in err.problems), \
        err.problems
    assert all(not isinstance(st, BaseException) for g in results if g != d for st, _ in results[g])
    # the next push sends that receiver full bytes and every receiver is exact again
    st = results[d][v + 1][0]
    assert isinstance(st, StepStats) and st.bytes_received == st.full_bytes_received
    got = {g - S: results[g][v + 1][1] for g in results if g >= S}
    assert check_dest_tensors(dst, got, _want(versions[v + 1])) == []


def test_delta_with_the_broadcast_baseline_is_refused_everywhere() -> None:
    from formats.errors import UsageError

    src, dst = _manifests()
    S, D = src.world_size, dst.world_size
    # one side asks for delta, the other for the baseline: they agree on both, then refuse
    _, errors = run_sessions(src, dst, lambda s, r: None, options_of=lambda role: {"delta": role == "send"},
                             strategy="broadcast")
    assert sorted(errors) == list(range(S + D))
    assert all(isinstance(e, UsageError) and "--strategy reshard" in str(e) for e in errors.values()), errors


def test_a_delta_over_another_base_is_never_applied() -> None:
    """A header whose base version is not the receiver's (here altered in flight) is refused by
    the receiver: its regions are named and keep their bytes until the next, full, push."""
    src, dst = _manifests()
    versions = _versions(3, seed=4)
    hits: list[tuple[int, int]] = []

    def corrupt(s: int, d: int, tag: int, data: bytearray) -> None:
        if not hits and tag in (17, 18):  # a delta header: base version is the 4th uint64
            data[24] ^= 0x04
            hits.append((s, d))

    results = _run(src, dst, _pushes(src, dst, versions), corrupt=corrupt, delta=True, bucket_size=64 << 10)
    s, d = hits[0]
    err = results[d][1][0]
    assert isinstance(err, DeltaChecksumError), err
    assert all(f"from rank {s}: the delta carries version 2 over base 5, expected 2 over 1" in p
               for p in err.problems), err.problems
    st = results[d][2][0]
    assert isinstance(st, StepStats) and st.bytes_received == st.full_bytes_received
    got = {g - src.world_size: results[g][2][1] for g in results if g >= src.world_size}
    assert check_dest_tensors(dst, got, _want(versions[2])) == []
