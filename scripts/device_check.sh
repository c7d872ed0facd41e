#!/usr/bin/env bash
# The GPU session's checks (scripts/device_check.py); on CPU the CUDA-only ones report SKIP. Arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
exec "$PYTHON" scripts/device_check.py "$@"
