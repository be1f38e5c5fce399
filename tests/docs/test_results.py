"""Every result in docs/results/ says where it came from (benchmarks/provenance.py): the commit,
the command and the code it measures; and it is a result of today's code of that path, or says that
it is older. A change to the code a result measures, made after the result, fails here until the
result is made again (or marked older, saying so where the docs show it). A change of comments and
docstrings alone is no change to the code: no figure can move with it."""

import ast
import re
import shutil
import subprocess

import pytest

from tests.commands import CHECKOUT

RESULTS = sorted((CHECKOUT / "docs" / "results").glob("*.md"))
HEADER = re.compile(
    r"<!-- result: commit=(?P<commit>[0-9a-f]{40})(?P<dirty>\+changes)? "
    r"measures=(?P<measures>[^>]*?)(?P<older> older)? -->"
)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=60)


def _history() -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"


def _code(text: str) -> str:
    """A Python module's code: its syntax tree without docstrings (comments are not in it)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _changed_since(commit: str, measures: list[str]) -> list[str]:
    """The files of ``measures`` whose code changed between ``commit`` and the checkout: added,
    removed, or different other than in comments and docstrings (a Python file's syntax tree)."""
    changed = []
    for path in _git("diff", "--name-only", commit, "HEAD", "--", *measures).stdout.split():
        before, after = _git("show", f"{commit}:{path}"), _git("show", f"HEAD:{path}")
        comparable = before.returncode == 0 and after.returncode == 0 and path.endswith(".py")
        if not comparable or _code(before.stdout) != _code(after.stdout):
            changed.append(path)
    return changed


def _header(path):
    lines = path.read_text().splitlines()
    match = HEADER.fullmatch(lines[0]) if lines else None
    assert match, f"{path.name}: its first line is not a result's header (benchmarks/provenance.py writes one)"
    assert lines[1].startswith("Made by `"), f"{path.name}: the second line does not say what made it"
    return match, lines[1]


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_each_result_names_its_commit_command_and_measured_code(path):
    match, said = _header(path)
    measures = match["measures"].split()
    assert measures and all((CHECKOUT / m).exists() for m in measures), f"{path.name}: measures {measures}"
    assert match["dirty"] is None, f"{path.name}: made from a tree with uncommitted changes; make it again"
    assert ("older than the code it measures" in said) == bool(match["older"]), f"{path.name}: {said}"


@pytest.mark.skipif(not _history(), reason="not a git checkout: the history to compare with is not here")
@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_a_result_is_of_todays_code_or_says_it_is_older(path):
    match, _ = _header(path)
    commit, measures = match["commit"], match["measures"].split()
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        pytest.skip(f"commit {commit[:12]} is not in this clone's history (a shallow clone)")
    changed = _changed_since(commit, measures)
    if match["older"]:
        assert changed, f"{path.name} says it is older, but nothing it measures changed since {commit[:12]}"
    else:
        assert not changed, (
            f"{path.name} was made at {commit[:12]}, and the code it measures changed since: {changed}. "
            "Run its benchmark again with --docs, or mark it older (benchmarks/provenance.py)"
        )


@pytest.mark.skipif(not _history(), reason="not a git checkout: the history to compare with is not here")
def test_the_check_sees_a_change_made_after_a_result():
    """A result of the first commit measuring the package is older than today's code; one of
    today's commit is not."""
    first = _git("rev-list", "--max-parents=0", "HEAD").stdout.split()[-1]
    head = _git("rev-parse", "HEAD").stdout.strip()
    assert _changed_since(first, ["shmsync"]) and not _changed_since(head, ["shmsync"])


def test_comments_and_docstrings_are_not_code_and_a_changed_constant_is():
    source = '''"""A module."""

LIMIT = 64  # rows


def f(x):
    """Twice ``x``."""
    return 2 * x
'''
    reworded = source.replace("A module.", "The module.").replace("# rows", "# a row each").replace("Twice", "Double")
    assert _code(reworded) == _code(source)
    assert _code(source.replace("64", "32")) != _code(source)
    assert _code(source.replace("2 * x", "x * 2")) != _code(source)
