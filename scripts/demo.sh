#!/usr/bin/env bash
# shardstream demo: set up .venv if needed, then run the main job on a built-in default.
#
# 1. Live refit: a seeded synthetic Qwen3-shaped model (~330 MB bf16) held by a 4-rank "trainer"
#    job as TP2xPP2 is pushed to a separately launched 4-rank "inference" job as TP4, the two
#    jobs joined by a rendezvous file; verified by per-region checksums, saved, then measured
#    against the gather-broadcast baseline on the same bytes.
# 2. Offline conversion: HF -> TP4 -> TP3 (uneven) -> HF, byte-identical to the original.
#
#   scripts/demo.sh [OUT_DIR] [--preset qwen3-small|qwen3-tiny|qwen3-2g] [--ranks N]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
OUT="demo-out"
PRESET="qwen3-small"
N=4
while [ $# -gt 0 ]; do
    case "$1" in
        --preset) PRESET="$2"; shift 2 ;;
        --ranks) N="$2"; shift 2 ;;
        *) OUT="$1"; shift ;;
    esac
done
rm -rf "$OUT"; mkdir -p "$OUT"
RULES=()
while read -r r; do RULES+=(--rule "$r"); done < <(python -c 'from streamer.tools.synth import QWEN3_TP_RULES; print("\n".join(QWEN3_TP_RULES))')

step() { echo; echo "== $*" >&2; }
step "1. synthetic $PRESET checkpoint"
shardstream synth --preset "$PRESET" --out "$OUT/hf"
step "2. describe it"
shardstream import "$OUT/hf" -o "$OUT/hf/manifest.json"
shardstream validate --data "$OUT/hf/manifest.json"
RULES2=()
while read -r r; do RULES2+=(--rule "$r"); done < <(python -c 'from streamer.tools.synth import QWEN3_TP_RULES; print("\n".join(g + "=R," + p for g, p in (r.split("=", 1) for r in QWEN3_TP_RULES)))')
step "live refit: trainer job TP2xPP2 ($N ranks) -> inference job TP$N ($N ranks), two launches + rendezvous"
shardstream layout --like "$OUT/hf/manifest.json" --mesh pp=2,tp=$((N / 2)) "${RULES2[@]}" -o "$OUT/train.json"
shardstream convert "$OUT/hf/manifest.json" "$OUT/train.json" --out "$OUT/trainer"   # the trainer's rank files
shardstream layout --like "$OUT/hf/manifest.json" --mesh tp=$N "${RULES[@]}" --no-files -o "$OUT/serve.json"
shardstream plan "$OUT/trainer" "$OUT/serve.json" --dst-domain-size $N
RDV="$OUT/rendezvous.port"
for STRATEGY in reshard broadcast; do
    rm -f "$RDV"
    SAVE=(); VERIFY=()
    if [ "$STRATEGY" = reshard ]; then SAVE=(--save "$OUT/served"); VERIFY=(--verify); fi
    # the inference job: opens an MPI port, writes it to the rendezvous file, waits for trainers
    mpiexec -n "$N" shardstream refit recv --manifest "$OUT/serve.json" --rendezvous "$RDV" \
        --strategy "$STRATEGY" --steps 3 --timeout 120 "${SAVE[@]}" --json > "$OUT/recv-$STRATEGY.json" &
    RECV=$!
    # the trainer job: a separate launch that dials the port in the file
    mpiexec -n "$N" shardstream refit send --manifest "$OUT/trainer" --rendezvous "$RDV" \
        --strategy "$STRATEGY" --steps 3 --timeout 120 "${VERIFY[@]}" --json > "$OUT/send-$STRATEGY.json"
    wait "$RECV"
done
shardstream validate --data "$OUT/served"
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
r = json.load(open(f"{out}/recv-reshard.json")); b = json.load(open(f"{out}/recv-broadcast.json"))
print(f"\n{'strategy':18s} {'bytes moved':>14s} {'median s':>10s} {'GB/s':>8s}")
for name, x in (("reshard", r), ("gather-broadcast", b)):
    print(f"{name:18s} {x['moved_bytes'] / 1e9:11.3f} GB {x['median_s']:10.3f} {x['gb_per_s']:8.2f}")
print(f"reshard moves {b['moved_bytes'] / r['moved_bytes']:.2f}x fewer bytes and is "
      f"{b['median_s'] / r['median_s']:.2f}x faster (median of {r['steps']} pushes; checksums verified: {r['verified']})")
PY

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
