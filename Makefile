# Set-up and checks. `make demo` and `make test` each install everything they need into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch from pip's configured index (the one release the tests run on). Which build that is
# depends on the index: PyPI's Linux wheel is the CUDA one; for the CPU build pass
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# An editable install of a package whose folders are mapped (workers/ is shmsync.workers) makes
# setuptools say that folders named like the package could shadow it: nothing to act on here.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"
# Three test processes on two cores: many tests spend seconds waiting on their children (spawn,
# imports, deadlines), and a third keeps both cores busy meanwhile.
PYTEST_ARGS ?= -n 3

# Older TorchRL minors: `make test` runs the tests marked `minors` under each (those whose outcome
# depends on the release, tests/conftest.py), `make test-full` every `torchrl` test.
TORCHRL_LEGS ?= 0.13 0.12 0.11
LEGS_MARK ?= minors and not full
LEGS_PYTEST_ARGS ?= $(PYTEST_ARGS)
# The other torch releases shmsync declares (pyproject.toml), with the newest torchrl: `make test`
# runs the quick tests of every torch-using module and the `minors` set on the current release
# (TORCH_LEGS); `make test-full` runs everything on it (CURRENT_TORCH) and that set on the others.
# The main tier runs on $(TORCH): its CPU build installs in seconds, the others' CUDA builds take
# minutes (docs/testing.md). Their installs empty PIP_CONSTRAINT: a pip configured to cap torch
# (some CI images are) would refuse the release asked for.
TORCH_LEGS ?= 2.15.0
TORCH_FULL_LEGS ?= 2.14.1
CURRENT_TORCH ?= 2.15.0
TORCH_LEGS_MARK ?= not full and (minors or not (slow or torchrl or distributed or cuda))
# The tests of torch-free code (the slot protocol and its checker, the header, the fences, the
# relay wire) run the same on every torch: the main tier runs them.
TORCH_FREE := protocol_interleavings interleavings protocol_model protocol header fences wire sealing acceptor
TORCH_LEGS_ARGS ?= $(foreach t,$(TORCH_FREE),--ignore=tests/test_$(t).py)
# TorchRL's next release, ahead of time (`make test-full`): the nightly named by NIGHTLY in
# shmsync/torchrl/releases.py (the one place it is written), with the tensordict nightly it needs.
TORCHRL_NIGHTLY ?= $(shell sed -n 's/^NIGHTLY = "\([0-9.]*\)".*/\1/p' shmsync/torchrl/releases.py)
TENSORDICT_NIGHTLY ?= 2026.10.26

.PHONY: install demo test test-full test-main test-fast test-busy test-protocol test-legs test-torch-current test-nightly docs lint bench bench-quick bench-loop soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The demo needs only torch, shmsync and the examples' extra (CartPole); the tests add the rest.
$(VENV)/.demo-installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(EDITABLE) $(BIN)/python -m pip install -q -e ".[examples]"
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	$(EDITABLE) $(BIN)/python -m pip install -q -e ".[test,dev,docs,ray,relay]"
	touch $@

install: $(VENV)/.installed

# `make demo DEMO_ARGS=--keep-running` trains until Ctrl-C, to watch it with `shmsync ls NAME --watch`.
DEMO_ARGS ?=
demo: $(VENV)/.demo-installed
	$(BIN)/python examples/train_cartpole.py $(DEMO_ARGS)

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
	$(MAKE) test-legs LEGS_MARK=torchrl TORCH_LEGS="$(TORCH_FULL_LEGS)"
	$(MAKE) test-torch-current
	$(MAKE) test-nightly

# Every test on the current torch release (the one a new user installs), the newest torchrl.
test-torch-current: .venv-torch-$(CURRENT_TORCH)/.installed
	@echo "== torch $$(.venv-torch-$(CURRENT_TORCH)/bin/python -c 'import torch, torchrl; print(torch.__version__, torchrl.__version__)')"
	.venv-torch-$(CURRENT_TORCH)/bin/python -m pytest $(PYTEST_ARGS) tests shmsync workers

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

# .venv-torch-2.15.0 (and so on): that torch release, the rest from .venv as for the TorchRL legs.
.venv-torch-%/.installed: $(VENV)/.installed pyproject.toml
	rm -rf .venv-torch-$*
	$(PYTHON) -m venv .venv-torch-$*
	echo "import site; site.addsitedir($$($(BIN)/python -c "import sysconfig; print(repr(sysconfig.get_paths()['purelib']))"))" > \
		"$$(.venv-torch-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_shmsync_base_venv.pth"
	PIP_CONSTRAINT=/dev/null .venv-torch-$*/bin/python -m pip install -q $(TORCH_PIP_ARGS) "torch==$*"
	touch $@

test-legs: $(foreach v,$(TORCHRL_LEGS),.venv-torchrl-$(v)/.installed) $(foreach v,$(TORCH_LEGS),.venv-torch-$(v)/.installed)
	set -e; for v in $(TORCHRL_LEGS); do \
		echo "== torchrl $$v: $$(.venv-torchrl-$$v/bin/python -c 'import torchrl, tensordict; print(torchrl.__version__, tensordict.__version__)')"; \
		.venv-torchrl-$$v/bin/python -m pytest $(LEGS_PYTEST_ARGS) -m "$(LEGS_MARK)" tests; \
	done; \
	for v in $(TORCH_LEGS); do \
		echo "== torch $$v: $$(.venv-torch-$$v/bin/python -c 'import torch, torchrl; print(torch.__version__, torchrl.__version__)')"; \
		.venv-torch-$$v/bin/python -m pytest $(LEGS_PYTEST_ARGS) -m "$(TORCH_LEGS_MARK)" $(TORCH_LEGS_ARGS) tests shmsync; \
	done

# Its own venv: a nightly tells its version through its distribution's metadata, which .venv's
# torchrl would shadow. shmsync's extras first, then the nightlies in place of the releases.
.venv-torchrl-nightly/.installed: pyproject.toml
	rm -rf .venv-torchrl-nightly
	$(PYTHON) -m venv .venv-torchrl-nightly
	.venv-torchrl-nightly/bin/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(EDITABLE) .venv-torchrl-nightly/bin/python -m pip install -q -e ".[test,ray,relay]"
	.venv-torchrl-nightly/bin/python -m pip uninstall -q -y torchrl tensordict
	.venv-torchrl-nightly/bin/python -m pip install -q "torchrl-nightly==$(TORCHRL_NIGHTLY)" "tensordict-nightly==$(TENSORDICT_NIGHTLY)"
	touch $@

test-nightly: .venv-torchrl-nightly/.installed
	@echo "== torchrl $$(.venv-torchrl-nightly/bin/python -c 'import torchrl, tensordict; print(torchrl.__version__, tensordict.__version__)')"
	.venv-torchrl-nightly/bin/python -m pytest $(PYTEST_ARGS) -m torchrl tests

docs: install
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

# The ecosystem's tools keep the rules: ruff (style, complexity), import-linter (the layers:
# pyproject.toml's contracts), vulture (no dead code; the whitelist names what only pytest, a
# command line or TorchRL calls), mypy (types, at pyproject.toml's strictness). mypy rather than
# pyright: it reads torch's and tensordict's annotations as they ship, runs from the same venv
# with no Node.js, and its per-module settings sit in pyproject.toml beside the other tools'.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/vulture
	$(BIN)/mypy shmsync workers

bench: install
	$(BIN)/python benchmarks/sync_bench.py

bench-quick: install
	$(BIN)/python benchmarks/sync_bench.py --quick

# The training loop per batch (update, then the next batch) beside TorchRL's SharedMem scheme.
bench-loop: install
	$(BIN)/python benchmarks/loop_bench.py

soak: install
	$(BIN)/python benchmarks/soak.py

clean:
	rm -rf $(VENV) .venv-torchrl-* .venv-torch-* *.egg-info .pytest_cache docs/_build
