"""vLLM plugin: registers the ``shardstream`` weight-transfer backend in every vLLM process.

Installing shardstream declares it under the ``vllm.general_plugins`` entry point (pyproject), which
vLLM loads in every process it starts; the engine module itself (it imports vLLM) is loaded only
when a worker asks for the backend. Nothing else is needed on the engine side::

    LLM(..., weight_transfer_config={"backend": "shardstream"})
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "shardstream"


def register() -> None:
    """Register the backend with vLLM's factory (idempotent: vLLM may load plugins more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "streamer.vllm.engine", "ShardstreamWeightTransferEngine")
