"""Matching a destination manifest's arrays to a source's: names, shapes, data types, and the
casts made on the way. Pure planning code.
"""

from __future__ import annotations

from formats.manifest.wire import Manifest

__all__ = ["CASTABLE", "array_casts", "match_arrays"]

#: data types cast into one another on the way when source and destination differ (the sender
#: casts while it packs, so the wire carries destination-sized bytes). FP8 is not among them:
#: it needs scales, not a cast.
CASTABLE = ("float16", "bfloat16", "float32", "float64")


def array_casts(src: Manifest, dst: Manifest) -> dict[str, tuple[str, str]]:
    """``fqn -> (source data_type, destination data_type)`` for every array cast on the way."""
    return {f: (src.arrays[f].data_type, d.data_type) for f, d in dst.arrays.items()
            if f in src.arrays and src.arrays[f].data_type != d.data_type}


def match_arrays(src: Manifest, dst: Manifest, *, allow_extra: bool = False) -> list[str]:
    """Every problem matching ``dst`` arrays to ``src`` arrays (missing, extra, shape, dtype)."""
    problems = []
    for fqn, d in dst.arrays.items():
        s = src.arrays.get(fqn)
        if s is None:
            problems.append(f"{fqn}: missing in source (the destination needs it)")
            continue
        if s.shape != d.shape:
            problems.append(f"{fqn}: shape mismatch (source {list(s.shape)}, destination {list(d.shape)})")
        if s.data_type != d.data_type and not (s.data_type in CASTABLE and d.data_type in CASTABLE):
            problems.append(f"{fqn}: data_type mismatch (source {s.data_type}, destination {d.data_type}): only "
                            f"floating-point pairs ({', '.join(CASTABLE)}) are cast on the way")
    if not allow_extra:
        for fqn in src.arrays:
            if fqn not in dst.arrays:
                problems.append(f"{fqn}: in source but not in destination (pass --allow-extra to drop it)")
    return problems
