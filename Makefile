# treespec: `make demo` runs tree-speculative generation on the embedded Gemma-3-270M;
# `make test` runs the test suite. Both set up .venv first (torch pinned to a CPU wheel); the tests also
# install llama-cpp-python (the llama.cpp target's tests; PyPI has it as source only: a first build takes
# about 10-30 minutes on 2 cores, pip caches the wheel).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The quick brown fox jumps over the lazy dog. The quick brown fox
ARGS ?= --max-new-tokens 128
# the demo shows treespec's own draft: n-gram lookup where the text repeats, the shipped head elsewhere
# (`--draft auto`, the CLI's default, is the same at T=0 in bf16; `--target auto`, the default, decodes on llama.cpp
# where that was measured faster and llama-cpp-python is installed; see the README)
DRAFT ?= lookup+head

.PHONY: setup setup-peers demo test test-fast bench clean

setup: $(VENV)/.installed

setup-peers: $(VENV)/.installed-peers

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

$(VENV)/.installed-peers: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev,peers]"
	touch $@

demo: setup
	$(BIN)/treespec generate "$(PROMPT)" --draft $(DRAFT) $(ARGS)

test: setup-peers
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -ra

test-fast: setup-peers
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -ra -m "not gemma"

# the benchmark protocol (docs/benchmarks.md): installs the bench extra, then runs benchmarks/run.py $(BENCH_ARGS)
BENCH_ARGS ?= --quick
bench: setup-peers
	$(BIN)/python -m pip install -q -e ".[dev,peers,bench]"
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
