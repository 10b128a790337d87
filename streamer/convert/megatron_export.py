"""Write a Megatron-LM ``torch_dist`` checkpoint from one rank's Megatron local tensors.

``convert SRC DST --out DIR --format torch_dist`` first converts into the one-rank megatron
preset (``layout --preset megatron``: unstacked ``decoder.layers.{l}.*`` tensors with the
per-group QKV interleave, ``[gate; up]`` and the padded vocab) in ``DIR/.staging``, with the
usual bounded memory. This module then packs that file into a torch_dist directory:

- each local tensor becomes one DCP chunk of its stacked global array
  (``decoder.layers.{l}.X`` -> chunk ``[l]`` of ``decoder.layers.X``; SequentialMLP experts
  ``local_experts.{e}`` -> ``[l, e]`` of ``experts.experts``), so only one tensor is in memory
  at a time; ``dist_checkpointing.load`` reshards these chunks to any tp × pp (× ep);
- items are written by ``torch.save`` (DCP's ``TORCH_SAVE`` item format) and ``.metadata`` is
  a pickle of torch's own DCP metadata classes: nothing of shardstream's is pickled;
- ``metadata.json`` (``sharded_backend: torch_dist``), ``common.pt`` (checkpoint version and
  iteration 0) and ``latest_checkpointed_iteration.txt`` = ``release`` complete the layout.

Needs torch (imported when called). No MPI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from formats.errors import FormatError, UsageError
from formats.manifest.wire import Manifest, atomic_write_bytes

__all__ = ["check_destination", "pack_torch_dist", "stacked_key"]

_INDEX = re.compile(r"\.(\d+)(?=\.)")
_MEGATRON_PREFIXES = ("decoder.", "embedding.", "output_layer.")
_LINEAR = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight$")


def stacked_key(local: str) -> tuple[str, tuple[int, ...]]:
    """``decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight`` ->
    (``decoder.layers.mlp.experts.experts.linear_fc1.weight``, (3, 1)): torch_dist's key and index."""
    idx = tuple(int(x) for x in _INDEX.findall(local))
    return _INDEX.sub("", local).replace("mlp.experts.local_experts.", "mlp.experts.experts."), idx


def check_destination(dst: Manifest, where: str) -> None:
    """``dst`` is a one-rank megatron preset layout; raises ``UsageError`` naming the problem."""
    if dst.world_size != 1:
        raise UsageError(f"{where}: --format torch_dist needs a one-rank megatron destination (layout --preset "
                         f"megatron, mesh tp=1), got world_size {dst.world_size}")
    bad = sorted(n for n in dst.local_tensors(0) if not n.startswith(_MEGATRON_PREFIXES))
    if bad:
        raise UsageError(f"{where}: --format torch_dist needs Megatron local tensor names (layout --preset megatron); "
                         f"{bad[0]} is not one ({len(bad)} such)")


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def pack_torch_dist(staged: Path, out: Path, *, vocab_rows: int | None = None) -> dict[str, Any]:
    """Pack the one-rank safetensors file in ``staged`` into ``out/release`` (a Megatron save
    root). ``vocab_rows``: the padded vocab the loading job computes (Megatron pads to a multiple
    of ``make_vocab_size_divisible_by × tp``); rows past the staged ones are written as a zero
    chunk. The iteration is written in a temporary directory and renamed into place, and
    ``latest_checkpointed_iteration.txt`` comes last, so a reader never sees half a save.
    Returns a small report (arrays, chunks, bytes)."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    files = sorted(staged.glob("*.safetensors"))
    if len(files) != 1:
        raise FormatError(f"{staged}: --format torch_dist needs a one-rank megatron destination (layout --preset "
                          f"megatron, default mesh tp=1); got {len(files)} files")
    items, shapes = _stacked_items(files[0], vocab_rows)
    tmp = out / ".release.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    rel = "__0_0.distcp"
    with open(files[0], "rb") as src, open(tmp / rel, "wb") as f:
        nbytes = _write_tensors(src, f, rel, items, shapes, sdm, storage)
        _write_extra_states(f, rel, items, shapes, sdm, storage)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / ".metadata", "wb") as f:  # torch's own DCP classes: nothing of ours is pickled
        pickle.dump(Metadata(state_dict_metadata=sdm, storage_data=storage), f)
        f.flush()
        os.fsync(f.fileno())
    torch.save({"checkpoint_version": 3.0, "iteration": 0}, tmp / "common.pt")
    (tmp / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                   "common_backend": "torch", "common_backend_version": 1}))
    it = out / "release"
    shutil.rmtree(it, ignore_errors=True)
    os.replace(tmp, it)
    atomic_write_bytes(out / "latest_checkpointed_iteration.txt", b"release")
    shutil.rmtree(staged)
    extra = sum(1 for k in sdm if "/" in k)
    return {"arrays": len(sdm) - extra, "chunks": len(storage) - extra, "extra_state": extra, "bytes": nbytes,
            "dir": os.fspath(it)}


def _stacked_items(path: Path, vocab_rows: int | None
                   ) -> tuple[list[tuple[str, tuple[int, ...], Any]], dict[str, tuple[tuple[int, ...], str]]]:
    """Each stored tensor as (stacked Megatron key, its layer/expert index, header entry), and
    each key's stacked global shape and dtype."""
    from formats.safetensors.io import read_header

    h = read_header(path)
    names = list(h.tensors)
    # a local-spec layout (--megatron-spec local): Megatron saves its separate norms under the TE
    # names (the spec's sharded_state_dict_keys_map), in MoE layers too
    local_spec = any(n.endswith(".input_layernorm.weight") for n in names) and any(
        n.endswith(".self_attention.linear_qkv.weight") for n in names)
    items: list[tuple[str, tuple[int, ...], Any]] = []
    for t in h.tensors.values():
        key, lead = stacked_key(t.name)
        if local_spec:
            key = key.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_").replace(
                ".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
        if not key.startswith(_MEGATRON_PREFIXES):
            raise FormatError(f"{path}: {t.name}: not a Megatron local tensor name; DST must be "
                              "`layout --preset megatron`")
        items.append((key, lead, t))
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for key, lead, t in items:
        prev = shapes.get(key)
        need = tuple(i + 1 for i in lead)
        if prev is not None:
            need = tuple(max(a, b) for a, b in zip(prev[0][:len(lead)], need))
        shape = tuple(t.shape)
        if key in _VOCAB_KEYS and vocab_rows is not None:
            if vocab_rows < shape[0]:
                raise UsageError(f"{t.name}: --megatron-tp pads the vocab to {vocab_rows} rows, fewer than the "
                                 f"{shape[0]} of the layout")
            shape = (vocab_rows,) + shape[1:]
        shapes[key] = (need + shape, t.dtype.name)
    return items, shapes


def _write_tensors(src: Any, f: Any, rel: str, items: list[tuple[str, tuple[int, ...], Any]],
                   shapes: dict[str, tuple[tuple[int, ...], str]], sdm: dict[str, Any],
                   storage: dict[Any, Any]) -> int:
    """Every tensor as a torch.save'd chunk of its stacked key (one tensor in memory at a time)."""
    import io

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from formats.manifest.dtypes import by_name

    nbytes = 0
    for key, lead, t in items:
        src.seek(t.start)
        dt = getattr(torch, by_name(t.dtype.name).name)
        full = (1,) * len(lead) + tuple(t.shape)
        ten = (torch.frombuffer(bytearray(src.read(t.nbytes)), dtype=dt).reshape(full) if t.nbytes
               else torch.empty(full, dtype=dt))  # frombuffer refuses an empty buffer
        shape, _ = shapes[key]
        tm = sdm.get(key)
        if tm is None:
            tm = sdm[key] = TensorStorageMetadata(TensorProperties(dtype=dt), torch.Size(shape), [])
        pieces = [(lead + (0,) * len(t.shape), ten)]
        if shape[len(lead)] > ten.shape[len(lead)]:  # the loader's extra vocab padding: zeros
            rows = shape[len(lead)] - ten.shape[len(lead)]
            pieces.append((lead + (ten.shape[len(lead)],) + (0,) * (len(t.shape) - 1),
                           torch.zeros((1,) * len(lead) + (rows,) + tuple(t.shape[1:]), dtype=dt)))
        for off, piece in pieces:
            offsets = torch.Size(off)
            buf = io.BytesIO()
            torch.save(piece, buf)
            data = buf.getvalue()
            pos = f.tell()
            f.write(data)
            tm.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece.shape)))
            storage[MetadataIndex(key, offsets)] = _StorageInfo(relative_path=rel, offset=pos, length=len(data))
        nbytes += t.nbytes
    return nbytes


def _write_extra_states(f: Any, rel: str, items: list[tuple[str, tuple[int, ...], Any]],
                        shapes: dict[str, tuple[tuple[int, ...], str]], sdm: dict[str, Any],
                        storage: dict[Any, Any]) -> None:
    """Megatron's linear layers also hold an ``_extra_state`` sharded object per layer (expert);
    its loader asks for them, so write what the local spec saves: ``torch.save([None])``."""
    import io

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    empty = io.BytesIO()
    torch.save([None], empty)
    for key, lead, _t in items:
        if not _LINEAR.search(key) or not lead:
            continue
        stack = shapes[key][0][:len(lead)]
        fqn = (key.removesuffix(".weight") + "._extra_state/shard_" + ".".join(map(str, lead)) + "_"
               + ".".join(map(str, stack)))
        pos = f.tell()
        f.write(empty.getvalue())
        sdm[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = _StorageInfo(relative_path=rel, offset=pos, length=len(empty.getvalue()))
