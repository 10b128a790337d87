"""pytest (``--doctest-modules streamer``): the engine module imports vLLM, which lives in the vLLM
venv only (scripts/_vllm_venv.sh); elsewhere it is left out of doctest collection (it has no
doctests). Its tests are the vllm tier (tests/vllm)."""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["engine.py"]
