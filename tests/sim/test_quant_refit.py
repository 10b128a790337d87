"""Quantize on refit over loopback sessions (every rank a thread): bf16/fp32 trainer arrays into
FP8 server tensors with their scales, on the senders (trainer shards of whole blocks) or on the
receivers (a trainer shard boundary cuts a block), bit-identical to the torch references written
from the definitions (tests/quant_reference.py), in place."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from helpers import n_examples, run_sessions
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_reference import ref_block_fp8, ref_mxfp8

from formats.errors import PlanError
from formats.manifest.box import Box
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source
from streamer.refit.session import RefitSession, StepStats

torch = pytest.importorskip("torch")

#: rows of one array per rank: (row start, row stop, holders); columns whole
Rows = Sequence[tuple[int, int, tuple[int, ...]]]


def _manifest(world: int, arrays: Mapping[str, tuple[tuple[int, ...], str, Rows]],
              tensors: Mapping[str, str] | None = None) -> Manifest:
    """A live manifest cutting each array by rows, each chunk at its own rows of a local tensor
    the array's size (a rank may hold several); ``tensors`` puts arrays in a named local tensor
    instead (their chunks stacked in the order given, as a fused ``qkv_proj``)."""
    out: dict[str, ArraySpec] = {}
    at: dict[tuple[int, str], int] = {}  # next free row of a fused local tensor on a rank
    for fqn, (shape, dt, rows) in arrays.items():
        chunks = []
        name = (tensors or {}).get(fqn)
        for lo, hi, holders in rows:
            src = Source(offsets=(lo,) + (0,) * (len(shape) - 1))
            if name is not None:
                off = at.get((holders[0], name), 0)
                for h in holders:
                    at[(h, name)] = off + hi - lo
                src = Source(tensor=name, offsets=(off,) + (0,) * (len(shape) - 1))
            chunks.append(Chunk(Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:]), holders, src))
        out[fqn] = ArraySpec(shape, dt, tuple(chunks))
    return Manifest(world_size=world, arrays=out)


def _even(n: int, k: int, ranks: Sequence[tuple[int, ...]] | None = None) -> list[tuple[int, int, tuple[int, ...]]]:
    """``n`` rows in ``k`` torch.chunk pieces, piece i on ``ranks[i]`` (default rank i)."""
    step = -(-n // k)
    return [(i * step, min(n, (i + 1) * step), ranks[i] if ranks else (i,)) for i in range(k) if i * step < n]


def _torch_dtype(dt: str) -> Any:
    return getattr(torch, dt)


def _local(m: Manifest, rank: int, full: Mapping[str, Any] | None) -> dict[str, Any]:
    """``rank``'s local tensors: the chunks of ``full`` copied in, or zeros."""
    ts = {n: torch.zeros(s.shape, dtype=_torch_dtype(s.data_type)) for n, s in m.local_tensors(rank).items()}
    if full is not None:
        for fqn, _, c in m.iter_chunks():
            if rank in c.holders:
                ts[c.tensor(fqn)][c.local_box.slices] = full[fqn][c.region.slices]
    return ts


def _gathered(m: Manifest, rank: int, ts: Mapping[str, Any], fqn: str) -> list[tuple[Box, Any]]:
    return [(c.region, ts[c.tensor(fqn)][c.local_box.slices]) for c in m.arrays[fqn].chunks if rank in c.holders]


def _bits(x: Any) -> Any:
    return x.contiguous().view(torch.uint8) if x.element_size() == 1 else x.contiguous().view(torch.int32)


def _refit(src: Manifest, dst: Manifest, full: Mapping[str, Any], pushes: int = 1,
           **options: Any) -> tuple[dict[int, dict[str, Any]], dict[int, list[StepStats]], dict[int, Any]]:
    """Push ``full`` (or, with several pushes, ``full`` scaled by the push number) and return the
    receivers' tensors, every rank's step stats and each rank's quantization report."""
    dsts = {r: _local(dst, r, None) for r in range(dst.world_size)}
    ptrs = {r: {n: t.data_ptr() for n, t in ts.items()} for r, ts in dsts.items()}

    def act(s: RefitSession, r: int) -> Any:
        for k in range(pushes):
            if s.role == "send":
                s.push(_local(src, r, {f: (w * (k + 1)).to(w.dtype) for f, w in full.items()}))
            else:
                s.pull(dsts[r])
        return list(s.steps), s.quant_report()

    results, errors = run_sessions(src, dst, act, **options)
    if errors:
        raise next(iter(errors.values()))
    for r, ts in dsts.items():  # written in place: the engine's tensors are the same memory
        assert {n: t.data_ptr() for n, t in ts.items()} == ptrs[r]
    return dsts, {g: v[0] for g, v in results.items()}, {g: v[1] for g, v in results.items()}


def _check(dst: Manifest, dsts: Mapping[int, Mapping[str, Any]], fqn: str, q: Any, s: Any) -> None:
    """Every holder's FP8 chunks and scale chunks equal the reference bit for bit."""
    scale = fqn + "_scale_inv"
    for r, ts in dsts.items():
        for region, got in _gathered(dst, r, ts, fqn):
            assert torch.equal(_bits(got), _bits(q[region.slices])), (fqn, r, region)
        for region, got in _gathered(dst, r, ts, scale):
            assert torch.equal(_bits(got), _bits(s[region.slices])), (scale, r, region)


def _weights(shapes: Mapping[str, tuple[tuple[int, ...], str]], seed: int = 0) -> dict[str, Any]:
    """Random weights whose magnitude grows along both dims, so that a block cut anywhere else
    than on the grid has another amax (a shared outlier would hide it)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for f, (shape, dt) in shapes.items():
        ramp = torch.arange(shape[0])[:, None] / 37 + torch.arange(shape[1])[None, :] / 53 - 3
        out[f] = (torch.randn(shape, generator=g) * 2.0 ** ramp).to(_torch_dtype(dt))
    return out


def _fp8_dst(world: int, arrays: Mapping[str, tuple[tuple[int, ...], Rows]], block: tuple[int, int],
             tensors: Mapping[str, str] | None = None) -> Manifest:
    """FP8 weights cut by rows (on the block grid) and their float32 scales, block images on the
    same ranks."""
    out: dict[str, tuple[tuple[int, ...], str, Rows]] = {}
    for f, (shape, rows) in arrays.items():
        out[f] = (shape, "float8_e4m3fn", rows)
        sshape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        out[f + "_scale_inv"] = (sshape, "float32", [(lo // block[0], -(-hi // block[0]), h) for lo, hi, h in rows])
    return _manifest(world, out, tensors)


# --------------------------------------------------------------------------- block FP8

@pytest.mark.parametrize("src_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_sender_and_receiver_side(src_dtype: str, ue8m0: bool) -> None:
    """16x16 blocks. ``a``: trainer rows [0,32) [32,64) (whole blocks: quantized by the senders);
    ``b``: trainer rows of torch.chunk(3) of 50 (17 rows: cut blocks, quantized by the receivers).
    Server: uneven, block-aligned rows (the last block partial), a row block replicated on two
    ranks, columns with a partial last block; an all-zero block in each."""
    shapes = {"a": ((64, 40), src_dtype), "b": ((50, 72), src_dtype)}
    W = _weights(shapes)
    W["a"][16:32, 16:32] = 0
    W["b"][32:48, :16] = 0
    src = _manifest(3, {"a": (*shapes["a"], [(0, 32, (0,)), (32, 64, (1, 2))]), "b": (*shapes["b"], _even(50, 3))})
    dst = _fp8_dst(3, {"a": ((64, 40), [(0, 48, (0,)), (48, 64, (1, 2))]),
                       "b": ((50, 72), [(0, 16, (0, 1)), (16, 50, (2,))])}, (16, 16))
    dsts, stats, reports = _refit(src, dst, W, fp8_block=(16, 16), ue8m0=ue8m0)
    for f in ("a", "b"):
        _check(dst, dsts, f, *ref_block_fp8(W[f], (16, 16), ue8m0))
    rep = reports[0]
    assert {f: a["where"] for f, a in rep["arrays"].items()} == {"a": "sender", "b": "receiver"}
    assert (rep["on_sender"], rep["on_receiver"]) == (1, 1)
    isz = 2 if src_dtype == "bfloat16" else 4
    a = rep["arrays"]["a"]
    # a moves once per destination holder: 48x40 + 2 x 16x40 FP8 bytes, plus the scales
    assert a["wire_bytes"] == (48 * 40 + 2 * 16 * 40) + (3 * 3 + 2 * 3) * 4
    assert a["wire_bytes_saved"] == (48 * 40 + 2 * 16 * 40) * (isz - 1) - (3 * 3 + 2 * 3) * 4
    assert rep["arrays"]["b"]["wire_bytes_saved"] == 0 and rep["wire_bytes_saved"] == a["wire_bytes_saved"]
    # the wire carried what the report says: FP8 for a, the source type for b
    assert sum(st[0].bytes_sent for g, st in stats.items() if g < 3) == a["wire_bytes"] + (16 * 72 * 2 + 34 * 72) * isz
    assert stats[0][0].quantize_seconds > 0  # rank 0 sends a's rows [0, 32)
    assert all(stats[g][0].quantize_seconds > 0 for g in (3, 4, 5))  # every receiver holds b


def test_fused_local_tensor_mixes_sender_and_receiver_side() -> None:
    """q and k live in one FP8 local tensor ``qk`` (and their scales in ``qk_scale``), as a vLLM
    ``qkv_proj``: q quantized by the senders, k by the receivers, each in its place."""
    shapes = {"q": ((32, 48), "bfloat16"), "k": ((48, 48), "bfloat16")}
    W = _weights(shapes, seed=3)
    src = _manifest(2, {"q": (*shapes["q"], _even(32, 2)), "k": (*shapes["k"], [(0, 20, (0,)), (20, 48, (1,))])})
    names = {"q": "qk", "k": "qk", "q_scale_inv": "qk_scale", "k_scale_inv": "qk_scale"}
    dst = _fp8_dst(2, {"q": ((32, 48), _even(32, 2)), "k": ((48, 48), [(0, 32, (0,)), (32, 48, (1,))])}, (16, 16),
                   names)
    dsts, _, reports = _refit(src, dst, W, fp8_block=(16, 16))
    assert {f: a["where"] for f, a in reports[2]["arrays"].items()} == {"q": "sender", "k": "receiver"}
    for f in ("q", "k"):
        _check(dst, dsts, f, *ref_block_fp8(W[f], (16, 16)))


def test_replica_halves_cut_a_block() -> None:
    """DeepSeek's 128x128 block; the trainer holds the whole 300x256 weight on two replicas,
    which split the sending inside a block (the planner infers the scales' block from their
    shape, 100 rows by the ceil rule, not 128). Each sender quantizes the whole blocks around its
    part; both agree with the reference."""
    W = _weights({"w": ((300, 256), "bfloat16")}, seed=4)
    src = _manifest(2, {"w": ((300, 256), "bfloat16", [(0, 300, (0, 1))])})
    dst = _fp8_dst(1, {"w": ((300, 256), [(0, 300, (0,))])}, (128, 128))
    dsts, stats, reports = _refit(src, dst, W)
    assert reports[0]["arrays"]["w"]["where"] == "sender"
    assert stats[0][0].bytes_sent > 0 and stats[1][0].bytes_sent > 0  # both replicas sent
    _check(dst, dsts, "w", *ref_block_fp8(W["w"]))


def test_domain_forwards_quantized_and_staged_bytes() -> None:
    """Both server ranks hold every chunk and share a domain: each piece lands once on one of
    them and is forwarded to the other (phase 2), as FP8 bytes and scales (a) or from the
    forwarder's staging buffer (b)."""
    shapes = {"a": ((32, 48), "bfloat16"), "b": ((48, 32), "float32")}
    W = _weights(shapes, seed=7)
    src = _manifest(2, {"a": (*shapes["a"], _even(32, 2)), "b": (*shapes["b"], [(0, 20, (0,)), (20, 48, (1,))])})
    dst = _fp8_dst(2, {"a": ((32, 48), [(0, 32, (0, 1))]), "b": ((48, 32), [(0, 16, (0, 1)), (16, 48, (0, 1))])},
                   (16, 16))
    forwards: list[int] = []

    def act(s: RefitSession, r: int) -> Any:
        forwards.append(s.plan.stats().phase2_transfers)
        return s.push(_local(src, r, W)) if s.role == "send" else s.pull(dsts[r])

    dsts = {r: _local(dst, r, None) for r in range(2)}
    _, errors = run_sessions(src, dst, act, fp8_block=(16, 16), dst_domain_size=2, verify=True)
    assert not errors, errors
    assert forwards[0] > 0
    for f in ("a", "b"):
        _check(dst, dsts, f, *ref_block_fp8(W[f], (16, 16)))


# delta: a slow link stated, else threads of one host share memory and send full bytes
@pytest.mark.parametrize("options", [{}, {"delta": True, "verify": True, "link_gbps": 0.01}],
                         ids=["full", "delta-verify"])
def test_second_push_quantizes_the_new_weights(options: dict[str, Any]) -> None:
    """The staging buffers and the executor are reused: push 2 gives the reference of its own
    weights (the test scales them by 2), on both sides; also as a delta push (the senders' base
    is the FP8 bytes they sent, the receivers' the staging buffer) with verified checksums."""
    shapes = {"a": ((32, 32), "float32"), "b": ((32, 32), "float32")}
    W = _weights(shapes, seed=5)
    src = _manifest(2, {"a": (*shapes["a"], _even(32, 2)), "b": (*shapes["b"], [(0, 10, (0,)), (10, 32, (1,))])})
    dst = _fp8_dst(1, {"a": ((32, 32), [(0, 32, (0,))]), "b": ((32, 32), [(0, 32, (0,))])}, (16, 16))
    dsts, stats, _ = _refit(src, dst, W, pushes=2, fp8_block=(16, 16), **options)
    assert len(stats[2]) == 2
    if options:
        assert stats[2][1].version == 2 and stats[2][1].verified_regions > 0
        assert stats[2][1].bytes_received < stats[2][1].full_bytes_received  # a delta went
    for f in ("a", "b"):
        _check(dst, dsts, f, *ref_block_fp8(W[f] * 2, (16, 16)))


# --------------------------------------------------------------------------- MXFP8

@pytest.mark.parametrize("cut", [64, 48], ids=["sender", "receiver"])
def test_mxfp8(cut: int) -> None:
    """1x32 blocks along the last dim, float8_e8m0fnu scales; the trainer cuts columns at ``cut``
    (48: inside a block). The server holds rows (any row cut is on the grid), the last column
    block partial (100 = 3 x 32 + 4)."""
    W = _weights({"m": ((6, 100), "bfloat16")}, seed=6)
    W["m"][2, 32:64] = 0  # an all-zero block: scale 2^-127
    src = Manifest(world_size=2, arrays={"m": ArraySpec((6, 100), "bfloat16", (
        Chunk(Box((0, 0), (6, cut)), (0,)), Chunk(Box((0, cut), (6, 100 - cut)), (1,))))})
    dst = _manifest(2, {"m": ((6, 100), "float8_e4m3fn", [(0, 4, (0,)), (4, 6, (1,))]),
                        "m_scale_inv": ((6, 4), "float8_e8m0fnu", [(0, 4, (0,)), (4, 6, (1,))])})
    dsts, _, reports = _refit(src, dst, W)
    assert reports[0]["arrays"]["m"]["where"] == ("sender" if cut == 64 else "receiver")
    assert reports[0]["arrays"]["m"]["scheme"] == "mxfp8 1x32"
    q, s = ref_mxfp8(W["m"])
    _check(dst, dsts, "m", q, s)
    assert (s[2, 1:2] == 0).all()  # the zero block's scale bits: 2^-127


# --------------------------------------------------------------------------- refusals

def test_unaligned_destination_refused_on_every_rank() -> None:
    src = _manifest(1, {"w": ((64, 32), "bfloat16", [(0, 64, (0,))])})
    dst = _fp8_dst(2, {"w": ((64, 32), [(0, 24, (0,)), (24, 64, (1,))])}, (16, 16))
    _, errors = run_sessions(src, dst, lambda s, r: None, fp8_block=(16, 16))
    assert sorted(errors) == [0, 1, 2]
    assert all(isinstance(e, PlanError) for e in errors.values()), errors
    lines = {tuple(e.problems) for e in errors.values()}  # type: ignore[attr-defined]
    assert len(lines) == 1
    (line,) = lines.pop()
    assert line.startswith("w: destination chunk") and "not aligned to the 16x16 quantization blocks" in line


def test_different_fp8_blocks_refused() -> None:
    src = _manifest(1, {"w": ((32, 32), "bfloat16", [(0, 32, (0,))])})
    dst = _fp8_dst(1, {"w": ((32, 32), [(0, 32, (0,))])}, (16, 16))
    _, errors = run_sessions(src, dst, lambda s, r: None,
                             options_of=lambda role: {"fp8_block": (16, 16) if role == "recv" else (32, 32)})
    assert sorted(errors) == [0, 1] and all("different --fp8-block" in str(e) for e in errors.values()), errors


def test_broadcast_strategy_refused() -> None:
    """The gather-broadcast baseline moves whole arrays in their source type: it does not quantize."""
    src = _manifest(1, {"w": ((32, 32), "bfloat16", [(0, 32, (0,))])})
    dst = _fp8_dst(1, {"w": ((32, 32), [(0, 32, (0,))])}, (16, 16))
    _, errors = run_sessions(src, dst, lambda s, r: None, fp8_block=(16, 16), strategy="broadcast")
    assert sorted(errors) == [0, 1]
    assert all("quantize on refit works with --strategy reshard only" in str(e) for e in errors.values()), errors


# --------------------------------------------------------------------------- any layout

def _cuts(draw: Any, n: int, step: int, world: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """``n`` elements cut at up to two points on multiples of ``step``, each piece on a nonempty
    set of ``world`` ranks."""
    points = sorted(set(draw(st.lists(st.integers(1, max(1, (n - 1) // step)), max_size=2))))
    edges = [0] + [p * step for p in points if p * step < n] + [n]
    holders = st.sets(st.integers(0, world - 1), min_size=1).map(lambda s: tuple(sorted(s)))
    return [(lo, hi, draw(holders)) for lo, hi in zip(edges, edges[1:])]


def _along(world: int, arrays: Mapping[str, tuple[tuple[int, int], str, int, Rows]]) -> Manifest:
    """A live manifest cutting each array along one dim (0 or 1); a rank's chunks sit at their
    global offsets in its local tensor (it may hold several)."""
    out = {}
    for fqn, (shape, dt, dim, cuts) in arrays.items():
        boxes = [(Box((lo, 0), (hi - lo, shape[1])) if dim == 0 else Box((0, lo), (shape[0], hi - lo)), h)
                 for lo, hi, h in cuts]
        out[fqn] = ArraySpec(shape, dt, tuple(Chunk(b, h, Source(offsets=b.offsets)) for b, h in boxes))
    return Manifest(world_size=world, arrays=out)


@settings(max_examples=n_examples(20))
@given(data=st.data())
def test_any_layout_matches_the_reference(data: Any) -> None:
    """Random trainer cuts (anywhere, with replicas) and server cuts (on the grid, replicated or
    not), block FP8 (16x16) or MXFP8, bf16 or fp32: the reference's bytes on every holder, and
    the senders quantize exactly when every trainer chunk is whole blocks."""
    draw = data.draw
    mx = draw(st.booleans())
    block = (1, 32) if mx else (16, 16)
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 80)))
    dt = draw(st.sampled_from(["bfloat16", "float32"]))
    sdim, ddim = draw(st.integers(0, 1)), draw(st.integers(0, 1))
    src_cuts = _cuts(draw, shape[sdim], 1, 2)
    dst_cuts = _cuts(draw, shape[ddim], block[ddim], 2)
    sshape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    src = _along(2, {"w": (shape, dt, sdim, src_cuts)})
    dst = _along(2, {"w": (shape, "float8_e4m3fn", ddim, dst_cuts),
                     "w_scale_inv": (sshape, "float8_e8m0fnu" if mx else "float32", ddim,
                                     [(lo // block[ddim], -(-hi // block[ddim]), h) for lo, hi, h in dst_cuts])})
    W = _weights({"w": (shape, dt)}, seed=draw(st.integers(0, 3)))
    if draw(st.booleans()):
        W["w"][:16, :32] = 0  # all-zero blocks
    dsts, _, reports = _refit(src, dst, W, **({} if mx else {"fp8_block": block}))
    aligned = all(lo % block[sdim] == 0 and (hi % block[sdim] == 0 or hi == shape[sdim]) for lo, hi, _ in src_cuts)
    assert reports[0]["arrays"]["w"]["where"] == ("sender" if aligned else "receiver")
    _check(dst, dsts, "w", *(ref_mxfp8(W["w"]) if mx else ref_block_fp8(W["w"], block)))
