"""The benchmarks run end to end on the smallest case, so a change cannot leave them broken until
the next time someone measures."""

import pytest

from shmsync.core.written_pages import unavailable_reason
from tests.commands import run_script

pytestmark = [pytest.mark.slow]


@pytest.mark.full  # run by hand before a table is published, and in `make test-full`
@pytest.mark.timeout(180)
def test_loop_bench_smallest_case():
    out = run_script(
        "benchmarks/loop_bench.py",
        "--sizes",
        "1",
        "--workers",
        "2",
        "--batches",
        "4",
        "--cases",
        "explicit",
        timeout=150,
    )
    # One table row per case: the loop per batch of all three collectors, and the ratios.
    row = next(line for line in out.splitlines() if line.startswith("| 1 MB | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 10, row
    assert cells[5].startswith("**") and cells[5].endswith("x**"), row


@pytest.mark.timeout(120)
@pytest.mark.skipif(unavailable_reason() is not None, reason="write tracking is unavailable here")
def test_written_pages_bench_quick():
    out = run_script("benchmarks/written_pages_bench.py", "--quick", timeout=90)
    rows = [line for line in out.splitlines() if line.startswith("| look, ")]
    assert len(rows) == 3, out
    assert all(float(row.strip("|").split("|")[1]) > 0 for row in rows), out
    assert "the first write to a protected page:" in out
