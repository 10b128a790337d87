"""Read a Megatron-LM ``torch_dist`` checkpoint (``megatron.core.dist_checkpointing``) as a manifest.

A Megatron save directory holds ``latest_checkpointed_iteration.txt`` (an iteration number, or
``release``) and one directory per iteration, ``iter_NNNNNNN/`` (or ``release/``). Each of those
is a torch DCP directory (``.metadata`` + ``__R_N.distcp``) next to ``metadata.json``
(``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (arguments and counters; never
read here). Arrays keep Megatron's global names and shapes: layers stacked on a leading dim
(``decoder.layers.self_attention.linear_qkv.weight [L, ...]``), the vocab padded.

Besides the model weights the DCP directory holds optimizer state as ordinary arrays
(``optimizer.state.exp_avg.<weight>``; distributed-optimizer saves use other ``optimizer.``
keys), RNG state and Transformer Engine ``_extra_state`` as byte entries. All of them are
skipped by name and counted. The pickles are read by :mod:`formats.dcp.io`'s restricted
unpicklers: nothing in the checkpoint is executed.

No MPI, no torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import FormatError
from ..manifest.wire import Manifest

__all__ = ["MegatronSkipped", "is_megatron_save_dir", "read_megatron_dist", "resolve_iteration_dir"]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_\d{7}")
#: the tracker file holds one short line; refuse anything longer
_MAX_TRACKER_BYTES = 64


@dataclass
class MegatronSkipped:
    """Entries of a Megatron checkpoint that are not model weights, by kind (fqns)."""

    optimizer: list[str] = field(default_factory=list)
    rng: list[str] = field(default_factory=list)
    extra_state: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """``"12 optimizer-state arrays, 1 RNG entries, 8 _extra_state entries"`` (kinds with none left out)."""
        parts = [f"{len(self.optimizer)} optimizer-state arrays" if self.optimizer else "",
                 f"{len(self.rng)} RNG entries" if self.rng else "",
                 f"{len(self.extra_state)} _extra_state entries" if self.extra_state else "",
                 f"{len(self.other)} other byte entries ({', '.join(self.other[:5])})" if self.other else ""]
        return ", ".join(p for p in parts if p) or "nothing"

    def to_dict(self) -> dict[str, int]:
        return {"optimizer": len(self.optimizer), "rng": len(self.rng), "extra_state": len(self.extra_state),
                "other": len(self.other)}


def _kind(fqn: str) -> str | None:
    """Which skipped kind an entry is, or None for a model weight. Keys of sharded objects carry
    a ``/shard_…`` suffix."""
    base = fqn.split("/", 1)[0]
    if base.startswith("optimizer."):
        return "optimizer"
    if base == "rng_state" or base.startswith("rng_state."):
        return "rng"
    if base.endswith("._extra_state") or base == "_extra_state":
        return "extra_state"
    return None


def is_megatron_save_dir(path: Path) -> bool:
    """A Megatron save root (with the iteration tracker) or one of its iteration directories."""
    if (path / TRACKER_FILE).is_file():
        return True
    return (path / ".metadata").is_file() and (path / "metadata.json").is_file() and _backend(path) == "torch_dist"


def _backend(it_dir: Path) -> str | None:
    try:
        with open(it_dir / "metadata.json", "rb") as f:
            raw = f.read(4096)
        d = json.loads(raw)
    except (OSError, ValueError):
        return None
    b = d.get("sharded_backend") if isinstance(d, dict) else None
    return b if isinstance(b, str) else None


def resolve_iteration_dir(path: str | os.PathLike[str]) -> Path:
    """The iteration directory to read: ``path`` itself, or the one its tracker file names.

    Raises ``FormatError`` (one precise line) when the tracker is malformed or names a missing
    directory.
    """
    p = Path(path)
    tracker = p / TRACKER_FILE
    if not tracker.is_file():
        return p
    try:
        with open(tracker, "rb") as f:
            raw = f.read(_MAX_TRACKER_BYTES + 1)
    except OSError as e:
        raise FormatError(f"{tracker}: cannot read ({e.strerror})") from None
    text = raw.decode("ascii", "replace").strip()
    if len(raw) > _MAX_TRACKER_BYTES:
        raise FormatError(f"{tracker}: expected an iteration number or 'release', got {len(raw)}+ bytes")
    if text == "release":
        it = p / "release"
    elif text.isdigit():
        it = p / f"iter_{int(text):07d}"
    else:
        raise FormatError(f"{tracker}: expected an iteration number or 'release', got {text!r:.40}")
    if not it.is_dir():
        raise FormatError(f"{tracker}: names iteration {text!r}, but {it} is not a directory")
    return it


def read_megatron_dist(path: str | os.PathLike[str]) -> tuple[Manifest, MegatronSkipped]:
    """Describe the model weights of the Megatron torch_dist checkpoint at ``path`` (a save root
    with ``latest_checkpointed_iteration.txt`` or an ``iter_NNNNNNN`` / ``release`` directory).

    Arrays keep the stored DCP keys and global shapes; every chunk addresses its ``.distcp``
    payload by byte range (a view, no copy). ``base_dir`` is the iteration directory.
    """
    from ..dcp.io import read_dcp

    it = resolve_iteration_dir(path)
    if not (it / ".metadata").is_file():
        raise FormatError(f"{it}: no .metadata (not a torch_dist checkpoint directory; a Megatron save root needs "
                          f"{TRACKER_FILE})")
    backend = _backend(it)
    if backend is not None and backend != "torch_dist":
        raise FormatError(f"{it / 'metadata.json'}: sharded_backend is {backend!r}; only 'torch_dist' is supported")
    m, byte_entries = read_dcp(it)
    skipped = MegatronSkipped()
    kept = {}
    for fqn, a in m.arrays.items():
        k = _kind(fqn)
        if k is None:
            kept[fqn] = a
        else:
            getattr(skipped, k).append(fqn)
    for fqn in byte_entries:
        getattr(skipped, _kind(fqn) or "other").append(fqn)
    if not kept:
        raise FormatError(f"{it}: no model weights found (only optimizer, RNG or _extra_state entries)")
    name = it.name if _ITER_DIR.fullmatch(it.name) is None else f"{it.parent.name}-{it.name}"
    return replace(m, arrays=kept, name=name), skipped
