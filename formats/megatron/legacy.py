"""Read Megatron-LM's legacy checkpoints (``--ckpt-format torch``) under HF names, executing no pickle.

A legacy save holds one ``torch.save`` archive per model-parallel rank:
``iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt`` (``mp_rank_TT_PPP`` with pipeline parallelism),
next to ``latest_checkpointed_iteration.txt``. Each archive is
``{"args": Namespace, "iteration": …, "model": {local name: tensor}, "optimizer": …, "rng_state": …}``
with the rank's *local* tensors under the local module spec's names (``input_layernorm.weight``,
``pre_mlp_layernorm.weight``), layers numbered within the stage.

``data.pkl`` is read by :class:`formats.dcp.unpickle.LegacyUnpickler`: tensor rebuilds and storages
are recorded, not run; ``argparse.Namespace`` becomes a plain record; NumPy's RNG state (and the
protocol-2 ``bytes`` in it, ``_codecs.encode(text, "latin1")``) and ``megatron.*`` enums become
inert records. Any other global is refused by name. The tensors' bytes are then addressed in
place: ``source.byte_range`` into the archive's stored (uncompressed) storage entries.

The mapping to HF arrays is the megatron preset on the checkpoint's own ``pp × tp`` mesh with
the local spec's names and the save's own padded vocabulary: ``args.padded_vocab_size``, else
the stored embedding (or output layer) rows × tp, else ``make_vocab_size_divisible_by`` × tp
padding (:func:`padded_vocab`). No MPI, no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from ..dcp.torch_archive import ArchiveWindow, clip, open_archive, payload_offset, read_data_pkl
from ..dcp.unpickle import (
    TORCH_ALIASES,
    LegacyUnpickler,
    Record,
    Refused,
    ScanRefused,
    TensorRef,
    restricted_load,
)
from ..errors import FormatError
from ..layouts.presets.megatron import MEGATRON_VOCAB_DIVISOR, megatron_padded_vocab
from ..manifest.box import Box, is_row_major, row_major_strides
from ..manifest.dtypes import DTYPES
from ..manifest.wire import ArraySpec, Chunk, Manifest, Source

__all__ = ["LegacyArchive", "LegacyTensor", "find_rank_files", "is_megatron_legacy", "read_legacy_archive",
           "read_legacy_tensors", "read_megatron_legacy"]

_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
FILE_NAME = "model_optim_rng.pt"
#: a legacy data.pkl lists every tensor of model and optimizer: allow more than a DCP item's
MAX_LEGACY_PKL_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class LegacyTensor:
    """One tensor of a legacy archive: its bytes are ``[start, stop)`` of the file."""

    shape: tuple[int, ...]
    data_type: str
    start: int
    stop: int


def is_megatron_legacy(path: Path) -> bool:
    """``path`` (a save root with the tracker, or an iteration directory) holds ``mp_rank_*`` dirs."""
    from .dist import resolve_iteration_dir

    try:
        it = resolve_iteration_dir(path)
    except FormatError:
        return False
    return it.is_dir() and any(_RANK_DIR.fullmatch(p.name) for p in it.iterdir() if p.is_dir())


def find_rank_files(it: Path, *, expert_named: bool = False) -> dict[tuple[int, int, int], Path]:
    """``(pp, ep, tp) -> model_optim_rng.pt`` of every ``mp_rank_TT[_PPP][_EEE]`` directory of ``it``
    (Megatron-LM's ``get_checkpoint_name``: ``_PPP`` with pipeline parallelism, then ``_EEE`` with
    expert parallelism). One suffix is the pipeline rank unless ``expert_named`` (a save whose
    ``args`` say pp = 1, ep > 1). Raises ``FormatError`` when the grid is incomplete."""
    out: dict[tuple[int, int, int], Path] = {}
    for p in sorted(it.iterdir()):
        m = _RANK_DIR.fullmatch(p.name)
        if m is None or not p.is_dir():
            continue
        f = p / FILE_NAME
        if not f.is_file():
            raise FormatError(f"{p}: no {FILE_NAME}")
        t, a, b = int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)
        out[(0, a, t) if expert_named and m.group(3) is None else (a, b, t)] = f
    if not out:
        raise FormatError(f"{it}: no mp_rank_XX directories (not a Megatron legacy checkpoint)")
    P, E, T = (1 + max(k[i] for k in out) for i in range(3))
    missing = [_rank_dir(p, e, t, P, E) for p in range(P) for e in range(E) for t in range(T) if (p, e, t) not in out]
    if missing:
        grid = f"tp = {T}, pp = {P}" + (f", ep = {E}" if E > 1 else "")
        raise FormatError(f"{it}: the mp_rank directories span {grid}; missing: {', '.join(missing)}")
    return out


def _rank_dir(p: int, e: int, t: int, P: int, E: int) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if P > 1 else "") + (f"_{e:03d}" if E > 1 else "")


# ------------------------------------------------------------------ one archive


@dataclass(frozen=True, slots=True)
class LegacyArchive:
    """One ``model_optim_rng.pt``: its model tensors by local name and the plain values of its
    ``args`` (ints, floats, strings, bools; a Namespace missing means ``{}``)."""

    tensors: dict[str, LegacyTensor]
    args: dict[str, Any]


def read_legacy_tensors(path: Path) -> dict[str, LegacyTensor]:
    """The model tensors of one ``model_optim_rng.pt`` (see :func:`read_legacy_archive`)."""
    return read_legacy_archive(path).tensors


def read_legacy_archive(path: Path) -> LegacyArchive:
    """The model tensors of one ``model_optim_rng.pt`` (``_extra_state`` and other non-tensors
    left out), each addressed by byte range, and its ``args``. Raises ``FormatError`` (one line
    per problem)."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise FormatError(f"{where}: cannot open ({e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        win = ArchiveWindow(fd, 0, size)
        try:
            zf = open_archive(win)
            infos = {i.filename: i for i in zf.infolist()}
            prefix, pkl = read_data_pkl(zf, infos, MAX_LEGACY_PKL_BYTES)
            obj = restricted_load(LegacyUnpickler, pkl, allow_persistent=True)
        except Refused as e:
            if e.detail:
                raise FormatError(f"{where}: data.pkl refers to {e.module}.{e.name}{e.detail}, which a legacy save "
                                  "never holds; refusing to load it") from None
            raise FormatError(f"{where}: data.pkl refers to {e.module}.{e.name}, which is not a tensor, storage, "
                              "argparse.Namespace or megatron class; refusing to load it") from None
        except ScanRefused as e:
            raise FormatError(f"{where}: data.pkl is not one torch.save writes ({e}); refusing to load it") from None
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure of a hostile file is one line
            raise FormatError(f"{where}: not a readable torch.save archive ({type(e).__name__}: "
                              f"{clip(str(e))})") from None
        model = obj.get("model") if isinstance(obj, dict) else None
        if not isinstance(model, dict):
            raise FormatError(f"{where}: no 'model' state dict (virtual pipeline stages 'model0', 'model1', ... are "
                              "not supported)")
        out: dict[str, LegacyTensor] = {}
        problems: list[str] = []
        offsets: dict[str, int] = {}
        for name, t in model.items():
            if not isinstance(name, str) or not isinstance(t, TensorRef):
                continue  # _extra_state (None or bytes)
            try:
                out[name] = _locate(win, infos, prefix, t, size, offsets)
            except ValueError as e:
                problems.append(f"{where}: {name}: {e}")
        if problems:
            raise FormatError(problems=problems)
        args = obj.get("args")
        return LegacyArchive(out, args.plain() if isinstance(args, Record) else {})
    finally:
        os.close(fd)


def _locate(win: ArchiveWindow, infos: Mapping[str, Any], prefix: str, t: TensorRef, size: int,
            offsets: dict[str, int]) -> LegacyTensor:
    dname = TORCH_ALIASES.get(t.dtype or "", t.dtype or "")
    dt = DTYPES.get(dname)
    if dt is None:
        raise ValueError(f"dtype {t.dtype} has no shardstream data_type")
    sizes = t.size
    if not is_row_major(sizes, t.stride):
        raise ValueError(f"tensor is not contiguous row-major (strides {list(t.stride)}, expected "
                         f"{list(row_major_strides(sizes))})")
    dinfo = infos.get(f"{prefix}data/{t.storage.key}")
    if dinfo is None or dinfo.compress_type != 0 or dinfo.flag_bits & 0x1:
        raise ValueError(f"storage entry data/{t.storage.key} is missing, compressed or encrypted")
    key = t.storage.key
    if key not in offsets:
        offsets[key] = payload_offset(win, dinfo, size)
    need = prod(sizes) * dt.itemsize
    start = offsets[key] + t.storage_offset * dt.itemsize
    if t.storage_offset < 0 or start + need > offsets[key] + dinfo.file_size:
        raise ValueError(f"tensor bytes [{start}, {start + need}) run past its storage entry")
    return LegacyTensor(tuple(sizes), dt.name, start, start + need)


# ------------------------------------------------------------------ HF view


def padded_vocab(archives: Mapping[tuple[int, int, int], LegacyArchive], files: Mapping[tuple[int, int, int], Path],
                 vocab: int, tp: int, config: str = "--model") -> int:
    """The padded vocabulary the save holds: ``args.padded_vocab_size`` (checked against the stored
    rows), else the stored ``embedding.word_embeddings.weight`` / ``output_layer.weight`` rows × tp,
    else ``args.make_vocab_size_divisible_by`` (default 128) × tp padding of ``vocab``. Raises
    ``FormatError`` naming the config's ``vocab_size`` when it does not fit."""
    key = min(archives)
    args = archives[key].args
    stored: tuple[int, Path, str] | None = None
    for k in sorted(archives):
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = archives[k].tensors.get(name)
            if t is not None and t.shape:
                stored = (t.shape[0] * tp, files[k], name)
                break
        if stored is not None:
            break
    div = args.get("make_vocab_size_divisible_by")
    if type(div) is not int or div < 1:
        div = None
    div_txt = (f"make_vocab_size_divisible_by {div} × tp {tp}" if div is not None
               else f"Megatron's default make_vocab_size_divisible_by {MEGATRON_VOCAB_DIVISOR} × tp {tp}")
    given = args.get("padded_vocab_size")
    if type(given) is int:
        if stored is not None and stored[0] != given:
            raise FormatError(f"{files[key]}: args.padded_vocab_size is {given}, but {stored[2]} in {stored[1]} holds "
                              f"{stored[0] // tp} rows per tensor-parallel rank (× tp {tp} = {stored[0]})")
        padded, how = given, "args.padded_vocab_size" + (f" ({div_txt})" if div is not None else "")
    elif stored is not None:
        padded, how = stored[0], f"{stored[2]} rows × tp {tp}"
    else:
        padded = megatron_padded_vocab(vocab, tp, div or MEGATRON_VOCAB_DIVISOR)
        how = f"vocab_size padded to a multiple of {div_txt}"
    if vocab > padded or padded % tp:
        raise FormatError(f"{config}: vocab_size {vocab} does not fit the checkpoint's padded vocabulary of {padded} "
                          f"({how}); does --model match the checkpoint?")
    if div is not None and megatron_padded_vocab(vocab, tp, div) != padded:
        # Megatron pads the tokenizer's vocabulary to a multiple of divisor × tp: a config whose
        # vocab_size pads to another size was not the one this save was trained with
        raise FormatError(f"{config}: vocab_size {vocab} pads to {megatron_padded_vocab(vocab, tp, div)} (a multiple of "
                          f"{div_txt}), but the checkpoint holds a padded vocabulary of {padded} ({how}); does "
                          "--model match the checkpoint?")
    return padded


def read_megatron_legacy(path: str | os.PathLike[str], cfg: Mapping[str, Any] | str | os.PathLike[str]) -> Manifest:
    """The HF-named manifest of the legacy checkpoint at ``path`` (save root or iteration
    directory), its chunks addressing the ``model_optim_rng.pt`` bytes. ``base_dir`` is the
    iteration directory."""
    from ..layouts.mesh import Mesh
    from ..layouts.presets import model_info, preset_manifest
    from .dist import resolve_iteration_dir

    it = resolve_iteration_dir(path)
    files, archives = _read_rank_files(it)
    P, E, T = (1 + max(k[i] for k in files) for i in range(3))
    info = model_info(cfg)
    padded = padded_vocab(archives, files, info.vocab, T, "--model" if isinstance(cfg, Mapping) else str(cfg))
    mesh = Mesh(("pp", "ep", "tp"), (P, E, T))
    view = preset_manifest(cfg, "megatron", mesh, megatron_spec="local", megatron_padded_vocab=padded)
    shapes = {r: {n: t.shape for n, t in view.local_tensors(r).items()} for r in range(mesh.size)}
    problems: list[str] = []
    arrays: dict[str, ArraySpec] = {}
    for fqn, spec in view.arrays.items():
        chunks: list[Chunk] = []
        dts: set[str] = set()
        for c in spec.chunks:
            key = mesh.coords(c.holders[0])  # replicas hold the same bytes: read the first
            table, f = archives[(key[0], key[1], key[2])].tensors, files[(key[0], key[1], key[2])]
            name = c.tensor(fqn)
            lt = table.get(name)
            want = shapes[c.holders[0]][name]
            if lt is None:
                problems.append(f"{f}: {fqn}: no tensor {name}")
                break
            if lt.shape != tuple(want):
                problems.append(f"{f}: {fqn}: {name} has shape {list(lt.shape)}, the config needs {list(want)}; "
                                "does --model match the checkpoint?")
                break
            dts.add(lt.data_type)
            rel = os.path.relpath(f, it).replace(os.sep, "/")
            chunks.append(Chunk(Box(offsets=c.region.offsets, sizes=c.region.sizes), (0,),
                                Source(tensor=name, offsets=c.local_offsets, file=rel, byte_range=(lt.start, lt.stop),
                                       stored_shape=lt.shape)))
        if len(dts) == 1 and len(chunks) == len(spec.chunks):
            arrays[fqn] = ArraySpec(spec.shape, dts.pop(), tuple(chunks))
        elif len(dts) > 1:
            problems.append(f"{it}: {fqn}: stored in several data_types {sorted(dts)}")
    if problems:
        raise FormatError(problems=problems)
    return Manifest(world_size=1, arrays=arrays, name=f"{it.parent.name}-{it.name}", base_dir=it)


def _read_rank_files(it: Path) -> tuple[dict[tuple[int, int, int], Path], dict[tuple[int, int, int], LegacyArchive]]:
    """Every rank's file and archive, keyed ``(pp, ep, tp)``. A single ``_XXX`` suffix is the
    expert rank when the save's ``args`` say pp = 1 and ep > 1; the grid must match the args' sizes."""
    files = find_rank_files(it)
    by_path = {f: read_legacy_archive(f) for f in files.values()}
    args = by_path[files[min(files)]].args
    ep_n, pp_n = args.get("expert_model_parallel_size"), args.get("pipeline_model_parallel_size")
    if type(ep_n) is int and ep_n > 1 and pp_n in (None, 1):
        files = find_rank_files(it, expert_named=True)
    sizes = [1 + max(k[i] for k in files) for i in range(3)]
    names = ("pipeline", "expert", "tensor")
    wrong = [f"args.{n}_model_parallel_size is {args[n + '_model_parallel_size']}" for n, size in zip(names, sizes)
             if type(args.get(n + "_model_parallel_size")) is int and args[n + "_model_parallel_size"] != size]
    if wrong:
        raise FormatError(f"{files[min(files)]}: {', '.join(wrong)}, but the mp_rank directories span pp = {sizes[0]}, "
                          f"ep = {sizes[1]}, tp = {sizes[2]}")
    return files, {k: by_path[f] for k, f in files.items()}
