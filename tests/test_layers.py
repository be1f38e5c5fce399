"""The import graph of shmsync follows its folders: no circle, and nothing low imports anything higher.

shmsync/core/        the memory protocol (with shmsync/errors.py): no torch, nothing of shmsync above it
shmsync/watch/       the operators' view of the header's rows (the readers' table, the alarm): the core
shmsync/writer/      a store and publishing into it: the layers above
shmsync/reader/      loading a store's versions: the layers above
shmsync/tools/       the shmsync command and the pytest plugin (shmsync/testing.py): the layers above
shmsync/torchrl/     TorchRL's guest          \\ the layers above, never each other
shmsync/relay/       several hosts            /
workers/             worker processes: anything
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RANK = {"core": 0, "watch": 1, "writer": 2, "reader": 3, "tools": 4, "torchrl": 5, "relay": 5, "workers": 6}
TOP = {"errors": "core", "testing": "tools"}  # the modules at the top of shmsync/, and their layers


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


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else TOP[parts[1]]


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


def test_every_module_lives_in_a_folder_of_the_house():
    assert {_folder(m) for m in _modules()} <= set(RANK)
    assert {m for m in _modules() if _folder(m) == "core"} >= {"shmsync.core.protocol", "shmsync.core.header"}
    loose = sorted(p.name for p in (ROOT / "shmsync").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py", "testing.py"], loose


def test_the_memory_protocol_imports_no_torch():
    """shmsync/core/ is torch-free: the protocol can be checked (and read) without it."""
    found = []
    for name, path in _modules().items():
        if _folder(name) == "core":
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{name}: {n}" for n in names if n.split(".")[0] in ("torch", "tensordict", "torchrl")]
    assert found == []


def test_nothing_imports_a_higher_folder():
    upward = [
        f"{name} -> {dep}"
        for name, deps in _graph().items()
        for dep in deps
        if RANK[_folder(dep)] > RANK[_folder(name)]
    ]
    assert upward == []


def test_torchrl_and_the_relay_do_not_import_each_other():
    across = [
        f"{name} -> {dep}"
        for name, deps in _graph().items()
        for dep in deps
        if {_folder(name), _folder(dep)} == {"torchrl", "relay"}
    ]
    assert across == []


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


def test_the_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from shmsync.torchrl import compat\nfrom ..writer.store import WeightStore\n")
    known = {"shmsync.torchrl.compat", "shmsync.writer.store", "shmsync.core.x"}
    assert _imports(module, "shmsync.core.x", known) == {"shmsync.torchrl.compat", "shmsync.writer.store"}


MAX_CLASS_LINES = 300
MAX_COMPLEXITY = 15


def test_no_class_is_over_300_lines():
    """A class reads in one sitting (its docstring included)."""
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


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
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
