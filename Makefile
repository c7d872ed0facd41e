# Developer shortcuts. `make test` is the CI suite; `make test-vllm` is the opt-in check against vLLM's own DSpark
# model class, which needs a separate ~3.4 GB venv (scripts/setup_vllm_env.sh builds it once).
PYTHON ?= .venv/bin/python
VLLM_VENV ?= .venv-vllm

.PHONY: test test-vllm setup-vllm

test:
	./scripts/test.sh

setup-vllm: $(VLLM_VENV)/.ready

$(VLLM_VENV)/.ready: scripts/setup_vllm_env.sh
	VLLM_VENV=$(VLLM_VENV) ./scripts/setup_vllm_env.sh
	touch $@

.venv/bin/python:
	./scripts/setup_env.sh

test-vllm: $(VLLM_VENV)/.ready $(PYTHON)
	VLLM_VENV=$(abspath $(VLLM_VENV)) HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -s -m vllm tests/test_vllm_optin.py
