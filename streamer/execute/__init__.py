"""Plan -> schedule of messages -> Executor over a Transport; staging of device tensors; delta encodings; quantize on refit."""

from __future__ import annotations
