"""How a refit moves: the options each job sets, and what the two jobs agree on at ``open``.

Each job passes its own ``RefitOptions``; ``RefitSession.open`` sends them round in one allgather
and every rank computes the same agreed options with ``agree``: verify or delta if either job
asks, the smallest bucket and the slower stated link, the most planned steps, and one strategy,
FP8 block and domain size (a difference there is refused by name). Nothing is negotiated that a user cannot set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from formats.errors import PlanError, UsageError
from streamer.execute.executor import DEFAULT_BUCKET

__all__ = ["STRATEGIES", "RefitOptions", "agree"]

STRATEGIES = ("reshard", "broadcast")


@dataclass(frozen=True, kw_only=True)
class RefitOptions:
    """One job's refit options (``RefitSession.open(..., options=RefitOptions(...))``)."""

    #: largest message (bytes); the jobs use the smaller of the two
    bucket_size: int = DEFAULT_BUCKET
    #: checksum every received region against the senders' (xxh64), and replicas among senders
    verify: bool = False
    #: "reshard" (move only the overlaps) or "broadcast" (the gather-broadcast baseline)
    strategy: str = "reshard"
    #: ranks per NVLink domain on each side (None: the planner's default)
    src_domain_size: int | None = None
    dst_domain_size: int | None = None
    #: accept sender arrays that no receiver holds (else refused by name)
    allow_extra: bool = False
    #: pushes the caller will run over this session; the jobs agree on the larger
    planned_steps: int = 1
    #: after the first push, send what changed since the last one
    delta: bool = False
    #: delta: the link between the two jobs, GB/s (None: measured at open -- ranks on one host share
    #: memory, where full bytes win; across hosts every delta is encoded); the jobs use the slower
    link_gbps: float | None = None
    #: quantize on refit: elements per float32 scale of block-FP8 weights (None: 128x128, or what
    #: the other job asks), and UE8M0 power-of-two scales
    fp8_block: tuple[int, int] | None = None
    ue8m0: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {self.strategy!r} (one of {', '.join(STRATEGIES)})")
        if self.bucket_size <= 0:
            raise UsageError(f"bucket_size must be positive, got {self.bucket_size}")
        if self.planned_steps < 1:
            raise UsageError(f"planned_steps must be at least 1, got {self.planned_steps}")
        for name in ("src_domain_size", "dst_domain_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise UsageError(f"{name} must be at least 1, got {v}")
        if self.link_gbps is not None and not (0 < self.link_gbps < float("inf")):
            raise UsageError(f"link_gbps must be a positive number of GB/s, got {self.link_gbps}")
        if self.fp8_block is not None and (len(self.fp8_block) != 2 or min(self.fp8_block) < 1):
            raise UsageError(f"fp8_block must be two positive sizes, got {self.fp8_block}")

    def wire(self) -> dict[str, Any]:
        """What this job sends in the agreement round (JSON)."""
        d = asdict(self)
        d["fp8_block"] = list(self.fp8_block) if self.fp8_block else None
        return d


def _one(cfgs: Sequence[dict[str, Any]], key: str, flag: str) -> Any:
    vals = sorted({tuple(c[key]) if isinstance(c[key], list) else c[key] for c in cfgs if c[key] is not None})
    if len(vals) > 1:
        shown = [list(v) if isinstance(v, tuple) else v for v in vals]
        raise PlanError(f"the two jobs asked for different {flag} values {shown}; pass the same to both")
    return vals[0] if vals else None


def agree(cfgs: Sequence[dict[str, Any]], host: Sequence[bool]) -> RefitOptions:
    """The options every rank uses, from every rank's ``wire()`` (``host``: whether each rank's
    transport moves host memory). Raises ``PlanError``/``UsageError`` naming what differs."""
    strategy = _one(cfgs, "strategy", "--strategy")
    block = _one(cfgs, "fp8_block", "--fp8-block")
    agreed = replace(
        RefitOptions(), strategy=strategy,
        verify=any(c["verify"] for c in cfgs), delta=any(c["delta"] for c in cfgs),
        ue8m0=any(c["ue8m0"] for c in cfgs), allow_extra=cfgs[0]["allow_extra"],
        link_gbps=min((c["link_gbps"] for c in cfgs if c.get("link_gbps") is not None), default=None),
        bucket_size=min(c["bucket_size"] for c in cfgs), planned_steps=max(c["planned_steps"] for c in cfgs),
        src_domain_size=_one(cfgs, "src_domain_size", "--src-domain-size"),
        dst_domain_size=_one(cfgs, "dst_domain_size", "--dst-domain-size"),
        fp8_block=(block[0], block[1]) if block else None)
    if agreed.delta and agreed.strategy != "reshard":
        raise UsageError("--delta works with --strategy reshard only")
    if agreed.delta and not all(host):
        raise UsageError("--delta encodes on the host: use --transport mpi or gloo (nccl: not yet)")
    return agreed
