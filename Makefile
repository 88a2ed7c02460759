# Two commands do everything on a fresh machine: `make demo` and `make test`.
# The environment is .venv/ with the exact versions of requirements-lock.txt.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.PHONY: help setup demo test lint unit notebooks docs docs-check browser-check bench launch execute-notebooks clean

help:
	@echo "make demo   set up .venv and run the main demonstration (8 simulated devices)"
	@echo "make test   set up .venv and run every check (ruff, pytest + hypothesis, nbval, docs)"
	@echo "make docs   build the documentation site into site/"
	@echo "make bench  run the benchmark and write out/bench.json"

$(STAMP): pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[dev]"
	@touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tree-attention-edu demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Unit, property and multi-process tests; two workers for two cores.
unit: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile tests

test: lint unit

bench: $(STAMP)
	mkdir -p out
	$(VENV)/bin/tree-attention-edu bench --json out/bench.json

launch: $(STAMP)
	$(VENV)/bin/tree-attention-edu launch --processes 2 --devices-per-process 4

clean:
	rm -rf $(VENV) site .cache .pytest_cache .hypothesis out
