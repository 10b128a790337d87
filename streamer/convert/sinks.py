"""The ``Sink`` protocol: what the job pipeline needs from an output format. A sink turns the
destination into jobs (a file, a zarr array), writes one job from the plan through the shared
``Filler``, re-verifies a job finished by an earlier run, and writes what goes beside the data.

Two sinks: ``SafetensorsSink`` (one file per destination file) and ``ZarrSink`` (the output is a
zarr v3 group, one array per logical array)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from formats.manifest.wire import Manifest
from streamer.convert.fill import Filler
from streamer.convert.progress import Progress
from streamer.plan.model import Plan

__all__ = ["Job", "Sink"]


class Job(Protocol):
    """One unit of output that one worker writes whole and records as done."""

    @property
    def name(self) -> str:
        """Unique among the jobs; orders the work and names the completion record."""
        ...

    @property
    def nbytes(self) -> int: ...


J = TypeVar("J", bound=Job)


class Sink(Protocol[J]):
    #: the destination the plan is computed against
    target: Manifest

    def layout(self, plan: Plan) -> list[J]:
        """The jobs, once the plan is known (the same list on every worker)."""
        ...

    def record_name(self, job: J) -> str:
        """File name of ``job``'s completion record."""
        ...

    def record_key(self, job: J) -> dict[str, Any]:
        """What a completion record must hold, checksums aside, for a later run to reuse ``job``."""
        ...

    def chunk_keys(self, job: J) -> list[str]:
        """``fqn|chunk index`` of every destination chunk ``job`` checksums."""
        ...

    def temp_paths(self, jobs: Sequence[J]) -> list[str]:
        """Paths (relative to the output) written through temp files, for stale-temp cleanup."""
        ...

    def prepare(self, out: Path) -> None:
        """Once the output is open, before any job is written (rank 0)."""
        ...

    def write(self, out: Path, job: J, filler: Filler, progress: Progress) -> dict[str, str]:
        """Write ``job`` and return the checksum of each of its chunks."""
        ...

    def intact(self, out: Path, job: J, checksums: Mapping[str, str]) -> bool:
        """Whether ``job``, as an earlier run left it, still holds exactly ``checksums``."""
        ...

    def manifest(self, checksums: Mapping[str, str]) -> Manifest:
        """The output manifest, with the chunks' checksums."""
        ...

    def finish(self, out: Path, final: Manifest, jobs: Sequence[J]) -> None:
        """What goes beside the data, written before the manifest (rank 0)."""
        ...

    def close(self) -> None: ...
