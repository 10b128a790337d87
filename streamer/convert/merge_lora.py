"""``convert --merge-lora ADAPTER``: a PEFT LoRA adapter merged into the base weights on the way.

Each weight an adapter targets becomes ``W + scale * B @ A`` (PEFT's ``merge_and_unload``), with
``scale = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA, per module where the config's
``rank_pattern`` / ``alpha_pattern`` say so. The merge is computed in float32 and cast once to the
destination's dtype: merging a small update into bf16 weights in bf16 would round most of it
away (and round it twice when the result is cast again).

It streams as every convert does. The merged arrays are float32 in the source manifest that the
planner sees (``merged_source``), so the sink casts them to what the destination asks, exactly as
for fp32 masters. ``MergingStore`` reads the base bytes of each region the plan moves and adds
``scale * B[rows] @ A[:, cols]`` of that region only. The adapter is read whole (its tensors are
small next to the weights: rank x (in + out) per module), in float32.

Refused by name, before anything is written: an adapter without ``adapter_config.json``, DoRA,
``fan_in_fan_out`` (GPT-2's Conv1D), embedding LoRA, tensors that are not LoRA pairs (biases,
``modules_to_save``), a module without its base weight in the source, or shapes that disagree.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import ValidationError
from formats.manifest.box import Box
from formats.manifest.spec import Chunk, Manifest
from formats.store import ResolvedTensor, SourceStore
from streamer.ops.cast import cast_bytes, with_dtypes

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "LoraPair", "MergingStore", "load_adapter", "merged_source"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
#: bytes of float32 rows merged at a time: the temporaries of a read stay this small
MERGE_BLOCK = 4 << 20
#: PEFT's saved name of one LoRA tensor
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class LoraPair:
    """One module's adapter, float32: ``a`` is (r, in), ``b`` is (out, r)."""

    a: np.ndarray[Any, Any]
    b: np.ndarray[Any, Any]
    scale: float

    def delta(self, rows: slice, cols: slice) -> np.ndarray[Any, Any]:
        """``scale * B[rows] @ A[:, cols]``, float32."""
        out: np.ndarray[Any, Any] = np.float32(self.scale) * (self.b[rows] @ self.a[:, cols])
        return out


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the first key that matches the module's name as a suffix (a
    regular expression, as ``peft.utils.get_pattern_key`` reads it)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _config(adapter: Path) -> dict[str, Any]:
    path = adapter / ADAPTER_CONFIG
    if not path.is_file():
        raise ValidationError(f"--merge-lora {adapter}: no {ADAPTER_CONFIG} (a PEFT adapter directory: "
                              "model.save_pretrained(DIR) on a PEFT model)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValidationError(f"{path}: not readable JSON ({e})") from e
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"{path}: peft_type {cfg.get('peft_type')!r}: only LORA adapters merge")
    if cfg.get("use_dora"):
        problems.append(f"{path}: use_dora: DoRA's magnitude vector does not merge as W + scale B A")
    if cfg.get("fan_in_fan_out"):
        problems.append(f"{path}: fan_in_fan_out: Conv1D weights (GPT-2) are stored transposed; not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            problems.append(f"{path}: {key} must be a positive number, got {cfg.get(key)!r}")
    if problems:
        raise ValidationError(problems=problems)
    return dict(cfg)


def load_adapter(adapter: str | Path) -> dict[str, LoraPair]:
    """The adapter in ``adapter`` (a PEFT directory), by the base array each pair merges into
    (``base_model.model.<module>.lora_A.weight`` -> ``<module>.weight``)."""
    from streamer.convert.importer import import_checkpoint

    d = Path(adapter)
    cfg = _config(d)
    if not (d / ADAPTER_FILE).is_file():
        raise ValidationError(f"--merge-lora {d}: no {ADAPTER_FILE}")
    m = import_checkpoint([d / ADAPTER_FILE])
    problems: list[str] = []
    halves: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
    with SourceStore(m) as store:
        for name, spec in sorted(m.arrays.items()):
            got = _NAME.match(name)
            if got is None or len(spec.shape) != 2:
                problems.append(f"{d / ADAPTER_FILE}: {name}: not a LoRA matrix (base_model.model.MODULE.lora_A.weight "
                                "or lora_B); biases, embedding LoRA and modules_to_save do not merge")
                continue
            chunk = spec.chunks[0]
            raw = store.read(store.resolve(name, chunk, 0), Box((0, 0), tuple(spec.shape)))
            halves.setdefault(got["module"], {})[got["ab"]] = (
                cast_bytes(raw, spec.data_type, "float32").view(np.float32).reshape(spec.shape))
    pairs = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"{d / ADAPTER_FILE}: base_model.model.{module}: lora_{'B' if 'A' in ab else 'A'}.weight "
                            "is missing")
            continue
        r = _pattern(cfg.get("rank_pattern") or {}, module, cfg["r"])
        alpha = _pattern(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        a, b = ab["A"], ab["B"]
        if a.shape[0] != r or b.shape[1] != r:
            problems.append(f"{d / ADAPTER_FILE}: base_model.model.{module}: lora_A {list(a.shape)} and lora_B "
                            f"{list(b.shape)} for rank {r}")
            continue
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        pairs[f"{module}.weight"] = LoraPair(np.ascontiguousarray(a), np.ascontiguousarray(b), float(scale))
    if problems:
        raise ValidationError(problems=problems)
    return pairs


def merged_source(src: Manifest, pairs: Mapping[str, LoraPair], where: str = "SRC") -> Manifest:
    """``src`` with every array the adapter merges into as float32 (what ``MergingStore`` reads
    back); a module without its base weight, or of another shape, is refused by name."""
    problems, merged = [], {}
    for fqn, p in sorted(pairs.items()):
        spec = src.arrays.get(fqn)
        want = [p.b.shape[0], p.a.shape[1]]
        if spec is None:
            problems.append(f"{where}: {fqn}: the adapter's module has no base weight here")
        elif list(spec.shape) != want:
            problems.append(f"{where}: {fqn} is {list(spec.shape)}, the adapter's B @ A is {want}")
        elif spec.data_type not in ("float32", "bfloat16", "float16"):
            problems.append(f"{where}: {fqn} is {spec.data_type}: only float weights merge")
        else:
            merged[fqn] = "float32"
    if problems:
        raise ValidationError(problems=problems)
    return with_dtypes(src, merged)


@dataclass(frozen=True, slots=True)
class _Merged(ResolvedTensor):
    """A base weight's stored tensor, read back as float32 with the adapter merged in."""

    base: ResolvedTensor | None = None
    pair: LoraPair | None = None
    #: global coordinates of the stored tensor's element (0, 0)
    origin: tuple[int, ...] = ()


class MergingStore(SourceStore):
    """Reads ``merged`` (``merged_source``) from the files ``original`` describes: merged arrays
    come back as float32, base + ``scale * B @ A`` of each region read."""

    def __init__(self, merged: Manifest, original: Manifest, pairs: Mapping[str, LoraPair]) -> None:
        super().__init__(merged)
        self._base = SourceStore(original)
        self._pairs = pairs

    def resolve(self, fqn: str, chunk: Chunk, rank: int) -> ResolvedTensor:
        pair = self._pairs.get(fqn)
        if pair is None:
            return super().resolve(fqn, chunk, rank)
        base = self._base.resolve(fqn, chunk, rank)
        origin = tuple(g - s for g, s in zip(chunk.region.offsets, chunk.local_offsets))
        from formats.manifest.dtypes import by_name

        return _Merged(base.path, base.name, by_name("float32"), base.shape, base.start, base, pair, origin)

    def read(self, rt: ResolvedTensor, box: Box, out: np.ndarray | None = None) -> np.ndarray:
        if not isinstance(rt, _Merged):
            return super().read(rt, box, out)
        assert rt.base is not None and rt.pair is not None
        self._base.read_budget, self._base.max_gap = self.read_budget, self.max_gap
        raw = self._base.read(rt.base, box)
        isz, (nrows, ncols) = rt.base.dtype.itemsize, box.sizes
        if out is None:
            out = np.empty(box.volume * 4, dtype=np.uint8)
        merged = out[:box.volume * 4].view(np.float32).reshape(nrows, ncols)
        r0, c0 = (o + off for o, off in zip(rt.origin, box.offsets))
        step = max(1, MERGE_BLOCK // max(1, ncols * 4))  # float32 temporaries of a few rows at a time
        for i in range(0, nrows, step):
            n = min(step, nrows - i)
            part = raw[i * ncols * isz:(i + n) * ncols * isz]
            w = part if rt.base.dtype.name == "float32" else cast_bytes(part, rt.base.dtype.name, "float32")
            merged[i:i + n] = w.view(np.float32).reshape(n, ncols) + rt.pair.delta(
                slice(r0 + i, r0 + i + n), slice(c0, c0 + ncols))
        return out

    def close(self) -> None:
        self._base.close()
        super().close()
