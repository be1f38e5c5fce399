"""The benchmarks run end to end on the smallest case, so a change cannot leave them broken until
the next time someone measures."""

import pytest

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
