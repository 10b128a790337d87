"""shardstream planning and byte movement.

The public API for trainers and servers::

    from streamer import RefitSession, manifest_from_state_dict  # FSDP2 / DTensor state dicts
    from streamer import manifest_from_megatron                 # a live megatron-core model

Names are imported on first use, so ``import streamer`` stays cheap (no torch, no MPI).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConvertOptions", "Plan", "PushFailed", "RefitOptions", "RefitSession", "RefusedError", "StateDictError", "StepStats", "__version__",
           "manifest_from_megatron", "manifest_from_state_dict", "plan_transfers"]

_LAZY = {"PushFailed": "refit.session", "RefitOptions": "refit.options", "RefitSession": "refit.session", "RefusedError": "refit.session", "StepStats": "refit.session",
         "manifest_from_state_dict": "refit.torch_state", "manifest_from_megatron": "refit.megatron", "StateDictError": "refit.torch_state",
         "plan_transfers": "plan", "Plan": "plan",
         "ConvertOptions": "convert.options"}


def _version() -> str:
    # importlib.metadata costs ~0.1 s of every rank's start; only --version and bench reports read it
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardstream")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return _version()
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'streamer' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{mod}", __name__), name)
