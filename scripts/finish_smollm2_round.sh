#!/usr/bin/env bash
# After scripts/train_smollm2_round.sh (same ROUND, default v3): turn that round's drafters into a candidate for the
# embedded pair and evaluate it against the shipped one, as the shipped DSpark drafter was made:
#   1. fine-tune the DSpark confidence head alone, greedy labels, on the held-out regenerated sequences;
#   2. recalibrate it (STS) on training prompts that are in no regenerated folder;
#   3. package both drafters compactly (bf16, like the embedded ones) under runs/candidate-$ROUND/;
#   4. evaluate the pair on ../shared/data/eval (quality on two shards side by side, then speed alone: run nothing
#      else meanwhile).
# Every step is skipped when its output exists, and the evaluation resumes unit by unit: re-run after an interruption.
# PHASES=quality stops before the timed phase. Shipping (scripts/package_drafter.py into hf_dspark/drafters/ with the
# report) is a separate, deliberate step: only when the candidate's macro tau beats the shipped drafter's.
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${HF:-.venv/bin/hf-dspark}
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
PHASES=${PHASES:-quality speed}
ROUND=${ROUND:-v3}
OUT=${OUT:-reports/eval-smollm2-$ROUND}
CAND=runs/candidate-$ROUND

if [ ! -f runs/smollm2-dspark-$ROUND-heldoutconf/drafter/config.json ]; then
    $HF train --data data/regen-smollm2-heldout --output runs/smollm2-dspark-$ROUND-heldoutconf \
        --init-drafter runs/smollm2-dspark-$ROUND/drafter --confidence-target greedy --train-modules confidence_head \
        --max-steps 300 --lr 2e-3 --batch-size 4 --threads 2
fi
if [ ! -f runs/calibrated-dspark-$ROUND/sts.json ]; then
    $HF calibrate --drafter runs/smollm2-dspark-$ROUND-heldoutconf/drafter --prompts ../shared/data/train \
        --exclude data/regen-smollm2* --num-prompts 350 \
        --max-new-tokens 128 --threads 2 --concurrency 16 --output runs/calibrated-dspark-$ROUND
fi
[ -f $CAND/dspark/config.json ] || $PY scripts/package_drafter.py --run runs/smollm2-dspark-$ROUND-heldoutconf \
    --drafter runs/calibrated-dspark-$ROUND --output $CAND/dspark --name smollm2-135m-instruct-dspark
[ -f $CAND/dflash/config.json ] || $PY scripts/package_drafter.py --run runs/smollm2-dflash-$ROUND \
    --output $CAND/dflash --name smollm2-135m-instruct-dflash \
    --verification-policy fixed

EVAL=(--data ../shared/data/eval --output "$OUT" --drafter $CAND/dspark --ablation $CAND/dflash
      --num-prompts 50 --speed-prompts 3 --speed-temperatures 0 --max-new-tokens 256 --temperatures 0 1 --threads 1)
if [[ " $PHASES " == *" quality "* ]]; then
    for shard in 0 1; do
        $HF eval "${EVAL[@]}" --phases quality --concurrency 16 --num-shards 2 --shard-index $shard &
    done
    wait
fi
if [[ " $PHASES " == *" speed "* ]]; then
    $HF eval "${EVAL[@]}" --phases speed --concurrency 16
fi
