"""The commands that run on several ranks at once (``refit send|recv``, ``convert`` under
``mpiexec``): how their refusals reach every rank, and who prints them.

The rule (docs/failures.md): a check that refuses on some ranks only never ends them alone. It
becomes a refusal that the group's first collective carries (``ops.agree``), so every
rank of both jobs ends with the same exit code, and each launch prints the lines once (its rank
0). That holds for a command line that does not parse too: the rank joins the group with the
usage error (exit 2) instead of exiting on its own, which would leave the others waiting.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from formats.errors import PlanError, ShardstreamError, TransportError, UsageError
from formats.manifest.wire import Manifest
from streamer.ops.agree import AgreedRefusal, LocalChecks, Refusal, agree

__all__ = ["ArgvError", "Parser", "announce", "argv_refused", "mpi_comm", "on_workers", "run_refit"]

#: seconds an unparseable command line waits for its peers in the agreement (no --timeout parsed)
DEFAULT_TIMEOUT = 300.0


class ArgvError(Exception):
    """A command line that did not parse (``Parser.error``), with the parser that refused it."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser, self.message = parser, message

    def print_usage(self) -> None:
        """What argparse prints alone: the usage, then the error."""
        self.parser.print_usage(sys.stderr)
        print(f"{self.parser.prog}: error: {self.message}", file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (``ArgvError``) rather than printed and exited on,
    so that a rank of a multi-rank launch can tell its peers (``argv_refused``)."""

    def error(self, message: str) -> NoReturn:
        raise ArgvError(self, message)


_announced: list[ShardstreamError] = []


def announce(e: ShardstreamError) -> None:
    """Print a verdict every rank holds: once per process, and only on the launch's rank 0 (one
    launcher, one copy of each line; two separately launched jobs print it once each)."""
    from streamer.transport.jobs import launcher_rank

    if _announced:
        return
    _announced.append(e)
    if launcher_rank()[0] == 0:
        for line in e.problems or [str(e)]:
            print(line, file=sys.stderr)
    sys.stderr.flush()


def run_refit(role: str | None, manifest: Manifest | None, refusal: Refusal | None, args: Any) -> int:
    """One side of a refit (``refit.job.RefitJob``); ``refusal``: what this rank refused already."""
    from streamer.refit.job import RefitJob
    from streamer.refit.options import RefitOptions
    from streamer.refit.session import RefusedError
    from streamer.transport.jobs import abort, launched_by_mpi

    checks = LocalChecks(refusal)
    options = RefitOptions()
    with checks.capture():  # options this rank alone may refuse
        options = RefitOptions(bucket_size=args.bucket_size, verify=args.verify, strategy=args.strategy,
                               delta=args.delta, link_gbps=args.link_gbps, fp8_block=args.fp8_block,
                               ue8m0=args.ue8m0,
                               src_domain_size=args.src_domain_size, dst_domain_size=args.dst_domain_size,
                               allow_extra=args.allow_extra, planned_steps=args.steps)
    job = RefitJob(role, manifest, rendezvous=args.rendezvous, transport=args.transport,
                   control=args.control, timeout=args.timeout, steps=args.steps, save=args.save, stay=args.stay,
                   replica=args.replica, replicas=args.replicas,
                   options=options, refusal=checks.refusal, announce=announce)
    try:
        report = job.run()
    except (AgreedRefusal, RefusedError, PlanError, UsageError) as e:
        announce(e)  # every rank has the same verdict: one line per problem per launch
        return e.exit_code
    except ShardstreamError as e:
        message = "\n".join(e.problems or [str(e)])
        group = job.session.group if job.session is not None else None
        # a transport failure means a peer is gone: MPI may block sending to it, and the peers
        # see the failure themselves; any other failure is news to them
        if group is not None and (group.plane == "store" or not isinstance(e, TransportError)):
            group.control.post_abort(message, e.exit_code)
        if launched_by_mpi():
            abort(message, e.exit_code)
        raise
    if report.reporter:
        from streamer.cli.args import emit

        emit(args, report.to_dict(), report.text())
    return 0


def _option(argv: list[str], name: str) -> str | None:
    """The value given to ``name`` (``--x V`` or ``--x=V``) in a command line that did not parse."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def _float(text: str | None, default: float) -> float:
    try:
        v = float(text) if text is not None else default
    except ValueError:
        return default
    return v if v > 0 else default


def argv_refused(e: ArgvError, argv: list[str], build_parser: Any) -> int:
    """A command line that did not parse. On a rank of a multi-rank launch: join the group with
    the usage error (exit 2 on every rank, one line). One process: argparse's own output."""
    try:
        refused = _join_refused(e, argv, build_parser)
    except ShardstreamError as err:  # e.g. the peers never came: the usage error stands
        print(f"{e.parser.prog}: error: {e.message}\n{err}", file=sys.stderr)
        return 2
    if refused is None:
        e.print_usage()
        return 2
    return refused


def _join_refused(e: ArgvError, argv: list[str], build_parser: Any) -> int | None:
    from streamer.transport.jobs import launched_by_mpi

    words = [a for a in argv if not a.startswith("-")]
    cmd = words[0] if words else ""
    comm = mpi_comm() if cmd == "convert" else None
    if comm is not None:
        from streamer.transport.mpi import MPITransport

        line = f"{e.parser.prog}: error: {e.message}"
        try:
            agree(MPITransport(comm), Refusal(2, (line,)), DEFAULT_TIMEOUT)
        except AgreedRefusal as verdict:
            announce(verdict)
            return verdict.exit_code
    if cmd != "refit" or not (launched_by_mpi() or _option(argv, "--rendezvous") or "RANK" in os.environ):
        return None
    role = next((w for w in words[1:] if w in ("send", "recv")), None)
    line = f"shardstream refit{' ' + role if role else ''}: error: {e.message}"
    # every other option at its default: the job refuses at once, it only needs to join
    args = build_parser().parse_args(["refit", role or "send", "--manifest", "-"])
    args.rendezvous = _option(argv, "--rendezvous")
    control = _option(argv, "--control")
    args.control = control if control in ("auto", "mpi", "store") else "auto"
    args.timeout = _float(_option(argv, "--timeout"), DEFAULT_TIMEOUT)
    # a trainer serving replicas refuses among its own ranks; a replica joins through its own file
    args.replicas = role == "send" and "--replicas" in argv
    args.replica = _option(argv, "--replica") if role == "recv" else None
    return run_refit(role, None, Refusal(2, (line,)), args)


def on_workers(body: Callable[[], int], *, debug: bool) -> int:
    """``body`` on one of convert's workers: an agreed refusal ends each worker with its code
    (one prints it); any other failure is this worker's alone, and aborts them all (``MPI_Abort``)
    instead of leaving the others to wait for it."""
    from streamer.ops.agree import problem_lines
    from streamer.transport.watchdog import abort

    try:
        return body()
    except AgreedRefusal:
        raise
    except Exception as e:  # noqa: BLE001 - this worker alone: the others must not wait for it
        if debug or os.environ.get("SHARDSTREAM_DEBUG") == "1":
            raise
        abort("\n".join(problem_lines(e)), e.exit_code if isinstance(e, ShardstreamError) else 3)
        raise  # pragma: no cover - abort does not return


def mpi_comm() -> Any:
    """COMM_WORLD when launched under mpiexec with more than one rank, else None."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        v = os.environ.get(var)
        if v and v.isdigit() and int(v) > 1:
            from mpi4py import MPI

            return MPI.COMM_WORLD
    return None
