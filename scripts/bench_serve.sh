#!/usr/bin/env bash
# Batched serving measurement (hf-dspark bench-serve): SmolLM2-135M-Instruct + the embedded DSpark drafter in DTYPE
# (float32 by default; DTYPE=bfloat16 for the AMX path), 64 eval prompts (first turns, shuffled with seed 0) x 256 new
# tokens, greedy, replayed at concurrency 1, 4, 16 and 64 for plain batched decoding, fixed-length DSpark
# verification and scheduled DSpark (Algorithm 1 by width layers over the profiled SPS of the padded batch, drafting
# skipped when it cannot pay). Writes reports/bench-serve-smollm2-<tag>.json, .png and .md (the table BENCHMARKS.md
# includes).
#
# Run it on a quiet machine: it first profiles the batched SPS(B) curve once and caches it (keyed by device, dtype and
# thread count, in $HF_DSPARK_CACHE/profiles/sps-batched-*.json); delete that file if it was measured under load.
# Extra arguments go to bench-serve and win over the defaults (e.g. --num-prompts 32 --max-new-tokens 64, --threads 2).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export HF_HUB_OFFLINE=1
DTYPE=${DTYPE:-float32}
case "$DTYPE" in float32) TAG=fp32 ;; bfloat16) TAG=bf16 ;; float16) TAG=fp16 ;; *) echo "unknown DTYPE $DTYPE" >&2; exit 2 ;; esac
exec .venv/bin/hf-dspark bench-serve \
    --prompts "${HF_DSPARK_SHARED:-../shared}/data/eval" \
    --drafter hf_dspark/drafters/smollm2-135m-instruct-dspark \
    --num-prompts 64 --max-new-tokens 256 \
    --concurrency 1 4 16 64 \
    --policies plain fixed scheduler \
    --dtype "$DTYPE" \
    --output "reports/bench-serve-smollm2-$TAG.json" \
    --markdown "reports/bench-serve-smollm2-$TAG.md" \
    "$@"
