#!/usr/bin/env bash
# A training round of the embedded SmolLM2-135M-Instruct drafters: continue both shipped drafters (DSpark and the
# DFlash ablation, same steps and data) on the regenerated data in DATA, with held-out evaluation on
# data/regen-smollm2-heldout (eval_log.jsonl: stop when tau stops rising). Outputs go to runs/smollm2-*-$ROUND. Every
# step is resumable: re-run the script (same ROUND) after an interruption.
#   ROUND=v3 (default): DATA = data/regen-smollm2 data/regen-smollm2-b (2737 turns).
#   Any other ROUND: also data/regen-smollm2-c (3256 turns, bfloat16 regeneration, data/README.md). The round after v5:
#     ROUND=v6 FROM=v5 FEATURES=runs/long/features TARGET_DTYPE=bfloat16 MP=bf16 STEPS=5000 EVAL_EVERY=1000 \
#       TRAIN_ARGS="--torch-compile --confidence-target greedy" ./scripts/train_smollm2_round.sh
# TRAIN_ARGS adds `hf-dspark train` arguments to both runs (e.g. "--torch-compile --confidence-target greedy").
# MP=bf16 trains under bfloat16 autocast (accelerate mixed precision). TARGET_DTYPE=bfloat16 computes the target
# features in bfloat16 (1.6x faster on a CPU with bfloat16 arithmetic; 0.6% relative difference from float32 in the
# tapped hidden states, 1.8% in the last one); the default is float32.
#
# A data folder may still be growing while its regeneration runs (commands in data/README.md); training pins the
# shards finished when it starts. Afterwards (scripts/finish_smollm2_round.sh, same ROUND), as for the shipped
# drafter: fine-tune the DSpark confidence head alone on the held-out data (a head fitted on the drafter's own
# training sequences, where it is more accurate, is overconfident on new prompts), recalibrate, evaluate, package.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${HF:-}" ]; then
    ./scripts/setup_env.sh
    HF=.venv/bin/hf-dspark
fi
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
WORKERS=${WORKERS:-2}
ROUND=${ROUND:-v3}
case "$ROUND" in
    v3) DEFAULT_DATA="data/regen-smollm2 data/regen-smollm2-b" ;;
    *) DEFAULT_DATA="data/regen-smollm2 data/regen-smollm2-b data/regen-smollm2-c" ;;
esac
read -r -a DATA <<< "${DATA:-$DEFAULT_DATA}"
FEATURES=${FEATURES:-data_cache/features-smollm2}
STEPS=${STEPS:-1500}   # STEPS=600 EVAL_EVERY=200: ~20 min of features on a fresh machine, ~1 h of training on 2 cores
COMMON=(--data "${DATA[@]}" --features "$FEATURES" --max-length 512 --batch-size 4 --num-anchors 64
        --max-steps "$STEPS" --lr 5e-4 --save-every 50 --threads 1 --mixed-precision "${MP:-no}"
        --eval-data data/regen-smollm2-heldout --eval-every "${EVAL_EVERY:-250}" --eval-sequences 64)
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"
COMMON+=("${TRAIN_ARGS[@]}")

# 1. target features of every finished shard of both folders (one features folder: files are named by digest)
for ((w = 0; w < WORKERS; w++)); do
    $HF features --data "${DATA[@]}" --output "$FEATURES" --threads 1 --target-dtype "${TARGET_DTYPE:-float32}" \
        --num-workers "$WORKERS" --worker-index "$w" &
done
wait
# 2. both drafters continue from the shipped ones, same data / steps / schedule
# (FROM=v5: continue from runs/smollm2-*-v5/drafter, a finished earlier round, instead)
if [ -n "${FROM:-}" ]; then
    INIT_DSPARK=runs/smollm2-dspark-$FROM/drafter INIT_DFLASH=runs/smollm2-dflash-$FROM/drafter
else
    INIT_DSPARK=hf_dspark/drafters/smollm2-135m-instruct-dspark INIT_DFLASH=hf_dspark/drafters/smollm2-135m-instruct-dflash
fi
$HF train "${COMMON[@]}" --init-drafter "$INIT_DSPARK" --output "runs/smollm2-dspark-$ROUND" &
$HF train "${COMMON[@]}" --init-drafter "$INIT_DFLASH" --output "runs/smollm2-dflash-$ROUND" &
wait
