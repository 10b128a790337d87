"""Same-job (in-place) reshard: every rank is both a source and a destination, and both layouts
use the same local names. Separate source/destination buffers keep sends and receives apart."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule
from streamer.execute.executor import Executor
from streamer.execute.schedule import build_schedule
from streamer.plan.planner import plan_transfers
from streamer.transport.loopback import LoopbackHub


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 4), (4, 2), (3, 4)])
def test_same_job_reshard_with_shared_names(src_tp: int, dst_tp: int) -> None:
    world = max(src_tp, dst_tp)
    base = manifest_from_arrays({"w": ((12, 10), "float32"), "b": ((7,), "int64")})
    full = {"w": np.arange(120, dtype=np.float32).reshape(12, 10), "b": np.arange(7, dtype=np.int64) * 3}

    def lay(tp: int) -> object:
        m = parse_mesh(f"dp={world // tp},tp={tp}") if world % tp == 0 else parse_mesh(f"tp={tp}")
        rules = [parse_rule("w=" + ",".join(["R"] * (m.ndim - 1) + ["S(0)"]), m),
                 parse_rule("b=" + ",".join(["R"] * (m.ndim - 1) + ["S(0)"]), m)]
        return apply_layout(base, m, rules, file_pattern=None)

    src, dst = lay(src_tp), lay(dst_tp)
    plan = plan_transfers(src, dst, same_job=True, split_bytes=8)
    st = plan.stats()
    assert st.moved_bytes == st.lower_bound_bytes
    sched = build_schedule(plan, 64)
    hub = LoopbackHub(plan.world_size)
    eps = hub.endpoints()
    srcs, dsts, errs = {}, {}, []
    for r in range(plan.world_size):
        srcs[r] = {c.tensor(f): np.array(full[f][c.region.slices], copy=True)
                   for f, a, c in src.iter_chunks() if r in c.holders}
        dsts[r] = {n: np.zeros(ts.shape, full[n].dtype) for n, ts in dst.local_tensors(r).items()}

    def go(r: int) -> None:
        try:
            Executor(eps[r], plan, sched, srcs[r], dst_tensors=dsts[r], timeout=10, verify=True).run()
        except Exception as e:  # noqa: BLE001 - collected, asserted below
            errs.append((r, e))

    ths = [threading.Thread(target=go, args=(r,)) for r in range(plan.world_size)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    assert not errs
    for f, a, c in dst.iter_chunks():
        for r in c.holders:
            np.testing.assert_array_equal(dsts[r][c.tensor(f)][c.local_box.slices], full[f][c.region.slices])
