#!/usr/bin/env bash
# Long fuzzing runs of the manifest parser/validator and the safetensors reader.
#   scripts/fuzz.sh [EXAMPLES]      (default 20000 per property)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
export SHARDSTREAM_FUZZ_EXAMPLES="${1:-20000}"
export HYPOTHESIS_PROFILE=thorough SHARDSTREAM_FUZZ_BIG=1000000
exec python -m pytest tests/unit/test_fuzz.py tests/unit/test_safetensors_io.py -k "fuzz or mutated or truncated or structural or huge or nested" -q
