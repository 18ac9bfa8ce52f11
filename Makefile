# Two commands matter: `make demo` and `make test`. Each bootstraps everything it needs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test build lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# Fetch the pinned sdist, patch, build (cached by a key of its inputs; a second run is instant).
build: $(STAMP)
	$(PY) tools/build_llama.py

lint: $(STAMP)
	$(PY) -m ruff check pyspecter tests tools

test: build lint
	$(PY) -m pytest -q

demo: build
	$(VENV)/bin/pyspecter demo

clean:
	rm -rf $(VENV) build
