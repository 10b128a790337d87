"""Replicas: several receiver jobs, one per inference replica, share one rendezvous (store plane).

Replica ``NAME`` joins through a rendezvous of its own, named after it (``transport.rendezvous``):
``PATH@NAME``, a file beside the rendezvous path, or ``tcp://HOST:PORT@NAME``, an entry in the
registry that trainer rank 0 serves at ``HOST:PORT`` (no shared filesystem). Its rank 0 serves the
replica's TCPStore and writes the file (or the entry) as a single receiver job writes ``PATH``
(``transport.jobs``), so each replica is one ordinary session with the trainer, with its own
epochs (a replica outlives a trainer restart as before). The trainer lists the files (or the
registry) before each push and joins the new ones.

The trainer's ranks must agree on which replicas they join and which they dropped, with no replica
in between (any may die): they share a small store of their own (``trainer_group``), served by
trainer rank 0: found through ``PATH.trainer``, or the registry itself at ``tcp://HOST:PORT``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from formats.errors import UsageError
from streamer.transport.jobs import (
    FRESH_SLACK,
    Clock,
    Group,
    close_store,
    launcher_rank,
    rank_name,
    store_wait,
)
from streamer.transport.rendezvous import TCP, FileRendezvous, Rendezvous, TcpRendezvous, registered

__all__ = ["replica_files", "replica_join", "replica_path", "replica_rendezvous", "trainer_group", "waiting"]

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _is_name(name: str) -> bool:
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and not name.startswith(".")


def check_name(name: str) -> str:
    if not _is_name(name):
        raise UsageError(f"replica name {name!r}: use letters, digits, '_', '-' and '.' (not first)")
    return name


def replica_path(rendezvous: str | Path, name: str) -> Path:
    """The file through which replica ``name`` joins: ``RENDEZVOUS@NAME``."""
    p = Path(rendezvous)
    return p.with_name(f"{p.name}@{check_name(name)}")


def replica_rendezvous(rendezvous: str | Path, name: str) -> str:
    """The rendezvous through which replica ``name`` joins: ``PATH@NAME`` or ``tcp://HOST:PORT@NAME``."""
    s = str(rendezvous)
    if s.startswith(TCP):
        TcpRendezvous.parse(s)  # a bad address is refused here, by name
        return f"{s.rstrip('/')}@{check_name(name)}"
    return str(replica_path(s, name))


def waiting(rendezvous: str | Path, group: Group) -> dict[str, str]:
    """The replicas waiting for a trainer now (name -> the store address they wait at): the files
    beside ``rendezvous``, or the registry that ``group`` (the trainer's, ``trainer_group``) holds."""
    if str(rendezvous).startswith(TCP):
        return {name: text.split("\n")[0] for name, text in registered(group.store).items()}
    return replica_files(rendezvous)


def replica_files(rendezvous: str | Path) -> dict[str, str]:
    """The replicas waiting for a trainer now: name -> their file's content (a store address)."""
    p = Path(rendezvous)
    prefix = f"{p.name}@"
    out: dict[str, str] = {}
    try:
        entries = sorted(p.parent.iterdir())
    except FileNotFoundError:
        return out
    for f in entries:
        name = f.name[len(prefix):]
        if not f.name.startswith(prefix) or not _is_name(name):
            continue
        try:
            text = f.read_text().strip().split("\n")[0]  # the address (the host rank 0 names comes after)
        except OSError:  # removed between the listing and the read: it joined someone
            continue
        if text:
            out[name] = text
    return out


def trainer_group(rendezvous: str | Path, timeout: float) -> Group:
    """The trainer job's own group (every rank a sender, no receiver) over a store served by its
    rank 0: found through ``RENDEZVOUS.trainer`` (written fresh, removed once every rank joined),
    or served at ``tcp://HOST:PORT``, where it is also the registry the replicas enter."""
    from streamer.transport.store import StoreControl

    rdv: Rendezvous
    if str(rendezvous).startswith(TCP):
        rdv = TcpRendezvous.parse(str(rendezvous), serving="trainer rank 0 (the replicas' registry)")
        path = str(rdv)
    else:
        p = Path(rendezvous)
        path = str(p.with_name(f"{p.name}.trainer"))
        rdv = FileRendezvous(Path(path))
    rank, size = launcher_rank()
    clock = Clock.start(timeout)
    t_start = time.time()
    if rank == 0:
        store, address = rdv.serve(timeout)
        rdv.publish(store, address, 0)
    else:
        store, _ = rdv.dial(clock.deadline, clock.timeout, t_start - FRESH_SLACK, "trainer rank 0's store")
    try:
        store.add("trainer/joined", 1)
        store.set(f"trainer/in/{rank}", "1")
        store_wait(store, [f"trainer/in/{r}" for r in range(size)], clock.deadline,
                    f"the trainer's {size} ranks to join through {path}")
    finally:
        if rank == 0:
            rdv.retire(store)

    def names(r: int) -> str:
        return rank_name(r, size)

    group = Group(StoreControl(store, rank, size, "trainer/all", names), StoreControl(store, rank, size, "trainer/send"),
                  "send", size, 0, str(rendezvous), store=store, plane="store", prefix="trainer/")
    group._closers.append(lambda t: close_store(store, rank, size, rank == 0, t, "trainer/"))
    return group


def replica_join(role: str, name: str, rendezvous: str | None, control: str) -> tuple[str, str]:
    """A replica's rendezvous (``RENDEZVOUS@NAME``: a file, or an entry in the trainer's registry at
    ``tcp://HOST:PORT``) and control plane (the store's)."""
    if role != "recv":
        raise UsageError("replica=NAME is for an inference replica (recv); the trainer opens with replicas=True")
    if rendezvous is None:
        raise UsageError("replica=NAME joins the trainer through a rendezvous: pass rendezvous=FILE (a path every job "
                         "sees) or tcp://HOST:PORT (the trainer's rank 0 serves it)")
    if control == "mpi":
        raise UsageError("replicas join and leave on the store control plane only (under MPI a peer's death "
                         "ends the launch): use control='store'")
    return replica_rendezvous(rendezvous, name), "store"


def agree_names(group: Group, found: dict[str, str] | None, timeout: float) -> dict[str, str]:
    """Trainer rank 0's listing of the replica files, on every trainer rank."""
    import json

    data = json.dumps(found or {}).encode() if group.role_rank == 0 else None
    got: Any = json.loads(group.role_control.bcast_bytes(data, 0, timeout))
    return {str(k): str(v) for k, v in got.items()}
