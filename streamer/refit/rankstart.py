"""What one refit rank works out at start, with no communication: its own plan and schedule, and
the digest of the inputs both jobs must agree on.

Every rank parses the same two manifests and runs the same deterministic planner, so the two
jobs agree on every transfer when they agree on what goes in: both manifests, the options that
change a plan or its messages, and the planner itself (shardstream's version and
``PLAN_ALGORITHM``). Ranks compare those few digests, not a digest of the whole plan, which
would need every rank's transfers. Each rank then expands only its own transfers and orders
only its own messages (where a forward it receives goes is computed from the compressed plan:
``forwards.forward_keys``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from formats.manifest.wire import Manifest
from streamer import __version__
from streamer.execute.schedule import Message, build_schedule
from streamer.plan.local_shapes import plan_shapes
from streamer.plan.planner import DEFAULT_SPLIT_BYTES, PLAN_ALGORITHM, Plan, plan_transfers

__all__ = ["input_digests", "input_problems", "plan_own"]


def input_digests(src_text: bytes, dst_text: bytes, options: Mapping[str, Any]) -> dict[str, str]:
    """What both jobs must agree on, by name: each manifest's digest (sha256 of the canonical
    compact text every rank parsed), each plan-affecting option, and the planner's version."""
    out = {"source manifest digest": hashlib.sha256(src_text).hexdigest(),
           "destination manifest digest": hashlib.sha256(dst_text).hexdigest(),
           "planner": f"shardstream {__version__}, plan algorithm {PLAN_ALGORITHM}",
           "split_bytes": str(DEFAULT_SPLIT_BYTES)}
    out.update((k, json.dumps(v)) for k, v in sorted(options.items()))
    return out


def input_problems(gathered: Sequence[Mapping[str, str]], name: Any = str) -> list[str]:
    """One line per input on which some ranks differ from rank 0 (``name(rank)`` labels ranks)."""
    problems = []
    ref = gathered[0]
    for key in sorted(set().union(*gathered)):
        bad = [r for r, g in enumerate(gathered) if g.get(key) != ref.get(key)]
        if bad:
            mine, theirs = ref.get(key, "(none)"), gathered[bad[0]].get(key, "(none)")
            problems.append(f"{key} differs on ranks {bad} ({name(bad[0])}: {_short(theirs)}, {name(0)}: "
                            f"{_short(mine)}): the two jobs run different shardstream versions, read "
                            "different manifests, or were given different options")
    return problems


def _short(v: str) -> str:
    return v[:16] + "…" if len(v) == 64 and all(c in "0123456789abcdef" for c in v) else v


def plan_own(src: Manifest, dst: Manifest, rank: int, *, bucket_size: int, src_domain_size: int | None = None,
             dst_domain_size: int | None = None, allow_extra: bool = False) -> tuple[Plan, list[Message]]:
    """The plan (compressed: per-class templates, no whole-plan figures) and merged rank
    ``rank``'s schedule, with the shapes of its peers' local tensors from the manifests."""
    plan = plan_transfers(src, dst, src_domain_size=src_domain_size, dst_domain_size=dst_domain_size,
                          allow_extra=allow_extra, stats=False)
    return plan, build_schedule(plan, bucket_size, plan_shapes(plan, src, dst), rank=rank)
