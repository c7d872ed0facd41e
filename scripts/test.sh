#!/usr/bin/env bash
# The test suite, including the short real-model checks (marker `slow`). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
