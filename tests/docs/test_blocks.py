"""Every Python block of the README and of the docs runs as pasted into a fresh file: each is
written to a file of its own and run as a script (spawned children included), or under pytest
when it is a test, with nothing defined for it; the API reference names every public name.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.commands import CHECKOUT

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
    if re.search(r"\bray\b|Distributed|RelaySender", code):
        marks.append(pytest.mark.distributed)
    if re.search(r"DistributedSyncCollector|DistributedCollector|RayCollector", code):
        # A cluster of nodes or actors (a minute): tests/torchrl/test_distributed.py and
        # test_ray.py run the same remote schemes in `make test`; the blocks run in `make test-full`.
        marks.append(pytest.mark.full)
    return marks


BLOCKS = _blocks()
# A block shown on several pages (the README repeats the TorchRL page's) runs once.
DISTINCT: dict[str, tuple[str, str, str]] = {}
for _block in BLOCKS:
    DISTINCT.setdefault(_block[2], _block)


def test_the_pages_have_their_blocks():
    pages = {page for page, _, _ in BLOCKS}
    assert {"README.md", "getting-started.md", "torchrl.md", "hosts.md"} <= pages, pages
    assert len(BLOCKS) >= 10


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
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    else:
        path = tmp_path / "block.py"
        path.write_text(code)
        cmd = [sys.executable, str(path)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the suite's
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, f"{page}, {title!r}: the block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
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


def _defaults() -> list[tuple[str, str, float]]:
    """``(page, pattern, the code's value)``: each default figure a page cites, where it cites it
    (the pattern's group is the figure)."""
    import inspect

    from shmsync import WeightStore
    from shmsync.relay import RelaySender
    from shmsync.store.copies import PARALLEL_MIN_BYTES
    from shmsync.watch.alarm import STALE_AFTER
    from shmsync.watch.remote_rows import SILENT_AFTER

    def default(fn, arg):
        return inspect.signature(fn).parameters[arg].default

    slots = default(WeightStore.create, "num_slots")
    return [
        ("docs/protocol.md", r"`num_slots` copies \(slots\) of the weights, (\d+) by default", slots),
        ("docs/memory.md", r"`num_slots`\*\* \((\d+) by default\)", slots),
        ("docs/gpus.md", r"\((\d+) M by default\)", slots),
        ("docs/operations.md", r"`stale_after` seconds while it runs \((\d+) by default\)", STALE_AFTER),
        ("README.md", r"stays at an old version for (\d+) s while it runs", STALE_AFTER),
        ("docs/operations.md", r"`silent` after ([\d.]+) s without a report", SILENT_AFTER),
        ("docs/hosts.md", r"`timeout` seconds \((\d+) by default\)", default(RelaySender, "timeout")),
        ("docs/security.md", r"`handshake_timeout` \((\d+) s\)", default(RelaySender, "handshake_timeout")),
        ("docs/operations.md", r"threads a copy of (\d+) MB or more is split across", PARALLEL_MIN_BYTES >> 20),
        ("docs/torchrl.md", r"split across the cores that sit idle from (\d+) MB on", PARALLEL_MIN_BYTES >> 20),
    ]


def test_the_defaults_the_pages_cite_are_the_codes():
    wrong = []
    for page, pattern, value in _defaults():
        text = " ".join((ROOT / page).read_text().split())  # a figure's sentence may break across lines
        found = re.search(pattern, text)
        if found is None:
            wrong.append(f"{page}: no longer says {pattern!r}")
        elif found.groups() and float(found.group(1)) != float(value):
            wrong.append(f"{page}: says {found.group(1)}, the code {value} ({pattern!r})")
    assert wrong == [], "\n".join(wrong)
