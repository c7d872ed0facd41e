#!/usr/bin/env bash
# The main job: DSpark-assisted greedy generation on SmolLM2-135M-Instruct with the embedded drafter, next to plain
# greedy generate(); prints tokens/s and the accepted length. Extra arguments go to `hf-dspark generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh --runtime
export HF_HUB_OFFLINE=1
# Python caches compiled modules, as pip's install would have compiled them up front (uv does not): with
# PYTHONDONTWRITEBYTECODE set, every run would compile torch and transformers again (about 6 s of each start).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/hf-dspark generate "$@"
