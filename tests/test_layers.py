"""The import graph of shmsync keeps the architecture: import-linter's contracts (pyproject.toml,
``make lint``) keep the layers, this module what they cannot see: workers/ (installed as
shmsync.workers, outside the package's folder) stands above everything, no import circle, and no
class or function too long to read in one sitting. docs/architecture.md draws the layers.
"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


@pytest.mark.slow
@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter comes with the dev extra")
def test_the_contracts_fail_on_an_upward_import(tmp_path):
    """The layers contract of pyproject.toml, run on a copy of the package where the memory
    protocol imports TorchRL's guest: broken, naming the import."""
    shutil.copytree(ROOT / "shmsync", tmp_path / "shmsync", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "shmsync" / "core" / "upward.py").write_text("from shmsync.torchrl import compat\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    run = subprocess.run([LINT_IMPORTS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stdout[-3000:]
    assert "BROKEN" in run.stdout and "shmsync.core.upward -> shmsync.torchrl.compat" in run.stdout, run.stdout[-3000:]


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
