"""``shardstream convert``: offline conversion to another layout or format, with bounded memory (one or many ranks)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from formats.errors import UsageError
from streamer.cli.args import emit as _out
from streamer.cli.args import parse_size, seconds
from streamer.cli.args import positive_int as _positive_int
from streamer.cli.collective import mpi_comm, on_workers
from streamer.cli.inputs import load_input, where
from streamer.cli.quant import add_quant_flags, fmt_quantized

if TYPE_CHECKING:
    from formats.manifest.wire import Manifest


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
    with agreed(workers, args.timeout):  # a refusal on one worker is every worker's
        src, dst = _convert_inputs(args, comm)
        src, store, extra = _adapter_inputs(args, src)
    out = Path(args.out) / ".staging" if torch_dist else Path(args.out)
    opts = ConvertOptions(memory_limit=args.memory_limit, resume=args.resume, max_shard_size=args.max_shard_size,
                          allow_extra=args.allow_extra, progress=None if not args.json else False,
                          cast=args.cast, format="safetensors" if torch_dist else args.format,
                          zarr_compressor=args.zarr_compressor or "none", fp8_block=args.fp8_block, ue8m0=args.ue8m0,
                          manifest_version=args.format_version, timeout=args.timeout, extra_files=extra)
    rep = convert(src, dst, out, opts, comm=comm, control=workers, src_where=where(args.src),
                  dst_where=where(args.dst), store=store)
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
    _out(args, obj, "\n".join([text, *fmt_quantized(rep.quantized)]))
    return 0


#: the files beside an HF checkpoint's weights that a merged checkpoint needs to be loaded and served
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def _adapter_inputs(args: argparse.Namespace, src: Manifest) -> tuple[Manifest, Any, tuple[tuple[str, bytes], ...]]:
    """``--merge-lora``: the source with the adapter merged in, and the store that reads it. A
    PEFT adapter as the source: its adapter_config.json goes with the output, which PEFT and vLLM
    need to load it (not into a merged checkpoint, which is no adapter)."""
    from formats.store import SourceStore
    from streamer.convert.merge_lora import ADAPTER_CONFIG, MergingStore, load_adapter, merged_source

    if args.merge_lora is None:
        cfg = src.base_dir / ADAPTER_CONFIG if src.base_dir is not None else None
        return src, SourceStore, ((ADAPTER_CONFIG, cfg.read_bytes()),) if cfg is not None and cfg.is_file() else ()
    if args.format == "torch_dist":
        raise UsageError("--merge-lora writes safetensors or zarr, not --format torch_dist")
    pairs = load_adapter(args.merge_lora)
    merged = merged_source(src, pairs, where(args.src))
    # a merged HF checkpoint is served as one: it keeps the base's config and tokenizer files
    side = [src.base_dir / n for n in HF_SIDE_FILES] if src.base_dir is not None else []
    return merged, lambda m: MergingStore(m, src, pairs), tuple((f.name, f.read_bytes()) for f in side if f.is_file())


def _convert_inputs(args: argparse.Namespace, comm: Any) -> tuple[Manifest, Manifest]:
    """Every check of ``convert``'s options and inputs that needs no plan."""
    if args.zarr_compressor is not None and args.format != "zarr":
        raise UsageError("--zarr-compressor applies to --format zarr only")
    if args.format == "zarr" and args.max_shard_size:
        raise UsageError("--max-shard-size splits safetensors files; it does not apply to --format zarr")
    src, dst = load_input(args.src), load_input(args.dst)
    torch_dist = args.format == "torch_dist"
    if args.megatron_tp is not None and not torch_dist:
        raise UsageError("--megatron-tp goes with --format torch_dist")
    if torch_dist and (comm is not None or args.resume or args.max_shard_size):
        raise UsageError("--format torch_dist runs in one process and takes no --resume or --max-shard-size")
    if torch_dist:
        from streamer.convert.megatron_export import check_destination

        check_destination(dst, where(args.dst))
        if Path(args.out).exists() and any(Path(args.out).iterdir()):
            raise UsageError(f"{args.out}: output directory is not empty")
    return src, dst


def add_convert(sub: Any) -> None:
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
    add_quant_flags(p)
    p.add_argument("--allow-extra", action="store_true")
    p.add_argument("--merge-lora", metavar="ADAPTER",
                   help="merge this PEFT LoRA adapter directory into the weights: W + scale B A in float32, then "
                        "cast to DST's dtype once (docs/cli/convert.md#merging-a-lora-adapter)")
    p.add_argument("--format-version", type=int, choices=(1, 2), default=2,
                   help="the output manifest: 2 compact, chunk checksums in manifest.checksums beside it "
                        "(default); 1 lists every chunk with its checksum")
    p.add_argument("--timeout", type=seconds, default=300.0, metavar="S",
                   help="under mpiexec: bound on every wait for the other workers (default 300); "
                        "a timeout ends every worker with exit 3")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_convert)
