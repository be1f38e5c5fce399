"""Words the project no longer uses stay out of its code, docs, tests, examples and benchmarks: one
word names one thing, and a retired word left in a comment or a page names a thing that is gone.
This file is the one place allowed to write them."""

from __future__ import annotations

import re
from pathlib import Path

from tests.commands import CHECKOUT

# Each retired word (a pattern, matched whatever its case) and what replaced it.
RETIRED = {
    r"reclaim": "give back (StoreMemory.give_back: a slot's pages returned to the system; a dead reader's row freed)",
    r"cuda[ _-]publisher": "CUDA writer (shmsync/writer/cuda.py's CudaWriter)",
    r"pinned d2h cop(y|ies)": "page-locked device-to-host copy (docs/results/gpu_bench.md)",
    r"zero-copy readers?": "reader in place (the mode `in place`; `zero_copy=` is the argument that asks for it)",
}
WHERE = ["shmsync", "docs", "tests", "examples", "benchmarks", "README.md"]
NOT_SOURCES = {"__pycache__", "_build", ".pytest_cache"}  # what a build or a run writes there
THIS = Path("tests", Path(__file__).name)  # the checkout's copy too, where the tests run from another


def _files():
    for top in WHERE:
        path = CHECKOUT / top
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            if file.is_file() and not NOT_SOURCES & set(file.parts) and file.relative_to(CHECKOUT) != THIS:
                yield file


def test_no_retired_word_is_left():
    patterns = {re.compile(word, re.I): now for word, now in RETIRED.items()}
    found = []
    for file in _files():
        try:
            text = file.read_text()
        except UnicodeDecodeError:  # a binary file (a compiled fence, an image)
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for pattern, now in patterns.items():
                if match := pattern.search(line):
                    found.append(f"{file.relative_to(CHECKOUT)}:{number}: {match.group(0)!r}, now {now}")
    assert found == [], "retired words:\n" + "\n".join(found)
