"""Layouts: mesh + placement rules -> manifest (design §4). No I/O, no MPI, no torch.

``mesh`` holds the mesh, the placements and the DTensor geometry; ``rules`` the glob rules, the
special axes (``pp``, ``ep``) and manifest building; ``models`` the model descriptions (HF
configs, NCCL M2N JSONs); ``presets`` what each framework (megatron, vllm, sglang, fsdp2, hf)
holds in memory, one table-driven module per framework. This package re-exports ``mesh`` and
``rules`` (their ``__all__``).
"""

from __future__ import annotations

from . import mesh, rules
from .mesh import *  # noqa: F403 - the public names of mesh (its __all__)
from .rules import *  # noqa: F403 - the public names of rules (its __all__)

__all__ = [*mesh.__all__, *rules.__all__]
