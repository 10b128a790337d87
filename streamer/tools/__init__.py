"""Benchmarks, the cluster simulator and synthetic checkpoints (``bench``, ``simulate``, ``synth``)."""

from __future__ import annotations
