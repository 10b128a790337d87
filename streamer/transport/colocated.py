"""Opening a colocated transport (``--transport shm`` or ``cuda-ipc``) for a refit group.

Both need every rank of both jobs on one node, and cuda-ipc a CUDA device on each: every rank
reports its host name and what it lacks in one allgather, so all of them refuse with the same
lines (exit 1) before any byte moves.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from formats.errors import PlanError, TransportError
from streamer.transport.base import Transport
from streamer.transport.handles import Backend, HandleTransport

__all__ = ["open_handle_transport"]


def _who(ranks: list[int], size: int, names: Any) -> str:
    if len(ranks) == size:
        return "every rank"
    return ", ".join(names(r) for r in ranks[:4]) + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")


def _colocation_problems(kind: str, control: Transport, timeout: float, names: Any,
                         local_problem: str, host: str | None = None) -> list[str]:
    """Every rank's host name and local problem (e.g. no CUDA), gathered: the same verdict everywhere."""
    got = [json.loads(x) for x in control.allgather_bytes(json.dumps(
        {"host": host or socket.gethostname(), "problem": local_problem}).encode(), timeout)]
    by_problem: dict[str, list[int]] = {}
    for r, g in enumerate(got):
        if g["problem"]:
            by_problem.setdefault(g["problem"], []).append(r)
    problems = [f"{_who(rs, len(got), names)}: --transport {kind}: {p}" for p, rs in by_problem.items()]
    hosts: dict[str, list[int]] = {}
    for r, g in enumerate(got):
        hosts.setdefault(g["host"], []).append(r)
    if len(hosts) > 1:
        where = "; ".join(f"{h}: {', '.join(names(r) for r in rs[:4])}{' ...' if len(rs) > 4 else ''}"
                          for h, rs in sorted(hosts.items()))
        problems.append(f"--transport {kind} needs every rank of both jobs on one node, but they run on "
                        f"{len(hosts)} hosts ({where}); use nccl, gloo or mpi across nodes")
    return problems


def open_handle_transport(kind: str, group: Any, timeout: float, device: Any = None) -> HandleTransport:
    """The ``shm`` or ``cuda-ipc`` transport of ``group``; refused (same problems on every rank,
    exit 1) when the ranks span several nodes or, for cuda-ipc, a rank sees no CUDA device.
    ``device``: cuda-ipc's device when the caller owns the choice (``transport.device``)."""
    control: Transport = group.control
    if group.plane != "mpi":  # the store plane carries no point-to-point messages: gloo does
        from streamer.transport.torch_dist import TorchDistTransport

        control = TorchDistTransport(group.control, "gloo", store=group.store, timeout=timeout,
                                     prefix=f"shardstream/{kind}")
    backend: Backend | None = None
    problem = ""
    try:
        if kind == "shm":
            from streamer.transport.shm import ShmBackend

            backend = ShmBackend()
        else:
            from streamer.transport.cuda_ipc import CudaIpcBackend

            backend = CudaIpcBackend.for_rank(group.role_rank, device)
    except (TransportError, RuntimeError, OSError) as e:  # every rank must reach the allgather below
        problem = str(e)
    problems = _colocation_problems(kind, control, timeout, group.name, problem)
    own = control is not group.control
    if problems or backend is None:
        if backend is not None:
            backend.close()
        if own:
            control.close()
        raise PlanError(problems=problems)
    return HandleTransport(backend, control, group.name, own_control=own)
