"""Problem lines as the checks report them (design §8: ``WHERE: ARRAY: what is wrong``), each
kind capped per array, and the small formatters their messages share. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["MAX_PER_KIND", "Report", "fmt_dims", "fmt_ranks"]

#: at most this many problems of one kind are printed per array; the rest are counted
MAX_PER_KIND = 20


class Report:
    """Collects problem lines, capping each (context, kind) at ``MAX_PER_KIND`` lines."""

    def __init__(self, where: str, cap: int = MAX_PER_KIND) -> None:
        self.where = where
        self.cap = cap
        self.lines: list[str] = []
        self._count: dict[tuple[str, str], int] = {}
        self._extra: dict[tuple[str, str], tuple[int, bool]] = {}
        self._last: dict[tuple[str, str], int] = {}

    def add(self, ctx: str, kind: str, msg: str) -> None:
        key = (ctx, kind)
        n = self._count.get(key, 0) + 1
        self._count[key] = n
        if n <= self.cap:
            self.lines.append(f"{self.where}: {ctx}: {msg}" if ctx else f"{self.where}: {msg}")
            self._last[key] = len(self.lines) - 1

    def more(self, ctx: str, kind: str, n: int, *, at_least: bool = False) -> None:
        """Count ``n`` further problems of a kind without their lines (``at_least``: a lower bound)."""
        if n <= 0 and not at_least:
            return
        key = (ctx, kind)
        old, old_al = self._extra.get(key, (0, False))
        self._extra[key] = (old + n, old_al or at_least)

    def finish(self) -> list[str]:
        tails: list[tuple[int, str]] = []
        keys = set(self._count) | set(self._extra)
        for key in keys:
            shown = min(self._count.get(key, 0), self.cap)
            hidden = self._count.get(key, 0) - shown
            extra, at_least = self._extra.get(key, (0, False))
            hidden += extra
            if hidden <= 0 and not at_least:
                continue
            ctx, kind = key
            head = f"{self.where}: {ctx}: " if ctx else f"{self.where}: "
            txt = f"... and more than {hidden} more {kind}" if at_least else f"... and {hidden} more {kind}"
            tails.append((self._last.get(key, len(self.lines) - 1), head + txt))
        out = list(self.lines)
        for pos, line in sorted(tails, key=lambda t: t[0], reverse=True):
            out.insert(pos + 1, line)
        return out


def fmt_dims(v: Sequence[int]) -> str:
    return "[" + ", ".join(str(x) for x in v) + "]"


def fmt_ranks(rs: Iterable[int], limit: int = 8) -> str:
    rl = sorted(set(rs))
    if len(rl) == 1:
        return f"rank {rl[0]}"
    s = ", ".join(str(r) for r in rl[:limit])
    if len(rl) > limit:
        s += f", ... ({len(rl)} ranks)"
    return f"ranks [{s}]"
