"""Replica rendezvous files (``streamer.transport.roster``, named by ``streamer.transport.rendezvous``) and the
arguments that open replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from formats.errors import UsageError
from streamer.refit.session import RefitSession
from streamer.transport.rendezvous import replica_path
from streamer.transport.roster import replica_files


def test_replica_files_list_the_waiting_replicas_only(tmp_path: Path) -> None:
    rdv = tmp_path / "rdv"
    assert replica_path(rdv, "a-1.x") == tmp_path / "rdv@a-1.x"
    replica_path(rdv, "a").write_text("tcp://h:1\n")
    replica_path(rdv, "b").write_text("tcp://h:2/3\n")
    (tmp_path / ".rdv@c.tmp-12").write_text("tcp://h:3\n")  # an atomic write under way
    (tmp_path / "rdv@d").write_text("")  # not written yet
    (tmp_path / "rdv").write_text("tcp://h:4\n")  # a single receiver job's file
    (tmp_path / "other@e").write_text("tcp://h:5\n")  # another session's replica
    assert replica_files(rdv) == {"a": "tcp://h:1", "b": "tcp://h:2/3"}
    assert replica_files(tmp_path / "missing" / "rdv") == {}


@pytest.mark.parametrize("name", ["", ".a", "a/b", "a b", "a@b"])
def test_bad_replica_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError, match="replica name"):
        replica_path(tmp_path / "rdv", name)


@pytest.mark.parametrize(("role", "kw", "message"), [
    ("send", {"replica": "a", "rendezvous": "r"}, "replica=NAME is for an inference replica"),
    ("recv", {"replica": "a"}, "pass rendezvous=FILE"),
    ("recv", {"replica": "a", "rendezvous": "r", "control": "mpi"}, "store control plane only"),
    ("recv", {"replicas": True, "rendezvous": "r"}, "replicas=True is for the trainer"),
    ("send", {"replicas": True}, "pass rendezvous=FILE"),
    ("send", {"replicas": True, "rendezvous": "r", "transport": "mpi"}, "gloo or nccl"),
])
def test_replica_arguments_are_checked_before_any_wait(role: str, kw: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        RefitSession.open(None, role, **kw)  # type: ignore[arg-type]
