#!/usr/bin/env bash
# shardstream demo: set up .venv if needed, then run the main job on a built-in default.
#
# Generates a seeded synthetic Qwen3-shaped checkpoint (~330 MB bf16), describes it as a
# manifest, converts it HF -> TP4 (S(0)/S(1) rules) -> TP3 (uneven shards) -> HF, and verifies
# that the result is byte-identical to the original.
#
#   scripts/demo.sh [OUT_DIR] [--preset qwen3-small|qwen3-tiny|qwen3-2g]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
OUT="demo-out"
PRESET="qwen3-small"
while [ $# -gt 0 ]; do
    case "$1" in
        --preset) PRESET="$2"; shift 2 ;;
        *) OUT="$1"; shift ;;
    esac
done
rm -rf "$OUT"; mkdir -p "$OUT"
RULES=()
while read -r r; do RULES+=(--rule "$r"); done < <(python -c 'from streamer.synth import QWEN3_TP_RULES; print("\n".join(QWEN3_TP_RULES))')

step() { echo; echo "== $*" >&2; }
step "1. synthetic $PRESET checkpoint"
shardstream synth --preset "$PRESET" --out "$OUT/hf"
step "2. describe it"
shardstream import "$OUT/hf" -o "$OUT/hf/manifest.json"
shardstream validate --data "$OUT/hf/manifest.json"
step "3. HF -> TP4 (column-parallel S(0), row-parallel S(1))"
shardstream layout --like "$OUT/hf/manifest.json" --mesh tp=4 "${RULES[@]}" -o "$OUT/tp4.json"
shardstream plan "$OUT/hf/manifest.json" "$OUT/tp4.json"
shardstream convert "$OUT/hf/manifest.json" "$OUT/tp4.json" --out "$OUT/tp4"
step "4. TP4 -> TP3 (uneven shards, strided reads for S(1) arrays)"
shardstream layout --like "$OUT/tp4" --mesh tp=3 "${RULES[@]}" -o "$OUT/tp3.json"
shardstream plan "$OUT/tp4" "$OUT/tp3.json"
shardstream convert "$OUT/tp4" "$OUT/tp3.json" --out "$OUT/tp3" --memory-limit 256MiB
shardstream validate --data "$OUT/tp3"
step "5. TP3 -> HF"
shardstream layout --like "$OUT/tp3" --mesh tp=1 -o "$OUT/hf1.json"
shardstream convert "$OUT/tp3" "$OUT/hf1.json" --out "$OUT/hf-back"
step "6. verify"
python scripts/compare_checkpoints.py "$OUT/hf/model.safetensors" "$OUT/hf-back/model.safetensors"
echo >&2
echo "demo done: outputs in $OUT/" >&2
