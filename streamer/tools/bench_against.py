"""``bench refit --against FILE``: rerun a committed reference configuration and print each ratio
next to its reference figure, so that a change to the schedule, the executor or a transport is
held against the last known-good figures (not a timed test: machines are noisy, so it prints and
the reader judges; record the output in CHANGELOG.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from formats.errors import UsageError

__all__ = ["FIGURES", "against_table", "load_reference"]

#: figure -> (label, whether larger is better)
FIGURES = {"ratio_to_floor": ("steady push / Alltoallv floor", False),
           "first_push_ratio_to_steady": ("first push / steady push", False),
           "speedup_vs_broadcast": ("gather-broadcast / steady push", True)}
_CONFIG_KEYS = {"preset", "senders", "receivers", "train_mesh", "serve_mesh", "repeats", "bucket_size", "source"}


def load_reference(path: str) -> dict[str, Any]:
    """The reference file: its ``config`` (keyword arguments of ``bench_refit``) and ``reference``
    figures; a file that is not one is refused by name."""
    p = Path(path)
    try:
        ref = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read the bench reference: {e}") from e
    cfg, figs = ref.get("config"), ref.get("reference")
    if not isinstance(cfg, dict) or not isinstance(figs, dict):
        raise UsageError(f"{path}: a bench reference needs a 'config' and a 'reference' object")
    unknown = sorted(set(cfg) - _CONFIG_KEYS) + sorted(set(figs) - set(FIGURES))
    if unknown:
        raise UsageError(f"{path}: unknown keys {unknown} (config: {sorted(_CONFIG_KEYS)}; reference: {sorted(FIGURES)})")
    return dict(ref)


def against_table(result: dict[str, Any], ref: dict[str, Any], path: str) -> str:
    """Each reference figure beside this run's, with which way is better."""
    lines = [f"bench refit --against {path} ({ref['config'].get('preset', 'qwen3-small')}, "
             f"{ref['config'].get('senders', 4)}+{ref['config'].get('receivers', 4)} ranks):",
             f"  {'figure':34s} {'this run':>9s} {'reference':>9s}  verdict"]
    for key, want in ref["reference"].items():
        label, bigger = FIGURES[key]
        now = float(result[key])
        better = now >= want if bigger else now <= want
        lines.append(f"  {label:34s} {now:9.2f} {float(want):9.2f}  {'ok' if better else 'WORSE'}")
    if ref.get("source"):
        lines.append(f"  reference: {ref['source']}")
    return "\n".join(lines)
