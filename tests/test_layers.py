"""The shape of the package: import-linter's contracts (pyproject.toml, ``make lint``) keep the
layers, this module what they cannot see: workers/ (installed as shmsync.workers, outside the
package's folder) stands above everything, no import circle, no function whose branches do not
read in one sitting (a class is as long as its one job needs), and tests/ laid out like the
package. docs/architecture.md draws the layers.
"""

import ast
import shutil
from pathlib import Path

import pytest

from tests.commands import BIN, CHECKOUT, python, run_command

ROOT = CHECKOUT


def _modules() -> dict[str, Path]:
    """Every module, by its dotted name (``shmsync.core.header``, ``shmsync.workers.launch``)."""
    found = {}
    for path in (ROOT / "shmsync").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] in ("__init__", "__main__") or "conf" in parts:
            continue
        found[".".join(parts)] = path
    for path in (ROOT / "workers").glob("*.py"):
        if path.stem != "__init__":
            found[f"shmsync.workers.{path.stem}"] = path
    return found


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """shmsync modules that ``path`` imports: at the top, inside functions, and under ``if
    TYPE_CHECKING:`` alike (a typing import is a dependency too)."""
    package = module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if not base.startswith("shmsync"):
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}"
                out.add(name if name in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("shmsync."))
    return {m for m in out if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


def test_the_package_has_no_loose_modules_beyond_its_entry_points():
    loose = sorted(p.name for p in (ROOT / "shmsync").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py", "testing.py"], loose


def test_nothing_in_the_package_imports_the_workers():
    below = [f"{name} -> {dep}" for name, deps in _graph().items() for dep in deps if dep.startswith("shmsync.workers")]
    assert [edge for edge in below if not edge.startswith("shmsync.workers")] == []


def test_the_import_graph_has_no_circle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                pytest.fail("import circle: " + " -> ".join([*path, node, dep]))
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


LINT_IMPORTS = BIN / "lint-imports"


@pytest.mark.slow
@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter comes with the dev extra")
def test_the_contracts_fail_on_an_upward_import(tmp_path):
    """The layers contract of pyproject.toml, run on a copy of the package where the memory
    protocol imports TorchRL's guest: broken, naming the import."""
    shutil.copytree(ROOT / "shmsync", tmp_path / "shmsync", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "shmsync" / "core" / "upward.py").write_text("from shmsync.torchrl import compat\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(BIN)}
    lint = run_command([str(LINT_IMPORTS)], cwd=tmp_path, env=env, timeout=120)
    assert lint.returncode != 0, lint.stdout[-3000:]
    said = lint.stdout[-3000:]
    assert "BROKEN" in lint.stdout and "shmsync.core.upward -> shmsync.torchrl.compat" in lint.stdout, said


MAX_COMPLEXITY = 15


def test_no_function_is_over_complexity_15():
    """Radon's cyclomatic complexity, which counts each boolean operator too (ruff's C901 in
    ``make lint`` does not): a function's branches read in one sitting."""
    cc_visit = pytest.importorskip("radon.complexity", reason="radon comes with the dev extra").cc_visit
    over = []
    for name, path in _modules().items():
        for block in cc_visit(path.read_text()):
            for function in [block, *getattr(block, "methods", [])]:
                if function.complexity > MAX_COMPLEXITY:
                    over.append(f"{name}.{function.fullname}: {function.complexity}")
    assert over == []


@pytest.mark.slow
def test_store_and_reader_import_without_torchrl():
    code = (
        "import sys; from shmsync import WeightStore, WeightReader; "
        "assert not [m for m in sys.modules if m.startswith('torchrl')], 'torchrl imported'"
    )
    run_command(python("-c", code), check=True, timeout=120)


# The modules whose tests are not in a test module of their name, and where they are: small
# parts that the tests of the module using them exercise whole, through the public API.
TESTED_ELSEWHERE = {
    "shmsync/core/pages.py": "page sizes and a store's bytes: tests/writer/test_store.py, tests/tools/test_cli.py",
    "shmsync/reader/binding.py": "a reader's module bound to slots: tests/reader/test_reader.py, test_in_place.py",
    "shmsync/reader/device.py": "following a module's device: tests/writer/test_cuda.py (on a GPU)",
    "shmsync/relay/child_link.py": "one relay's versions, fed by its parent: tests/relay/test_node.py, test_sender.py",
    "shmsync/relay/messages.py": "the relay's messages, each refused when malformed: tests/relay/test_incoming.py, "
    "test_server.py",
    "shmsync/relay/raw_versions.py": "versions as raw bytes for a relay: tests/relay/test_node.py",
    "shmsync/store/device_records.py": "device slots' records in the header: tests/writer/test_device_slots.py",
    "shmsync/store/layout.py": "a store's layout, checked as untrusted input: tests/core/test_header.py",
    "shmsync/store/memory.py": "a store's mapping (file, header, slots): tests/writer/test_store.py, "
    "tests/reader/test_in_place.py, tests/writer/test_crash.py",
    "shmsync/store/sources.py": "a source matched against the layout: tests/writer/test_store.py (the mismatches)",
    "shmsync/writer/background.py": "the opt-in background copy: tests/writer/test_store.py, test_crash.py",
    "shmsync/writer/role.py": "the writer role: tests/writer/test_store.py (one writer at a time), test_crash.py",
    "shmsync/writer/slot_copy.py": "a version copied into a slot: tests/writer/test_store.py, test_changes.py, "
    "tests/relay/test_deltas.py",
    "shmsync/tools/ctrl_c.py": "Ctrl-C in the commands and the demo: tests/tools/test_cli.py, tests/examples/",
    "shmsync/torchrl/attribute_paths.py": "a weight_update_map's paths: tests/torchrl/test_hooks.py",
    "shmsync/torchrl/receiver.py": "a worker's side of the scheme: tests/torchrl/test_scheme.py, test_conformance.py",
    "shmsync/torchrl/remote_nodes.py": "a remote node's pushes: tests/torchrl/test_publisher.py, test_distributed.py, "
    "test_ray.py",
    "shmsync/torchrl/collector_patches.py": "the wrappers on a collector: tests/torchrl/test_scheme.py, "
    "test_freshness.py, test_conformance.py",
    "shmsync/torchrl/store_group.py": "a collector's stores: tests/torchrl/test_publisher.py, test_scheme.py",
    "shmsync/torchrl/sender.py": "WeightSender: tests/torchrl/test_hooks.py",
    "shmsync/torchrl/settings.py": "the scheme's settings: tests/torchrl/test_backend.py, tests/watch/test_alarm.py",
    "shmsync/torchrl/trainer_weights.py": "the trainer's models of a collector: tests/torchrl/test_conformance.py",
    "shmsync/watch/remote_rows.py": "other hosts' readers in the table: tests/store/test_reader_table.py, "
    "tests/relay/test_reports.py",
    "workers/collector.py": "a standalone worker's collector: tests/workers/test_launch.py",
    "workers/policies.py": "the launcher's environments and policies: tests/workers/test_launch.py",
}


def _test_module_of(path: Path) -> Path:
    """Where the tests of ``path`` (a module of shmsync/ or workers/) live, by its name."""
    relative = path.relative_to(ROOT)
    folder = Path("tests", *relative.parts[1:-1]) if relative.parts[0] == "shmsync" else Path("tests", "workers")
    return folder / f"test_{path.stem}.py"


def test_the_tests_are_laid_out_like_the_package():
    """A change to shmsync/relay/sealing.py has its tests in tests/relay/test_sealing.py, or the
    module is listed above with where they are."""
    modules = [p for p in (ROOT / "shmsync").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    modules += [p for p in (ROOT / "workers").glob("*.py") if p.name != "__init__.py"]
    named = {p.relative_to(ROOT).as_posix(): _test_module_of(p) for p in modules if "conf" not in p.parts}
    untested = sorted(m for m, t in named.items() if not (ROOT / t).exists() and m not in TESTED_ELSEWHERE)
    assert not untested, f"modules with no test module of their name, and not in TESTED_ELSEWHERE: {untested}"
    stale = sorted(m for m in TESTED_ELSEWHERE if m not in named or (ROOT / named[m]).exists())
    assert not stale, f"TESTED_ELSEWHERE names modules that are gone or now have a test module: {stale}"


# The underscore names of torch's and TorchRL's own objects that shmsync reads on purpose: torch's
# module registries and tensor version counter (cheaper than their public walks, stable across
# releases), and TorchRL's, each reached through the boundary module torchrl/compat.py.
FOREIGN_PRIVATE = {"_parameters", "_buffers", "_version", "_forward_pre_hooks", "_forward_hooks", "_foreach_copy_"}


def _private_reads(tree: ast.AST) -> list[tuple[str, int, str]]:
    """``(function, line, attribute)`` for each ``x._name`` a module-level function reads, where
    ``x`` is not a module it imported (``torch._foreach_copy_``) nor ``self`` (a method built in a
    function), and ``_name`` not a dunder."""
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }  # a module imported by name (``from shmsync.core import segment``)
    found = []
    for function in (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(function):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and (root.id in modules or root.id == "self"):
                continue  # a module's private function (``torch._C._set_grad_enabled``), or a method's own state
            if node.attr not in FOREIGN_PRIVATE:
                found.append((function.name, node.lineno, node.attr))
    return found


def test_no_module_level_function_reads_another_objects_private_state():
    """A function that needs a class's private fields is that class's method (or the state is
    public): nothing outside an object reaches inside it."""
    reads = []
    for name, path in _modules().items():
        if name == "shmsync.torchrl.compat":
            continue  # the one boundary where TorchRL's private names are read, each checked (tests/torchrl/)
        reads += [f"{name}.{f} line {line}: ._{a[1:]}" for f, line, a in _private_reads(ast.parse(path.read_text()))]
    assert reads == []
