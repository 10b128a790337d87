"""Transports: one Protocol (``base.Transport``), several implementations."""

from __future__ import annotations

from streamer.transport.base import Request, Transport, wait_all

__all__ = ["Request", "Transport", "wait_all"]
