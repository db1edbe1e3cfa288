# kvserve: `make demo` runs the main job, `make test` runs every test. Both install what is missing.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
DEMO_MODEL ?= models/shakespeare-target
DEMO_PROMPT ?= ROMEO:

.PHONY: install build test-deps build-tests demo test test-cpp test-python bench clean

# torch first and pinned: an unpinned `torch` would pull a multi-GB CUDA build. Then the package,
# built against that torch (no build isolation), with its runtime dependencies.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -q "scikit-build-core>=0.10" ninja cmake
	$(PIP) install -q --no-build-isolation -e .

build: install

# The shipped model (models/shakespeare-target, trained by scripts/train_tiny.py); override
# DEMO_MODEL with any Hugging Face directory.
demo: install
	$(PYTHON) -m kvserve generate --model $(DEMO_MODEL) --prompt "$(DEMO_PROMPT)" --max-tokens 96 \
		--temperature 0.8 --top-k 50 --seed 0

# Test dependencies: pytest etc. from PyPI, GoogleTest from Debian.
test-deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -q pytest hypothesis "transformers>=4.45" scipy nbclient nbformat ipykernel matplotlib "scikit-build-core>=0.10" ninja cmake
	@dpkg -s libgtest-dev >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libgtest-dev)

build-tests: test-deps
	$(PIP) install -q --no-build-isolation -e . --config-settings=cmake.define.KVSERVE_BUILD_TESTS=ON

test-cpp: build-tests
	ctest --test-dir build/py --output-on-failure

test-python: build-tests
	$(PYTHON) -m pytest -q

test: build-tests
	ctest --test-dir build/py --output-on-failure
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) benchmarks/bench_decode.py

clean:
	rm -rf build
