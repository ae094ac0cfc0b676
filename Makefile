# Two entry points for a new user (see README.md):
#   make quickstart   create .venv, install ktx, train + evaluate the embedded default
#   make test         create .venv, install ktx[test], run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
QUICKSTART_DIR ?= runs/quickstart

.PHONY: install quickstart test bench

$(BIN)/.ktx-installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

install: $(BIN)/.ktx-installed

quickstart: install
	rm -rf $(QUICKSTART_DIR)
	$(BIN)/ktx train --gin_file=runs/quickstart.gin --gin.MODEL_DIR="'$(QUICKSTART_DIR)'"
	$(BIN)/ktx eval --gin_file=runs/eval.gin --gin_file=runs/quickstart.gin --gin.MODEL_DIR="'$(QUICKSTART_DIR)'"

test: install
	$(BIN)/python -m pytest -q -n 2 --durations=15 tests

bench: install
	for f in tests/benchmarks/*.py; do $(BIN)/python $$f || exit 1; done
