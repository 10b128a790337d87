#!/usr/bin/env bash
# The engine half: vllm serve with the shardstream weight-transfer backend and vLLM's RL endpoints
# (/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
# /pause, /resume, /weight_info: VLLM_SERVER_DEV_MODE=1). The trainer half is trainer.py.
#
#     examples/vllm/serve.sh MODEL [PORT] [more vllm serve flags, e.g. --tensor-parallel-size 2]
set -euo pipefail
model=${1:?usage: serve.sh MODEL [PORT] [vllm serve flags]}
port=${2:-8000}
shift $(( $# >= 2 ? 2 : 1 ))
export VLLM_SERVER_DEV_MODE=1
exec vllm serve "$model" --port "$port" --weight-transfer-config '{"backend": "shardstream"}' "$@"
