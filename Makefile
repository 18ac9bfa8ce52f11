# Two commands matter: `make demo` and `make test`. Each bootstraps everything it needs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-unit asan-test build lint clean

# SPECTER_NATIVE=0: the editable install skips the llama.cpp build (tools/pip_backend.py): `make build` does it next,
# and test-unit needs none
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	SPECTER_NATIVE=0 $(PY) -m pip install -q -e '.[dev,server,plot]'
	@touch $(STAMP)

# Fetch the pinned sdist, patch, build (cached by a key of its inputs; a second run is instant).
build: $(STAMP)
	$(PY) tools/build_llama.py

lint: $(STAMP)
	$(PY) -m ruff check pyspecter tests tools

# The unit tier needs no llama.cpp, so it runs while the library builds (two compile jobs and a test process on
# two cores: an empty cache's `make test` about half a minute sooner; a warm one builds nothing). Then smol-moe and
# its learned predictor (cached; minutes on a fresh machine, with progress lines), so the tests that use it find
# both, as a user's first `generate` would, and the integration tier. --durations: the log says where the time went.
test: lint
	@$(PY) tools/build_llama.py & build=$$!; \
	$(PY) -m pytest -q tests/unit; unit=$$?; \
	wait $$build && exit $$unit
	$(VENV)/bin/pyspecter models build smol-moe
	$(PY) -m pytest -q --durations=25 tests/integration

# The fast tier alone: no llama.cpp build needed, seconds.
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# The integration suite once under AddressSanitizer (not run by CI: a separate, slower build, ~3x slower tests).
# The instrumented libraries come first on PYTHONPATH; Python itself is not instrumented, so libasan is preloaded.
ASAN_TESTS ?= tests/integration
asan-test: $(STAMP)
	SPECTER_ASAN=1 $(PY) tools/build_llama.py
	PYTHONPATH=$$(SPECTER_ASAN=1 $(PY) tools/build_llama.py --print-root) \
	LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	$(PY) -m pytest -q -p no:cacheprovider $(ASAN_TESTS)

demo: build
	$(VENV)/bin/pyspecter demo

clean:
	rm -rf $(VENV) build
