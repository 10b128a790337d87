"""One rank's share of a plan: what it sends and receives, figured without expanding any other
rank's transfers (``shardstream plan SRC DST --rank R``). Pure, like the planner.

Ranks are the merged numbering refit uses: the source job's ranks ``0..S-1``, then the
destination job's ``S..S+D-1`` (one numbering for both in a same-job reshard). Summed over all
ranks, ``bytes_sent`` and ``bytes_received`` each give the plan's ``moved_bytes``, ``sends`` its
``transfers``, ``network_bytes_sent`` its ``network_bytes``; the largest ``bytes_sent`` is its
``max_send_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from formats.errors import UsageError
from streamer.plan.model import Plan

__all__ = ["RankFigures", "rank_figures", "rank_role"]


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures, in bytes unless named otherwise; ``to_dict()`` is what ``--json`` prints."""

    rank: int  # merged rank
    role: str  # "send", "recv", or "send+recv" (a same-job reshard)
    job_rank: int  # its rank inside its own job
    bytes_sent: int  # phases 1 and 2 (forwards included)
    bytes_received: int
    transfers: int  # transfers it sends or receives (phases 1 and 2)
    sends: int
    receives: int
    forwards: int  # phase-2 sends: bytes it received in phase 1, passed on inside its domain
    forward_bytes: int
    local_copies: int  # phase 0: same-job bytes it already holds, copied in place
    local_copy_bytes: int
    network_bytes_sent: int  # sent to a rank in another domain
    send_peers: tuple[int, ...]  # merged ranks it sends to
    recv_peers: tuple[int, ...]  # merged ranks it receives from

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["send_peers"], out["recv_peers"] = list(self.send_peers), list(self.recv_peers)
        return out


def rank_role(plan: Plan, rank: int) -> tuple[str, int]:
    """(role, rank inside its job) of merged rank ``rank``; UsageError outside the plan's ranks."""
    if not 0 <= rank < plan.world_size:
        raise UsageError(f"--rank {rank} is outside the plan's ranks 0..{plan.world_size - 1} (senders "
                         f"0..{plan.src_world - 1}, then receivers)" if not plan.same_job else
                         f"--rank {rank} is outside the plan's ranks 0..{plan.world_size - 1}")
    if plan.same_job:
        return "send+recv", rank
    return ("send", rank) if rank < plan.src_world else ("recv", rank - plan.src_world)


def rank_figures(plan: Plan, rank: int) -> RankFigures:
    """What merged rank ``rank`` sends and receives under ``plan``: only the items and arrays whose
    chunks it holds are expanded (``Plan.grids``), and nothing is materialised."""
    role, job_rank = rank_role(plan, rank)
    sums = dict.fromkeys(("sent", "received", "sends", "receives", "forwards", "forward_bytes", "copies",
                          "copy_bytes", "network"), 0)
    send_peers: set[int] = set()
    recv_peers: set[int] = set()
    for g in plan.grids((rank,)):
        phase = g.block.phase[g.items][:, None]
        nbytes = np.broadcast_to(g.block.item_bytes()[g.items][:, None], g.src.shape)
        out = (g.src == rank) & (phase != 0)
        into = (g.dst == rank) & (phase != 0)
        fwd = out & (phase == 2)
        copy = (g.src == rank) & (g.dst == rank) & (phase == 0)
        cross = out & (plan.domains(g.src) != plan.domains(g.dst))
        for key, mask in (("sent", out), ("received", into), ("forward_bytes", fwd), ("copy_bytes", copy),
                          ("network", cross)):
            sums[key] += int(nbytes[mask].sum(dtype=np.int64))
        for key, mask in (("sends", out), ("receives", into), ("forwards", fwd), ("copies", copy)):
            sums[key] += int(np.count_nonzero(mask))
        send_peers.update(np.unique(g.dst[out]).tolist())
        recv_peers.update(np.unique(g.src[into]).tolist())
    return RankFigures(rank, role, job_rank, sums["sent"], sums["received"], sums["sends"] + sums["receives"],
                       sums["sends"], sums["receives"], sums["forwards"], sums["forward_bytes"], sums["copies"],
                       sums["copy_bytes"], sums["network"], tuple(sorted(send_peers)), tuple(sorted(recv_peers)))
