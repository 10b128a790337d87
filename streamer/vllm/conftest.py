"""pytest (``--doctest-modules streamer``): the engine and trainer modules import vLLM, which lives
in the vLLM venv only (scripts/_vllm_venv.sh); elsewhere they are left out of doctest collection
(they have no doctests). Their tests are the vllm tier (tests/vllm)."""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["engine.py", "trainer.py"]
