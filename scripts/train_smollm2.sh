#!/usr/bin/env bash
# The recipe behind the embedded SmolLM2-135M-Instruct drafters. Every step is resumable: re-run the script after an
# interruption and it continues where it stopped. Set WORKERS to the number of cores to use for the data steps.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
HF=.venv/bin/hf-dspark
WORKERS=${WORKERS:-2}
DATA=${DATA:-data/regen-smollm2}
FEATURES=${FEATURES:-data_cache/features-smollm2}
STEPS=${STEPS:-800}
COMMON=(--block-size 7 --num-layers 2 --markov-rank 128 --draft-vocab-size 8192 --batch-size 4 --num-anchors 64
        --max-length 512 --max-steps "$STEPS" --lr 1e-3 --save-every 50 --threads 1)

# 1. target regeneration of the training prompts (SmolLM2's recommended sampling: T=0.2, top-p 0.9)
for ((w = 0; w < WORKERS; w++)); do
    $HF data --prompts ../shared/data/train --output "$DATA" --batch-size 32 --shard-size 64 --max-new-tokens 256 \
        --threads 1 --num-workers "$WORKERS" --worker-index "$w" &
done
wait
# 2. target features, cached once (bf16)
for ((w = 0; w < WORKERS; w++)); do
    $HF features --data "$DATA" --output "$FEATURES" --threads 1 --num-workers "$WORKERS" --worker-index "$w" &
done
wait
# 3. DSpark (Markov + confidence head) and the DFlash ablation (no sequential head), same data / steps / shape
$HF train --data "$DATA" --features "$FEATURES" --output runs/smollm2-dspark --sequential-head markov "${COMMON[@]}" &
$HF train --data "$DATA" --features "$FEATURES" --output runs/smollm2-dflash --sequential-head none "${COMMON[@]}" &
wait
