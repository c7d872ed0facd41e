#!/usr/bin/env bash
# Draft sources against plain generate() on SmolLM2-135M-Instruct + the embedded drafter, one interleaved run:
# transformers' prompt lookup, the DSpark-only scheduler and the hybrid default (drafter block or prompt lookup,
# priced per round). Writes reports/bench-sources-$DTYPE.{json,md}. Run it on a quiet machine: nothing else may use
# the CPU while it measures. Defaults: 10 prompts per set x 256 new tokens; NUM_PROMPTS / MAX_NEW_TOKENS shorten it.
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${HF:-.venv/bin/hf-dspark}
export HF_HUB_OFFLINE=1
DTYPE=${DTYPE:-float32}
$HF bench --prompts ../shared/data/eval --num-prompts "${NUM_PROMPTS:-10}" --max-new-tokens "${MAX_NEW_TOKENS:-256}" \
    --first-turn-only --dtype "$DTYPE" --threads "${THREADS:-2}" --policies scheduler hybrid --prompt-lookup 10 \
    --output "reports/bench-sources-$DTYPE.json" --markdown "reports/bench-sources-$DTYPE.md" "$@"
