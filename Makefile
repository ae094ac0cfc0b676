# Two entry points for a new user (see README.md):
#   make quickstart   create .venv, install ktx, train + evaluate the embedded default
#   make test         create .venv, install ktx[test], run the whole test suite (fast tier,
#                     then the slow one); make test-fast: the fast tier only
#   make docs         install ktx[docs] into the same .venv, build the site into docs/_build/html
#                     (Sphinx + MyST, warnings are errors)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
QUICKSTART_DIR ?= runs/quickstart

.PHONY: install quickstart test test-fast bench docs

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

# The fast tier, then the tests marked slow (processes killed and relaunched). The slow
# tier runs three workers on two cores: its tests wait on their `ktx` processes (starts,
# heartbeat timeouts, a shared reference run), and two workers kept 1.5 of 2 cores busy
# (CONTRIBUTING.md).
# The slow tier collects only the modules that mark tests slow: collecting every module
# for its 7 tests was 17 s of its start on 2 cores, 4 s so. tests/conftest.py refuses a
# slow test this list would miss (outside a test_*.py module that says `mark.slow`).
SLOW_TEST_FILES = $(shell grep -rlE 'mark\.slow' tests --include='test_*.py' | sort)

test: install
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 -m "not slow" tests
	$(BIN)/python -m pytest -q -n 3 --dist worksteal --durations=5 -m slow $(SLOW_TEST_FILES)

test-fast: install
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow" tests

bench: install
	for f in tests/benchmarks/*.py; do $(BIN)/python $$f || exit 1; done

# The documentation site. ktx[docs] only adds packages to the venv (Sphinx, MyST, the theme);
# its own marker, so `make install`'s is untouched and `make test` runs with what it had.
$(BIN)/.ktx-docs-installed: $(BIN)/.ktx-installed setup.py
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

docs: $(BIN)/.ktx-docs-installed
	rm -rf docs/_build/html
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html
