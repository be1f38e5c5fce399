"""The TorchRL boundary (``shmsync/torchrl/compat.py``): the only module that touches a TorchRL
private name or counts on a TorchRL behaviour; importing shmsync changes nothing in TorchRL; and
a TorchRL release that renamed, removed or changed any entry of the catalogue ends, within a
minute, with every worker loading every version under the right tags, or a TorchRLChangedError
naming the entry. Never a hang, never stale or mislabelled frames, never a raw error.

The TorchRL releases are played by rewriting TorchRL's source in every process of the play (the
trainer, its workers, nodes and Ray actors alike): ``tests/torchrl/torchrl_edits/sitecustomize.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torchrl

from shmsync.torchrl import compat
from tests.commands import CHECKOUT, python, run_command, start_command, with_tests_importable
from tests.torchrl import collectors
from tests.weights import fill

pytestmark = [pytest.mark.slow, pytest.mark.torchrl]
ROOT = CHECKOUT
EDITS = Path(__file__).resolve().parent / "torchrl_edits"
TORCHRL = Path(torchrl.__file__).resolve().parent
PLAY_TIMEOUT = 90  # a play that has not ended by then hung (each ends in well under a minute)
LEFT_PATIENCE = 15  # seconds the processes a play started have to end after it


# -- the catalogue ------------------------------------------------------------------------------------
@pytest.mark.minors
def test_an_entry_found_otherwise_names_itself_the_torchrl_and_the_versions_that_work():
    class Changed:
        _weight_sync_schemes = 5  # say, a list in a future torchrl

    with pytest.raises(compat.TorchRLChangedError) as info:
        compat.schemes_of(Changed())
    message = str(info.value)
    assert f'"{compat.SCHEMES}"' in message and "checked on torchrl 0.11-0.14" in message
    assert f"installed torchrl {torchrl.__version__}" in message and "it is a int" in message
    assert "shmsync supports torchrl 0.11 to 0.15" in message


@pytest.mark.parametrize(
    "version, advice",
    [
        ("0.16.0", "pip install 'torchrl>=0.11,<0.16'"),
        ("0.10.2", "pip install 'torchrl>=0.11,<0.16'"),
        ("2026.9.1", "pip install -U torchrl-nightly tensordict-nightly"),
    ],
)
def test_a_torchrl_outside_the_tested_range_is_refused_at_import_with_a_clear_message(version, advice):
    code = f"import torchrl; torchrl.__version__ = {version!r}; import shmsync.torchrl.scheme"
    proc = run_command(python("-c", code), timeout=120)
    assert proc.returncode != 0
    assert (
        f"shmsync supports torchrl 0.11 to 0.15 (and torchrl-nightly from 2026.10.27); this is torchrl {version}."
        in proc.stderr
    )
    assert advice in proc.stderr


@pytest.mark.parametrize("version, minor", [("0.15.0", (0, 15)), ("0.15.0rc1+cpu", (0, 15)), ("2026.11.3", (0, 15))])
def test_the_next_minor_and_a_nightly_from_the_tested_one_on_are_let_in_as_0_15(version, minor):
    from shmsync.torchrl import releases

    assert releases.refusal(version) is None and releases.minor(version) == minor


BOUNDARY = ROOT / "shmsync" / "torchrl" / "compat.py"


def _shmsync_module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.minors
def test_every_entry_is_checked_somewhere_and_in_the_docs_catalogue():
    boundary = BOUNDARY.read_text()
    others = "".join(p.read_text() for p in (ROOT / "shmsync").rglob("*.py") if p != BOUNDARY)
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
    # torch's own names that TorchRL happens to set too (an attribute of that name):
    # torch.Tensor._version is the tensor's version counter, torch.nn.Module._parameters and
    # _buffers its registries of parameters and buffers, no part of TorchRL.
    return {n for n in names if n.startswith("_") and not n.startswith("__")} - TORCH_NAMES


TORCH_NAMES = {"_version", "_parameters", "_buffers"}


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
    sources = [(p, _shmsync_module(p)) for p in (ROOT / "shmsync").rglob("*.py") if p != BOUNDARY]
    assert len(sources) > 40, "every module of the package is looked at, in every folder"
    sources += [(p, f"shmsync.workers.{p.stem}") for p in (ROOT / "workers").glob("*.py")]
    sources += [(p, "hydra_plugins.shmsync_searchpath") for p in (ROOT / "hydra_plugins").rglob("*.py")]
    uses = [use for path, module in sorted(sources) for use in _uses_of_torchrl_internals(path, module, private)]
    assert uses == [], "TorchRL internals touched outside shmsync/torchrl/compat.py:\n" + "\n".join(uses)


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


@functools.cache
def _torchrl_state(first: tuple[str, ...]) -> dict:
    code = f"MODULES = {list(first) + _TORCHRL_MODULES!r}\n" + _SNAPSHOT
    proc = run_command(python("-c", code), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(_TORCHRL_MODULES + ["shmsync"], id="torchrl, then import shmsync"),
        pytest.param(  # `import shmsync` alone, then torchrl, is this one's first step
            [
                "shmsync",
                "shmsync.torchrl.scheme",
                "shmsync.torchrl.hooks",
                "shmsync.torchrl.distributed",
                "shmsync.testing",
            ],
            id="every shmsync module and the pytest plugin",
            marks=pytest.mark.minors,
        ),
    ],
)
def test_importing_shmsync_changes_no_torchrl_attribute(first):
    without = _torchrl_state(())
    with_shmsync = _torchrl_state(tuple(first))
    changed = sorted(k for k in without.keys() | with_shmsync.keys() if without.get(k) != with_shmsync.get(k))
    assert changed == [], f"TorchRL attributes that differ once shmsync is imported: {changed[:20]}"


# -- TorchRL releases that changed --------------------------------------------------------------------
def _module_of(path: Path) -> str:
    return ".".join(("torchrl", *path.relative_to(TORCHRL).with_suffix("").parts)).removesuffix(".__init__")


def renamed(name: str, *within: str) -> list[tuple[str, str, str]]:
    """Edits that rename identifier ``name`` everywhere in the TorchRL packages ``within``."""
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    edits = []
    for package in within:
        base = TORCHRL.joinpath(*package.split(".")[1:])
        for path in sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]:
            if path.exists() and pattern.search(path.read_text()):
                edits.append((_module_of(path), f"re:{pattern.pattern}", f"{name}_renamed"))
    return edits


def edited(module: str, old: str, new: str) -> list[tuple[str, str, str]]:
    """One edit of ``module``'s source (``old`` may be ``re:`` + a regular expression)."""
    return [(module, old, new)]


@dataclass
class Change:
    """A TorchRL release that changed: the edits, the play that runs on it, what must come of it
    (``"ok"``, or the catalogue entry the TorchRLChangedError names), and whether it is a case the
    older torchrl minors play too (the full list plays on the newest), and whether ``make test``
    plays it (on the newest minor: one case per way the scheme meets TorchRL, its tracker, its set-up
    in the workers, the hook's state; the rollout, distributed and Ray cases run those paths
    unchanged in test_distributed.py and test_ray.py)."""

    id: str
    play: str
    edits: list[tuple[str, str, str]]
    expect: str | tuple[str, ...]
    every_node: bool = False
    in_make_test: bool = False


SEND = "scheme.send(weights=processed_weights, worker_ids=worker_ids)"
CASCADE = r"re:self\.context\.update_policy_weights_\(\s*model_id=model_id,\s*policy_or_weights=weights\s*\)"
RECEIVE_THEN_VERSION = (
    "            scheme.receive()\n        self._set_received_policy_version(model_version)\n\n    def _connect"
)
ALL = ("torchrl.collectors", "torchrl.weight_update", "torchrl.trainers")

CHANGES = [
    # -- one host: MultiSyncCollector (every torchrl minor) --
    Change("schemes renamed", "multisync", renamed("_weight_sync_schemes", *ALL), compat.SCHEMES),
    Change(
        "tracker renamed",
        "multisync",
        renamed("policy_version_tracker", *ALL),
        compat.TRACKER,
        every_node=True,
        in_make_test=True,
    ),
    Change(
        "rollout renamed",
        "multisync",
        edited("torchrl.collectors._single", r"re:\bdef rollout\(", "def rollout_renamed(")
        + edited("torchrl.collectors._single", r"re:\bself\.rollout\(", "self.rollout_renamed("),
        "ok",
        every_node=True,
    ),
    Change(
        "rollout called through the class",
        "multisync",
        edited("torchrl.collectors._single", r"re:\bself\.rollout\(\)", "type(self).rollout(self)"),
        "ok",
        every_node=True,
    ),
    Change(
        "the scheme never set up in the workers",
        "multisync",
        edited(
            "torchrl.collectors.utils",
            r"re:if weight_sync_scheme is not None:(\s*#[^\n]*)?(\s*)weight_sync_scheme\.init_on_receiver\(",
            r"if False:\1\2weight_sync_scheme.init_on_receiver(",
        )
        + edited("torchrl.collectors._runner", "inner_collector.register_scheme_receiver(weight_sync_schemes)", "pass"),
        compat.WORKERS_SET_UP,
        every_node=True,
        in_make_test=True,
    ),
    Change("update sends nothing", "multisync", edited("torchrl.collectors._base", SEND, "pass"), "ok"),
    Change("update sends twice", "multisync", edited("torchrl.collectors._base", SEND, f"{SEND}; {SEND}"), "ok"),
    Change(
        "update sends through the class",
        "multisync",
        edited("torchrl.collectors._base", SEND, SEND.replace("scheme.send(", "type(scheme).send(scheme, ")),
        "ok",
    ),
    Change(
        "iterator called through the class",
        "multisync",
        edited("torchrl.collectors._base", "yield from self.iterator()", "yield from type(self).iterator(self)"),
        "ok",
    ),
    Change(
        # The scheme's stores exist before the collector: nothing looks up the collector's schemes.
        "a scheme made before its collector, the collector's schemes renamed",
        "multisync_preinitialized",
        renamed("_weight_sync_schemes", *ALL),
        "ok",
    ),
    Change(
        "a scheme made before its collector, never handed the collector",
        "multisync_preinitialized",
        edited("torchrl.collectors._multi_base", "if not scheme.initialized_on_sender:", "if False:"),
        compat.CONNECT,
    ),
    # -- the trainer hook (every torchrl minor) --
    Change(
        "the hook's interval state renamed",
        "hook",
        renamed("_last_update_count", "torchrl.trainers"),
        "ok",
        in_make_test=True,
    ),
    Change("the optimizer-step count renamed", "hook", renamed("_optim_count", "torchrl.trainers"), compat.OPTIM_COUNT),
    Change(
        "the trainer's registered modules renamed",
        "hook",
        renamed("_modules", "torchrl.trainers.trainers"),
        compat.TRAINER_MODULES,
    ),
    # -- several hosts (torchrl 0.14) --
    Change(
        "DistributedSyncCollector._make_container renamed",
        "distributed_sync",
        renamed("_make_container", "torchrl.collectors.distributed.sync"),
        "ok",
        every_node=True,
    ),
    Change(
        "DistributedCollector._make_container renamed",
        "distributed_generic",
        renamed("_make_container", "torchrl.collectors.distributed.generic"),
        "ok",
        every_node=True,
    ),
    Change(
        "the schemes' _worker_idx renamed",
        "distributed_sync",
        renamed("_worker_idx", "torchrl.weight_update", "torchrl.collectors"),
        "ok",
        every_node=True,
    ),
    Change(
        "DistributedWeightSyncScheme._store renamed",
        "distributed_sync",
        renamed("_store", "torchrl.weight_update._distributed"),
        compat.DIST_STORE,
        every_node=True,
    ),
    Change(
        "the receive buffers renamed",
        "distributed_sync",
        renamed("_tensordict_out", "torchrl.collectors.distributed.sync"),
        compat.CONTAINER,
    ),
    Change(
        "a node not told of a push",
        "distributed_sync",
        edited("torchrl.weight_update._distributed", CASCADE, "pass"),
        compat.DIST_PUSH,
    ),
    Change(
        "pushes around the trainer scheme's send",
        "distributed_sync",
        edited("torchrl.collectors.distributed.sync", "scheme.send()", "type(scheme).send(scheme)"),
        compat.DIST_PUSH,
    ),
    Change(
        "DistributedCollector's node not told of a push",
        "distributed_generic",
        edited("torchrl.weight_update.weight_sync_schemes", CASCADE, "pass")
        + edited("torchrl.weight_update._distributed", CASCADE, "pass"),
        compat.DIST_PUSH,
    ),
    Change(
        "a Ray actor never told the push's version",
        "ray",
        edited("torchrl.collectors._base", RECEIVE_THEN_VERSION, "            scheme.receive()\n\n    def _connect"),
        "ok",
        every_node=True,
    ),
    Change(
        "a Ray actor told the version before the weights",
        "ray",
        edited(
            "torchrl.collectors._base",
            RECEIVE_THEN_VERSION,
            "            pass\n        self._set_received_policy_version(model_version)\n"
            "        for scheme in self._receiver_schemes.values():\n            scheme.receive()\n\n    def _connect",
        ),
        "ok",
        every_node=True,
    ),
    Change(
        "a Ray actor not told of a push",
        "ray",
        edited("torchrl.weight_update.weight_sync_schemes", CASCADE, "pass"),
        compat.RAY_PUSH,
    ),
]

_REMOTE = {"distributed_sync", "distributed_generic", "ray"}


def _applies(change: Change) -> str | None:
    """Why ``change`` cannot be played on the installed torchrl, or None."""
    if not change.edits:
        return f"torchrl {torchrl.__version__} has nothing of that name"
    for module, old, _ in change.edits:
        path = TORCHRL.joinpath(*module.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        source = path.read_text() if path.exists() else ""
        present = re.search(old[3:], source) if old.startswith("re:") else old in source
        if not present:
            return f"torchrl {torchrl.__version__}'s {module} has no {old!r}"
    if change.play in _REMOTE and compat.TORCHRL_VERSION < (0, 14):
        return "shmsync's remote nodes need torchrl >= 0.14"
    if change.play == "ray" and importlib.util.find_spec("ray") is None:
        return "ray is not installed"
    if not change.every_node and compat.NEWEST_RELEASE > compat.TORCHRL_VERSION:
        return f"the full list of changes plays on torchrl {compat._minor(compat.NEWEST_RELEASE)}"
    return None


def _param(change: Change):
    marks = [pytest.mark.slow]
    if change.play in _REMOTE:
        marks.append(pytest.mark.distributed)
    if not (change.in_make_test and compat.NEWEST_RELEASE <= compat.TORCHRL_VERSION):
        marks.append(pytest.mark.full)
    return pytest.param(change, id=change.id, marks=marks)


@pytest.mark.timeout(PLAY_TIMEOUT + 60)
@pytest.mark.parametrize("change", [_param(c) for c in CHANGES])
def test_a_torchrl_that_changed_ends_loaded_or_with_the_entry_named(change, request, tmp_path):
    reason = _applies(change)
    if reason:
        pytest.skip(reason)
    if change.play == "ray":
        request.getfixturevalue("one_ray_cluster")  # one Ray cluster at a time
    env = {
        **os.environ,
        "PYTHONPATH": with_tests_importable(None, str(EDITS))["PYTHONPATH"],
        "SHMSYNC_TORCHRL_EDITS": json.dumps(change.edits),
        "SHMSYNC_PLAY_SMALL": "0" if change.expect == "ok" else "1",  # a named error comes at the first publish
    }
    result, output = _play(change.play, env, tmp_path)
    expected = change.expect if isinstance(change.expect, tuple) else (change.expect,)
    if expected == ("ok",):
        assert result["outcome"] == "ok", result
    else:
        assert result["outcome"] == "named" and result["entry"] in expected, result
        assert f"installed torchrl {torchrl.__version__}" in result["detail"], result


def _play(play: str, env: dict, folder: Path) -> tuple[dict, str]:
    """Run ``tests.torchrl.plays.play(play)`` in a session of its own; its result and its output. Fails if it
    hangs, prints no result, or leaves a process of its session running."""
    import psutil

    out = folder / "play.out"
    with open(out, "w") as sink:
        proc = start_command(
            python("-c", f"from tests.torchrl.plays import play; play({play!r})"),
            cwd=folder,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            new_session=True,
        )
        try:
            proc.wait(PLAY_TIMEOUT)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
    # What the play started ends with it: its workers notice their parent is gone within seconds.
    deadline = time.monotonic() + LEFT_PATIENCE
    while True:
        left = [p for p in psutil.process_iter(["pid"]) if _session_of(p.pid) == proc.pid and p.pid != proc.pid]
        if not left or hung or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in [proc, *left]:
        try:
            os.kill(p.pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()
    output = out.read_text()
    assert not hung, f"the play hung past {PLAY_TIMEOUT} s:\n{output[-4000:]}"
    assert not left, f"the play left {len(left)} processes running:\n{output[-4000:]}"
    results = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert results, f"the play printed no result (exit {proc.returncode}):\n{output[-4000:]}"
    assert proc.returncode == 0, output[-4000:]
    return json.loads(results[-1].removeprefix("RESULT ")), output


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


# -- no single call path carries the guarantee ---------------------------------------------------------
def _loads_every_version(collector, policy, batches: int = 5) -> None:
    """Publish a new version before each batch; each batch must run it, whole, tagged with it."""
    from tests.weights import fill

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
    from tests.torchrl.collectors import make_pendulum

    return MultiSyncCollector(
        [make_pendulum] * 2,
        policy,
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        **kwargs,
    )


# torchrl 0.11 and 0.12 hand the scheme no worker collector, so no rollout is shadowed there: the
# policy's own check is the only reload (docs/torchrl.md, the rollout's row of the catalogue).
_NO_SHADOW = pytest.mark.skipif(
    compat.TORCHRL_VERSION < (0, 13), reason="torchrl < 0.13 hands the scheme no worker collector: nothing to shadow"
)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "worker_class", ["RolloutCannotBeShadowed", pytest.param("PolicyHooksBypassed", marks=_NO_SHADOW)]
)
def test_workers_load_and_tag_every_version_when_their_collector_works_another_way(worker_class):
    """A worker collector whose rollout cannot be shadowed (the policy's own check reloads; the
    trainer completes ``("next", key)``), or that calls its policy without its module hooks (the
    poll before each rollout reloads, and the rollout's frames are tagged with the version it polled)."""

    policy = collectors.make_probe_policy()
    fill(policy, 0)
    collector = _probe_collector(policy, collector_class=getattr(collectors, worker_class))
    try:
        _loads_every_version(collector, policy)
    finally:
        collector.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
@_NO_SHADOW
def test_workers_load_every_version_without_the_collector_method_wrappers():
    """The wrappers removed from the collector: each update still publishes (key by key), the
    workers load it and tag both keys."""

    policy = collectors.make_probe_policy()
    fill(policy, 0)
    collector = _probe_collector(policy)
    for method in ("update_policy_weights_", "shutdown", "load_state_dict", "iterator"):
        assert method in vars(collector), f"shmsync did not wrap {method}: the test removes nothing"
        delattr(collector, method)
    try:
        _loads_every_version(collector, policy)
    finally:
        collector.shutdown()
