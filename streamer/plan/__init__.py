"""The planner (pure: formats + numpy; no MPI, no torch.distributed): manifests -> compressed Plan, forwards, per-rank figures.

``from streamer.plan import plan_transfers, Plan`` is the planning entry point. The modules, in
the order they build on one another: ``topology`` (ranks and domains), ``layout`` (an array's
chunks in canonical order), ``model`` (``Transfer``, ``PlanStats``, the compressed ``Plan``),
``match`` (arrays matched by name, shape and data type), ``template`` (exact overlaps and one
class's transfers), ``fp8`` (FP8 weights planned with their scales), ``classes``, ``stats`` (the
figures and the gather-broadcast baseline), ``balance`` (replica shares), ``planner``
(``plan_transfers``), and beside them ``check`` (``validate_plan``: ``shardstream plan --check``),
``forwards`` (where a phase-2 forward goes in the message order), ``rankplan`` and
``local_shapes`` (one rank's figures and tensor shapes).
"""

from __future__ import annotations

from streamer.plan.check import validate_plan
from streamer.plan.match import CASTABLE, array_casts, match_arrays
from streamer.plan.model import DEFAULT_SPLIT_BYTES, PLAN_ALGORITHM, Plan, PlanStats, RankGrid, Transfer
from streamer.plan.planner import plan_transfers

__all__ = ["CASTABLE", "DEFAULT_SPLIT_BYTES", "PLAN_ALGORITHM", "Plan", "PlanStats", "RankGrid", "Transfer",
           "array_casts", "match_arrays", "plan_transfers", "validate_plan"]
