"""Refusals every rank learns: the rule that keeps bad input on one rank from hanging the others.

A check that can refuse (a file, a manifest, an option, an output directory, a lock) may fail on
some ranks only. If those ranks simply exited, the others would wait for them at the next
collective until ``--timeout``, or forever where MPI cannot time out. So every multi-rank
command runs its checks *before anyone waits on anyone*, catches a refusal instead of raising it
(``LocalChecks``), and then holds one **agreement round** (``agree``): an allgather of "ok" or
"(exit code, lines)" from every rank. If any rank refused, every rank raises the same
``AgreedRefusal``: the lines of all refusing ranks (duplicates once), and the exit code of the
lowest refusing rank. The CLI prints the lines on one rank per launch and every rank exits with
that code, within the time of one allgather.

    checks = LocalChecks()
    with checks.capture():
        manifest = load_manifest(path)             # may refuse on this rank only
    agree(group.control, checks.refusal, timeout)  # every rank: go on together, or all refuse

``agreed(transport, timeout)`` is the two in one block (a single process: the block's own error
propagates unchanged). Group formation carries a refusal too (``rendezvous.join``): a rank whose
manifest did not load still joins, so that the others learn why instead of waiting for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from formats.errors import ShardstreamError

__all__ = ["AgreedRefusal", "Collective", "LocalChecks", "Refusal", "agree", "agreed", "problem_lines"]

class Collective(Protocol):
    """What an agreement round needs of a group: an allgather of bytes with a timeout (every
    ``Transport`` has it; so does convert's group of workers)."""

    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]: ...


#: lines an agreed refusal keeps (a broken manifest on 1000 ranks is still one problem)
MAX_LINES = 200


def problem_lines(e: BaseException) -> list[str]:
    """The lines the CLI prints for ``e`` (one per problem)."""
    if isinstance(e, ShardstreamError):
        lines = e.problems or [str(e)]
    elif isinstance(e, OSError):
        lines = [f"shardstream: {e.filename or ''}: {e.strerror or e}"]
    else:  # a bug: name it, so the peers do not wait for a rank that is gone
        lines = [f"shardstream: internal error: {type(e).__name__}: {e}"]
    return [ln if ln.startswith(("shardstream", "/", ".")) or ": " in ln else f"shardstream: {ln}" for ln in lines]


@dataclass(frozen=True)
class Refusal:
    """What one rank refuses with: the exit code it would exit with alone, and its lines."""

    exit_code: int
    lines: tuple[str, ...]

    @classmethod
    def of(cls, e: BaseException) -> Refusal:
        code = e.exit_code if isinstance(e, ShardstreamError) else 3
        return cls(int(code), tuple(problem_lines(e)))

    def to_json(self) -> dict[str, Any]:
        return {"code": self.exit_code, "lines": list(self.lines)}


class AgreedRefusal(ShardstreamError):
    """Raised on every rank of a group with the same lines and exit code (see the module doc)."""

    def __init__(self, refusals: list[tuple[int, Refusal]]) -> None:
        lines: list[str] = []
        for _, r in refusals:
            lines += [ln for ln in r.lines if ln not in lines]
        if len(lines) > MAX_LINES:
            lines = lines[:MAX_LINES] + [f"... and {len(lines) - MAX_LINES} more"]
        super().__init__(problems=lines)
        #: the merged (or world) ranks that refused, lowest first
        self.ranks = [r for r, _ in refusals]
        self.exit_code = refusals[0][1].exit_code

    def refusal(self) -> Refusal:
        """This verdict as one rank's refusal (to carry it on into a larger group)."""
        return Refusal(self.exit_code, tuple(self.problems))


class LocalChecks:
    """Collects what this rank refuses instead of raising it (``capture``); the first refusal wins."""

    def __init__(self, refusal: Refusal | None = None) -> None:
        self.refusal = refusal
        self.error: BaseException | None = None

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Run the block; an error in it (our errors, OSError, or a bug) becomes this rank's refusal."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every error must reach the peers, bugs included
            if os.environ.get("SHARDSTREAM_DEBUG") == "1":
                import traceback

                traceback.print_exc()
            if self.refusal is None:
                self.refusal, self.error = Refusal.of(e), e

    def raise_alone(self) -> None:
        """No peer to tell (one process): raise the captured error as it was."""
        if self.error is not None:
            raise self.error
        if self.refusal is not None:
            raise AgreedRefusal([(0, self.refusal)])


def agree(transport: Collective, refusal: Refusal | None, timeout: float, extra: Any = None) -> list[Any]:
    """One allgather of every rank's refusal (or None) and ``extra`` (JSON). Raises
    ``AgreedRefusal`` on every rank if any rank refused; else returns every rank's ``extra``."""
    payload = json.dumps({"r": refusal.to_json() if refusal else None, "x": extra}).encode()
    got = [json.loads(g) for g in transport.allgather_bytes(payload, timeout)]
    refused = [(r, Refusal(int(g["r"]["code"]), tuple(g["r"]["lines"]))) for r, g in enumerate(got) if g["r"]]
    if refused:
        raise AgreedRefusal(refused)
    return [g["x"] for g in got]


@contextmanager
def agreed(transport: Collective | None, timeout: float) -> Iterator[None]:
    """Run the block on every rank, then ``agree`` on whether any rank refused in it. With no
    ``transport`` (one process) the block's own error propagates unchanged."""
    checks = LocalChecks()
    with checks.capture():
        yield
    if transport is None:
        checks.raise_alone()
    else:
        agree(transport, checks.refusal, timeout)
