# Set-up and checks. `make demo` and `make test` each install everything they need into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch from pip's configured index (the one release the main tier runs on). Which build that is
# depends on the index: PyPI's Linux wheel is the CUDA one; for the CPU build pass
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# An editable install of a package whose folders are mapped (workers/ is shmsync.workers) makes
# setuptools say that folders named like the package could shadow it: nothing to act on here.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"
# Three test processes on two cores: tests spend part of their time waiting on their children
# (deadlines, handshakes), and a third keeps both cores busy meanwhile. CI prints the slowest.
PYTEST_ARGS ?= -n 3
DURATIONS ?= --durations=30

# Older TorchRL minors: `make test` runs the tests marked `minors` under each (those whose outcome
# depends on the release), `make test-full` every `torchrl` test.
TORCHRL_LEGS ?= 0.13 0.12 0.11
LEGS_MARK ?= minors and not full
LEGS_PYTEST_ARGS ?= $(PYTEST_ARGS)

# shmsync as users get it, on the torch release a new user installs (CURRENT_TORCH, with the
# newest torchrl): the wheel, installed into a venv of its own with no editable install anywhere,
# and the tests run from a copy outside the checkout, where `import shmsync` is site-packages'.
# That leg runs the fast tier, the tests marked `shipped` and the `minors` set (what can differ
# between torch releases); the sdist's install runs the `shipped` tests. The main tier runs on
# $(TORCH): its CPU build installs in seconds, the current release's CUDA build takes a minute to
# install, so it is installed once into a cache outside the checkout, keyed by what it installs,
# and reused (made again where it is absent). Its installs empty PIP_CONSTRAINT: a pip configured
# to cap torch (some CI images are) would refuse the release asked for.
CURRENT_TORCH ?= 2.15.0
SHIPPED_MARK ?= not full and (shipped or minors or not (slow or torchrl or distributed or cuda))
SHIPPED_ROOT := $(shell mktemp -d -u $${TMPDIR:-/tmp}/shmsync-shipped-XXXXXX)
CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/shmsync
PY_TAG := $(shell $(PYTHON) -c "import platform, sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}')")
TORCH_SITE = $(CACHE)/torch-$(1)-$(PY_TAG)-$(shell echo "$(TORCH_PIP_ARGS)" | cksum | cut -d' ' -f1)
# make test-full: the other torch releases shmsync declares (pyproject.toml), each with .venv's rest.
TORCH_FULL_LEGS ?= 2.14.1
# TorchRL's next release, ahead of time (`make test-full`): the nightly named by NIGHTLY in
# shmsync/torchrl/releases.py (the one place it is written), with the tensordict nightly it needs.
TORCHRL_NIGHTLY ?= $(shell sed -n 's/^NIGHTLY = "\([0-9.]*\)".*/\1/p' shmsync/torchrl/releases.py)
TENSORDICT_NIGHTLY ?= 2026.10.26

.PHONY: install demo test test-full test-main test-fast test-busy test-protocol test-legs test-current test-sdist \
	test-torch test-nightly dist docs lint bench bench-quick bench-loop soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The demo needs only torch, shmsync and the examples' extra (CartPole); the tests add the rest.
$(VENV)/.demo-installed: $(BIN)/python pyproject.toml setup.py
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

# CI's command. Beside the main tier: lint, the docs, the shipped legs (the wheel on the current
# torch, the sdist) and the older minors, whose installs mostly wait on the package index; the
# legs run one process each, filling what the main tier leaves of the cores. Each target's output
# is printed whole when it ends. The `full` tier (heavier variants of paths this also runs) waits
# for test-full.
test: install
	@$(MAKE) --no-print-directory -j7 -Otarget lint test-main test-legs test-current test-sdist docs \
		LEGS_PYTEST_ARGS="-p no:xdist"

test-main: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) $(DURATIONS) -m "not full" tests shmsync workers

# Everything: every interleaving configuration, every TorchRL change played on every minor, every
# stress run and doc block, every test on the current torch and the shipped wheel.
test-full: lint install $(foreach v,$(TORCHRL_LEGS),.venv-torchrl-$(v)/.installed) docs
	$(BIN)/python -m pytest $(PYTEST_ARGS) $(DURATIONS) tests shmsync workers
	$(MAKE) test-legs LEGS_MARK=torchrl
	$(MAKE) test-current SHIPPED_MARK="" LEGS_PYTEST_ARGS="$(PYTEST_ARGS)"
	$(MAKE) test-sdist
	$(MAKE) test-torch TORCH_VERSION=$(TORCH_FULL_LEGS)
	$(MAKE) test-nightly

# The core's quick tests (protocol, store, reader, files, CLI, relay wire): every test marked
# neither slow, torchrl, distributed nor cuda (a test there that takes seconds fails, asking for
# the mark: tests/conftest.py). Under a minute.
test-fast: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not slow and not torchrl and not distributed and not cuda" tests shmsync

# The suite beside two CPU-bound processes, as on a busy machine: it must hold as on a quiet one.
test-busy: install
	@set -e; sh -c 'while :; do :; done' & one=$$!; sh -c 'while :; do :; done' & two=$$!; \
	trap "kill $$one $$two" EXIT; \
	$(BIN)/python -m pytest $(PYTEST_ARGS) $(DURATIONS) -m "not full" tests shmsync workers

# Every interleaving of the slot protocol's configurations, and the checker itself.
test-protocol: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/core/test_protocol_interleavings.py tests/core/test_interleavings.py \
		tests/core/test_protocol_model.py

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

# A torch release installed once per machine, outside the checkout (`pip install --target`): a
# folder of its own, keyed by the release, the Python, the machine and TORCH_PIP_ARGS, made under
# another name and renamed when whole, so that a cut-off install is never taken for one.
$(CACHE)/torch-%/.complete:
	rm -rf "$(@D).partial-$$PPID" && mkdir -p "$(CACHE)"
	PIP_CONSTRAINT=/dev/null $(PYTHON) -m pip install -q --no-compile --target "$(@D).partial-$$PPID" \
		$(TORCH_PIP_ARGS) "torch==$(word 1,$(subst -, ,$*))"
	touch "$(@D).partial-$$PPID/.complete"
	rm -rf "$(@D)" && mv "$(@D).partial-$$PPID" "$(@D)"

# The wheel and the sdist, as pip builds them (an isolated build environment), checked as an
# index shows them (the metadata, the long description).
dist: install
	rm -rf dist
	$(BIN)/python -m build --outdir dist . >/dev/null
	$(BIN)/python -m twine check --strict dist/*

# .venv-current: the current torch (from the cache, by a .pth line) and the wheel with its test
# and relay extras, nothing of the checkout.
.venv-current/.installed: dist $(call TORCH_SITE,$(CURRENT_TORCH))/.complete
	rm -rf .venv-current
	$(PYTHON) -m venv .venv-current
	echo "$(call TORCH_SITE,$(CURRENT_TORCH))" > \
		"$$(.venv-current/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_cached_torch.pth"
	PIP_CONSTRAINT=/dev/null .venv-current/bin/python -m pip install -q "$$(ls dist/shmsync-*.whl)[test,relay]"
	touch $@

test-current: .venv-current/.installed
	@echo "== the wheel, on torch $$(.venv-current/bin/python -c 'import torch, torchrl; print(torch.__version__, "and torchrl", torchrl.__version__)')"
	rm -rf $(SHIPPED_ROOT)-wheel && mkdir -p $(SHIPPED_ROOT)-wheel && cp -r tests pyproject.toml $(SHIPPED_ROOT)-wheel/
	cd $(SHIPPED_ROOT)-wheel && SHMSYNC_INSTALLED=wheel SHMSYNC_CHECKOUT=$(CURDIR) $(CURDIR)/.venv-current/bin/python \
		-m pytest $(LEGS_PYTEST_ARGS) -p no:cacheprovider -m "$(SHIPPED_MARK)" tests; \
		code=$$?; rm -rf $(SHIPPED_ROOT)-wheel; exit $$code

# The sdist, built and installed as pip installs one (its fence compiled), into a folder of its
# own put first on the path of .venv-current's interpreter (which holds its dependencies).
test-sdist: .venv-current/.installed
	rm -rf $(SHIPPED_ROOT)-sdist && mkdir -p $(SHIPPED_ROOT)-sdist && cp -r tests pyproject.toml $(SHIPPED_ROOT)-sdist/
	PIP_CONSTRAINT=/dev/null .venv-current/bin/python -m pip install -q --no-deps --target $(SHIPPED_ROOT)-sdist/site \
		"$$(ls dist/shmsync-*.tar.gz)"
	@echo "== the sdist, installed into $(SHIPPED_ROOT)-sdist/site"
	cd $(SHIPPED_ROOT)-sdist && SHMSYNC_INSTALLED=sdist SHMSYNC_SITE=$(SHIPPED_ROOT)-sdist/site \
		PYTHONPATH=$(SHIPPED_ROOT)-sdist/site SHMSYNC_CHECKOUT=$(CURDIR) $(CURDIR)/.venv-current/bin/python \
		-m pytest -p no:xdist -p no:cacheprovider -m "shipped and not full" tests; \
		code=$$?; rm -rf $(SHIPPED_ROOT)-sdist; exit $$code

# make test-full: every test on another torch release (TORCH_VERSION), the rest from .venv.
.venv-torch-%/.installed: $(VENV)/.installed $(call TORCH_SITE,%)/.complete
	rm -rf .venv-torch-$*
	$(PYTHON) -m venv .venv-torch-$*
	echo "$(call TORCH_SITE,$*)" > \
		"$$(.venv-torch-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_cached_torch.pth"
	echo "import site; site.addsitedir($$($(BIN)/python -c "import sysconfig; print(repr(sysconfig.get_paths()['purelib']))"))" > \
		"$$(.venv-torch-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_shmsync_base_venv.pth"
	touch $@

TORCH_VERSION ?= $(TORCH_FULL_LEGS)
test-torch: .venv-torch-$(TORCH_VERSION)/.installed
	@echo "== torch $$(.venv-torch-$(TORCH_VERSION)/bin/python -c 'import torch; print(torch.__version__)')"
	.venv-torch-$(TORCH_VERSION)/bin/python -m pytest $(PYTEST_ARGS) -m "torchrl or minors" tests

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
# pyproject.toml's contracts), vulture (no dead code; pyproject.toml names what only pytest, a
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
	rm -rf $(VENV) .venv-torchrl-* .venv-torch-* .venv-current dist build *.egg-info .pytest_cache docs/_build
