"""A byte progress bar for long work: shown on a terminal, silent when piped."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class Progress:
    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None,
                 enabled: bool | None = None, min_interval: float = 0.2) -> None:
        self.total = max(0, total)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._min = min_interval

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < self._min and self.done < self.total:
            return
        self._last = now
        el = max(now - self.t0, 1e-9)
        rate = self.done / el
        frac = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        width = 28
        fill = int(width * min(1.0, frac))
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% "
                          f"{human_bytes(self.done)}/{human_bytes(self.total)} {rate / 1e9:.2f} GB/s "
                          f"ETA {eta:4.0f}s ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
