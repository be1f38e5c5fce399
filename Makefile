# Set-up and checks. `make demo` and `make test` each install everything they need into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch from pip's configured index (the one release the tests run on). Which build that is
# depends on the index: PyPI's Linux wheel is the CUDA one; for the CPU build pass
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# Three test processes on two cores: many tests spend seconds waiting on their children (spawn,
# imports, deadlines), and a third keeps both cores busy meanwhile.
PYTEST_ARGS ?= -n 3

# Older TorchRL minors: `make test` runs the tests marked `minors` under each (those whose outcome
# depends on the release, tests/conftest.py), `make test-full` every `torchrl` test.
TORCHRL_LEGS ?= 0.13 0.12 0.11
LEGS_MARK ?= minors and not full
LEGS_PYTEST_ARGS ?= $(PYTEST_ARGS)

.PHONY: install demo test test-full test-main test-fast test-busy test-protocol test-legs docs lint bench bench-quick soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The demo needs only torch, shmsync and the examples' extra (CartPole); the tests add the rest.
$(VENV)/.demo-installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[examples]"
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	$(BIN)/python -m pip install -q -e ".[test,dev,docs,ray,relay]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/train_cartpole.py

# CI's command. Beside the main tier, the older minors' venvs install (mostly waiting on the
# package index), the docs build, and then the legs run one after the other in one process each:
# the main tier keeps the cores busy, and the legs fill what it leaves. Each target's output is
# printed whole when it ends. The `full` tier (tests/conftest.py: heavier variants of paths this
# also runs) waits for test-full.
test: lint
	@$(MAKE) --no-print-directory -j5 -Otarget test-main test-legs docs LEGS_PYTEST_ARGS="-p no:xdist"

test-main: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not full" tests shmsync workers

# Everything: every interleaving configuration, every TorchRL change played on every minor, every
# stress run and doc block.
test-full: lint install $(foreach v,$(TORCHRL_LEGS),.venv-torchrl-$(v)/.installed) docs
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests shmsync workers
	$(MAKE) test-legs LEGS_MARK=torchrl

# The core's quick tests: protocol, store, reader, files, CLI, relay wire; the multi-process
# ones (seconds each: every child imports torch) are marked slow. Under a minute.
test-fast: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not slow and not torchrl and not distributed and not cuda" tests shmsync

# The suite beside two CPU-bound processes, as on a busy machine: it must hold as on a quiet one.
test-busy: install
	@set -e; sh -c 'while :; do :; done' & one=$$!; sh -c 'while :; do :; done' & two=$$!; \
	trap "kill $$one $$two" EXIT; \
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not full" tests shmsync workers

# Every interleaving of the slot protocol's small configurations, and the checker itself.
test-protocol: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/test_protocol_interleavings.py tests/test_interleavings.py tests/test_protocol_model.py

# .venv-torchrl-0.13 (and so on): that TorchRL minor with its own tensordict minor. Everything
# else (torch, pytest, shmsync as .venv has it installed) comes from .venv, added by a .pth line
# after this venv's own packages (site.addsitedir, so .venv's editable shmsync is found too): the
# leg's torchrl and tensordict shadow .venv's, torch installs once, and installing a leg writes
# nothing in the checkout (a leg can install while tests run).
.venv-torchrl-%/.installed: $(VENV)/.installed pyproject.toml
	rm -rf .venv-torchrl-$*
	$(PYTHON) -m venv .venv-torchrl-$*
	echo "import site; site.addsitedir($$($(BIN)/python -c "import sysconfig; print(repr(sysconfig.get_paths()['purelib']))"))" > \
		"$$(.venv-torchrl-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_shmsync_base_venv.pth"
	.venv-torchrl-$*/bin/python -m pip install -q "torchrl~=$*.0" "tensordict~=$*.0"
	touch $@

test-legs: $(foreach v,$(TORCHRL_LEGS),.venv-torchrl-$(v)/.installed)
	set -e; for v in $(TORCHRL_LEGS); do \
		echo "== torchrl $$v: $$(.venv-torchrl-$$v/bin/python -c 'import torchrl, tensordict; print(torchrl.__version__, tensordict.__version__)')"; \
		.venv-torchrl-$$v/bin/python -m pytest $(LEGS_PYTEST_ARGS) -m "$(LEGS_MARK)" tests; \
	done

docs: install
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python benchmarks/sync_bench.py

bench-quick: install
	$(BIN)/python benchmarks/sync_bench.py --quick

soak: install
	$(BIN)/python benchmarks/soak.py

clean:
	rm -rf $(VENV) .venv-torchrl-* *.egg-info .pytest_cache docs/_build
