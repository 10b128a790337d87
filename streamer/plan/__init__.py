"""The planner (pure: formats + numpy; no MPI, no torch.distributed): manifests -> compressed Plan, forwards, per-rank figures."""

from __future__ import annotations
