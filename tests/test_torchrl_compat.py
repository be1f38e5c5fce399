"""The TorchRL boundary (``shmsync/_torchrl_compat.py``): the only module that touches a TorchRL
private name or counts on a TorchRL behaviour; importing shmsync changes nothing in TorchRL; and
a TorchRL release that renamed, removed or changed any entry of the catalogue ends, within a
minute, with every worker loading every version under the right tags, or a TorchRLChangedError
naming the entry. Never a hang, never stale or mislabelled frames, never a raw error.

"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchrl

from shmsync import _torchrl_compat as compat

pytestmark = [pytest.mark.torchrl]
ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TORCHRL = Path(torchrl.__file__).resolve().parent
PLAY_TIMEOUT = 90  # a play that has not ended by then hung (each ends in well under a minute)
LEFT_PATIENCE = 15  # seconds the processes a play started have to end after it


# -- the catalogue ------------------------------------------------------------------------------------
def test_an_entry_found_otherwise_names_itself_the_torchrl_and_the_versions_that_work():
    class Changed:
        _weight_sync_schemes = 5  # say, a list in a future torchrl

    with pytest.raises(compat.TorchRLChangedError) as info:
        compat.schemes_of(Changed())
    message = str(info.value)
    assert f'"{compat.SCHEMES}"' in message and "checked on torchrl 0.11-0.14" in message
    assert f"installed torchrl {torchrl.__version__}" in message and "it is a int" in message
    assert "shmsync supports torchrl 0.11 to 0.14" in message


def test_a_torchrl_outside_the_tested_range_is_refused_at_import_with_a_clear_message():
    code = "import torchrl; torchrl.__version__ = '0.15.0'; import shmsync.scheme"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "shmsync supports torchrl 0.11 to 0.14, each minor tested; this is torchrl 0.15.0" in proc.stderr


def test_every_entry_is_checked_somewhere_and_in_the_docs_catalogue():
    boundary = (ROOT / "shmsync" / "_torchrl_compat.py").read_text()
    others = "".join(p.read_text() for p in (ROOT / "shmsync").glob("*.py") if p.name != "_torchrl_compat.py")
    constants = {n: v for n, v in vars(compat).items() if isinstance(v, str) and v in compat.CATALOGUE}
    assert sorted(constants.values()) == sorted(compat.CATALOGUE), "every entry has one constant naming it"
    unchecked = []
    for name, entry in constants.items():
        # Uses beyond the constant's definition and its catalogue line.
        inside = len(re.findall(rf"\b{name}\b", boundary)) - 2
        if inside < 1 and f"compat.{name}" not in others:
            unchecked.append(entry)
    assert unchecked == [], f"catalogue entries nothing checks: {unchecked}"
    docs = (ROOT / "docs" / "torchrl.md").read_text()
    missing = [entry for entry in compat.CATALOGUE if f"| {entry} |" not in docs]
    assert missing == [], f"entries the docs' TorchRL page does not list: {missing}"


# -- one boundary -----------------------------------------------------------------------------------
EXTENSION_POINTS = {  # TorchRL's template methods, meant for schemes to define
    "_init_on_sender_impl",
    "_init_on_receiver_impl",
    "_setup_connection_and_weights_on_sender_impl",
    "_setup_connection_and_weights_on_receiver_impl",
}


def _torchrl_private_names() -> set[str]:
    """Every private name TorchRL defines: functions, classes, attributes it sets, module names."""
    names: set[str] = set()
    for path in TORCHRL.rglob("*.py"):
        names.update(path.relative_to(TORCHRL).with_suffix("").parts)
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _torchrl_bases(module: str, cls: str) -> list[type]:
    found = getattr(importlib.import_module(module), cls, None)
    return [b for b in found.__mro__ if b.__module__.split(".")[0] == "torchrl"] if isinstance(found, type) else []


def _uses_of_torchrl_internals(path: Path, module: str, private: set[str], root: Path = ROOT) -> list[str]:
    """Where ``path`` touches a TorchRL private name: an attribute of anything but its own object,
    an attribute its class inherits from TorchRL, an override of a TorchRL private method other
    than the template methods, a string naming one, a private TorchRL module, the call stack or
    an object's ``__dict__``."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    found: list[str] = []

    def visit(node: ast.AST, bases: list[type]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = bases
            where = f"{path.relative_to(root)}:{getattr(child, 'lineno', '?')}"
            if isinstance(child, ast.ClassDef):
                inner = _torchrl_bases(module, child.name)
                for item in child.body:
                    overrides = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in private
                    if overrides and item.name not in EXTENSION_POINTS and any(item.name in vars(b) for b in inner):
                        found.append(f"{where}: overrides TorchRL's {item.name}")
            elif isinstance(child, ast.Attribute) and child.attr in private:
                own = isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")
                if not own or any(hasattr(b, child.attr) for b in inner):
                    found.append(f"{where}: .{child.attr}")
            elif isinstance(child, ast.Attribute) and child.attr in ("_getframe", "__dict__"):
                found.append(f"{where}: .{child.attr}")
            elif isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "vars":
                found.append(f"{where}: vars()")
            elif isinstance(child, ast.Constant) and child.value in private and id(child) not in docstrings:
                found.append(f"{where}: {child.value!r}")
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                if isinstance(child, ast.ImportFrom):
                    modules += [f"{child.module}.{a.name}" for a in child.names]
                for m in modules:
                    if m.split(".")[0] == "torchrl" and any(p.startswith("_") for p in m.split(".")):
                        found.append(f"{where}: import {m}")
            visit(child, inner)

    visit(tree, [])
    return found


def test_nothing_outside_the_boundary_touches_a_torchrl_internal():
    private = _torchrl_private_names()
    sources = [(p, f"shmsync.{p.stem}") for p in (ROOT / "shmsync").glob("*.py") if p.name != "_torchrl_compat.py"]
    sources += [(p, f"shmsync.workers.{p.stem}") for p in (ROOT / "workers").glob("*.py")]
    sources += [(p, "hydra_plugins.shmsync_searchpath") for p in (ROOT / "hydra_plugins").rglob("*.py")]
    uses = [use for path, module in sorted(sources) for use in _uses_of_torchrl_internals(path, module, private)]
    assert uses == [], "TorchRL internals touched outside shmsync/_torchrl_compat.py:\n" + "\n".join(uses)


def test_the_source_check_can_fail(tmp_path):
    """A module reading a collector's schemes and a scheme's store by hand is found, twice."""
    path = tmp_path / "offender.py"
    path.write_text("def f(collector, scheme):\n    return getattr(collector, '_weight_sync_schemes'), scheme._store\n")
    found = _uses_of_torchrl_internals(path, "json", _torchrl_private_names(), root=tmp_path)
    assert found == ["offender.py:2: '_weight_sync_schemes'", "offender.py:2: ._store"], found


# -- importing shmsync changes nothing in TorchRL -----------------------------------------------------
_SNAPSHOT = r"""
import importlib, inspect, json, re, sys, types
def fingerprint(value):
    code = getattr(value, "__code__", None) or getattr(getattr(value, "__func__", None), "__code__", None)
    if code is not None:
        return f"code {code.co_filename}:{code.co_firstlineno}:{getattr(value, '__qualname__', '')}"
    if isinstance(value, (types.ModuleType, type)):
        return f"{type(value).__name__} {getattr(value, '__name__', '')}"
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return re.sub(r"0x[0-9a-f]+", "0x", repr(value))  # addresses differ from process to process
    return type(value).__qualname__
for name in MODULES:
    importlib.import_module(name)
state = {}
for name, module in sorted(sys.modules.items()):
    if not name.startswith("torchrl") or not isinstance(module, types.ModuleType):
        continue
    for attr, value in list(vars(module).items()):
        state[f"{name}.{attr}"] = fingerprint(value)
        if isinstance(value, type) and value.__module__ == name:
            for cattr, cvalue in list(vars(value).items()):
                state[f"{name}.{attr}.{cattr}"] = fingerprint(cvalue)
from torchrl.weight_update import weight_sync_schemes
state["registry"] = sorted(k for k in getattr(weight_sync_schemes, "_WEIGHT_SYNC_SCHEMES", {}) if k != "shmsync")
print(json.dumps(state))
"""

_TORCHRL_MODULES = ["torchrl.collectors", "torchrl.collectors.distributed", "torchrl.weight_update", "torchrl.trainers"]


def _torchrl_state(first: list[str]) -> dict:
    code = f"MODULES = {first + _TORCHRL_MODULES!r}\n" + _SNAPSHOT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(["shmsync"], id="import shmsync, then torchrl"),
        pytest.param(_TORCHRL_MODULES + ["shmsync"], id="torchrl, then import shmsync"),
        pytest.param(
            ["shmsync", "shmsync.scheme", "shmsync.hook", "shmsync.distributed", "shmsync.testing"],
            id="every shmsync module and the pytest plugin",
        ),
    ],
)
def test_importing_shmsync_changes_no_torchrl_attribute(first):
    without = _torchrl_state([])
    with_shmsync = _torchrl_state(first)
    changed = sorted(k for k in without.keys() | with_shmsync.keys() if without.get(k) != with_shmsync.get(k))
    assert changed == [], f"TorchRL attributes that differ once shmsync is imported: {changed[:20]}"


# -- no single call path carries the guarantee ---------------------------------------------------------
def _loads_every_version(collector, policy, batches: int = 5) -> None:
    """Publish a new version before each batch; each batch must run it, whole, tagged with it."""
    from helpers import fill

    it = iter(collector)
    next(it)
    for version in range(1, batches + 1):
        fill(policy, version)
        collector.update_policy_weights_()
        batch = next(it)
        assert torch.equal(batch["w_lo"], batch["w_hi"]), "a frame ran a mix of two versions"
        assert (batch["w_lo"] == version).all(), f"a worker ran {batch['w_lo'].unique().tolist()}, not {version}"
        assert (batch["policy_version"] == version).all(), f"frames tagged {batch['policy_version'].unique()}"
        assert (batch["next", "policy_version"] == version).all()


def _probe_collector(policy, **kwargs):
    from torchrl.collectors import MultiSyncCollector

    from shmsync import ShmWeightSyncScheme

    from helpers import make_pendulum

    return MultiSyncCollector(
        [make_pendulum] * 2,
        policy,
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        **kwargs,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("worker_class", ["RolloutCannotBeShadowed", "PolicyHooksBypassed"])
def test_workers_load_and_tag_every_version_when_their_collector_works_another_way(worker_class):
    """A worker collector whose rollout cannot be shadowed (the policy's own check reloads; the
    trainer completes ``("next", key)``), or that calls its policy without its module hooks (the
    poll before each rollout reloads, and the rollout's frames are tagged with the version it polled)."""
    import helpers

    policy = helpers.make_probe_policy()
    helpers.fill(policy, 0)
    collector = _probe_collector(policy, collector_class=getattr(helpers, worker_class))
    try:
        _loads_every_version(collector, policy)
    finally:
        collector.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_workers_load_every_version_without_the_collector_method_wrappers():
    """The wrappers removed from the collector: each update still publishes (key by key), the
    workers load it and tag both keys."""
    import helpers

    policy = helpers.make_probe_policy()
    helpers.fill(policy, 0)
    collector = _probe_collector(policy)
    for method in ("update_policy_weights_", "shutdown", "load_state_dict", "iterator"):
        assert method in vars(collector), f"shmsync did not wrap {method}: the test removes nothing"
        delattr(collector, method)
    try:
        _loads_every_version(collector, policy)
    finally:
        collector.shutdown()
