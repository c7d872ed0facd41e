#!/usr/bin/env bash
# One hf-dspark command run alternately on an older checkout and on this one (A B A B ...), each run writing its own
# JSON report, so that a before/after comparison of a speed ratio (each run measures its own plain baseline) shares
# the machine's state of the minute: two runs of each give a read of the noise.
#
#   scripts/compare_checkouts.sh OLD_CHECKOUT OUT_DIR ROUNDS -- bench --prompts ../shared/data/eval --num-prompts 2
#
# OLD_CHECKOUT: a folder holding an older hf_dspark package (e.g. `git worktree add /tmp/base <rev>`), imported ahead
# of this checkout's; it runs with this checkout's environment. Each run writes OUT_DIR/{old,new}-<round>.json through
# the command's --output flag; the command's stdout and stderr go to OUT_DIR/{old,new}-<round>.log.
set -euo pipefail
if [[ $# -lt 5 || $4 != "--" ]]; then
    echo "usage: $0 OLD_CHECKOUT OUT_DIR ROUNDS -- COMMAND [ARGS...]" >&2
    exit 2
fi
old=$(cd "$1" && pwd)
out=$2
rounds=$3
shift 4
[[ -d $old/hf_dspark ]] || { echo "$old has no hf_dspark package" >&2; exit 2; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got $rounds" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for side in old new; do
        if [[ $side == old ]]; then path=$old; else path=$here; fi
        echo "round $round: $side ($path)"
        log="$out/$side-$round.log"
        (cd "$here" && PYTHONPATH="$path" "$python" -m hf_dspark.cli "$@" --output "$out/$side-$round.json" \
            > "$log" 2>&1) || { echo "the $side run failed (round $round): $(tail -n 1 "$log")" >&2; exit 1; }
    done
done
