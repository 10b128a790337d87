"""A trainer that serves several inference replicas (``RefitSession.open(..., replicas=True)``).

Each replica is a receiver job of its own (``open(..., replica="NAME")``: its own launcher,
manifest and layout) that joins through ``RENDEZVOUS@NAME``: a file beside the trainer's, or an
entry in the registry that trainer rank 0 serves at ``tcp://HOST:PORT`` (``transport.roster``). The trainer
holds one ordinary session per replica, planned on its own: each moves the lower bound of bytes
for its layout, and keeps its own delta bases (the senders' base copies are per replica).

Before each push trainer rank 0 lists the waiting replicas and its ranks join the new replicas
together; a joiner's first push is full (its tensors hold no version the trainer knows), while
the others keep getting deltas. The pushes to the replicas run at once (a thread each, over
host transports; one after another by name on device ones), and each ends when every receiver
rank of its replica says it holds the version (a receipt on its store: bytes handed to a socket
prove nothing). A replica that fails (died, closed, timed out) is dropped on every trainer rank
(their verdicts are exchanged over the trainer's own group, ``rendezvous.join(replicas=True)``)
and the push goes on for the others. ``StepStats.replicas`` says what each replica received, or
why it was dropped. ``push()`` raises ``PushFailed`` only when no replica is left; a refused push
(``RefusedError``) raises once the other replicas' pushes ended (they may hold the version).
A dropped replica whose receivers survive (``--stay``) waits for a new sender job: the trainer
joins it again at a later push, with a full push.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from formats.errors import (
    PeerTimeoutError,
    PushFailed,
    ShardstreamError,
    TransportError,
    UsageError,
    ValidationError,
)
from streamer.execute.executor import ExecStats
from streamer.transport.rendezvous import replica_rendezvous, trainer_form
from streamer.transport.roster import agree_names, waiting

__all__ = ["Fleet", "ReplicaResult", "check_fleet_args"]

#: seconds a listed replica's store gets to answer before its file counts as stale
PROBE = 5.0
#: the trainer ranks' exchange of verdicts waits this many timeouts for the others (see ``_agree``)
VERDICT_WAIT = 2


@dataclass(frozen=True)
class ReplicaResult:
    """One replica's part in a trainer's push: the version it now holds, or why it was dropped."""

    name: str
    #: the version the push delivered to it (None: it failed, see ``error``)
    version: int | None
    #: why it was dropped (it died, closed, or could not join); None: it received the push
    error: str | None = None
    #: True when this push was its first from this trainer (full bytes, not a delta)
    joined: bool = False
    #: this trainer rank's seconds pushing to it, and joining it (opening its session) before
    seconds: float = 0.0
    join_seconds: float = 0.0
    #: bytes this trainer rank sent it (on the wire), and their full size
    bytes_sent: int = 0
    full_bytes_sent: int = 0


def check_fleet_args(role: str, rendezvous: str | None, transport: Any) -> str:
    """The rendezvous path of a trainer serving replicas, or the usage error."""
    rendezvous = trainer_form(role, rendezvous)
    if transport is not None and (not isinstance(transport, str) or transport not in ("gloo", "nccl")):
        raise UsageError(f"replicas move over gloo or nccl (the store control plane), not {transport!r}")
    return rendezvous


class Fleet:
    """The per-replica sessions of one trainer rank (see the module docstring)."""

    def __init__(self, owner: Any, opener: Callable[..., Any], rendezvous: str, transport: str | None) -> None:
        #: the trainer's own session (its group: the trainer's ranks), and ``RefitSession.open``
        self.owner = owner
        self.opener = opener
        self.rendezvous = rendezvous
        self.kind = transport
        self.subs: dict[str, Any] = {}
        #: the rendezvous file each session was joined through (a replica's receivers write a new
        #: one when they wait for a new sender job), and files that failed to join
        self.joined_by: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.last: int | None = None
        #: the replicas joined at open: their first push counts as their joining one
        self.fresh: set[str] = set()
        #: seconds this rank took to join each replica (reported with its first push)
        self.join_seconds: dict[str, float] = {}

    @property
    def group(self) -> Any:
        return self.owner.group

    @property
    def timeout(self) -> float:
        return float(self.owner.timeout)

    # ------------------------------------------------------------------ joining
    def waiting(self) -> dict[str, str]:
        """The replicas waiting to be joined now (name -> the address they wait at): new, not the
        epoch a session joined through, nor one that failed to join. Not probed."""
        return {name: text for name, text in waiting(self.rendezvous, self.group).items()
                if text not in (self.joined_by.get(name), self.refused.get(name))}

    def await_names(self, names: set[str], timeout: float) -> None:
        """Until every replica in ``names`` was joined or waits to be (``waiting``); raises
        ``PeerTimeoutError`` naming the missing ones after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while missing := names - set(self.subs) - set(self.waiting()):
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"replicas {', '.join(sorted(missing))} did not join through {self.rendezvous} "
                                       f"within {timeout:g} s")
            time.sleep(0.05)

    def _listing(self, wait: bool) -> dict[str, str]:
        """Trainer rank 0: the waiting replicas (``waiting``) whose store answers; with ``wait``,
        until one is there."""
        from streamer.transport.store import open_store

        deadline = time.monotonic() + self.timeout
        while True:
            found = {}
            for name, text in self.waiting().items():
                host, port = text.removeprefix("tcp://").split("/")[0].rsplit(":", 1)
                try:
                    # a gone job's port refuses at once; a TCPStore client would retry it for PROBE s
                    socket.create_connection((host, int(port)), timeout=PROBE).close()
                    open_store(host, int(port), server=False, timeout=PROBE)
                except Exception:  # noqa: BLE001 - a stale file: its job is gone
                    self.refused[name] = text
                    continue
                found[name] = text
            if found or not wait or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def admit(self, results: dict[str, ReplicaResult], *, wait: bool = False) -> set[str]:
        """Join the replicas waiting now (every trainer rank alike); the names joined. A replica
        that fails to join is reported in ``results`` and not tried again through the same file."""
        found = agree_names(self.group, self._listing(wait) if self.group.role_rank == 0 else None,
                            self.timeout + 10 if wait else self.timeout)
        if wait and not found:
            raise PeerTimeoutError(f"no replica joined through {self.rendezvous}@NAME within {self.timeout:g} s")
        fresh = set()
        for name, text in sorted(found.items()):
            if name in self.subs:  # its receivers wait for a new sender job: the old session is over
                self.drop(name, "it opened the session again")
            error = ""
            t0 = time.perf_counter()
            try:
                self.subs[name] = self.opener(self.owner.manifest, "send",
                                                    rendezvous=replica_rendezvous(self.rendezvous, name),
                                                    transport=self.kind, control="store", timeout=self.timeout,
                                                    options=self.owner.options, device_ops=self.owner.device_ops)
            except ShardstreamError as e:
                error = _reason(e)
            errors = self._agree({name: error} if error else {})
            if name in errors:
                self.refused[name] = text
                results[name] = ReplicaResult(name, None, f"could not join: {errors[name]}")
                if name in self.subs:
                    self.drop(name, errors[name])
            else:
                self.joined_by[name] = text
                self.join_seconds[name] = time.perf_counter() - t0
                fresh.add(name)
        return fresh

    def _agree(self, errors: dict[str, str]) -> dict[str, str]:
        """Every trainer rank's failures, merged (the first rank's reason for each replica). The
        other trainer ranks may come a whole timeout later than this one (trainer rank 0 waits
        up to the timeout for a replica's receipts, a rank's wait on a hung replica times out
        after another's ended): this waits for them ``VERDICT_WAIT`` timeouts (a trainer rank
        that died ends it sooner when it served the trainer's store)."""
        merged: dict[str, str] = {}
        wait = VERDICT_WAIT * self.timeout + PROBE
        for got in self.group.role_control.allgather_bytes(json.dumps(errors).encode(), wait):
            for name, reason in json.loads(got).items():
                merged.setdefault(name, reason)
        return merged

    def drop(self, name: str, reason: str) -> None:
        """Leave replica ``name``'s session: its receivers end the push with ``reason``."""
        sub = self.subs.pop(name)
        self.joined_by.pop(name, None)
        self.join_seconds.pop(name, None)
        sub.group.control.post_abort(f"the trainer dropped replica {name}: {reason}", 3)
        try:
            sub.close(done=False)
        except ShardstreamError:  # its store went away with it
            pass

    # ------------------------------------------------------------------ pushing
    def push(self, tensors: Any, version: int | None) -> tuple[ExecStats, int, list[ReplicaResult], list[Any]]:
        """One push to every replica (see the module docstring): the replicas' figures added up,
        the version, what each replica received, and their sessions' own step figures."""
        t0 = time.perf_counter()
        results: dict[str, ReplicaResult] = {}
        fresh = self.admit(results) | self.fresh
        self.fresh = set()
        v = version if version is not None else self._next_version()
        if not self.subs:
            raise PushFailed(_none_left(results), v)
        mine, errors, refusals = self._push_each(tensors, v)
        stats = [mine[name] for name in sorted(mine)]
        errors = self._agree(errors)
        for name in sorted(self.subs):
            if name in errors:
                self.drop(name, errors[name])
                results[name] = ReplicaResult(name, None, errors[name])
            elif name in mine:
                st = mine[name]
                results[name] = ReplicaResult(name, v, None, name in fresh, st.seconds, self.join_seconds.pop(name, 0.0),
                                              st.bytes_sent, st.full_bytes_sent)
        if any(name in mine for name in self.subs):
            self.last = v  # a replica holds it (even beside a refusal): the next push numbers on
        refused = [refusals[n] for n in sorted(refusals) if n in self.subs]  # not one dropped meanwhile
        if refused:
            self.fresh = {n for n in fresh if n in self.subs and n not in mine}  # their first push is yet to come
            raise refused[0]  # every trainer rank holds it (the refusing replica's agreement), after the drops
        if not self.subs:
            raise PushFailed(_none_left(results), v)
        return _combined(stats, time.perf_counter() - t0), v, [results[n] for n in sorted(results)], stats

    def _next_version(self) -> int:
        """One more than the last version this trainer pushed or any replica it serves held when
        it joined (a restarted trainer continues the numbering, as a single session does)."""
        held = [int(v) for sub in self.subs.values() for v in sub.held_at_start if v is not None]
        return max([self.last or 0, *held]) + 1

    def _push_each(self, tensors: Any, v: int) -> tuple[dict[str, Any], dict[str, str], dict[str, ValidationError]]:
        """Push ``v`` to every replica: each one's step figures, the reasons of those that failed,
        and the refusals (every trainer rank and that replica's ranks hold each).
        Host transports push to all replicas at once (a thread each, the state dict collected
        once); device ones (a thread's CUDA device is not the rank's) one after another. Every
        replica's push has ended when this returns; anything else raised (a bug) raises here."""
        from streamer.refit.local import collect_local

        def one(name: str) -> Any:
            st = self.subs[name].push(shared, version=v)
            self.subs[name].await_receipts(v)  # it holds v: not only were the bytes sent
            return st

        names = sorted(self.subs)
        shared, problems = collect_local(tensors)
        together = not problems and self._host() and len(names) > 1
        if not together:
            shared = tensors  # each session collects it (and refuses what it must) on this thread
        outcomes = _each(lambda name: _outcome(one, name), names, together)
        mine: dict[str, Any] = {}
        errors: dict[str, str] = {}
        refusals: dict[str, ValidationError] = {}
        for name, (st, error) in zip(names, outcomes):
            if isinstance(error, TransportError):
                errors[name] = _reason(error)
            elif isinstance(error, ValidationError):  # a refused push (RefusedError)
                refusals[name] = error
            elif error is not None:
                raise error  # a bug, or bad input this rank alone found
            else:
                mine[name] = st
        return mine, errors, refusals

    def _host(self) -> bool:
        """Whether every replica's transport moves host memory (threads may drive them)."""
        return all(getattr(sub.transport, "device", None) is None for sub in self.subs.values())

    def close(self, done: bool) -> None:
        """Leave every replica's session; host ones at once (a hung replica's store answers only
        at the timeout: one such wait, not one per replica)."""
        def leave(name: str) -> None:
            try:
                subs[name].close(done)
            except ShardstreamError:  # a replica that went away meanwhile
                pass

        host = self._host()
        subs, self.subs = self.subs, {}
        _each(leave, sorted(subs), host)


def _each(act: Callable[[str], Any], names: list[str], together: bool) -> list[Any]:
    """``act(name)`` for every name: with ``together``, a thread each (one name: on this thread),
    else one after another; every call has ended when this returns."""
    if not together or len(names) < 2:
        return [act(name) for name in names]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="shardstream-replica") as pool:
        return list(pool.map(act, names))


def _outcome(push: Callable[[str], Any], name: str) -> tuple[Any, BaseException | None]:
    """``push(name)``'s result, or what it raised (collected, so that every push ends first)."""
    try:
        return push(name), None
    except Exception as e:  # noqa: BLE001 - sorted out by the caller once every push ended
        return None, e


def _reason(e: ShardstreamError) -> str:
    return "; ".join(e.problems) if e.problems else str(e)


def _none_left(results: dict[str, ReplicaResult]) -> str:
    why = "; ".join(f"{r.name}: {r.error}" for r in results.values() if r.error)
    return "no replica is left" + (f" ({why})" if why else "")


def _combined(stats: list[Any], seconds: float) -> ExecStats:
    """The replicas' figures added up (the largest buffer peak; the push's wall seconds)."""
    es = ExecStats()
    for st in stats:
        for f in fields(ExecStats):
            if f.name == "encodings":
                for k, n in st.encodings.items():
                    es.encodings[k] = es.encodings.get(k, 0) + n
            elif f.name == "peak_buffer_bytes":
                es.peak_buffer_bytes = max(es.peak_buffer_bytes, st.peak_buffer_bytes)
            else:
                setattr(es, f.name, getattr(es, f.name) + getattr(st, f.name))
    es.seconds = seconds
    return es
