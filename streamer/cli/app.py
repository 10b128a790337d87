"""``shardstream`` command line: a thin layer over the library (design §8).

Exit codes: 0 success; 1 invalid input (every problem on its own line); 2 usage error;
3 runtime failure (peer died, timeout, I/O). No traceback for bad input unless ``--debug``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from formats.errors import PlanError, ShardstreamError, UsageError
from formats.limits import RANK_FILE_PATTERN
from streamer import __version__
from streamer.cli.args import emit as _out
from streamer.cli.args import parse_block, parse_size
from streamer.cli.args import positive_int as _positive_int
from streamer.cli.collective import ArgvError, Parser, announce, argv_refused, mpi_comm, on_workers
from streamer.ops.agree import AgreedRefusal

if TYPE_CHECKING:
    from formats.manifest import Manifest

__all__ = ["main", "parse_size", "build_parser"]


def _load(path: str) -> Any:
    """A manifest file, a directory with manifest.json, or a checkpoint to import on the fly."""
    from formats.manifest import load_manifest
    from streamer.convert.importer import import_checkpoint

    p = Path(path)
    if p.is_file() and p.suffix == ".json" and not p.name.endswith(".index.json"):
        return load_manifest(p)
    if p.is_dir() and (p / "manifest.json").exists():
        return load_manifest(p / "manifest.json")
    return import_checkpoint([p])


def _where(path: str) -> str:
    """How problem lines name a manifest given as PATH: the manifest file a directory stands for."""
    p = Path(path)
    return str(p / "manifest.json") if p.is_dir() and (p / "manifest.json").exists() else path


# ------------------------------------------------------------------ commands

def cmd_import(args: argparse.Namespace) -> int:
    from formats.manifest import save_manifest
    from streamer.convert.importer import import_checkpoint

    out = Path(args.output)
    extra: dict[str, Any] = {}
    if args.to is not None and args.model is None:
        raise UsageError("--to hf needs --model CFG (the model's HF config.json)")
    if args.model is not None and args.to is None:
        raise UsageError("--model applies with --to hf (import a Megatron checkpoint under HF names)")
    p = Path(args.paths[0])
    from streamer.convert.importer import import_megatron, is_megatron_checkpoint

    if len(args.paths) == 1 and is_megatron_checkpoint(p):
        m, skipped = import_megatron(p, manifest_dir=out.parent.resolve(), name=args.name, model=args.model)
        extra["skipped"] = skipped.to_dict()
    elif args.to is not None:
        raise UsageError(f"{p}: --to hf reads Megatron checkpoints (a directory with "
                         "latest_checkpointed_iteration.txt, or an iter_NNNNNNN directory: torch_dist or legacy "
                         "mp_rank_XX)")
    else:
        m = import_checkpoint(args.paths, manifest_dir=out.parent.resolve(), name=args.name)
    save_manifest(m, out)
    chunks = m.chunk_count()
    nbytes = sum(a.nbytes for a in m.arrays.values())
    _out(args, {"manifest": str(out), "arrays": len(m.arrays), "chunks": chunks, "bytes": nbytes, **extra},
         f"wrote {out}: {len(m.arrays)} arrays, {chunks} chunks, {nbytes / 1e9:.3f} GB")
    return 0


def _write_layout(m: Manifest, args: argparse.Namespace) -> Manifest:
    """Validate and write a generated manifest in ``--format-version``. The compact form is
    parsed back and validated as written (per layout, without expanding an array); the returned
    manifest is that parsed one."""
    from formats.manifest import COMPACT_FORMAT_VERSION, atomic_write_bytes, dumps_manifest, loads_manifest
    from formats.validate import validate_manifest

    text = dumps_manifest(m, format_version=args.format_version)
    if args.format_version == COMPACT_FORMAT_VERSION:
        m = loads_manifest(text, where=args.output)
    problems = validate_manifest(m, where=args.output, check_paths=False)
    if problems:
        raise ShardstreamError(problems=problems)
    atomic_write_bytes(args.output, text.encode())
    return m


def cmd_layout(args: argparse.Namespace) -> int:
    from formats.layouts import apply_layout, parse_mesh, parse_rule

    mesh = parse_mesh(args.mesh or "tp=1")
    rule_texts = list(args.rule)
    if not getattr(args, "preset", None) and (args.first_stage_layers is not None
                                              or args.last_stage_layers is not None):
        raise UsageError("--first-stage-layers / --last-stage-layers go with --preset megatron")
    if args.megatron_spec is not None and getattr(args, "preset", None) != "megatron":
        raise UsageError("--megatron-spec goes with --preset megatron")
    if not getattr(args, "preset", None) and getattr(args, "dtype", None):
        raise UsageError("--dtype goes with --preset (other layouts take the dtypes of --model / --like)")
    if getattr(args, "preset", None):  # the framework's own local names and fused layouts
        from formats.layouts.presets import preset_dtype, preset_manifest

        if not getattr(args, "model", None) or args.like or args.rule or args.include_mtp:
            raise UsageError("layout --preset needs --model CFG (an HF config.json) and takes no --like, --rule "
                             "or --include-mtp")
        pattern = None if args.no_files else args.file_pattern
        if args.file_pattern is None and not args.no_files and args.preset != "hf":
            pattern = RANK_FILE_PATTERN  # hf: convert names the files (model.safetensors, shards)
        dtype = preset_dtype(args.model, args.dtype)
        m = preset_manifest(args.model, args.preset, mesh, file_pattern=pattern, domain_size=args.domain_size,
                            name=args.name, dtype=dtype, fp8=args.fp8, first_stage_layers=args.first_stage_layers,
                            last_stage_layers=args.last_stage_layers, megatron_spec=args.megatron_spec or "te")
        m = _write_layout(m, args)
        chunks = m.chunk_count()
        _out(args, {"manifest": args.output, "world_size": m.world_size, "arrays": len(m.arrays), "chunks": chunks,
                    "preset": args.preset, "dtype": dtype},
             f"wrote {args.output}: {args.preset}, {dtype}, world_size {m.world_size}, {len(m.arrays)} arrays, "
             f"{chunks} chunks")
        return 0
    if getattr(args, "model", None):
        from formats.layouts import manifest_from_arrays
        from formats.layouts.models import arrays_from_model, generic_rules

        if args.like:
            raise UsageError("layout: give --like MANIFEST or --model CFG, not both")
        like = manifest_from_arrays(arrays_from_model(args.model, fp8=args.fp8, include_mtp=args.include_mtp))
        rule_texts = rule_texts or generic_rules(mesh.axes)  # no --rule: Megatron-like generic rules
    elif args.like:
        like = _load(args.like)
    else:
        raise UsageError("layout needs --like MANIFEST or --model CFG (HF config.json or NCCL M2N model JSON)")
    rules = [parse_rule(r, mesh) for r in rule_texts]
    if args.rule:  # a typo in a glob silently replicates the array: say so
        from formats.layouts import unmatched_rules

        for r in unmatched_rules(like.arrays, rules):
            print(f"shardstream: warning: rule {r.pattern!r} matches no array", file=sys.stderr)
    pattern = None if args.no_files else args.file_pattern
    if args.file_pattern is None and not args.no_files:
        # one rank: leave files to `convert`, which names them HF style (model.safetensors, or shards
        # + index with --max-shard-size); several ranks: one file per rank
        pattern = None if mesh.size == 1 else RANK_FILE_PATTERN
    m = _write_layout(apply_layout(like, mesh, rules, file_pattern=pattern, domain_size=args.domain_size,
                                   name=args.name), args)
    chunks = m.chunk_count()
    _out(args, {"manifest": args.output, "world_size": m.world_size, "arrays": len(m.arrays), "chunks": chunks},
         f"wrote {args.output}: world_size {m.world_size}, {len(m.arrays)} arrays, {chunks} chunks")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from formats.manifest import load_manifest
    from formats.validate import validate_data, validate_manifest

    results = []
    bad = 0
    for path in args.manifests:
        try:
            m = load_manifest(path)
            problems = validate_manifest(m, where=path)
            if args.data and not problems:
                problems = validate_data(m, where=path)
            info = {"arrays": len(m.arrays), "chunks": None if problems else m.chunk_count(),
                    "world_size": m.world_size}
        except ShardstreamError as e:
            problems = e.problems or [str(e)]
            info = {}
        for p in problems:
            print(p, file=sys.stderr)
        bad += bool(problems)
        results.append({"manifest": path, "ok": not problems, "problems": problems, **info})
        if not args.json:
            if problems:
                print(f"FAIL {path}: {len(problems)} problem(s)")
            else:
                print(f"ok   {path}: {info['arrays']} arrays, {info['chunks']} chunks, world_size "
                      f"{info['world_size']}{', data checked' if args.data else ''}")
    if args.json:
        print(json.dumps({"ok": bad == 0, "manifests": results}))
    return 1 if bad else 0


def _fmt_stats(st: dict[str, Any]) -> str:
    def gb(k: str) -> str:
        return f"{st[k] / 1e9:12.4f} GB"

    rows = [
        ("total (lands on destinations)", gb("total_bytes")),
        ("moved (rank to rank)", gb("moved_bytes")),
        ("lower bound", gb("lower_bound_bytes")),
        ("network / local", f"{st['network_bytes'] / 1e9:.4f} / {st['local_bytes'] / 1e9:.4f} GB"),
        ("min network", gb("min_network_bytes")),
        ("max send / ideal", f"{st['max_send_bytes'] / 1e9:.4f} / {st['ideal_max_send_bytes'] / 1e9:.4f} GB"),
        ("max recv", gb("max_recv_bytes")),
        ("transfers", f"{st['transfers']:12d}"),
        ("gather-broadcast moved", gb("broadcast_moved_bytes")),
        ("gather-broadcast max recv", gb("broadcast_max_recv_bytes")),
    ]
    if st["moved_bytes"]:
        rows.append(("broadcast / reshard bytes", f"{st['broadcast_moved_bytes'] / st['moved_bytes']:12.2f} x"))
    if st.get("fp8_pairs") or st.get("unpaired_scales"):
        rows.append(("FP8 weight + scale pairs", f"{st['fp8_pairs']:12d} (each scale block moves with its rows)"))
    if st.get("unpaired_scales"):
        names = st["unpaired_scales"]
        rows.append(("scales planned alone", f"{len(names):12d} (chunks not block for block with the weight: "
                     f"{', '.join(names[:3])}{', …' if len(names) > 3 else ''})"))
    return "\n".join([*(f"{k:32s} {v}" for k, v in rows), *_fmt_quantized(st.get("quantized"))])


def _fmt_quantized(q: dict[str, Any] | None) -> list[str]:
    """Lines naming the arrays quantized (by convert, or by a refit's senders or receivers), their
    scheme and the bytes saved (stored; and, in a refit, on the wire)."""
    if not q or not q.get("arrays"):
        return []
    arrays = q["arrays"]
    schemes = sorted({a["scheme"] for a in arrays.values()})
    if "wire_bytes_saved" in q:  # a refit plan (quant_refit.refit_quant_report)
        where = f"refit: {q['on_sender']} by the senders, {q['on_receiver']} by the receivers"
        lines = [f"{'quantized on refit':32s} {len(arrays):12d} arrays ({', '.join(schemes)}; {where}), "
                 f"{q['wire_bytes_saved'] / 1e9:.4f} GB fewer on the wire, {q['bytes_saved'] / 1e9:.4f} GB stored"]
        lines += [f"  {f}: {a['from']} -> {a['scheme']} on the {a['where']}, {a['wire_bytes_saved']} B fewer on the wire"
                  for f, a in list(arrays.items())[:8]]
    else:
        where = next(iter(arrays.values()))["where"]
        lines = [f"{'quantized on write':32s} {len(arrays):12d} arrays ({', '.join(schemes)}; {where}), "
                 f"{q['bytes_saved'] / 1e9:.4f} GB saved"]
        lines += [f"  {f}: {a['from']} -> {a['scheme']}, {a['bytes_saved']} B saved" for f, a in list(arrays.items())[:8]]
    if len(arrays) > 8:
        lines.append(f"  … and {len(arrays) - 8} more (--json lists every one)")
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    from streamer.plan.gcpause import paused_gc

    with paused_gc():  # a full-size plan: ~10^6 long-lived objects (see streamer.plan.gcpause)
        return _cmd_plan(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    import time

    from formats.validate import validate_manifest
    from streamer.execute.quant import refit_quant, refit_quant_report
    from streamer.plan.planner import plan_transfers

    src, dst = _load(args.src), _load(args.dst)
    problems = validate_manifest(src, where=args.src, check_paths=False) + validate_manifest(
        dst, where=args.dst, check_paths=False)
    if problems:
        raise ShardstreamError(problems=problems)
    t0 = time.perf_counter()
    try:
        # FP8 destinations fed from float sources are planned as a refit quantizes them
        quant = refit_quant(src, dst, block=args.fp8_block, ue8m0=args.ue8m0)
        psrc, planned = (quant.src, quant.dst) if quant else (src, dst)
        plan = plan_transfers(psrc, planned, src_domain_size=args.src_domain_size,
                              dst_domain_size=args.dst_domain_size, same_job=args.same_job,
                              allow_extra=args.allow_extra, stats=args.rank is None)
    except PlanError as e:  # its lines name the array; say which manifests were being matched
        raise PlanError(problems=[f"{args.dst}: {ln}; source manifest {args.src}" for ln in e.problems]) from e
    if args.check:
        _check_plan(args, plan, psrc, planned)
    if args.rank is not None:
        return _plan_rank(args, plan, psrc, planned, t0)
    dt = time.perf_counter() - t0
    st = plan.stats().to_dict()
    st["plan_seconds"] = round(dt, 4)
    st["digest"] = plan.digest()
    if quant:
        st["quantized"] = refit_quant_report(quant, dst, plan)
    _out(args, st, f"plan {args.src} -> {args.dst} ({dt:.3f} s)\n{_fmt_stats(st)}")
    return 0


def _check_plan(args: argparse.Namespace, plan: Any, src: Any, dst: Any) -> None:
    """``plan --check``: every transfer of the whole plan checked against the two manifests
    (``streamer.plan.check.validate_plan``); one line per problem and exit 1 if there is any."""
    from streamer.plan.check import validate_plan

    problems = validate_plan(plan, src, dst)
    if problems:
        raise PlanError(problems=[f"{args.dst}: plan check: {ln}; source manifest {args.src}" for ln in problems])
    print(f"plan check: ok ({plan.num_transfers} transfers)", file=sys.stderr)


def _plan_rank(args: argparse.Namespace, plan: Any, src: Any, dst: Any, t0: float) -> int:
    """``plan --rank R``: that merged rank's figures, and the messages its schedule has."""
    import time

    from streamer.execute.schedule import build_schedule
    from streamer.plan.local_shapes import plan_shapes
    from streamer.plan.rankplan import rank_figures

    fig = rank_figures(plan, args.rank)
    sched = build_schedule(plan, args.bucket_size, plan_shapes(plan, src, dst), rank=args.rank)
    msgs = [m for m in sched if args.rank in (m.src, m.dst)]
    dt = time.perf_counter() - t0
    out = fig.to_dict()
    out.update(messages=len(msgs), bucket_size=args.bucket_size, plan_seconds=round(dt, 4))
    job = "both jobs" if plan.same_job else ("the source job" if fig.role == "send" else "the destination job")
    rows = [("sent", f"{fig.bytes_sent / 1e9:.4f} GB in {fig.sends} transfers to {len(fig.send_peers)} ranks "
                     f"({fig.forwards} phase-2 forwards, {fig.forward_bytes / 1e9:.4f} GB)"),
            ("received", f"{fig.bytes_received / 1e9:.4f} GB in {fig.receives} transfers from "
                         f"{len(fig.recv_peers)} ranks"),
            ("sent across domains", f"{fig.network_bytes_sent / 1e9:.4f} GB"),
            ("local copies", f"{fig.local_copies} ({fig.local_copy_bytes / 1e9:.4f} GB)"),
            ("messages", f"{len(msgs)} (buckets of {args.bucket_size} B)")]
    text = "\n".join([f"plan {args.src} -> {args.dst}: rank {fig.rank} ({fig.role}, rank {fig.job_rank} of {job}) "
                      f"({dt:.3f} s)", *(f"{k:32s} {v}" for k, v in rows)])
    _out(args, out, text)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Under ``mpiexec -n K``: every check runs on every worker and ends in an agreement round
    (``ops.agree``), so a refusal on any worker ends all of them with it; a failure later,
    while writing, aborts the job (``MPI_Abort``) instead of leaving the others waiting."""
    comm = mpi_comm()
    if comm is None:
        return _convert(args, None)
    return on_workers(lambda: _convert(args, comm), debug=args.debug)


def _convert(args: argparse.Namespace, comm: Any) -> int:
    from streamer.convert import ConvertOptions, convert
    from streamer.ops.agree import agreed

    torch_dist = args.format == "torch_dist"
    workers = None
    if comm is not None:
        from streamer.transport.mpi import MPITransport

        workers = MPITransport(comm)
    with agreed(workers, ConvertOptions.timeout):  # a refusal on one worker is every worker's
        src, dst = _convert_inputs(args, comm)
    out = Path(args.out) / ".staging" if torch_dist else Path(args.out)
    opts = ConvertOptions(memory_limit=args.memory_limit, resume=args.resume, max_shard_size=args.max_shard_size,
                          allow_extra=args.allow_extra, progress=None if not args.json else False,
                          cast=args.cast, format="safetensors" if torch_dist else args.format,
                          zarr_compressor=args.zarr_compressor or "none", fp8_block=args.fp8_block, ue8m0=args.ue8m0,
                          manifest_version=args.format_version)
    rep = convert(src, dst, out, opts, comm=comm, control=workers, src_where=_where(args.src),
                  dst_where=_where(args.dst))
    if torch_dist:  # a Megatron save root: the one-rank megatron layout packed into torch_dist chunks
        from streamer.convert.megatron_export import pack_torch_dist

        rows = None
        if args.megatron_tp is not None:
            from formats.layouts.presets.megatron import megatron_padded_vocab

            emb = dst.arrays.get("model.embed_tokens.weight")
            rows = megatron_padded_vocab(emb.shape[0], args.megatron_tp) if emb is not None else None
        packed = pack_torch_dist(out, Path(args.out), vocab_rows=rows)
        _out(args, {**rep.to_dict(), "out": args.out, "torch_dist": packed},
             f"converted {args.src} -> {args.out}: Megatron torch_dist save ({packed['arrays']} arrays, "
             f"{packed['chunks']} chunks, {packed['bytes'] / 1e9:.3f} GB) in {packed['dir']}")
        return 0
    if comm is not None and comm.Get_rank() != 0:
        return 0
    gbps = rep.bytes_written / rep.seconds / 1e9 if rep.seconds else 0.0
    obj = {**rep.to_dict(), "out": args.out, "gb_per_s": round(gbps, 3),
           "moved_bytes": rep.plan_stats.get("moved_bytes")}
    if rep.quantized:
        obj["quantized"] = rep.quantized
    what = "zarr arrays" if args.format == "zarr" else "files"
    text = (f"converted {args.src} -> {args.out}: {rep.files_written} {what} written, "
            f"{rep.files_skipped} reused, {rep.bytes_written / 1e9:.3f} GB written, "
            f"{rep.bytes_read / 1e9:.3f} GB read in {rep.reads} reads, {rep.seconds:.2f} s "
            f"({gbps:.2f} GB/s, {rep.workers} worker(s))")
    _out(args, obj, "\n".join([text, *_fmt_quantized(rep.quantized)]))
    return 0


def _convert_inputs(args: argparse.Namespace, comm: Any) -> tuple[Manifest, Manifest]:
    """Every check of ``convert``'s options and inputs that needs no plan."""
    if args.zarr_compressor is not None and args.format != "zarr":
        raise UsageError("--zarr-compressor applies to --format zarr only")
    if args.format == "zarr" and args.max_shard_size:
        raise UsageError("--max-shard-size splits safetensors files; it does not apply to --format zarr")
    src, dst = _load(args.src), _load(args.dst)
    torch_dist = args.format == "torch_dist"
    if args.megatron_tp is not None and not torch_dist:
        raise UsageError("--megatron-tp goes with --format torch_dist")
    if torch_dist and (comm is not None or args.resume or args.max_shard_size):
        raise UsageError("--format torch_dist runs in one process and takes no --resume or --max-shard-size")
    if torch_dist:
        from streamer.convert.megatron_export import check_destination

        check_destination(dst, _where(args.dst))
        if Path(args.out).exists() and any(Path(args.out).iterdir()):
            raise UsageError(f"{args.out}: output directory is not empty")
    return src, dst


def cmd_inspect(args: argparse.Namespace) -> int:
    p = Path(args.path)
    if p.is_file() and p.suffix == ".safetensors":
        from formats.safetensors_io import read_header

        h = read_header(p)
        lines = [f"{p}: {len(h.tensors)} tensors, {h.file_size} bytes, data at offset {h.data_start}"]
        for t in h.tensors.values():
            lines.append(f"  {t.name:60s} {t.dtype.name:14s} {list(t.shape)!s:24s} {t.nbytes} B")
        tensors = [{"name": t.name, "data_type": t.dtype.name, "shape": list(t.shape), "nbytes": t.nbytes,
                    "offset": t.start} for t in h.tensors.values()]
        _out(args, {"path": str(p), "kind": "safetensors", "tensors": tensors, "metadata": h.metadata},
             "\n".join(lines))
        return 0
    m = _load(args.path)
    per_rank: dict[int, int] = {}
    for fqn, a, c in m.iter_chunks():
        for h_ in c.holders:
            per_rank[h_] = per_rank.get(h_, 0) + c.region.volume * a.dtype.itemsize
    chunks = m.chunk_count()
    nbytes = sum(a.nbytes for a in m.arrays.values())
    lines = [f"{args.path}: manifest {m.name or ''} world_size {m.world_size}, mesh {m.mesh}, "
             f"{len(m.arrays)} arrays, {chunks} chunks, {nbytes / 1e9:.3f} GB logical"]
    for r in sorted(per_rank):
        lines.append(f"  rank {r:5d}: {per_rank[r] / 1e9:.4f} GB")
    _out(args, {"path": args.path, "kind": "manifest", "world_size": m.world_size, "arrays": len(m.arrays),
                "chunks": chunks, "bytes": nbytes, "bytes_per_rank": {str(k): v for k, v in sorted(per_rank.items())}},
         "\n".join(lines))
    return 0


def cmd_refit(args: argparse.Namespace) -> int:
    """One side of a live refit (a thin shell over ``streamer.refit.job.RefitJob``).

    A check that refuses on some ranks only (this side's manifest, an option, the --save
    directory) does not end them alone: it travels with the group's formation and every rank of
    both jobs raises the same verdict (``ops.agree``), printed once per launch, with the
    same exit code. Refusals that every rank agreed on later (``RefusedError``, a plan
    mismatch) end the same way. Anything else happened on this rank alone: it tells the others
    (store plane) or aborts the MPI jobs, so no rank waits out the timeout.
    """
    from streamer.cli.collective import run_refit
    from streamer.ops.agree import LocalChecks

    checks = LocalChecks()
    manifest = None
    with checks.capture():  # a manifest that does not load is refused on every rank, not here alone
        manifest = _load(args.manifest)
    return run_refit(args.role, manifest, checks.refusal, args)


def cmd_bench(args: argparse.Namespace) -> int:
    import tempfile

    from streamer.tools import bench
    from streamer.tools.bench_rank import bench_scale, scale_case, scale_lines

    if args.what == "vllm":  # in the vLLM venv: one engine, three ways to update it
        from streamer.vllm.bench import bench_cli
        _out(args, *bench_cli(args.model, args.repeats))
        return 0
    work = args.work or tempfile.mkdtemp(prefix="shardstream-bench-")
    if args.source == "megatron" and args.what != "convert":
        raise UsageError("--source megatron goes with bench convert")
    if args.what == "convert" and args.source == "megatron":
        from streamer.tools.bench_megatron import bench_convert_megatron, megatron_table

        r = bench_convert_megatron(work, preset=args.preset or "qwen3-2g", memory_limit=args.memory_limit,
                                   repeats=args.repeats or 2)
        text = megatron_table(r)
    elif args.what == "convert":
        r = bench.bench_convert(work, preset=args.preset or "qwen3-2g", memory_limit=args.memory_limit,
                                repeats=args.repeats or 2, src_tp=args.src_tp, dst_tp=args.dst_tp, dcp=not args.no_dcp)
        text = bench.convert_table(r)
    elif args.what == "plan":
        r = bench.bench_plan(tuple(args.sweep), model=args.model)
        lines = ["bench plan: TP8 -> TP4xDP2 (uneven, domain 8), sweep over chunks"]
        lines += [f"  {x['chunks']:8d} chunks {x['transfers']:8d} transfers  plan {x['plan_s']:7.3f} s  validate "
                  f"{x['validate_s']:7.3f} s  peak {x['peak_bytes'] / 2**20:7.1f} MiB" for x in r["sweep"]]
        lines.append(f"  scaling exponent: plan {r['plan_exponent']:.2f}, validate {r['validate_exponent']:.2f} "
                     "(1.0 = linear)")
        if "model" in r:
            mm = r["model"]
            lines.append(f"  {mm['config']}: {mm['train']} -> {mm['serve']}: {mm['src_chunks']} + {mm['dst_chunks']} "
                         f"chunks, manifests {mm['manifests_s']:.2f} s, plan {mm['plan_s']:.2f} s (target <= 2 s), "
                         f"{mm['transfers']} transfers, peak RSS +{mm['plan_peak_rss_growth_bytes'] / 2**20:.0f} MiB")
        case = scale_case(args.model) if args.model else None
        if case is not None:  # the preset layouts: one rank's refit start, the whole plan from the files
            r["scale"] = bench_scale(work, str(Path(args.model).parent), names=(case,))
            lines += scale_lines(r["scale"])
        text = "\n".join(lines)
    elif args.what == "validate":
        r = bench.bench_validate(args.chunks)
        text = (f"bench validate: {r['chunks']} chunks ({r['manifest_bytes'] / 1e6:.1f} MB JSON): parse "
                f"{r['parse_s']:.2f} s + validate {r['validate_s']:.2f} s = {r['total_s']:.2f} s (target <= 5 s)")
    elif args.what == "ipc":  # colocated refit: 1 + 1 ranks on one node (one GPU for cuda-ipc)
        from streamer.tools.bench_ipc import bench_ipc, ipc_text

        r = bench_ipc(args.transport, size=args.size, repeats=args.repeats or 5, bucket_size=args.bucket_size)
        text = ipc_text(r)
    elif args.delta:
        from streamer.tools.bench_delta import bench_refit_delta, delta_table

        r = bench_refit_delta(work, senders=args.senders, receivers=args.receivers, train_mesh=args.train_mesh,
                              serve_mesh=args.serve_mesh, steps=args.repeats or 3, lr=args.lr,
                              bucket_size=args.bucket_size)
        text = delta_table(r)
    elif args.against:
        from streamer.tools.bench_against import against_table, load_reference

        ref = load_reference(args.against)
        r = bench.bench_refit(work, **ref["config"])
        text = bench.refit_table(r) + "\n" + against_table(r, ref, args.against)
    else:
        r = bench.bench_refit(work, senders=args.senders, receivers=args.receivers,
                              preset=args.preset or "qwen3-small", train_mesh=args.train_mesh,
                              serve_mesh=args.serve_mesh, repeats=args.repeats or 5, bucket_size=args.bucket_size,
                              source=args.source)
        text = bench.refit_table(r)
    r["work"] = work
    if args.plot:
        bench.plot(r, args.what, args.plot)
        text += f"\nplot written to {args.plot}"
    _out(args, r, text)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    import time

    from streamer.tools.synth import PRESETS, qwen3_arrays, write_checkpoint

    shape = PRESETS[args.preset]
    arrays = qwen3_arrays(shape)
    t0 = time.perf_counter()
    files = write_checkpoint(args.out, arrays, seed=args.seed, max_shard_size=args.max_shard_size)
    nbytes = sum(f.stat().st_size for f in files)
    dt = time.perf_counter() - t0
    _out(args, {"out": args.out, "files": [str(f) for f in files], "arrays": len(arrays), "bytes": nbytes},
         f"wrote {args.out}: {args.preset}, {len(arrays)} arrays, {len(files)} file(s), {nbytes / 1e6:.1f} MB "
         f"in {dt:.2f} s (seed {args.seed})")
    return 0


# ------------------------------------------------------------------ parser

def _add_import(sub: Any) -> None:
    p = sub.add_parser("import", help="describe an existing checkpoint as a manifest")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("-o", "--output", required=True, metavar="MANIFEST")
    p.add_argument("--name")
    p.add_argument("--model", metavar="CFG", help="with --to hf: the model's HF config.json")
    p.add_argument("--to", choices=("hf",), help="Megatron torch_dist: arrays under HF names (unstacked layers, "
                   "q/k/v and gate/up split, vocab padding dropped), still addressing the stored bytes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_import)


def _add_layout(sub: Any) -> None:
    p = sub.add_parser("layout", help="generate a manifest from a mesh and placement rules")
    p.add_argument("--like", metavar="MANIFEST", help="take arrays, shapes and dtypes from this manifest/checkpoint")
    p.add_argument("--model", metavar="CFG", help="take arrays from an HF config.json or an NCCL M2N model JSON "
                   "(without --rule: generic Megatron-like rules)")
    p.add_argument("--fp8", action="store_true", help="--model: block-FP8 linear weights + weight_scale_inv (with --preset: each scale laid out with its weight)")
    p.add_argument("--include-mtp", action="store_true", help="--model: DeepSeek-V3 MTP layers too")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="--preset: the weights' data_type (default: the config's torch_dtype / dtype, else bfloat16)")
    p.add_argument("--preset", choices=("megatron", "vllm", "sglang", "fsdp2", "hf"),
                   help="--model: the framework's own local tensors (fused qkv / gate_up, padded vocab, stage-local "
                        "layers); arrays keep HF names")
    p.add_argument("--first-stage-layers", type=int, metavar="N",
                   help="--preset megatron: layers on the first pipeline stage (decoder_first_pipeline_num_layers)")
    p.add_argument("--last-stage-layers", type=int, metavar="N",
                   help="--preset megatron: layers on the last pipeline stage (decoder_last_pipeline_num_layers)")
    p.add_argument("--megatron-spec", choices=("te", "local"),
                   help="--preset megatron: Transformer Engine layer specs (default; norms fused as "
                        "layer_norm_weight) or the local spec (input_layernorm / pre_mlp_layernorm)")
    p.add_argument("--mesh", metavar="A=N,...", help="device mesh, row-major (default tp=1)")
    p.add_argument("--rule", action="append", default=[], metavar="GLOB=PLACEMENTS",
                   help="e.g. '*.q_proj.weight=S(0)'; one placement per mesh axis; first match wins")
    p.add_argument("--file-pattern", default=None,
                   help=f"per-rank file name (default {RANK_FILE_PATTERN}; one rank: HF names)")
    p.add_argument("--no-files", action="store_true", help="a live (in-memory) manifest: no source.file")
    p.add_argument("--domain-size", type=_positive_int)
    p.add_argument("--format-version", type=int, choices=(1, 2), default=2,
                   help="2 (default): compact manifest, arrays refer to shared mesh layouts; 1: every chunk listed")
    p.add_argument("--name")
    p.add_argument("-o", "--output", required=True, metavar="MANIFEST")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_layout)


def _add_validate(sub: Any) -> None:
    p = sub.add_parser("validate", help="check manifests (and with --data, their files)")
    p.add_argument("manifests", nargs="+", metavar="MANIFEST")
    p.add_argument("--data", action="store_true", help="also open the files: headers, tensors, byte ranges, checksums")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="plan the transfers from SRC's layout to DST's and print the figures")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--src-domain-size", type=_positive_int)
    p.add_argument("--dst-domain-size", type=_positive_int)
    p.add_argument("--same-job", action="store_true", help="rank r of both manifests is one process")
    p.add_argument("--allow-extra", action="store_true", help="source arrays the destination lacks are dropped")
    p.add_argument("--rank", type=int, metavar="R",
                   help="only what merged rank R sends and receives (senders 0..S-1, then receivers S..S+D-1)")
    p.add_argument("--bucket-size", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="with --rank: the bucket size its messages are counted with (refit's default)")
    p.add_argument("--check", action="store_true",
                   help="also check every transfer of the plan against both manifests (one line per problem, exit 1)")
    _add_quant_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def _add_quant_flags(p: Any, *, refit: bool = False) -> None:
    p.add_argument("--fp8-block", type=parse_block, default=None if refit else (128, 128), metavar="R,C",
                   help="quantize: elements per float32 scale of FP8 weights fed from bf16/fp32 "
                        "(default 128,128, DeepSeek-V3" + ("; or what the other job asks)" if refit else ")"))
    p.add_argument("--ue8m0", action="store_true",
                   help="quantize: round block-FP8 scales up to a power of two (DeepGEMM use_ue8m0)"
                        + ("; on if either job asks" if refit else ""))


def _add_convert(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint to another layout, with bounded memory")
    p.add_argument("src", metavar="SRC", help="source manifest, convert output dir, or HF checkpoint")
    p.add_argument("dst", metavar="DST", help="destination manifest (from `layout`)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--megatron-tp", type=_positive_int, metavar="N",
                   help="--format torch_dist: pad the vocab as Megatron does for a job of this tensor-parallel "
                        "size (a multiple of 128 x N; default: as at tp 1)")
    p.add_argument("--format", choices=["safetensors", "zarr", "torch_dist"], default="safetensors",
                   help="zarr: DIR becomes a zarr v3 group, one array per logical array")
    p.add_argument("--zarr-compressor", choices=["zstd", "none"], default=None,
                   help="--format zarr: chunk compression (default none)")
    p.add_argument("--memory-limit", type=parse_size, default=1 << 30, metavar="SIZE")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                   help="one-rank (HF) output: split files at this size and write model.safetensors.index.json")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--cast", metavar="DTYPE", choices=["float16", "bfloat16", "float32", "float64"],
                   help="store floating-point arrays as DTYPE (e.g. fp32 master weights -> bfloat16)")
    _add_quant_flags(p)
    p.add_argument("--allow-extra", action="store_true")
    p.add_argument("--format-version", type=int, choices=(1, 2), default=2,
                   help="the output manifest: 2 compact, chunk checksums in manifest.checksums beside it "
                        "(default); 1 lists every chunk with its checksum")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_convert)


def _add_refit(sub: Any) -> None:
    p = sub.add_parser("refit", help="live refit: push weights from a trainer job to an inference job")
    p.add_argument("role", choices=["send", "recv"])
    p.add_argument("--manifest", required=True, metavar="M", help="this side's manifest (sender: with files)")
    p.add_argument("--rendezvous", metavar="FILE", help="join a separately launched job through this file")
    p.add_argument("--save", metavar="DIR", help="receivers also write what they received (safetensors + manifest)")
    p.add_argument("--transport", choices=["mpi", "gloo", "nccl", "shm", "cuda-ipc"], default=None,
                   help="mpi (default under mpiexec), gloo (CPU, default on the store plane), nccl (GPU); "
                        "one node only: shm (host shared memory), cuda-ipc (GPU memory, colocated jobs)")
    p.add_argument("--control", choices=["auto", "mpi", "store"], default="auto",
                   help="control plane: mpi (mpiexec jobs), store (a TCPStore; any launcher, e.g. torchrun); "
                        "auto: receivers pick mpi under mpiexec, else store; senders follow the rendezvous file")
    p.add_argument("--strategy", choices=["reshard", "broadcast"], default="reshard",
                   help="broadcast: the gather-broadcast baseline, for comparison")
    p.add_argument("--bucket-size", type=parse_size, default=256 << 20, metavar="SIZE")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S")
    p.add_argument("--steps", type=_positive_int, default=1, help="pushes to run over one session")
    p.add_argument("--stay", action="store_true",
                   help="refit recv: outlive failed pushes and trainer restarts, pulling until the sender job "
                        "closes the session (store control plane; docs/resilience.md)")
    p.add_argument("--verify", action="store_true", help="compare per-region checksums with the senders'")
    p.add_argument("--delta", action="store_true",
                   help="after the first push, send only what changed (encoded); senders keep a copy of what they sent")
    p.add_argument("--src-domain-size", type=_positive_int)
    p.add_argument("--dst-domain-size", type=_positive_int)
    p.add_argument("--allow-extra", action="store_true")
    _add_quant_flags(p, refit=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_refit)


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    p.add_argument("what", choices=["plan", "convert", "refit", "validate", "ipc", "vllm"])
    p.add_argument("--sweep", type=_positive_int, nargs="+", default=[1200, 4800, 19200, 102400],
                   help="bench plan: chunk counts of the sweep")
    p.add_argument("--model", metavar="CFG", help="bench plan: also time the full plan of this HF config; "
                                                  "bench vllm: the HF checkpoint directory the engine serves")
    p.add_argument("--plot", metavar="PNG", help="also draw the result (needs matplotlib)")
    p.add_argument("--work", metavar="DIR", help="scratch directory (default: a new temp dir)")
    p.add_argument("--preset", choices=["qwen3-tiny", "qwen3-small", "qwen3-2g"])
    p.add_argument("--memory-limit", default="256MiB")
    p.add_argument("--repeats", type=_positive_int, default=None,
                   help="bench convert: runs (default 2); bench refit: steady-state pushes after the first (default 5)")
    p.add_argument("--src-tp", type=_positive_int, default=4, help="bench convert: source TP size")
    p.add_argument("--dst-tp", type=_positive_int, default=3, help="bench convert: target TP size")
    p.add_argument("--no-dcp", action="store_true", help="bench convert: skip the torch.distributed.checkpoint path")
    p.add_argument("--chunks", type=_positive_int, default=100_000)
    p.add_argument("--senders", type=_positive_int, default=4)
    p.add_argument("--receivers", type=_positive_int, default=4)
    p.add_argument("--train-mesh", default="pp=2,tp=2")
    p.add_argument("--serve-mesh", default="tp=4")
    p.add_argument("--source", choices=["files", "fsdp2", "megatron"], default="files",
                   help="bench refit: the trainer's rank files, or a real FSDP2 model (fp32 masters, cast to bf16); "
                        "bench convert: megatron = a Megatron torch_dist save -> HF (import --to hf + convert)")
    p.add_argument("--delta", action="store_true",
                   help="bench refit: full vs delta pushes after real AdamW steps of a small Llama (--repeats steps)")
    p.add_argument("--lr", type=float, default=1e-6, help="bench refit --delta: the AdamW learning rate")
    p.add_argument("--against", metavar="FILE", help="bench refit: rerun FILE's reference configuration and print each "
                                                     "ratio beside its reference (benchmarks/refit-reference.json)")
    p.add_argument("--bucket-size", type=parse_size, default=64 << 20)
    p.add_argument("--transport", choices=["shm", "cuda-ipc", "mpi", "gloo", "nccl"], default="shm",
                   help="bench ipc: the transport (cuda-ipc: both ranks on one GPU; shm: its CPU twin)")
    p.add_argument("--size", type=parse_size, default=256 << 20, metavar="SIZE", help="bench ipc: bytes per push")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


def _add_synth(sub: Any) -> None:
    p = sub.add_parser("synth", help="write a seeded synthetic HF checkpoint shaped like a Qwen3 model")
    p.add_argument("--preset", choices=["qwen3-tiny", "qwen3-small", "qwen3-2g"], default="qwen3-small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_synth)


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="summarise a safetensors file or a manifest")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="shardstream", description="Move model weights between parallelism layouts.")
    ap.add_argument("--debug", action="store_true", help="show Python tracebacks")
    ap.add_argument("--version", action="version", version=f"shardstream {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in (_add_import, _add_layout, _add_validate, _add_plan, _add_convert, _add_refit, _add_bench, _add_synth):
        add(sub)
    from streamer.tools.simulate import add_simulate_parser

    add_simulate_parser(sub)
    _add_inspect(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = ap.parse_args(argv)
    except ArgvError as e:  # a rank of a multi-rank launch tells its peers; one process prints it
        return argv_refused(e, argv, build_parser)
    except SystemExit as e:
        return int(e.code or 0)
    debug = args.debug or os.environ.get("SHARDSTREAM_DEBUG") == "1"
    try:
        return int(args.func(args))
    except AgreedRefusal as e:  # every rank holds it: one prints it
        if debug:
            raise
        announce(e)
        return e.exit_code
    except ShardstreamError as e:
        if debug:
            raise
        for line in e.problems or [str(e)]:
            print(line if line.startswith(("shardstream", "/", ".")) or ": " in line else f"shardstream: {line}",
                  file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("shardstream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardstream inspect ... | head`: the reader left, nothing to report
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the interpreter's flush at exit
        except OSError:
            pass
        return 0
    except OSError as e:
        if debug:
            raise
        print(f"shardstream: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 3
