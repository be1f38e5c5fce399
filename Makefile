# Set-up and checks. `make demo` and `make test` each install everything they need into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; TORCH picks another build, TORCH_PIP_ARGS passes pip more arguments
# for it (an --index-url for a CUDA build).
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?= -n 2

.PHONY: install demo test lint bench bench-quick clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python examples/train_cartpole.py

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests shmsync workers

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python benchmarks/sync_bench.py

bench-quick: install
	$(BIN)/python benchmarks/sync_bench.py --quick

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
