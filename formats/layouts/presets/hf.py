"""``hf``: one rank, HF names (``convert`` names the files and writes the index). Tied embeddings:
``model.embed_tokens.weight`` only, as ``save_pretrained`` writes it (``lm_head.weight`` is the same
tensor and is not stored)."""

from __future__ import annotations

from .builder import Builder
from .engine import Framework, ModelInfo, Options
from .geometry import PresetError

__all__ = ["FRAMEWORK"]


def place(b: Builder, info: ModelInfo, opts: Options) -> None:
    if b.mesh.size != 1:
        raise PresetError(f"preset hf: one rank, got mesh {b.mesh} ({b.mesh.size} ranks); use fsdp2 or a rule "
                          f"layout for several ranks")
    for fqn in info.arrays:
        b.whole(fqn, fqn)


FRAMEWORK = Framework("hf", None, ordered=False, place=place)
