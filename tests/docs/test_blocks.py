"""Every Python block of the README and of the docs runs as pasted into a fresh file: each is
written to a file of its own and run as a script (spawned children included), or under pytest
when it is a test, with nothing defined for it; the API reference names every public name.
"""

import os
import re

import pytest

from tests.commands import CHECKOUT, python, run_command

ROOT = CHECKOUT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> list[tuple[str, str, str]]:
    """``(page, section title, code)`` of every ```python block, in order."""
    out = []
    for page in PAGES:
        section = "top"
        for part in re.split(r"(^```python\n.*?^```$)", page.read_text(), flags=re.S | re.M):
            if part.startswith("```python"):
                out.append((page.name, section, part.split("\n", 1)[1].rsplit("```", 1)[0]))
            else:
                titles = re.findall(r"^#+ (.+)$", part, flags=re.M)
                section = titles[-1] if titles else section
    return out


def _marks(code: str) -> list:
    # Each block runs in an interpreter of its own (seconds to import torch), and many start
    # workers: slow.
    marks = [pytest.mark.slow]
    if re.search(r"\btorchrl\b", code):
        marks.append(pytest.mark.torchrl)  # a TorchRL call path: replayed under the nightly
    if re.search(r"\bray\b|Distributed|RelaySender", code):
        marks.append(pytest.mark.distributed)
    if re.search(r"DistributedSyncCollector|DistributedCollector|RayCollector", code):
        # A cluster of nodes or actors (a minute): tests/torchrl/test_distributed.py and
        # test_ray.py run the same remote schemes in `make test`; the blocks run in `make test-full`.
        marks.append(pytest.mark.full)
    return marks


BLOCKS = _blocks()
# A block shown on several pages (the README's example is the first on Getting started and on the
# TorchRL page) runs once.
DISTINCT: dict[str, tuple[str, str, str]] = {}
for _block in BLOCKS:
    DISTINCT.setdefault(_block[2], _block)


def test_the_pages_have_their_blocks():
    pages = {page for page, _, _ in BLOCKS}
    assert {"README.md", "getting-started.md", "torchrl.md", "hosts.md"} <= pages, pages
    assert len(BLOCKS) >= 10
    example = {(page, title): code for page, title, code in BLOCKS}
    readme = example["README.md", "Example"]
    # One example, word for word: a copy that drifts would be a second one to read and to run.
    assert example["getting-started.md", "A TorchRL collector on shmsync"] == readme
    assert example["torchrl.md", "Collectors"] == readme


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page, title, code",
    [
        pytest.param(page, title, code, marks=_marks(code), id=re.sub(r"\W+", "-", f"{page[:-3]}-{title}").strip("-"))
        for page, title, code in DISTINCT.values()
    ],
)
def test_a_block_runs_as_written(request, tmp_path, page, title, code):
    if re.search(r"\bray\b", code):
        request.getfixturevalue("one_ray_cluster")  # one Ray cluster at a time
    if re.search(r"^def test_", code, flags=re.M):
        path = tmp_path / "test_block.py"
        path.write_text(code)
        cmd = python("-m", "pytest", "-q", "-p", "no:cacheprovider", str(path))
    else:
        path = tmp_path / "block.py"
        path.write_text(code)
        cmd = python(str(path))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the suite's
    proc = run_command(cmd, cwd=tmp_path, timeout=280, env=env)
    assert proc.returncode == 0, f"{page}, {title!r}: the block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "was never shut down" not in proc.stderr, f"{page}, {title!r}: a collector left running:\n{proc.stderr}"
    shown = SHOWS.get((page, title))
    if shown:
        lines = proc.stdout.splitlines()
        assert lines[0] == shown[0] and lines[-1] == shown[-1], f"{page}, {title!r} printed {lines}"


# What a block's text says it shows: its first and last lines of output.
SHOWS = {("getting-started.md", "Store and reader"): ["worker now runs version 0", "worker now runs version 3"]}


def test_the_api_reference_names_every_public_name():
    import shmsync
    import shmsync.errors

    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"\bshmsync\.(\w+)", api))
    errors = {name for name in vars(shmsync.errors) if name[0].isupper() and name != "annotations"}
    missing = sorted(set(shmsync.__all__) - documented - errors)
    assert missing == [], f"public names missing from docs/api.md: {missing}"
    assert ".. automodule:: shmsync.errors" in api


# -- what the pages cite is what the code has ----------------------------------------------------------
FILE = re.compile(r"\b((?:shmsync|tests|benchmarks|examples|workers|docs)/[\w/.-]+\.(?:py|md|sh))\b")
DOTTED = re.compile(r"\bshmsync(?:\.\w+)+")


def _cited_files() -> set[tuple[str, str]]:
    return {(page.name, path) for page in PAGES for path in FILE.findall(page.read_text())}


def _cited_names() -> set[tuple[str, str]]:
    """``shmsync.x.y`` names the pages cite, as written (in text or in code)."""
    return {(page.name, name) for page in PAGES for name in DOTTED.findall(page.read_text())}


def _resolve(name: str) -> bool:
    """Whether ``shmsync.x.y.Z.attr`` is a module, or an attribute reached from one."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_file_the_pages_cite_exists():
    missing = sorted(f"{page}: {path}" for page, path in _cited_files() if not (ROOT / path).exists())
    assert missing == [], "the docs cite files that do not exist:\n" + "\n".join(missing)


def _logger_names() -> set[str]:
    """The loggers shmsync logs to (a page may cite one: ``shmsync.alarm``)."""
    code = "".join(p.read_text() for p in (ROOT / "shmsync").rglob("*.py"))
    return set(re.findall(r'getLogger\("([\w.]+)"\)', code))


def test_every_shmsync_name_the_pages_cite_exists():
    loggers = _logger_names()
    missing = sorted(f"{page}: {name}" for page, name in _cited_names() if name not in loggers and not _resolve(name))
    assert missing == [], "the docs cite names that do not exist:\n" + "\n".join(missing)


def test_the_reference_check_sees_a_renamed_module(tmp_path):
    """A page citing a module that was renamed fails both checks."""
    assert not _resolve("shmsync.writer.memory") and not (ROOT / "shmsync/writer/memory.py").exists()
    assert _resolve("shmsync.store.memory.StoreMemory") and not _resolve("shmsync.store.memory.Memory")


def _loops_without_finally(code: str) -> list[int]:
    """Lines of the loops over a collector in ``code`` that no ``try`` whose ``finally`` shuts that
    collector down encloses."""
    import ast

    def shuts_down(body: list[ast.stmt], name: str) -> bool:
        return any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "shutdown"
            and isinstance(n.func.value, ast.Name) and n.func.value.id == name
            for stmt in body for n in ast.walk(stmt)
        )  # fmt: skip

    bare = []

    def visit(node: ast.AST, guarded: set[str]) -> None:
        if isinstance(node, ast.Try):
            named = {n.id for s in node.finalbody for n in ast.walk(s) if isinstance(n, ast.Name)}
            inner = guarded | {name for name in named if shuts_down(node.finalbody, name)}
            for child in node.body:
                visit(child, inner)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        loop = isinstance(node, ast.For) and isinstance(node.iter, ast.Name) and "collector" in node.iter.id
        if loop and node.iter.id not in guarded:
            bare.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(code), set())
    return bare


def test_every_collector_loop_shuts_its_collector_down_in_a_finally():
    """What getting-started says to always do: every loop over a collector in the README and the
    docs sits in a ``try`` whose ``finally`` calls that collector's ``shutdown()``."""
    loops = [
        (page, title, code) for page, title, code in BLOCKS if re.search(r"^\s*for \w+ in \w*collector\w*:", code, re.M)
    ]
    assert len(loops) >= 4, loops  # the README's, getting-started's, torchrl's, hosts' (two)
    bare = [f"{page}, {title!r}: line {line}" for page, title, code in loops for line in _loops_without_finally(code)]
    assert bare == [], "collector loops without a try/finally that shuts the collector down:\n" + "\n".join(bare)
    assert _loops_without_finally("for batch in collector:\n    pass\ncollector.shutdown()\n") == [1]
