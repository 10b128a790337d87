"""RefitSession start plans only its own rank (issue 14 item 3): no rank materialises the whole
plan, computes its digest or its whole-plan figures, and the two jobs agree through the digests
of their inputs, refusing a difference by name on every rank before any byte moves."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import (
    check_dest_tensors,
    empty_dest_tensors,
    lay_out,
    make_source_tensors,
    oracle_arrays,
    run_sessions,
)

from formats.errors import PlanError
from formats.layouts import Mesh, Replicate, Shard
from streamer.plan.model import Plan
from streamer.refit.session import RefitSession

ARRAYS = {"w": ((12, 8), "bfloat16"), "b": ((12,), "float32")}


def _manifests() -> Any:
    src = lay_out(ARRAYS, Mesh(("dp", "tp"), (2, 2)), {"w": (Replicate(), Shard(0)), "b": (Replicate(), Shard(0))})
    dst = lay_out(ARRAYS, Mesh(("tp",), (3,)), {"w": (Shard(1),), "b": (Shard(0),)})
    return src, dst


def test_start_never_expands_the_whole_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    def whole(*_: Any) -> Any:
        raise AssertionError("a refit rank asked for the whole plan")

    monkeypatch.setattr(Plan, "transfers", property(whole))
    monkeypatch.setattr(Plan, "digest", whole)
    monkeypatch.setattr(Plan, "stats", whole)
    src, dst = _manifests()
    full = oracle_arrays(ARRAYS)
    srcs, dsts = make_source_tensors(src, full), empty_dest_tensors(dst)

    def act(s: RefitSession, r: int) -> Any:
        assert len(s.inputs_digest) == 64
        return s.push(srcs[r]) if s.role == "send" else s.pull(dsts[r])

    _, errors = run_sessions(src, dst, act, dst_domain_size=3)
    assert not errors, errors
    assert check_dest_tensors(dst, dsts, full) == []


def test_inputs_that_differ_are_refused_by_name_on_every_rank() -> None:
    src, dst = _manifests()
    moved: list[int] = []
    _, errors = run_sessions(src, dst, lambda s, r: moved.append(r),
                             options_of=lambda role: {"allow_extra": role == "send"})
    assert sorted(errors) == list(range(7)) and not moved
    lines = {tuple(e.problems) for e in errors.values() if isinstance(e, PlanError)}  # type: ignore[attr-defined]
    assert len(lines) == 1, errors
    (only,) = lines.pop()
    assert only.startswith("allow_extra differs on ranks [4, 5, 6] (rank 4: false, rank 0: true)"), only
