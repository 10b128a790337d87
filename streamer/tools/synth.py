"""Synthetic, seeded checkpoints shaped like real models (for the demo, tests and benchmarks).

Values are seeded normal floats (bf16 made by rounding float32), so a checkpoint is the same
bytes on every machine. Tensors are generated and written one at a time: memory stays at one
tensor whatever the model size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.manifest.dtypes import DTYPES

__all__ = ["Qwen3Shape", "PRESETS", "qwen3_arrays", "QWEN3_TP_RULES", "write_checkpoint", "tensor_data"]


@dataclass(frozen=True)
class Qwen3Shape:
    hidden: int = 1024
    intermediate: int = 3072
    layers: int = 8
    vocab: int = 32000
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    data_type: str = "bfloat16"


PRESETS: dict[str, Qwen3Shape] = {
    # ~330 MB in bf16: the demo's default
    "qwen3-small": Qwen3Shape(),
    # a few MB: tests
    "qwen3-tiny": Qwen3Shape(hidden=64, intermediate=160, layers=2, vocab=1000, heads=4, kv_heads=2, head_dim=16),
    # ~2.3 GB: the convert benchmark
    "qwen3-2g": Qwen3Shape(hidden=2048, intermediate=8192, layers=14, vocab=64000, heads=16, kv_heads=8,
                           head_dim=128),
}

#: Megatron-style tensor parallelism with the generic rules: column-parallel S(0), row-parallel S(1)
QWEN3_TP_RULES = [
    "*embed_tokens.weight=S(0)",
    "*lm_head.weight=S(0)",
    "*.q_proj.weight=S(0)",
    "*.k_proj.weight=S(0)",
    "*.v_proj.weight=S(0)",
    "*.o_proj.weight=S(1)",
    "*.gate_proj.weight=S(0)",
    "*.up_proj.weight=S(0)",
    "*.down_proj.weight=S(1)",
]


def qwen3_arrays(s: Qwen3Shape) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF parameter names, shapes and dtypes of a Qwen3 dense model."""
    dt = s.data_type
    q = s.heads * s.head_dim
    kv = s.kv_heads * s.head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((s.vocab, s.hidden), dt)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((s.hidden,), dt)
        out[p + "self_attn.q_proj.weight"] = ((q, s.hidden), dt)
        out[p + "self_attn.k_proj.weight"] = ((kv, s.hidden), dt)
        out[p + "self_attn.v_proj.weight"] = ((kv, s.hidden), dt)
        out[p + "self_attn.o_proj.weight"] = ((s.hidden, q), dt)
        out[p + "self_attn.q_norm.weight"] = ((s.head_dim,), dt)
        out[p + "self_attn.k_norm.weight"] = ((s.head_dim,), dt)
        out[p + "post_attention_layernorm.weight"] = ((s.hidden,), dt)
        out[p + "mlp.gate_proj.weight"] = ((s.intermediate, s.hidden), dt)
        out[p + "mlp.up_proj.weight"] = ((s.intermediate, s.hidden), dt)
        out[p + "mlp.down_proj.weight"] = ((s.hidden, s.intermediate), dt)
    out["model.norm.weight"] = ((s.hidden,), dt)
    out["lm_head.weight"] = ((s.vocab, s.hidden), dt)
    return out


def tensor_data(name: str, shape: tuple[int, ...], data_type: str, seed: int) -> np.ndarray:
    """Seeded values for one tensor as raw storage (bf16 -> uint16 bits)."""
    import zlib

    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = 1
    for d in shape:
        n *= d
    if data_type in ("bfloat16", "float32", "float16", "float64"):
        f = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
        if data_type == "bfloat16":
            u = f.view(np.uint32)
            # round to nearest even, like torch's float32 -> bfloat16
            arr = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
        else:
            arr = f.astype(data_type)
    elif data_type == "bool":
        return rng.integers(0, 2, size=n, dtype=np.uint8).astype(np.bool_).reshape(shape)
    else:
        dt = DTYPES[data_type]
        arr = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
        return arr.reshape(shape + (dt.itemsize,)) if shape else arr
    return arr.reshape(shape)


def _iter(arrays: dict[str, tuple[tuple[int, ...], str]], seed: int) -> Iterator[tuple[str, np.ndarray]]:
    for name, (shape, dt) in arrays.items():
        yield name, tensor_data(name, shape, dt, seed)


def write_checkpoint(out_dir: str | os.PathLike[str], arrays: dict[str, tuple[tuple[int, ...], str]], *,
                     seed: int = 0, max_shard_size: int | None = None) -> list[Path]:
    """Write an HF-style checkpoint (``model.safetensors`` or shards + index) atomically."""
    import json

    from formats.manifest.wire import atomic_write_bytes
    from formats.safetensors.io import SafetensorsWriter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, dt) in arrays.items():
        n = DTYPES[dt].itemsize * int(np.prod(shape, dtype=np.int64))
        if max_shard_size and groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    files = []
    weight_map = {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        specs = [(n, DTYPES[arrays[n][1]], arrays[n][0]) for n in group]
        w = SafetensorsWriter(out / fname, specs)
        try:
            for name in group:
                data = tensor_data(name, arrays[name][0], arrays[name][1], seed)
                w.write(name, 0, np.ascontiguousarray(data).view(np.uint8).reshape(-1))
                weight_map[name] = fname
            w.commit()
        except BaseException:
            w.abort()
            raise
        files.append(out / fname)
    if len(groups) > 1:
        total = sum(DTYPES[dt].itemsize * int(np.prod(s, dtype=np.int64)) for s, dt in arrays.values())
        atomic_write_bytes(out / "model.safetensors.index.json", json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())
    return files
