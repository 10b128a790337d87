"""Compare the manifest a vLLM engine described with the ``vllm`` preset's (``shardstream layout``)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from formats.manifest.wire import Manifest, load_manifest, parse_manifest

#: vLLM 0.32 keeps routed experts in a ``routed_experts`` submodule; the preset predates it
RENAMES = ((".mlp.experts.routed_experts.", ".mlp.experts."),)


def _norm(name: str) -> str:
    for a, b in RENAMES:
        name = name.replace(a, b)
    return name


def preset_manifest(model: Path, tp: int, fp8: bool = False) -> Manifest:
    """``shardstream layout --preset vllm`` for ``model``'s config (``fp8``: its block-FP8 layout)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "m.json"
        subprocess.run([sys.executable, "-m", "streamer", "layout", "--preset", "vllm", "--model",
                        str(model / "config.json"), "--mesh", f"tp={tp}", "--dtype", "bfloat16", "--no-files",
                        "-o", str(out)] + (["--fp8"] if fp8 else []), check=True)
        return load_manifest(out)


def _view(m: Manifest) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    arrays = {fqn: (a.shape, a.data_type, sorted((c.region.offsets, c.region.sizes, c.holders,
                                                   _norm(c.tensor(fqn)), c.local_offsets) for c in a.chunks))
              for fqn, a in m.arrays.items()}
    tensors = {r: {_norm(n): (t.shape, t.data_type) for n, t in m.local_tensors(r).items()}
               for r in range(m.world_size)}
    return arrays, tensors


def compare_manifests(got: dict[str, Any] | Manifest, want: Manifest) -> list[str]:
    """What differs between the two, one line per array or rank (empty: the same layout)."""
    g = got if isinstance(got, Manifest) else parse_manifest(json.loads(json.dumps(got)))
    (ga, gt), (wa, wt) = _view(g), _view(want)
    out = [f"array {n}: engine has it, the preset does not" for n in sorted(set(ga) - set(wa))]
    out += [f"array {n}: the preset has it, the engine does not" for n in sorted(set(wa) - set(ga))]
    out += [f"array {n}: engine {ga[n]} != preset {wa[n]}" for n in sorted(set(ga) & set(wa)) if ga[n] != wa[n]]
    if g.world_size != want.world_size:
        out.append(f"world_size {g.world_size} != {want.world_size}")
    out += [f"rank {r} local tensors: engine {gt.get(r)} != preset {wt.get(r)}"
            for r in sorted(set(gt) | set(wt)) if gt.get(r) != wt.get(r)]
    return out
