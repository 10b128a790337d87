"""Refit straight into a running vLLM engine (``docs/vllm.md``).

- :mod:`~streamer.vllm.manifest`: ``manifest_from_vllm(model)``, the receiver manifest read from
  vLLM's own layer objects inside each worker;
- :mod:`~streamer.vllm.engine`: the ``shardstream`` weight-transfer engine (imports vLLM);
- :mod:`~streamer.vllm.plugin`: the ``vllm.general_plugins`` entry point that registers it.

Nothing here is imported by ``import streamer``; the modules import vLLM lazily or only when vLLM
asks for them.
"""
