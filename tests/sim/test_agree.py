"""The agreement round (``streamer.ops.agree``, issue 24): a refusal on some ranks is
raised on every rank with the same lines and exit code; nobody is left waiting. Also a refit
whose manifest did not load on one receiver, over loopback ranks in threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from formats.errors import ManifestError, UsageError
from streamer.ops.agree import AgreedRefusal, LocalChecks, Refusal, agree, agreed
from streamer.transport.loopback import LoopbackHub


def _ranks(n: int, body: Callable[[Any, int], Any]) -> tuple[dict[int, Any], dict[int, BaseException]]:
    eps = LoopbackHub(n).endpoints()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(r: int) -> None:
        try:
            results[r] = body(eps[r], r)
        except BaseException as e:  # noqa: BLE001 - collected per rank
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors


def test_one_refusing_rank_ends_every_rank_with_its_code() -> None:
    def body(t: Any, r: int) -> Any:
        checks = LocalChecks()
        with checks.capture():
            if r == 2:
                raise ManifestError("serve.json: not valid JSON (line 1)")
        return agree(t, checks.refusal, 5.0, extra=r)

    results, errors = _ranks(4, body)
    assert results == {} and sorted(errors) == [0, 1, 2, 3]
    for e in errors.values():
        assert isinstance(e, AgreedRefusal)
        assert e.problems == ["serve.json: not valid JSON (line 1)"] and e.exit_code == 1 and e.ranks == [2]


def test_lines_once_and_the_lowest_refusing_rank_sets_the_code() -> None:
    def body(t: Any, r: int) -> Any:
        refusal = {1: Refusal(2, ("shardstream refit recv: error: bad --bucket-size",)),
                   2: Refusal(1, ("missing.json: no such file or directory",)),
                   3: Refusal(1, ("missing.json: no such file or directory",))}.get(r)
        return agree(t, refusal, 5.0)

    _, errors = _ranks(4, body)
    e = errors[0]
    assert isinstance(e, AgreedRefusal) and e.exit_code == 2 and e.ranks == [1, 2, 3]
    assert e.problems == ["shardstream refit recv: error: bad --bucket-size",
                          "missing.json: no such file or directory"]
    assert all(x.problems == e.problems and x.exit_code == 2 for x in errors.values())


def test_no_refusal_returns_every_ranks_extra() -> None:
    results, errors = _ranks(3, lambda t, r: agree(t, None, 5.0, extra={"rank": r}))
    assert errors == {}
    assert all(v == [{"rank": 0}, {"rank": 1}, {"rank": 2}] for v in results.values())


def test_agreed_block_os_errors_and_bugs_refuse_too() -> None:
    def body(t: Any, r: int) -> None:
        with agreed(t, 5.0):
            if r == 1:
                Path("/nonexistent/dir/file").read_text()
            if r == 2:
                raise KeyError("oops")

    _, errors = _ranks(3, body)
    e = errors[0]
    assert isinstance(e, AgreedRefusal) and e.exit_code == 3  # rank 1's: an OSError is a runtime failure
    assert e.problems[0] == "shardstream: /nonexistent/dir/file: No such file or directory"
    assert e.problems[1] == "shardstream: internal error: KeyError: 'oops'"


def test_agreed_alone_raises_the_original_error() -> None:
    with pytest.raises(UsageError, match="bad"), agreed(None, 1.0):
        raise UsageError("bad")


def test_refit_with_a_receiver_manifest_that_did_not_load(tmp_path: Path) -> None:
    """Receiver rank 1's manifest is missing: every rank of both jobs raises the same verdict
    before any plan (the other receiver and the senders would otherwise wait for it)."""
    from helpers import lay_out

    from formats.layouts import Mesh, Shard
    from streamer.refit.session import RefitSession
    from streamer.transport.jobs import Group

    src = dst = lay_out({"w": ((8, 4), "float32")}, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    hub = LoopbackHub(4)
    eps = hub.endpoints()
    errors: dict[int, BaseException] = {}

    def rank(g: int) -> None:
        role = "send" if g < 2 else "recv"
        manifest: Any = (src if role == "send" else dst) if g != 3 else tmp_path / "missing.json"
        try:
            RefitSession.open(manifest, role, group=Group(eps[g], eps[g], role, 2, 2, plane="loopback"),
                              transport=eps[g], timeout=10)
        except BaseException as e:  # noqa: BLE001 - collected per rank
            errors[g] = e

    threads = [threading.Thread(target=rank, args=(g,)) for g in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert sorted(errors) == [0, 1, 2, 3]
    assert all(isinstance(e, AgreedRefusal) and e.exit_code == 1 and e.ranks == [3] for e in errors.values())
    assert errors[0].problems == [f"{tmp_path / 'missing.json'}: no such manifest file"]
