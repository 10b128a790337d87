"""``shardstream import``: describe an existing checkpoint as a manifest.

Understands a single ``*.safetensors`` file, several of them (each tensor a whole array), an HF
sharded checkpoint (``model.safetensors.index.json``), a zarr v3 group (``zarr.json``), a torch
DCP directory, a Megatron-LM torch_dist save (its root with ``latest_checkpointed_iteration.txt``,
or one ``iter_NNNNNNN`` directory), and a directory written by ``convert`` (its ``manifest.json``). File paths in the manifest are relative to the manifest's directory,
which must contain the checkpoint (design §3).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from formats.errors import FormatError, ManifestError, ShardNotFoundError, UsageError
from formats.manifest.box import Box
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source, load_manifest

if TYPE_CHECKING:
    from formats.megatron.dist import MegatronSkipped

__all__ = ["import_checkpoint", "import_megatron", "is_megatron_checkpoint", "rebase_manifest"]


def _rel(path: Path, base: Path) -> str:
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(base))
    if rel == ".." or rel.startswith(".." + os.sep) or os.path.isabs(rel):
        raise UsageError(f"{path}: the manifest must be written in the checkpoint's directory or above it "
                         f"(file paths are relative and may not leave it); got manifest directory {base}")
    return rel.replace(os.sep, "/")


def _from_files(files: list[Path], base: Path, name: str | None) -> Manifest:
    from formats.safetensors.io import read_header

    arrays: dict[str, ArraySpec] = {}
    problems: list[str] = []
    for f in files:
        h = read_header(f)
        rel = _rel(f, base)
        for tname, st in h.tensors.items():
            if tname in arrays:
                problems.append(f"{f}: tensor {tname!r} also appears in another file")
                continue
            shape = tuple(st.shape)
            if any(s == 0 for s in shape):
                chunks: tuple[Chunk, ...] = ()  # empty arrays have no chunks (empty regions are not listed)
            else:
                chunks = (Chunk(Box.whole(shape), (0,), Source(file=rel)),)
            arrays[tname] = ArraySpec(shape, st.dtype.name, chunks)
    if problems:
        raise FormatError(problems=problems)
    return Manifest(world_size=1, arrays=arrays, name=name, base_dir=base)


def _from_zarr(group: Path, base: Path, name: str | None) -> Manifest:
    """A zarr v3 group: one array per zarr array (sub-groups walked; the fqn is the array path
    with '/' read as '.'), each one chunk covering the whole array, read by zarr slicing
    (``source.file`` = the group, ``source.tensor`` = the array path)."""
    from formats.zarr.io import list_arrays

    rel = _rel(group, base)
    arrays: dict[str, ArraySpec] = {}
    problems: list[str] = []
    for path, info in list_arrays(group):
        fqn = path.replace("/", ".")
        if fqn in arrays:
            problems.append(f"{group}: arrays {path!r} and another both map to the name {fqn!r}")
            continue
        chunks: tuple[Chunk, ...] = ()
        if not any(s == 0 for s in info.shape):
            chunks = (Chunk(Box.whole(info.shape), (0,), Source(tensor=path, file=rel)),)
        arrays[fqn] = ArraySpec(info.shape, info.data_type, chunks)
    if problems:
        raise FormatError(problems=problems)
    if not arrays:
        raise FormatError(f"{group}: the zarr group holds no arrays")
    return Manifest(world_size=1, arrays=arrays, name=name, base_dir=base)


def rebase_manifest(m: Manifest, new_base: Path) -> Manifest:
    """The same manifest with ``source.file`` paths made relative to ``new_base``."""
    from dataclasses import replace

    if m.base_dir is None or os.path.realpath(m.base_dir) == os.path.realpath(new_base):
        return replace(m, base_dir=new_base)
    prefix = _rel(m.base_dir, new_base)
    arrays = {}
    for fqn, a in m.arrays.items():
        chunks = []
        for c in a.chunks:
            if c.source is not None and c.source.file is not None:
                f = c.source.file if prefix == "." else (
                    prefix if c.source.file == "." else f"{prefix}/{c.source.file}")
                c = Chunk(c.region, c.holders, replace(c.source, file=f))
            chunks.append(c)
        arrays[fqn] = ArraySpec(a.shape, a.data_type, tuple(chunks))
    return replace(m, arrays=arrays, base_dir=new_base)


def import_checkpoint(paths: list[str | os.PathLike[str]], *, manifest_dir: str | os.PathLike[str] | None = None,
                      name: str | None = None) -> Manifest:
    """Describe the checkpoint at ``paths``. ``manifest_dir`` is where the manifest will live
    (paths are made relative to it); default: the checkpoint's directory."""
    ps = [Path(p) for p in paths]
    if not ps:
        raise UsageError("import needs at least one PATH")
    for p in ps:
        if not p.exists():
            raise ShardNotFoundError(f"{p}: no such file or directory")
    if len(ps) == 1 and ps[0].is_dir():
        d = ps[0]
        base = Path(manifest_dir) if manifest_dir else d
        if is_megatron_checkpoint(d):
            m, _ = import_megatron(d, manifest_dir=base, name=name)
            return m
        if (d / "manifest.json").exists():
            return rebase_manifest(load_manifest(d / "manifest.json"), base.resolve())
        from formats.zarr.io import ZARR_JSON, is_zarr_group

        if (d / ZARR_JSON).exists():
            if not is_zarr_group(d):
                raise FormatError(f"{d / ZARR_JSON}: not a zarr v3 group (import the group that holds the array)")
            return _from_zarr(d, base, name or d.name)
        if (d / "model.safetensors.index.json").exists():
            return _from_index(d / "model.safetensors.index.json", base, name)
        if (d / "model.safetensors").exists():
            return _from_files([d / "model.safetensors"], base, name or d.name)
        if (d / ".metadata").exists():  # torch.distributed.checkpoint: pickles read restricted, never run
            import sys
            from dataclasses import replace

            from formats.dcp.io import read_dcp

            m, skipped = read_dcp(d)
            if skipped:
                shown = ", ".join(skipped[:10]) + (", ..." if len(skipped) > 10 else "")
                print(f"shardstream: note: {d}: skipped {len(skipped)} non-tensor entries: {shown}", file=sys.stderr)
            return rebase_manifest(replace(m, name=name or m.name), base.resolve())
        sts = sorted(d.glob("*.safetensors"))
        if sts:
            return _from_files(sts, base, name or d.name)
        raise UsageError(f"{d}: no manifest.json, model.safetensors.index.json or *.safetensors found")
    if len(ps) == 1 and ps[0].name.endswith(".index.json"):
        base = Path(manifest_dir) if manifest_dir else ps[0].parent
        return _from_index(ps[0], base, name)
    for p in ps:
        if p.is_dir() or not p.name.endswith(".safetensors"):
            raise UsageError(f"{p}: expected *.safetensors files, an index.json, or one directory")
    base = Path(manifest_dir) if manifest_dir else ps[0].parent
    return _from_files(ps, base, name)


def is_megatron_checkpoint(d: Path) -> bool:
    """A Megatron-LM save (root with its tracker file, torch_dist or legacy iteration directory)
    that is not already described by a ``manifest.json``."""
    from formats.megatron.dist import is_megatron_save_dir
    from formats.megatron.legacy import is_megatron_legacy

    return d.is_dir() and not (d / "manifest.json").exists() and (is_megatron_save_dir(d) or is_megatron_legacy(d))


def import_megatron(path: str | os.PathLike[str], *, manifest_dir: str | os.PathLike[str] | None = None,
                    name: str | None = None, model: str | os.PathLike[str] | None = None,
                    quiet: bool = False) -> tuple[Manifest, MegatronSkipped]:
    """Describe a Megatron-LM torch_dist checkpoint: its model weights under the stored keys, or
    with ``model`` (an HF ``config.json``) under HF names (:func:`formats.layouts.megatron_hf.megatron_to_hf`).
    Chunks address the ``.distcp`` bytes either way. Prints what was skipped unless ``quiet``."""
    import sys
    from dataclasses import replace

    from formats.megatron.dist import read_megatron_dist

    d = Path(path)
    from formats.megatron.legacy import is_megatron_legacy

    if is_megatron_legacy(d):
        from formats.megatron.dist import MegatronSkipped
        from formats.megatron.legacy import read_megatron_legacy

        if model is None:
            raise UsageError(f"{d}: a Megatron legacy checkpoint (mp_rank_XX/model_optim_rng.pt) holds per-rank "
                             "local tensors; import it with --model CFG --to hf")
        m = read_megatron_legacy(d, model)
        base = Path(manifest_dir) if manifest_dir else d
        return rebase_manifest(replace(m, name=name or m.name), base.resolve()), MegatronSkipped()
    m, skipped = read_megatron_dist(d)
    if not quiet:
        print(f"shardstream: note: {d}: skipped {skipped.summary()} (not model weights)", file=sys.stderr)
    if model is not None:
        from formats.layouts.megatron_hf import megatron_to_hf

        m = megatron_to_hf(m, model, where=str(d))
    base = Path(manifest_dir) if manifest_dir else d
    return rebase_manifest(replace(m, name=name or m.name), base.resolve()), skipped


def _from_index(index: Path, base: Path, name: str | None) -> Manifest:
    try:
        data = json.loads(index.read_text())
        wm = data["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{index}: not a valid safetensors index ({e})") from e
    files = []
    for f in sorted(set(wm.values())):
        if os.path.isabs(f) or ".." in Path(f).parts:
            raise ManifestError(f"{index}: weight_map names {f!r}, outside the checkpoint directory")
        files.append(index.parent / f)
    m = _from_files(files, base, name or index.parent.name)
    missing = sorted(set(wm) - set(m.arrays))
    if missing:
        raise FormatError(problems=[f"{index}: {t}: listed in weight_map but not found in {wm[t]}" for t in missing])
    return m
