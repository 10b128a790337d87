"""RefitSession over the loopback transport, every rank a thread: the agreement round refuses a
push on every rank before any byte moves (wrong dtype, wrong shape, missing tensor, Partial
DTensor, diverged replicas under verify), the gather-broadcast baseline runs over the Transport
protocol, and pushes accept torch tensors and nn.Modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import (
    check_dest_tensors,
    empty_dest_tensors,
    lay_out,
    make_source_tensors,
    oracle_arrays,
    run_sessions,
)

from formats.layouts import Mesh, Replicate, Shard
from formats.manifest.wire import Manifest
from streamer.refit.session import RefitSession, RefusedError

ARRAYS = {"w": ((6, 4), "bfloat16"), "b": ((6,), "float32"), "s": ((), "float32")}


def _manifests() -> tuple[Manifest, Manifest]:
    # trainer: dp=2 x tp=2 (replicated across dp); server: tp=3
    src = lay_out(ARRAYS, Mesh(("dp", "tp"), (2, 2)),
                  {"w": (Replicate(), Shard(0)), "b": (Replicate(), Shard(0)), "s": (Replicate(), Replicate())})
    dst = lay_out(ARRAYS, Mesh(("tp",), (3,)), {"w": (Shard(0),), "b": (Shard(0),), "s": (Replicate(),)})
    return src, dst


def _run(src: Manifest, dst: Manifest, act: Callable[[RefitSession, int], Any], *, verify: bool = False,
         strategy: str = "reshard") -> tuple[dict[int, Any], dict[int, BaseException]]:
    return run_sessions(src, dst, act, verify=verify, strategy=strategy)


def _push_pull(src_tensors: dict[int, dict[str, Any]], dst_tensors: dict[int, dict[str, np.ndarray]]) -> Any:
    def act(s: RefitSession, r: int) -> Any:
        return s.push(src_tensors[r]) if s.role == "send" else s.pull(dst_tensors[r])
    return act


@pytest.mark.parametrize("strategy", ["reshard", "broadcast"])
def test_session_moves_every_array(strategy: str) -> None:
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    srcs = make_source_tensors(src, full)
    dsts = empty_dest_tensors(dst)
    _, errors = _run(src, dst, _push_pull(srcs, dsts), verify=True, strategy=strategy)
    assert not errors, errors
    assert check_dest_tensors(dst, dsts, full) == []


def _refused(errors: dict[int, BaseException], n: int) -> list[str]:
    """Every rank raised RefusedError with the same problems; return them."""
    assert sorted(errors) == list(range(n)), f"only ranks {sorted(errors)} failed"
    assert all(isinstance(e, RefusedError) for e in errors.values()), errors
    problems = {tuple(e.problems) for e in errors.values()}  # type: ignore[attr-defined]
    assert len(problems) == 1, problems
    return list(problems.pop())


def test_wrong_dtype_refused_everywhere_before_any_byte_moves() -> None:
    torch = pytest.importorskip("torch")
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    srcs: dict[int, dict[str, Any]] = {r: dict(ts) for r, ts in make_source_tensors(src, full).items()}
    # rank 1 hands a float16 tensor where the manifest says bfloat16: same bytes, other meaning
    srcs[1]["w"] = torch.zeros(srcs[1]["w"].shape, dtype=torch.float16)
    dsts = empty_dest_tensors(dst)
    _, errors = _run(src, dst, _push_pull(srcs, dsts))
    problems = _refused(errors, 7)
    assert any("sender rank 1" in p and "'w'" in p and "float16" in p and "bfloat16" in p for p in problems), problems
    # receivers untouched: nothing moved
    assert all(not v.any() for ts in dsts.values() for v in ts.values())


def test_wrong_shape_and_missing_tensor_refused() -> None:
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    srcs = make_source_tensors(src, full)
    srcs[0]["b"] = np.zeros(5, dtype=np.float32)
    del srcs[3]["s"]
    dsts = empty_dest_tensors(dst)
    _, errors = _run(src, dst, _push_pull(srcs, dsts))
    problems = _refused(errors, 7)
    assert any("sender rank 0" in p and "'b'" in p and "[5]" in p and "[3]" in p for p in problems), problems
    assert any("sender rank 3" in p and "'s'" in p and "missing" in p for p in problems), problems


def test_diverged_replica_refused_under_verify_only() -> None:
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    srcs = make_source_tensors(src, full)
    # dp replica 1 (ranks 2, 3) diverged on rank 2's shard of w
    srcs[2]["w"] = srcs[2]["w"].copy()
    srcs[2]["w"][0, 0] ^= 1
    dsts = empty_dest_tensors(dst)
    _, errors = _run(src, dst, _push_pull(srcs, dsts), verify=True)
    problems = _refused(errors, 7)
    assert len(problems) == 1 and problems[0].startswith("w: region"), problems
    assert "sender rank 0" in problems[0] and "sender rank 2" in problems[0], problems
    assert all(not v.any() for ts in dsts.values() for v in ts.values())
    # without verify the replicas are not compared (documented): the push goes through
    dsts = empty_dest_tensors(dst)
    _, errors = _run(src, dst, _push_pull(srcs, dsts), verify=False)
    assert not errors


def test_torch_tensors_and_modules() -> None:
    torch = pytest.importorskip("torch")
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    np_srcs = make_source_tensors(src, full)

    def as_module(ts: dict[str, np.ndarray]) -> Any:
        m = torch.nn.Module()
        for n, v in ts.items():
            t = torch.from_numpy(v.copy())
            if n == "w":  # bf16 travels as uint16 in numpy; torch has the real dtype
                t = t.view(torch.bfloat16)
            m.register_buffer(n, t)
        return m

    mods = {r: as_module(ts) for r, ts in np_srcs.items()}
    dsts = empty_dest_tensors(dst)
    _, errors = _run(src, dst, _push_pull(mods, dsts))  # type: ignore[arg-type]
    assert not errors, errors
    assert check_dest_tensors(dst, dsts, full) == []


def test_partial_dtensor_refused_by_name() -> None:
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from streamer.refit.local import collect_local
    from streamer.transport.torch_dist import free_port

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        _, problems = collect_local({"grad_like": d, "ok": torch.ones(2)})
    finally:
        if mine:
            dist.destroy_process_group()
    assert len(problems) == 1 and "'grad_like'" in problems[0] and "Partial" in problems[0]


@pytest.mark.parametrize("strategy", ["reshard", "broadcast"])
def test_fp32_masters_cast_to_bf16_on_the_way(strategy: str) -> None:
    """Source float32, destination bfloat16: the sender casts while packing (the wire carries
    2-byte elements) and receivers hold exactly what ``convert --cast`` would write."""
    from streamer.ops.cast import cast_bytes

    arrays32 = {"w": ((6, 4), "float32"), "b": ((6,), "float32"), "s": ((), "float32")}
    arrays16 = {"w": ((6, 4), "bfloat16"), "b": ((6,), "bfloat16"), "s": ((), "float32")}
    src = lay_out(arrays32, Mesh(("dp", "tp"), (2, 2)),
                  {"w": (Replicate(), Shard(0)), "b": (Replicate(), Shard(0)), "s": (Replicate(), Replicate())})
    dst = lay_out(arrays16, Mesh(("tp",), (3,)), {"w": (Shard(0),), "b": (Shard(0),), "s": (Replicate(),)})
    rng = np.random.default_rng(0)
    full32 = {n: rng.standard_normal(shape).astype(np.float32) for n, (shape, _) in arrays32.items()}
    want = {n: cast_bytes(v.reshape(-1).view(np.uint8), "float32", arrays16[n][1]).view(
        "<u2" if arrays16[n][1] == "bfloat16" else "<f4").reshape(v.shape) for n, v in full32.items()}
    srcs = make_source_tensors(src, full32)
    dsts = empty_dest_tensors(dst)
    results, errors = _run(src, dst, _push_pull(srcs, dsts), verify=True, strategy=strategy)
    assert not errors, errors
    assert check_dest_tensors(dst, dsts, want) == []
    if strategy == "reshard":
        # destination-sized bytes on the wire: w and b are bf16 (2 B), s float32 (4 B) x 3 receivers
        assert sum(r.bytes_received for g, r in results.items() if g >= 4) == (24 + 6) * 2 + 3 * 4
        assert sum(r.cast_bytes for g, r in results.items() if g < 4) == (24 + 6) * 2  # s is not cast


def test_int_to_float_refused_at_plan_time() -> None:
    from formats.errors import PlanError
    from streamer.plan.planner import plan_transfers

    src = lay_out({"w": ((4,), "int32")}, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    dst = lay_out({"w": ((4,), "float32")}, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    with pytest.raises(PlanError) as e:
        plan_transfers(src, dst)
    assert "w: data_type mismatch (source int32, destination float32)" in str(e.value)
