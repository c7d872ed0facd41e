#!/usr/bin/env bash
# Tokens/s of every verification-length policy (fixed 1..g, static thresholds, the prefix scheduler) against plain
# generate(), per domain, in one interleaved run on SmolLM2-135M-Instruct + the embedded (calibrated) drafter.
# Run it on a quiet machine: nothing else may use the CPU while it measures.
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${HF:-.venv/bin/hf-dspark}
export HF_HUB_OFFLINE=1
DTYPE=${DTYPE:-float32}
$HF bench --prompts ../shared/data/eval --num-prompts "${NUM_PROMPTS:-2}" --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
    --first-turn-only --dtype "$DTYPE" --threads "${THREADS:-2}" \
    --policies fixed=1 fixed=2 fixed=3 fixed=4 fixed=5 fixed=6 fixed=7 threshold=0.3 threshold=0.5 threshold=0.7 scheduler \
    --output "reports/bench-policies-$DTYPE.json" "$@"
