"""shmsync as users get it: what ``pip install`` puts in site-packages, not the checkout.

``make test`` runs these three times: against the checkout's editable install (the main tier), and
from a copy of the tests outside the checkout against the wheel (``SHMSYNC_INSTALLED=wheel``, with
the rest marked ``shipped``) and against the sdist's install (``SHMSYNC_INSTALLED=sdist``). They are
in the main tier: several start an interpreter that imports torch, which on a CUDA build of torch
(the wheel's leg) takes seconds of CPU. Each check is something a user would otherwise meet at their first
import: a module left out of the wheel, a command or a plugin not registered, a version that
disagrees with the distribution's.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

import shmsync
from tests.commands import BIN, CHECKOUT, run_command

pytestmark = [pytest.mark.shipped, pytest.mark.slow]

INSTALLED = os.environ.get("SHMSYNC_INSTALLED")  # "wheel", "sdist", or None: the checkout's editable install
as_installed = pytest.mark.skipif(INSTALLED is None, reason="the shipped legs check the wheel and the sdist")


def _source_modules() -> set[str]:
    """Every file the checkout ships, as its path in site-packages: the package's modules, its
    data files, the workers (shmsync/workers/) and the Hydra plugin."""
    files = set()
    for path in (CHECKOUT / "shmsync").rglob("*"):
        if path.is_file() and path.suffix in (".py", ".yaml", ".typed"):
            files.add(path.relative_to(CHECKOUT).as_posix())
    files |= {f"shmsync/workers/{p.name}" for p in (CHECKOUT / "workers").glob("*.py")}
    files |= {p.relative_to(CHECKOUT).as_posix() for p in (CHECKOUT / "hydra_plugins").rglob("*.py")}
    return files


def _installed_files() -> set[str]:
    """The files installed beside shmsync's package (its site-packages folder), that shmsync ships."""
    site = Path(shmsync.__file__).resolve().parents[1]
    files = set()
    for top in ("shmsync", "hydra_plugins"):
        for path in (site / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.add(path.relative_to(site).as_posix())
    return files


def test_shmsync_is_the_one_installed():
    """Outside the checkout, ``import shmsync`` must resolve to what was installed."""
    where = Path(shmsync.__file__).resolve().parent
    source = (CHECKOUT / "shmsync").resolve()
    if INSTALLED is None:
        assert where == source, where
    else:
        assert where != source, f"{where}: the checkout's sources, not the installed package"
        site = os.environ.get("SHMSYNC_SITE")  # the sdist's, installed apart
        assert where.parent == Path(site).resolve() if site else where.parent.name == "site-packages", where


@as_installed
def test_every_module_of_the_checkout_is_installed():
    """A folder or file of the package that the build left out fails here, not at a user's import."""
    missing = sorted(_source_modules() - _installed_files())
    assert not missing, f"the {INSTALLED} does not install: {missing}"


@as_installed
def test_every_module_imports_from_where_it_was_installed():
    site = Path(shmsync.__file__).resolve().parents[1]
    for relative in sorted(f for f in _source_modules() if f.endswith(".py") and not f.endswith("__main__.py")):
        name = relative[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(site), f"{name} came from {module.__file__}"


@pytest.mark.skipif(INSTALLED != "wheel", reason="the wheel make dist built: the sdist's install is pip's own build")
def test_the_wheel_is_tagged_for_an_index():
    """The wheel installed is one PyPI accepts: manylinux, for this one CPython (a compiler tags
    ``linux_x86_64``, which PyPI refuses)."""
    tags = re.findall(r"^Tag: (.+)$", importlib.metadata.distribution("shmsync").read_text("WHEEL") or "", re.M)
    python = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert tags and all(re.fullmatch(rf"{python}-{python}-manylinux\w+", tag) for tag in tags), tags


def test_the_compiled_fence_is_installed_and_used():
    from shmsync.core import fences

    spec = importlib.util.find_spec("shmsync.core._atomics")
    assert spec is not None and spec.origin.endswith(".so"), "the C fence was not built"
    assert fences.source() == "extension", fences.source()


def test_the_version_is_the_distributions():
    assert shmsync.__version__ == importlib.metadata.version("shmsync")


def test_the_shmsync_command_runs():
    command = shutil.which("shmsync") or str(BIN / "shmsync")
    if INSTALLED == "sdist":  # installed beside the wheel's with --target: its script is in its own bin/
        command = str(Path(shmsync.__file__).resolve().parents[1] / "bin" / "shmsync")
    said = run_command([command, "--help"])
    assert said.returncode == 0 and said.stdout.startswith("usage: shmsync"), said.stderr[-2000:]
    run_command([command, "ls"], check=True)


def test_the_pytest_plugin_is_registered(pytestconfig):
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="pytest11")}
    assert plugins.get("shmsync") == "shmsync.testing", plugins
    assert pytestconfig.pluginmanager.has_plugin("shmsync")


def test_hydra_finds_the_config_group():
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    assert "ShmSyncSearchPathPlugin" in [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent), version_base="1.3"):
        cfg = compose(config_name=None, overrides=["+weight_sync_scheme=shmsync"])
    assert cfg.weight_sync_scheme._target_ == "shmsync.ShmWeightSyncScheme"


def test_a_store_and_a_reader_round_trip():
    import torch

    policy = torch.nn.Linear(4, 2)
    with shmsync.WeightStore.create(policy) as store:
        worker = torch.nn.Linear(4, 2)
        reader = shmsync.WeightReader(store, worker)
        with torch.no_grad():
            policy.weight.fill_(3.0)
        store.publish(policy)
        assert reader.poll() and reader.version == 1 and bool((worker.weight == 3.0).all())
        reader.close()


@pytest.mark.torchrl
@pytest.mark.timeout(180)
# pip builds the sdist's install from the files make dist's wheel was built from (the sdist's own
# install is checked whole above): a collector, three interpreters of a CUDA torch, runs on the wheel.
@pytest.mark.skipif(INSTALLED == "sdist", reason="the wheel's leg runs a collector on the same files")
def test_a_torchrl_collector_runs_on_the_installed_package():
    """A MultiSyncCollector's workers, in processes of their own, run the installed shmsync: each
    batch runs (and is tagged with) the version published before it."""
    from torchrl.collectors import MultiSyncCollector

    from tests.torchrl.collectors import make_linear_policy, make_pendulum

    policy = make_linear_policy(0.0)
    collector = MultiSyncCollector(
        [make_pendulum] * 2,
        policy,
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": shmsync.ShmWeightSyncScheme()},
    )
    try:
        batches = iter(collector)
        for version in range(3):
            if version:
                policy.module.bias.data.fill_(float(version))
                collector.update_policy_weights_()
            batch = next(batches)
            assert (batch["policy_version"] == version).all() and (batch["action"] == version).all()
    finally:
        collector.shutdown()
