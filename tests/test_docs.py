"""Every Python block of the README and of the docs runs as pasted into a fresh file: each is
written to a file of its own and run as a script (spawned children included), or under pytest
when it is a test, with nothing defined for it; the API reference names every public name.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
