"""Shared geometry of the presets: even splits, torch.chunk pieces, pipeline partitions."""

from __future__ import annotations

from ..mesh import LayoutError

__all__ = ["PresetError", "ceil_to", "divide", "piece", "pp_partition"]


class PresetError(LayoutError):
    """A model / mesh / option combination a framework preset cannot lay out."""


def ceil_to(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``.

    >>> ceil_to(1000, 64)
    1024
    """
    return -(-n // m) * m


def piece(n: int, k: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``i`` of ``n`` split in ``k`` (torch.chunk: trailing pieces may be empty)."""
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def divide(n: int, k: int, what: str) -> int:
    """``n / k``, or a :class:`PresetError` saying ``what`` when ``k`` does not divide ``n``."""
    if n % k:
        raise PresetError(f"{what}")
    return n // k


def pp_partition(num_layers: int, pp: int, style: str, *, first: int | None = None,
                 last: int | None = None) -> list[int]:
    """Layers per pipeline stage. ``megatron``: even (``num_layers % pp == 0``), or with
    ``first`` / ``last`` (Megatron-core's ``decoder_first_pipeline_num_layers`` /
    ``decoder_last_pipeline_num_layers``) those on the first / last stage and the rest even over
    the others; ``vllm``: ``get_pp_indices`` (remainder to the stages before the last, from the
    second-to-last backwards); ``sglang``: remainder to the last stages.

    >>> pp_partition(6, 4, "vllm"), pp_partition(6, 4, "sglang"), pp_partition(61, 16, "megatron", first=3, last=2)
    ([1, 2, 2, 1], [1, 1, 2, 2], [3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2])
    """
    if num_layers < pp:
        raise PresetError(f"{num_layers} layers cannot fill {pp} pipeline stages (every stage needs a layer)")
    if (first is not None or last is not None) and style != "megatron":
        raise PresetError(f"{style}: first/last pipeline stage layer counts are a megatron option")
    base, rem = divmod(num_layers, pp)
    parts = [base] * pp
    if style == "megatron" and (first is not None or last is not None):
        for what, v in (("first", first), ("last", last)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise PresetError(f"megatron: {what}-stage layers must be an integer >= 1, got {v!r}")
        ends = [x for x in (first, last) if x is not None]
        if pp <= len(ends):
            raise PresetError(f"megatron: first/last-stage layer counts need pp > {len(ends)} (got pp = {pp})")
        rest, inner = num_layers - sum(ends), pp - len(ends)
        if rest < inner or rest % inner:
            raise PresetError(f"megatron: {num_layers} layers minus first/last-stage layers ({sum(ends)}) leave "
                               f"{rest} for {inner} middle stages: Megatron needs a whole number >= 1 per stage")
        parts = [rest // inner] * pp
        if first is not None:
            parts[0] = first
        if last is not None:
            parts[-1] = last
    elif style == "megatron":
        if rem:
            raise PresetError(f"megatron: num_hidden_layers ({num_layers}) must be divisible by pp ({pp}) "
                               f"(Megatron's even pipeline split; or give the first/last stages their own layer "
                               f"counts, as decoder_first/last_pipeline_num_layers do)")
    elif style == "vllm":
        for i in range(2, rem + 2):
            parts[-i] += 1
    elif style == "sglang":
        for i in range(pp - rem, pp):
            parts[i] += 1
    else:
        raise ValueError(style)
    return parts


