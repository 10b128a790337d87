"""Error hierarchy. Every class also inherits a builtin so callers can catch either.

No I/O, no MPI.
"""

from __future__ import annotations

__all__ = [
    "ShardstreamError",
    "ManifestError",
    "ValidationError",
    "FormatError",
    "ShardNotFoundError",
    "RegionOutOfBoundsError",
    "PlanError",
    "UsageError",
    "TransportError",
    "PeerTimeoutError",
    "PushFailed",
    "OutputLockedError",
]


class ShardstreamError(Exception):
    """Root of every error shardstream raises on purpose.

    ``problems`` holds one line per problem (``PATH: ARRAY: what is wrong``); the CLI prints
    each on its own line. ``exit_code`` is what the CLI returns (design §8).
    """

    exit_code = 1

    def __init__(self, message: str = "", problems: list[str] | None = None) -> None:
        self.problems: list[str] = list(problems) if problems else ([message] if message else [])
        if not message and self.problems:
            message = self.problems[0] if len(self.problems) == 1 else (
                f"{len(self.problems)} problems, first: {self.problems[0]}")
        super().__init__(message)


class ManifestError(ShardstreamError, ValueError):
    """A manifest does not parse or breaks a structural rule."""


class ValidationError(ShardstreamError, ValueError):
    """Validation found one or more problems (all listed in ``problems``)."""


class FormatError(ShardstreamError, ValueError):
    """A data file (safetensors, zarr, DCP) is malformed or hostile."""


class ShardNotFoundError(ShardstreamError, FileNotFoundError):
    """A file or stored tensor a manifest names is missing."""


class RegionOutOfBoundsError(ShardstreamError, IndexError):
    """A region does not fit inside its array or local tensor."""


class PlanError(ShardstreamError, ValueError):
    """Source and destination manifests cannot be matched (missing array, shape mismatch...)."""


class UsageError(ShardstreamError, ValueError):
    """Bad command-line usage (exit 2)."""

    exit_code = 2


class TransportError(ShardstreamError, RuntimeError):
    """Moving bytes failed at run time (exit 3)."""

    exit_code = 3


class PeerTimeoutError(TransportError, TimeoutError):
    """A peer did not answer within the timeout (exit 3)."""


class PushFailed(TransportError):
    """A push broke off on this receiver (the trainer died, a connection closed, the push
    stalled): ``version`` is the one it carried (None when it never began), ``reason`` why. The
    receiver's session stays open; its next ``pull()`` waits for the next push (exit 3)."""

    def __init__(self, reason: str, version: int | None = None) -> None:
        self.version, self.reason = version, reason
        what = f"the push of version {version}" if version is not None else "the next push"
        super().__init__(f"{what} failed: {reason}")


class OutputLockedError(ShardstreamError, RuntimeError):
    """Another process holds the output directory lock (exit 3)."""

    exit_code = 3
