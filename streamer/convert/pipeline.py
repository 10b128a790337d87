"""The job pipeline of ``convert`` (design §7), the same for every output format.

1. Check the inputs and plan; open every source tensor the plan reads (rank 0), so that bad
   input fails before anything is written. Under ``mpiexec`` the step ends in an agreement
   round (``ops.agree``): a refusal on any worker ends every worker with it.
2. Rank 0 opens the output: takes its lock, turns a finished output back into records when
   resuming, removes the manifest and stale temp files; again agreed on by every worker.
3. Every worker (``mpiexec -n K``: K ranks) writes its share of the sink's jobs, largest first;
   with ``--resume`` a job whose completion record still matches what is on disk is skipped.
4. Results are gathered; rank 0 writes what goes beside the data, then ``manifest.json`` (last:
   a directory with a manifest is complete), then drops the records and the lock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from formats.errors import FormatError, PlanError, ShardstreamError, UsageError, ValidationError
from formats.manifest.wire import Manifest, atomic_write_bytes, load_manifest, save_manifest
from formats.store import SourceStore
from formats.validate.manifest import validate_manifest
from streamer.convert.fill import Filler
from streamer.convert.options import REPORT_COUNTS, ConvertOptions, ConvertReport
from streamer.convert.progress import Progress
from streamer.convert.safetensors_sink import SafetensorsSink
from streamer.convert.sinks import Job, Sink
from streamer.convert.state import MANIFEST, Lock, Records, mark_incomplete, open_output, remove_state
from streamer.ops.agree import AgreedRefusal, Refusal, agreed
from streamer.ops.quant import planned_destination, quant_report, quant_targets
from streamer.plan.match import CASTABLE, array_casts
from streamer.plan.model import Plan
from streamer.plan.planner import plan_transfers

__all__ = ["convert"]

J = TypeVar("J", bound=Job)


@dataclass(frozen=True)
class _Workers:
    """This process among the conversion's workers (one, or the ranks of ``mpiexec``)."""

    comm: Any
    rank: int = 0
    size: int = 1
    timeout: float = 300.0
    #: the workers' small collectives with timeouts (an ``MPITransport`` over ``comm``; None: one worker)
    control: Any = None

    @classmethod
    def of(cls, comm: Any, control: Any, timeout: float) -> _Workers:
        if comm is None:
            return cls(None, timeout=timeout)
        if control is None:
            raise UsageError("convert with several workers needs their control plane (control=MPITransport(comm))")
        return cls(comm, comm.Get_rank(), comm.Get_size(), timeout, control)

    def agreed(self) -> AbstractContextManager[None]:
        """Run a block on every worker; a refusal in it on any worker is raised on all of them."""
        return agreed(self.control, self.timeout)


def convert(src: Manifest, dst: Manifest, out_dir: str | os.PathLike[str], opts: ConvertOptions | None = None,
            *, comm: Any = None, control: Any = None, log: Any = None, src_where: str = "SRC",
            dst_where: str = "DST", store: Callable[[Manifest], SourceStore] = SourceStore) -> ConvertReport:
    """Convert the checkpoint ``src`` describes into ``dst``'s layout under ``out_dir``.

    Raises ``ValidationError`` / ``PlanError`` / ``FormatError`` (nothing written) for bad input,
    ``OutputLockedError`` when another convert holds ``out_dir``. ``src_where`` / ``dst_where``
    name the manifests in problem lines (the CLI passes their paths). Several workers: ``comm``
    (mpi4py) and ``control``, their collectives with timeouts (``MPITransport(comm)``); a refusal
    on one worker is then an ``AgreedRefusal`` on all of them (``ops.agree``). ``store``: what
    reads ``src`` (``merge_lora.MergingStore`` merges an adapter on the way).
    """
    opts = opts or ConvertOptions()
    t0 = time.perf_counter()
    workers = _Workers.of(comm, control, opts.timeout)
    with workers.agreed():  # every check that can refuse, on every worker, before anyone waits
        _check_inputs(src, dst, src_where, dst_where)
        # arrays the destination asks in another float type: the plan moves the source's type and
        # the sink casts while it writes (int/float pairs stay mismatches for the plan to refuse)
        asked = {f: s for f, (s, d) in array_casts(src, dst).items() if s in CASTABLE and d in CASTABLE}
        # FP8 weights with a scale sibling, fed from a float source: moved as the source's type and
        # quantized by the sink, which also computes their scales
        try:
            targets = quant_targets(src, dst, block=opts.fp8_block, ue8m0=opts.ue8m0)
        except PlanError as e:
            raise PlanError(problems=[f"{dst_where}: {ln}" for ln in e.problems]) from e
        sink = _sink(dst, planned_destination(dst, targets, asked), targets, opts, dst_where)
        plan = _checked_plan(src, sink.target, opts, workers.rank, src_where, dst_where, store)
        jobs = sink.layout(plan)
    rep = _run(src, sink, jobs, Path(out_dir), opts, workers, store)
    rep.seconds = time.perf_counter() - t0
    rep.plan_stats = plan.stats().to_dict()
    rep.quantized = quant_report(dst, targets, "by convert") if targets else {}
    return rep


def _sink(dst: Manifest, planned: Manifest, targets: Any, opts: ConvertOptions, dst_where: str) -> Sink[Any]:
    if opts.format == "zarr":
        from streamer.convert.zarr_sink import ZarrSink  # zarr is an optional dependency

        return ZarrSink(planned, opts, dst_where, stored=dst, quantize=targets)
    if opts.format == "safetensors":
        return SafetensorsSink(planned, opts, stored=dst, quantize=targets)
    raise UsageError(f"--format {opts.format}: expected safetensors or zarr")


def _check_inputs(src: Manifest, dst: Manifest, src_where: str, dst_where: str) -> None:
    problems = validate_manifest(src, where=src_where) + validate_manifest(dst, where=dst_where)
    if problems:
        raise ValidationError(problems=problems)
    missing = sorted({f for f, _, c in src.iter_chunks() if c.source is None or c.source.file is None})
    if missing:
        raise ValidationError(problems=[f"{src_where}: {f}: chunk has no source.file, so there is nothing to read "
                                        "(describe the files with `shardstream import`)" for f in missing[:20]])


def _run(src: Manifest, sink: Sink[J], jobs: Sequence[J], out: Path, opts: ConvertOptions,
         workers: _Workers, store: Callable[[Manifest], SourceStore]) -> ConvertReport:
    # ---- from here on we write; bad input has been ruled out
    lock: Lock | None = None
    try:
        with workers.agreed():  # rank 0 opens the output (lock, not empty): every worker learns how it went
            if workers.rank == 0:
                lock = _open(out, opts, sink, jobs)
        rep, checksums = _run_jobs(src, out, sink, jobs, opts, workers, store)
        if lock is not None:
            final = sink.manifest(checksums)
            sink.finish(out, final, jobs)
            for name, data in opts.extra_files:
                atomic_write_bytes(out / name, data)
            save_manifest(final, out / MANIFEST, format_version=opts.manifest_version)  # v2: + checksum sidecar
            remove_state(out, lock)  # every worker is past _gather: all records are written
        if workers.control is not None:
            workers.control.barrier(opts.timeout)  # rank 0 has written the manifest
    finally:
        if lock is not None:
            lock.release()
    return rep


# ------------------------------------------------------------------ 1. plan and preflight

def _checked_plan(src: Manifest, dst: Manifest, opts: ConvertOptions, rank: int, src_where: str,
                  dst_where: str, store: Callable[[Manifest], SourceStore]) -> Plan:
    """The plan, after every source tensor it reads has been opened (rank 0; the caller's
    agreement round shares the verdict)."""
    try:
        plan = plan_transfers(src, dst, allow_extra=opts.allow_extra)
    except PlanError as e:  # its lines name the array; say which manifests were being matched
        raise PlanError(problems=[f"{dst_where}: {ln}; source manifest {src_where}" for ln in e.problems]) from e
    problems = _preflight(src, plan, store) if rank == 0 else []
    if problems:
        raise FormatError(problems=problems)
    return plan


def _preflight(src: Manifest, plan: Plan, open_store: Callable[[Manifest], SourceStore]) -> list[str]:
    """Open every source tensor the plan reads, before anything is written."""
    problems: list[str] = []
    reported: set[str] = set()
    seen: set[tuple[str, int, int]] = set()
    with open_store(src) as store:
        for t in plan.transfers:
            if (t.fqn, t.src_chunk, t.src_rank) in seen:
                continue
            seen.add((t.fqn, t.src_chunk, t.src_rank))
            chunk = src.arrays[t.fqn].chunks[t.src_chunk]
            try:
                rt = store.resolve(t.fqn, chunk, t.src_rank)
                if not chunk.local_box.fits_in(rt.shape):
                    problems.append(f"{rt.path}: {t.fqn}: stored tensor {rt.name!r} has shape {list(rt.shape)}, "
                                    f"too small for chunk region {chunk.region} at offsets {list(chunk.local_offsets)}")
            except ShardstreamError as e:
                # one line per problem: a broken file is reported once, not once per chunk in it
                problems.extend(p for p in (e.problems or [str(e)]) if p not in reported)
                reported.update(e.problems or [str(e)])
            if len(problems) > 200:
                problems.append("... (stopping after 200 problems)")
                break
    return problems


# ------------------------------------------------------------------ 2. the output directory

def _open(out: Path, opts: ConvertOptions, sink: Sink[J], jobs: Sequence[J]) -> Lock:
    """Rank 0: lock ``out``; with ``--resume``, turn a finished output back into records; then
    make it read as incomplete until the new manifest lands."""
    lock = open_output(out, opts.resume)
    try:
        if opts.resume and (out / MANIFEST).exists():
            _records_from_manifest(out, sink, jobs)
        mark_incomplete(out, sink.temp_paths(jobs))
        sink.prepare(out)
    except BaseException:
        lock.release()
        raise
    return lock


def _records_from_manifest(out: Path, sink: Sink[J], jobs: Sequence[J]) -> None:
    """A finished output keeps no records: its manifest's chunk checksums stand for them, where
    its chunks are the ones this run writes. ``Sink.intact`` still checks every job on disk."""
    try:
        old = load_manifest(out / MANIFEST)
    except (OSError, ShardstreamError):
        return
    known: dict[str, str] = {}
    try:
        for fqn, a in sink.manifest({}).arrays.items():
            b = old.arrays.get(fqn)
            if b is None or (b.shape, b.data_type, len(b.chunks)) != (a.shape, a.data_type, len(a.chunks)):
                continue
            for ci, (mine, theirs) in enumerate(zip(a.chunks, b.chunks)):
                src = theirs.source
                if src is not None and src.checksum is not None and replace(theirs, source=replace(
                        src, checksum=None)) == mine:
                    known[f"{fqn}|{ci}"] = src.checksum
    except ShardstreamError:  # its checksum sidecar is gone or damaged: nothing is reused on trust
        return
    records = Records(out)
    for job in jobs:
        keys = sink.chunk_keys(job)
        if all(k in known for k in keys):
            records.save(sink.record_name(job), {**sink.record_key(job), "checksums": {k: known[k] for k in keys}})


# ------------------------------------------------------------------ 3. the jobs

def _assign(jobs: Sequence[J], workers: int) -> list[list[J]]:
    """Largest job first onto the least loaded worker (deterministic: ties broken by name)."""
    loads = [0] * workers
    share: list[list[J]] = [[] for _ in range(workers)]
    for j in sorted(jobs, key=lambda j: (-j.nbytes, j.name)):
        w = min(range(workers), key=lambda i: (loads[i], i))
        loads[w] += j.nbytes
        share[w].append(j)
    return share


def _run_jobs(src: Manifest, out: Path, sink: Sink[J], jobs: Sequence[J], opts: ConvertOptions,
              workers: _Workers, open_store: Callable[[Manifest], SourceStore]) -> tuple[ConvertReport, dict[str, str]]:
    """This worker's share of ``jobs``; then every worker's report and checksums."""
    mine = _assign(jobs, workers.size)[workers.rank]
    rep = ConvertReport(workers=workers.size)
    checksums: dict[str, str] = {}
    records = Records(out)
    progress = Progress(sum(j.nbytes for j in mine), "convert", enabled=opts.progress if workers.rank == 0 else False)
    error: str | None = None
    store = open_store(src)
    store.read_budget = opts.buffer_bytes
    try:
        filler = Filler(src, store)
        for job in mine:
            done = _reusable(out, sink, job, records) if opts.resume else None
            if done is not None:
                checksums.update(done)
                rep.files_skipped += 1
                progress.update(job.nbytes)
                continue
            records.drop(sink.record_name(job))
            cs = sink.write(out, job, filler, progress)
            checksums.update(cs)
            records.save(sink.record_name(job), {**sink.record_key(job), "checksums": cs})
            rep.files_written += 1
            rep.bytes_written += job.nbytes
    except ShardstreamError as e:
        if workers.comm is None:
            raise
        error = "; ".join(e.problems or [str(e)])
    finally:
        sink.close()
        store.close()
        progress.close()
    rep.bytes_read = store.stats.bytes_read
    rep.reads = store.stats.reads
    return _gather(workers, error, rep, checksums)


def _reusable(out: Path, sink: Sink[J], job: J, records: Records) -> Mapping[str, str] | None:
    """The checksums of ``job`` as an earlier run finished it, if its record matches this run
    and the output on disk still matches the record; else None."""
    record = records.load(sink.record_name(job))
    if record is None or any(record.get(k) != v for k, v in sink.record_key(job).items()):
        return None
    cs = record.get("checksums")
    if not isinstance(cs, dict) or not all(isinstance(cs.get(k), str) for k in sink.chunk_keys(job)):
        return None
    return cs if sink.intact(out, job, cs) else None


# ------------------------------------------------------------------ 4. results

def _gather(workers: _Workers, error: str | None, rep: ConvertReport, checksums: dict[str, str]
            ) -> tuple[ConvertReport, dict[str, str]]:
    """Under mpiexec: every worker learns every failure, and the reports and checksums add up."""
    if workers.comm is None:
        return rep, checksums
    results = workers.comm.allgather((error, rep.to_dict(), checksums))
    errs = [(i, Refusal(FormatError.exit_code, (f"worker {i}: {e}",))) for i, (e, _, _) in enumerate(results) if e]
    if errs:  # every worker holds the same list: one of them prints it
        raise AgreedRefusal(errs)
    total = ConvertReport(workers=workers.size)
    for _, d, cs in results:
        for k in REPORT_COUNTS:
            setattr(total, k, getattr(total, k) + d[k])
        checksums.update(cs)
    return total, checksums
