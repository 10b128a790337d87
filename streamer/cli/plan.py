"""``shardstream plan``: plan the transfers between two layouts and print the figures (``--rank``, ``--check``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from formats.errors import PlanError, ShardstreamError
from streamer.cli.args import emit as _out
from streamer.cli.args import parse_size
from streamer.cli.args import positive_int as _positive_int
from streamer.cli.inputs import load_input
from streamer.cli.quant import add_quant_flags, fmt_quantized

if TYPE_CHECKING:
    pass


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
    return "\n".join([*(f"{k:32s} {v}" for k, v in rows), *fmt_quantized(st.get("quantized"))])


def cmd_plan(args: argparse.Namespace) -> int:
    from streamer.plan.gcpause import paused_gc

    with paused_gc():  # a full-size plan: ~10^6 long-lived objects (see streamer.plan.gcpause)
        return _cmd_plan(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    import time

    from formats.validate.manifest import validate_manifest
    from streamer.execute.quant import refit_quant, refit_quant_report
    from streamer.plan.planner import plan_transfers

    src, dst = load_input(args.src), load_input(args.dst)
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


def add_plan(sub: Any) -> None:
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
    add_quant_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
