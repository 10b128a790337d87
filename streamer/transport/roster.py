"""Replicas: which inference replicas wait for a trainer serving them (store plane).

Replica ``NAME`` joins through a rendezvous of its own, named after it (``transport.rendezvous``):
``PATH@NAME``, a file beside the rendezvous path, or ``tcp://HOST:PORT@NAME``, an entry in the
registry that trainer rank 0 serves at ``HOST:PORT`` (no shared filesystem). Its rank 0 serves the
replica's TCPStore and writes the file (or the entry) as a single receiver job writes ``PATH``,
so each replica is one ordinary session with the trainer, with its own epochs (a replica outlives
a trainer restart as before). The trainer lists the files (or the registry) before each push and
joins the new ones (``refit.fleet``).

The trainer's ranks must agree on which replicas they join and which they dropped, with no replica
in between (any may die): they share a group of their own (``rendezvous.join(replicas=True)``),
over a store served by trainer rank 0, and rank 0's listing is the one they all take (``agree_names``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streamer.transport.jobs import Group
from streamer.transport.registry import registered
from streamer.transport.rendezvous import TCP, is_name

__all__ = ["agree_names", "replica_files", "waiting"]


def waiting(rendezvous: str | Path, group: Group) -> dict[str, str]:
    """The replicas waiting for a trainer now (name -> the store address they wait at): the files
    beside ``rendezvous``, or the registry whose store ``group`` (the trainer's own) is over."""
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
        if not f.name.startswith(prefix) or not is_name(name):
            continue
        try:
            text = f.read_text().strip().split("\n")[0]  # the address (the host rank 0 names comes after)
        except OSError:  # removed between the listing and the read: it joined someone
            continue
        if text:
            out[name] = text
    return out


def agree_names(group: Group, found: dict[str, str] | None, timeout: float) -> dict[str, str]:
    """Trainer rank 0's listing of the replica files, on every trainer rank."""
    data = json.dumps(found or {}).encode() if group.role_rank == 0 else None
    got: Any = json.loads(group.role_control.bcast_bytes(data, 0, timeout))
    return {str(k): str(v) for k, v in got.items()}
