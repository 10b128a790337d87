"""shardstream planning and byte movement.

The public API for trainers and servers::

    from streamer import RefitSession, manifest_from_state_dict

Names are imported on first use, so ``import streamer`` stays cheap (no torch, no MPI).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("shardstream")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["ConvertOptions", "Plan", "PushFailed", "RefitOptions", "RefitSession", "RefusedError", "StateDictError", "StepStats", "__version__",
           "manifest_from_state_dict", "plan_transfers"]

_LAZY = {"PushFailed": "refit.session", "RefitOptions": "refit.options", "RefitSession": "refit.session", "RefusedError": "refit.session", "StepStats": "refit.session",
         "manifest_from_state_dict": "refit.torch_state", "StateDictError": "refit.torch_state",
         "plan_transfers": "plan", "Plan": "plan",
         "ConvertOptions": "convert.options"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'streamer' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{mod}", __name__), name)
