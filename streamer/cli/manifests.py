"""Commands that make or read manifests: ``import``, ``layout``, ``validate``, ``inspect`` and ``synth``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from formats.errors import ShardstreamError, UsageError
from formats.manifest.limits import RANK_FILE_PATTERN
from streamer.cli.args import emit as _out
from streamer.cli.args import parse_size
from streamer.cli.args import positive_int as _positive_int
from streamer.cli.inputs import load_input

if TYPE_CHECKING:
    from formats.manifest.wire import Manifest


def cmd_import(args: argparse.Namespace) -> int:
    from formats.manifest.wire import save_manifest
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
    from formats.manifest.wire import (
        COMPACT_FORMAT_VERSION,
        atomic_write_bytes,
        dumps_manifest,
        loads_manifest,
    )
    from formats.validate.manifest import validate_manifest

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
        like = load_input(args.like)
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
        from streamer.convert.merge_lora import ADAPTER_CONFIG

        if mesh.size == 1 and like.base_dir is not None and (like.base_dir / ADAPTER_CONFIG).is_file():
            pattern = "adapter_model.safetensors"  # a PEFT adapter: the file PEFT and vLLM load
    m = _write_layout(apply_layout(like, mesh, rules, file_pattern=pattern, domain_size=args.domain_size,
                                   name=args.name), args)
    chunks = m.chunk_count()
    _out(args, {"manifest": args.output, "world_size": m.world_size, "arrays": len(m.arrays), "chunks": chunks},
         f"wrote {args.output}: world_size {m.world_size}, {len(m.arrays)} arrays, {chunks} chunks")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from formats.manifest.wire import load_manifest
    from formats.validate.manifest import validate_data, validate_manifest

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


def cmd_inspect(args: argparse.Namespace) -> int:
    p = Path(args.path)
    if p.is_file() and p.suffix == ".safetensors":
        from formats.safetensors.io import read_header

        h = read_header(p)
        lines = [f"{p}: {len(h.tensors)} tensors, {h.file_size} bytes, data at offset {h.data_start}"]
        for t in h.tensors.values():
            lines.append(f"  {t.name:60s} {t.dtype.name:14s} {list(t.shape)!s:24s} {t.nbytes} B")
        tensors = [{"name": t.name, "data_type": t.dtype.name, "shape": list(t.shape), "nbytes": t.nbytes,
                    "offset": t.start} for t in h.tensors.values()]
        _out(args, {"path": str(p), "kind": "safetensors", "tensors": tensors, "metadata": h.metadata},
             "\n".join(lines))
        return 0
    m = load_input(args.path)
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


def add_import(sub: Any) -> None:
    p = sub.add_parser("import", help="describe an existing checkpoint as a manifest")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("-o", "--output", required=True, metavar="MANIFEST")
    p.add_argument("--name")
    p.add_argument("--model", metavar="CFG", help="with --to hf: the model's HF config.json")
    p.add_argument("--to", choices=("hf",), help="Megatron torch_dist: arrays under HF names (unstacked layers, "
                   "q/k/v and gate/up split, vocab padding dropped), still addressing the stored bytes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_import)


def add_layout(sub: Any) -> None:
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


def add_validate(sub: Any) -> None:
    p = sub.add_parser("validate", help="check manifests (and with --data, their files)")
    p.add_argument("manifests", nargs="+", metavar="MANIFEST")
    p.add_argument("--data", action="store_true", help="also open the files: headers, tensors, byte ranges, checksums")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)


def add_synth(sub: Any) -> None:
    p = sub.add_parser("synth", help="write a seeded synthetic HF checkpoint shaped like a Qwen3 model")
    p.add_argument("--preset", choices=["qwen3-tiny", "qwen3-small", "qwen3-2g"], default="qwen3-small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_synth)


def add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="summarise a safetensors file or a manifest")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)
