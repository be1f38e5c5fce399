"""The import graph of shmsync: no circle, and nothing low imports anything higher."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The core, lowest first: a module may import modules of its own layer or below, never above.
LAYERS = [
    {"errors", "_header", "_processes", "_fence", "_paths", "_secret"},  # words, processes, fences, secrets
    {"_segment", "_protocol", "_layout", "_source", "_pinning", "_viewing", "_copy"},  # memory and protocol
    {"_memory", "table"},  # one store's mapping; the readers' table read from its header
    {"store", "_cuda", "tagging", "versions", "lifetime", "host"},  # the store, the CUDA publisher beside it
    {"reader", "cli", "testing", "alarm"},  # its clients
]
# The top (TorchRL, other hosts, worker processes), each module on its own: it may import the
# core and, of the top, only these.
TOP = {
    "_torchrl_compat": set(),  # the TorchRL boundary
    "_versioning": set(),
    "_scheme_sender": {"_torchrl_compat"},
    "_scheme_worker": {"_torchrl_compat"},
    "_collector_glue": {"_torchrl_compat", "_versioning", "_scheme_sender"},
    "_remote": {"_torchrl_compat", "_versioning", "_collector_glue", "_reports"},
    "scheme": {"_torchrl_compat", "_versioning", "_scheme_sender", "_scheme_worker", "_collector_glue", "_remote"},
    "sender": {"_torchrl_compat"},
    "hook": {"_torchrl_compat", "scheme", "sender"},
    "distributed": {"_torchrl_compat", "_remote", "scheme", "_reports"},
    "_registration": {"scheme"},
    "_wire": set(),
    "_reports": {"_wire"},
    "relay": {"_wire", "_reports"},
    "workers.policies": set(),
    "workers.collector": {"workers.policies"},
    "workers.relay": {"relay"},
    "workers.launch": {"workers.collector", "workers.relay"},
}
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer} | {name: len(LAYERS) for name in TOP}


def _modules() -> dict[str, Path]:
    found = {p.stem: p for p in (ROOT / "shmsync").glob("*.py") if p.stem != "__init__"}
    found.update({f"workers.{p.stem}": p for p in (ROOT / "workers").glob("*.py") if p.stem != "__init__"})
    return found


def _imports(path: Path, package: str) -> set[str]:
    """shmsync modules ``path`` imports: at the top, inside functions, and under
    ``if TYPE_CHECKING:`` alike (a typing import is a dependency too)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y / from . import x
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            out.update(n if package == "shmsync" else f"workers.{n}" for n in names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shmsync."):
            parts = node.module.split(".")
            out.add(".".join(parts[1:3]) if parts[1] == "workers" else parts[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("shmsync."))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = "workers" if name.startswith("workers.") else "shmsync"
        graph[name] = {m for m in _imports(path, package) if m in modules and m != name}
    return graph


def test_every_module_has_a_place():
    assert [m for m in _modules() if m not in RANK] == []


def test_no_core_module_imports_a_higher_layer_or_the_top():
    upward = [f"{name} -> {dep}" for name, deps in _graph().items() for dep in deps if RANK[dep] > RANK[name]]
    assert upward == []


@pytest.mark.parametrize("module", sorted(TOP))
def test_a_top_module_imports_only_what_it_builds_on(module):
    graph = _graph()
    assert graph[module] & set(TOP) <= TOP[module], f"{module} imports {sorted(graph[module] & set(TOP) - TOP[module])}"


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


def test_store_and_reader_import_without_torchrl():
    code = (
        "import sys; from shmsync import WeightStore, WeightReader; "
        "assert not [m for m in sys.modules if m.startswith('torchrl')], 'torchrl imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
