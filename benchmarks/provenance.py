"""Where a result in ``docs/results/`` comes from: the commit, date, machine and command that made
it, and the code it measures. A benchmark run with ``--docs`` writes its table with that header;
``tests/docs/test_results.py`` fails when the code a result measures changed after its commit
(comments and docstrings aside), so a table in the docs is always one that today's code of its path
made (or says it is older).

The header's first line is for the check to read, the second for people::

    <!-- result: commit=<40 hex digits> measures=<path> <path> ... -->
    Made by `python benchmarks/x.py --docs` at commit <12 hex> on <date>: <machine>.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def machine() -> str:
    """The machine in words: CPU, cores, Python, torch (and torchrl where it is imported)."""
    import torch

    parts = [
        platform.processor() or platform.machine(),
        f"{os.cpu_count()} cores",
        f"Python {platform.python_version()}",
    ]
    parts.append(f"torch {torch.__version__}")
    torchrl = sys.modules.get("torchrl")
    if torchrl is not None:
        parts.append(f"torchrl {torchrl.__version__}")
    return ", ".join(parts)


def commit() -> str:
    """The checkout's commit; ``+changes`` after it where the tree differs from it (a result made
    so is older than any commit, and the check says so)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "shmsync", "workers", "benchmarks")
    return head + ("+changes" if dirty else "")


def write(name: str, text: str, measures: Sequence[str]) -> Path:
    """Write ``docs/results/<name>.md``: the header, then ``text``.

    Args:
        name: the result's name (the benchmark's, or a case of it).
        text: the table and its lines, as the benchmark prints them.
        measures: the paths, from the checkout's root, of the code the result measures: the
            benchmark itself and the modules on the measured path.
    """
    for path in measures:
        if not (ROOT / path).exists():
            raise FileNotFoundError(f"{name}: the measured path {path!r} does not exist")
    made = commit()
    command = " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    head = (
        f"<!-- result: commit={made} measures={' '.join(measures)} -->\n"
        f"Made by `{command}` at commit {made[:12]} on {time.strftime('%Y-%m-%d')}: {machine()}.\n"
    )
    path = RESULTS / f"{name}.md"
    path.write_text(f"{head}\n{text}\n")
    return path
