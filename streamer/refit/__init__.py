"""The live refit session: RefitSession (open, push, pull), local tensors, replicas, persistence, state-dict manifests."""

from __future__ import annotations
