"""``shardstream`` command line: a thin layer over the library (design §8).

Exit codes: 0 success; 1 invalid input (every problem on its own line); 2 usage error;
3 runtime failure (peer died, timeout, I/O). No traceback for bad input unless ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from formats.errors import ShardstreamError, UsageError
from streamer.cli.args import emit as _out
from streamer.cli.args import parse_size, seconds
from streamer.cli.args import positive_int as _positive_int
from streamer.cli.collective import ArgvError, Parser, announce, argv_refused
from streamer.cli.convert import add_convert
from streamer.cli.inputs import load_input
from streamer.cli.manifests import add_import, add_inspect, add_layout, add_synth, add_validate
from streamer.cli.plan import add_plan
from streamer.cli.quant import add_quant_flags
from streamer.ops.agree import AgreedRefusal

__all__ = ["main", "parse_size", "build_parser"]


# ------------------------------------------------------------------ commands


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
        manifest = load_input(args.manifest)
    return run_refit(args.role, manifest, checks.refusal, args)


def _megatron_mesh(args: argparse.Namespace) -> tuple[int, int] | None:
    """bench vllm --source megatron: the trainer's (tp, pp) from --train-mesh (default tp=2)."""
    if args.source != "megatron":
        if args.source != "files":
            raise UsageError(f"bench vllm takes --source megatron or none, not {args.source}")
        return None
    sizes = {"tp": 2, "pp": 1}
    for part in (args.train_mesh or "tp=2").split(","):
        axis, _, n = part.partition("=")
        if axis not in sizes or not n.isdigit() or int(n) < 1:
            raise UsageError(f"bench vllm --source megatron: --train-mesh takes tp=N[,pp=N], got {args.train_mesh!r}")
        sizes[axis] = int(n)
    return sizes["tp"], sizes["pp"]


def cmd_bench(args: argparse.Namespace) -> int:
    import tempfile

    from streamer.tools import bench

    if args.what == "vllm" and args.lora:  # in the vLLM venv: an adapter pushed against the disk path
        from streamer.vllm.bench_lora import lora_cli
        _out(args, *lora_cli(args.model, args.lora_ranks, args.repeats, args.dst_tp))
        return 0
    if args.what == "vllm":  # in the vLLM venv: one engine, three ways to update it
        from streamer.vllm.bench import bench_cli
        _out(args, *bench_cli(args.model, args.repeats, args.dst_tp, _megatron_mesh(args)))
        return 0
    if args.what == "refit" and args.replicas is None and not args.against:
        args.train_mesh, args.serve_mesh = _refit_meshes(args)
    work = args.work or tempfile.mkdtemp(prefix="shardstream-bench-")
    if args.source == "megatron" and args.what != "convert":
        raise UsageError("--source megatron goes with bench convert")
    if args.plot:  # before the benchmark runs, not after it
        bench.require_matplotlib()
    if args.what == "convert" and args.source == "megatron":
        from streamer.tools.bench_megatron import bench_convert_megatron, megatron_table

        r = bench_convert_megatron(work, preset=args.preset or "qwen3-2g", memory_limit=args.memory_limit,
                                   repeats=args.repeats or 2)
        text = megatron_table(r)
    elif args.what == "convert":
        r = bench.bench_convert(work, preset=args.preset or "qwen3-2g", memory_limit=args.memory_limit,
                                repeats=args.repeats or 2, src_tp=args.src_tp, dst_tp=args.dst_tp or 3, dcp=not args.no_dcp)
        text = bench.convert_table(r)
    elif args.what == "plan":
        r, text = _bench_plan(args, work)
    elif args.what == "validate":
        r = bench.bench_validate(args.chunks)
        text = (f"bench validate: {r['chunks']} chunks ({r['manifest_bytes'] / 1e6:.1f} MB JSON): parse "
                f"{r['parse_s']:.2f} s + validate {r['validate_s']:.2f} s = {r['total_s']:.2f} s (target <= 5 s)")
    elif args.what == "ipc":  # colocated refit: 1 + 1 ranks on one node (one GPU for cuda-ipc)
        from streamer.tools.bench_ipc import bench_ipc, ipc_text

        r = bench_ipc(args.transport, size=args.size, repeats=args.repeats or 5, bucket_size=args.bucket_size)
        text = ipc_text(r)
    else:
        r, text = _bench_refit(args, work)
    r["work"] = work
    if args.plot:
        bench.plot(r, args.what, args.plot)
        text += f"\nplot written to {args.plot}"
    _out(args, r, text)
    return 0


def _bench_plan(args: argparse.Namespace, work: str) -> tuple[dict[str, Any], str]:
    from streamer.tools import bench
    from streamer.tools.bench_rank import bench_scale, scale_case, scale_lines

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
    return r, "\n".join(lines)


def _bench_refit(args: argparse.Namespace, work: str) -> tuple[dict[str, Any], str]:
    from streamer.tools import bench

    if args.replicas is not None:
        from streamer.tools.bench_replicas import bench_replicas_cli
        return bench_replicas_cli(work, args)
    if args.codec and not args.delta:
        raise UsageError("bench refit --codec measures the delta codec: pass --delta with it")
    if args.delta and args.codec:
        from streamer.tools.bench_codec import bench_codec, codec_table

        r = bench_codec(size=args.size, steps=args.repeats or 3)
        return r, codec_table(r)
    if args.delta:
        from streamer.tools.bench_delta import bench_refit_delta, delta_table

        r = bench_refit_delta(work, senders=args.senders, receivers=args.receivers, train_mesh=args.train_mesh,
                              serve_mesh=args.serve_mesh, steps=args.repeats or 3, lrs=tuple(args.lr),
                              bucket_size=args.bucket_size)
        return r, delta_table(r)
    if args.against:
        from streamer.tools.bench_against import against_table, load_reference

        ref = load_reference(args.against)
        r = bench.bench_refit(work, **ref["config"])
        return r, bench.refit_table(r) + "\n" + against_table(r, ref, args.against)
    r = bench.bench_refit(work, senders=args.senders, receivers=args.receivers, preset=args.preset or "qwen3-small",
                          train_mesh=args.train_mesh, serve_mesh=args.serve_mesh, repeats=args.repeats or 5,
                          bucket_size=args.bucket_size, source=args.source)
    return r, bench.refit_table(r)


def _refit_meshes(args: argparse.Namespace) -> tuple[str, str]:
    """bench refit's meshes: as given, else one fitting the rank counts (``pp=2,tp=2`` -> ``tp=4`` at
    the default 4 + 4); a mesh of another size than its job is refused before anything starts."""
    from formats.layouts.mesh import parse_mesh

    train = args.train_mesh or ("pp=2,tp=2" if args.senders == 4 else f"tp={args.senders}")
    serve = args.serve_mesh or f"tp={args.receivers}"
    sized = [("--train-mesh", train, "--senders", args.senders)] if args.source != "fsdp2" else []
    for flag, mesh, ranks, n in [*sized, ("--serve-mesh", serve, "--receivers", args.receivers)]:
        size = parse_mesh(mesh).size
        if size != n:
            raise UsageError(f"{flag} {mesh} has {size} ranks but {ranks} is {n}")
    return train, serve


# ------------------------------------------------------------------ parser


def _add_refit(sub: Any) -> None:
    p = sub.add_parser("refit", help="live refit: push weights from a trainer job to an inference job")
    p.add_argument("role", choices=["send", "recv"])
    p.add_argument("--manifest", required=True, metavar="M", help="this side's manifest (sender: with files)")
    p.add_argument("--rendezvous", metavar="FILE|tcp://HOST:PORT",
                   help="join a separately launched job through this file, or through receiver rank 0's store at "
                        "tcp://HOST:PORT (no shared filesystem; docs/refit.md)")
    p.add_argument("--save", metavar="DIR", help="receivers also write what they received (safetensors + manifest)")
    p.add_argument("--replica", metavar="NAME",
                   help="refit recv: join as inference replica NAME of a trainer serving several (store control "
                        "plane; docs/resilience.md#replicas)")
    p.add_argument("--replicas", action="store_true",
                   help="refit send: serve every inference replica that joins through --rendezvous (refit recv "
                        "--replica NAME); store control plane, gloo (docs/resilience.md#replicas)")
    p.add_argument("--transport", choices=["mpi", "gloo", "nccl", "shm", "cuda-ipc"], default=None,
                   help="mpi (default under mpiexec), gloo (CPU, default on the store plane), nccl (GPU); "
                        "one node only: shm (host shared memory), cuda-ipc (GPU memory, colocated jobs)")
    p.add_argument("--control", choices=["auto", "mpi", "store"], default="auto",
                   help="control plane: mpi (mpiexec jobs), store (a TCPStore; any launcher, e.g. torchrun); "
                        "auto: receivers pick mpi under mpiexec, else store; senders follow the rendezvous file")
    p.add_argument("--strategy", choices=["reshard", "broadcast"], default="reshard",
                   help="broadcast: the gather-broadcast baseline, for comparison")
    p.add_argument("--bucket-size", type=parse_size, default=256 << 20, metavar="SIZE")
    p.add_argument("--timeout", type=seconds, default=300.0, metavar="S")
    p.add_argument("--steps", type=_positive_int, default=1, help="pushes to run over one session")
    p.add_argument("--stay", action="store_true",
                   help="refit recv: outlive failed pushes and trainer restarts, pulling until the sender job "
                        "closes the session (store control plane; docs/resilience.md)")
    p.add_argument("--verify", action="store_true", help="compare per-region checksums with the senders'")
    p.add_argument("--delta", action="store_true",
                   help="after the first push, send only what changed (encoded); senders keep a copy of what they sent")
    p.add_argument("--link-gbps", type=float, default=None, metavar="G",
                   help="--delta: the link between the jobs, GB/s; messages are encoded only where that pays "
                        "(default: ranks on one host share memory and send full bytes, across hosts always encode)")
    p.add_argument("--src-domain-size", type=_positive_int)
    p.add_argument("--dst-domain-size", type=_positive_int)
    p.add_argument("--allow-extra", action="store_true")
    add_quant_flags(p, refit=True)
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
    p.add_argument("--dst-tp", type=_positive_int, default=None,
                   help="bench convert: target TP size (default 3); bench vllm: the engine's TP size (default 1)")
    p.add_argument("--no-dcp", action="store_true", help="bench convert: skip the torch.distributed.checkpoint path")
    p.add_argument("--chunks", type=_positive_int, default=100_000)
    p.add_argument("--senders", type=_positive_int, default=4)
    p.add_argument("--receivers", type=_positive_int, default=4)
    p.add_argument("--train-mesh", default=None, help="bench refit: the trainer's mesh (default pp=2,tp=2 at 4 "
                   "senders, else tp=SENDERS)")
    p.add_argument("--serve-mesh", default=None, help="bench refit: the server's mesh (default tp=RECEIVERS)")
    p.add_argument("--source", choices=["files", "fsdp2", "megatron"], default="files",
                   help="bench refit: the trainer's rank files, or a real FSDP2 model (fp32 masters, cast to bf16); "
                        "bench convert: megatron = a Megatron torch_dist save -> HF (import --to hf + convert); "
                        "bench vllm: megatron = a live megatron-core trainer (--train-mesh tp=N[,pp=N]) pushes first")
    p.add_argument("--delta", action="store_true",
                   help="bench refit: full vs delta pushes after real AdamW steps of a small Llama (--repeats steps)")
    p.add_argument("--codec", action="store_true",
                   help="bench refit --delta: the delta codec on one core against every core, next to a full push "
                        "(one sender, one receiver, --size bytes of bf16, --repeats steps)")
    p.add_argument("--lora", action="store_true",
                   help="bench vllm: a LoRA adapter pushed into the engine against the disk path (save_pretrained "
                        "+ load_lora_adapter), end to end, per --lora-ranks")
    p.add_argument("--lora-ranks", default="8,64", metavar="R,R",
                   help="bench vllm --lora: the adapter ranks measured (default 8,64)")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5], metavar="LR",
                   help="bench refit --delta: the AdamW learning rates, one run each (default 1e-6 1e-5)")
    p.add_argument("--replicas", type=_positive_int, metavar="N",
                   help="bench refit: one trainer serving N inference replicas; the last joins midway: its join "
                        "and first (full) push next to a steady push (--size bytes of weights)")
    p.add_argument("--against", metavar="FILE", help="bench refit: rerun FILE's reference configuration and print each "
                                                     "ratio beside its reference (benchmarks/refit-reference.json)")
    p.add_argument("--bucket-size", type=parse_size, default=64 << 20)
    p.add_argument("--transport", choices=["shm", "cuda-ipc", "mpi", "gloo", "nccl"], default="shm",
                   help="bench ipc: the transport (cuda-ipc: both ranks on one GPU; shm: its CPU twin)")
    p.add_argument("--size", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="bench ipc: bytes per push; bench refit --replicas and --delta --codec: bytes of weights")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


class _Version(argparse.Action):
    """argparse's ``version`` action, but reading the installed version only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        import streamer

        print(f"shardstream {streamer.__version__}")  # stdout, as argparse's own action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="shardstream", description="Move model weights between parallelism layouts.")
    ap.add_argument("--debug", action="store_true", help="show Python tracebacks")
    ap.add_argument("--version", action=_Version, nargs=0, help="show program's version number and exit")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in (add_import, add_layout, add_validate, add_plan, add_convert, _add_refit, _add_bench, add_synth):
        add(sub)
    from streamer.tools.simulate import add_simulate_parser

    add_simulate_parser(sub)
    add_inspect(sub)
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
