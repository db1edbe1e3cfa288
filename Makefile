# kvserve: `make demo` runs the main job, `make test` runs every test. Both install what is missing.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
DEMO_MODEL ?= models/shakespeare-target
DEMO_PROMPT ?= ROMEO:

.PHONY: install build test-deps build-tests demo test test-cpp test-python test-asan check-cuda bench clean

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
	$(PIP) install -q pytest pytest-xdist hypothesis "transformers>=4.45" "compressed-tensors>=0.12" scipy \
		nbclient nbformat ipykernel matplotlib fastapi uvicorn prometheus-client openai httpx peft gguf \
		"scikit-build-core>=0.10" ninja cmake vllm-router
	@dpkg -s libgtest-dev >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libgtest-dev)

# Every CPU kernel variant this machine runs (a plain install builds the best one and the portable
# baseline), so that the tests cover each. RUNTIME_TESTS=OFF leaves the runtime's C++ tests out
# of this build (.ci/run: make test-asan builds and runs them sanitized).
RUNTIME_TESTS ?= ON
build-tests: test-deps
	$(PIP) install -q --no-build-isolation -e . --config-settings=cmake.define.KVSERVE_BUILD_TESTS=ON \
		--config-settings=cmake.define.KVSERVE_CPU_CAPABILITIES=RUNNABLE \
		--config-settings=cmake.define.KVSERVE_RUNTIME_TESTS=$(RUNTIME_TESTS)

test-cpp: build-tests
	ctest --test-dir build/py --output-on-failure -j2

# The Python suite: the tests that share the machine on every core (pytest-xdist), then those
# that need it to themselves (the `serial` marker: tests/e2e, torchrun launches), one at a time.
# --durations: the slowest tests, in the log, for keeping CI within its time.
# MARKERS=EXPR narrows both passes to the tests that match a marker expression: .ci/run's
# `make test MARKERS=unsanitized` runs those that make test-asan leaves out, so that CI runs each
# test once (the rest sanitized).
SELECT := $(if $(MARKERS),($(MARKERS)) and ,)
PYTEST_SUITE := $(PYTHON) -m pytest -q -m "$(SELECT)not serial" -n $$(nproc) --durations=15 && \
	$(PYTHON) -m pytest -q -m "$(SELECT)serial" --durations=25

test-python: build-tests
	$(PYTEST_SUITE)

test: build-tests
	@date +"%T built"
	ctest --test-dir build/py --output-on-failure -j2
	$(PYTEST_SUITE)

# The C++ tests and the Python suite once more under AddressSanitizer + UndefinedBehaviorSanitizer:
# an instrumented build in build/asan, loaded by an uninstrumented Python with the sanitizer
# runtimes preloaded. Leak checking is off (CPython and libtorch keep allocations until exit).
ASAN_BUILD := build/asan
ASAN_ENV := ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_odr_violation=0 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# To keep CI short, the instrumented build is -O1 with line tables only, holds just the CPU
# kernel variant this machine runs (the only one the sanitized process uses) and no emulated
# CUDA kernel tests (make test runs them; tests/cpp/CMakeLists.txt), ctest runs two at a time,
# and the Python suite leaves out the tests marked `unsanitized` (work in subprocesses or in
# Python and transformers, which the sanitizer does not see; tests/conftest.py gives each reason).
# pytest on the sanitized build in two passes, as make test's (the workers too load that build).
ASAN_PYTEST := $(ASAN_ENV) LD_PRELOAD="$$(gcc -print-file-name=libasan.so) \
	$$(gcc -print-file-name=libubsan.so)" $(PYTHON) scripts/asan_pytest.py $(ASAN_BUILD) -q \
	-p no:cacheprovider

# What test-asan needs first: the package installed with its tests (CI, right after make test,
# passes ASAN_DEPS= to skip the reinstall).
ASAN_DEPS ?= build-tests

test-asan: $(ASAN_DEPS)
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSERVE_SANITIZE=ON \
		-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
		-DKVSERVE_CPU_CAPABILITIES=$$($(PYTHON) -c "import kvserve; print(kvserve._C.cpu_capability().upper())") \
		-DKVSERVE_BUILD_TESTS=ON -DPython_EXECUTABLE=$$($(PYTHON) -c "import sys; print(sys.executable)")
	cmake --build $(ASAN_BUILD)
	@date +"%T asan built"
	$(ASAN_ENV) ctest --test-dir $(ASAN_BUILD) --output-on-failure -j2
	$(ASAN_PYTEST) -m "not unsanitized and not serial" -n $$(nproc) --durations=15
	$(ASAN_PYTEST) -m "not unsanitized and serial"

# Compile-checks every CUDA kernel body (nvcc alone) and launcher (against the installed torch).
check-cuda:
	bash scripts/check_cuda.sh

bench: install
	$(PYTHON) benchmarks/bench_decode.py

clean:
	rm -rf build
