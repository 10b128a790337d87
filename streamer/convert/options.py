"""What a conversion is asked to do (``ConvertOptions``), what it did (``ConvertReport``), and one
destination file of it (``FileJob``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from formats.integrity.checksum import DEFAULT_ALGO
from formats.safetensors.rankfiles import FileJob

__all__ = ["ConvertOptions", "ConvertReport", "FileJob", "REPORT_COUNTS"]


@dataclass(frozen=True)
class ConvertOptions:
    """Knobs of one conversion."""

    #: bytes of buffers one worker may hold (slab buffer + read buffers)
    memory_limit: int = 1 << 30
    #: continue an interrupted conversion, skipping files already complete and verified
    resume: bool = False
    #: one-rank (HF) output: split into files of at most this many bytes (None: one file)
    max_shard_size: int | None = None
    #: drop source arrays the destination does not list (otherwise an error)
    allow_extra: bool = False
    #: checksum algorithm recorded per chunk in the output manifest
    checksum: str = DEFAULT_ALGO
    #: show a progress bar (None: only on a terminal)
    progress: bool | None = None
    #: cast floating-point arrays to this data_type on the way (e.g. fp32 master weights -> bfloat16)
    cast: str | None = None
    #: output format: "safetensors" (one file per destination file) or "zarr" (DIR is a zarr v3 group)
    format: str = "safetensors"
    #: zarr output: chunk compression ("none" or "zstd")
    zarr_compressor: str = "none"
    #: quantize on write: elements per float32 scale of block-FP8 weights (the last two dims)
    fp8_block: tuple[int, int] = (128, 128)
    #: quantize on write: block-FP8 scales rounded up to a power of two (DeepGEMM use_ue8m0)
    ue8m0: bool = False
    #: the output manifest's format_version: 2 (compact, checksums in a sidecar) or 1 (every chunk)
    manifest_version: int = 2
    #: under mpiexec: seconds a worker waits for the others in an agreement round (checks, plan,
    #: preflight, opening the output), before it gives up with exit 3
    timeout: float = 300.0
    #: small files written into the output before its manifest, as (name, bytes): a PEFT
    #: adapter's adapter_config.json, without which PEFT and vLLM cannot load the adapter
    extra_files: tuple[tuple[str, bytes], ...] = ()

    @property
    def buffer_bytes(self) -> int:
        """The most one slab, zarr unit or coalesced read may buffer: a quarter of the limit, so
        that the two write buffers, the read span and a scratch copy fit in it together."""
        return max(1 << 16, self.memory_limit // 4)


#: the counters of a report that add up over workers
REPORT_COUNTS = ("files_written", "files_skipped", "bytes_written", "bytes_read", "reads")


@dataclass
class ConvertReport:
    files_written: int = 0
    files_skipped: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    reads: int = 0
    seconds: float = 0.0
    workers: int = 1
    plan_stats: dict[str, Any] = field(default_factory=dict)
    #: arrays quantized on write and the bytes saved (``quantize.quant_report``); empty if none
    quantized: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (*REPORT_COUNTS, "seconds", "workers")}
