#!/usr/bin/env bash
# The test suite, including the short real-model checks (marker `slow`). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export HF_HUB_OFFLINE=1
# Python caches compiled modules, as pip's install would have compiled them up front (uv does not): with
# PYTHONDONTWRITEBYTECODE set, every run would compile torch and transformers again (about 6 s of each start).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q "$@"
