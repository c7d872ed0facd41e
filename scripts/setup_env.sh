#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv. torch==2.13.0 goes in FIRST: it is the CPU build
# on this machine's disk; an unpinned torch (or a dependency asking for a newer one) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[test]"
