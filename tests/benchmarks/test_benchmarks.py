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


@pytest.mark.timeout(60)
def test_gpu_status_prints_the_readmes_gpu_line():
    """What benchmarks/gpu_check.sh prints to paste is the line tests/docs/test_facts.py reads: for
    the run the README names, the README's line as far as its tests."""
    from tests.docs.test_facts import _text, gpu_line

    readme = gpu_line(_text("README.md"))
    values = {"gpu": readme["gpu"], "torch": readme["torch"], "commit": readme["commit"], "date": readme["date"]}
    args = [f"--{k}={v}" for k, v in values.items()]
    out = run_script("benchmarks/gpu_status.py", "--passed", readme["passed"], *args, timeout=50)
    printed = " ".join(out.split("\n\n", 1)[1].split())
    line = gpu_line(printed)
    assert {k: line[k] for k in values} == values and line["passed"] == readme["passed"], printed
    assert line["floor"] == readme["floor"] and line["since"] is None, printed
    assert readme.group(0).startswith(printed), f"the README's line is not the one printed:\n{printed}"
    assert "nothing to paste" in run_script("benchmarks/gpu_status.py", "--passed", "3", "--failed", *args, timeout=50)
