"""The benchmarks run end to end on the smallest case, so a change cannot leave them broken until
the next time someone measures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=150):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(180)
def test_loop_bench_smallest_case():
    out = _run("benchmarks/loop_bench.py", "--sizes", "1", "--workers", "2", "--batches", "4", "--cases", "explicit")
    # One table row per case: the loop per batch of all three collectors, and the ratios.
    row = next(line for line in out.splitlines() if line.startswith("| 1 MB | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 10, row
    assert cells[5].startswith("**") and cells[5].endswith("x**"), row
