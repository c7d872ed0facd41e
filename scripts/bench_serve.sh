#!/usr/bin/env bash
# Batched serving measurement (hf-dspark bench-serve): SmolLM2-135M-Instruct (float32) + the embedded DSpark drafter,
# 64 eval prompts (first turns, shuffled with seed 0) x 256 new tokens, greedy, replayed at concurrency 1, 4, 16 and
# 64 for plain batched decoding, fixed-length DSpark verification and scheduled DSpark (prefix scheduler over the
# profiled SPS(B) of the batch's total verification tokens). Writes reports/bench-serve-smollm2-fp32.json and .png.
#
# Run it on a quiet machine: it first profiles the batched SPS(B) curve once and caches it (keyed by device, dtype and
# thread count, in $HF_DSPARK_CACHE/profiles/sps-batched-*.json); delete that file if it was measured under load.
# Extra arguments go to bench-serve (e.g. --device cuda, --threads 2, --num-prompts 32, --schedule topk).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/hf-dspark bench-serve \
    --prompts "${HF_DSPARK_SHARED:-../shared}/data/eval" \
    --drafter hf_dspark/drafters/smollm2-135m-instruct-dspark \
    --num-prompts 64 --max-new-tokens 256 \
    --concurrency 1 4 16 64 \
    --methods plain fixed scheduled \
    --output reports/bench-serve-smollm2-fp32.json \
    "$@"
