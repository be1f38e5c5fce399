"""What the README, the docs and the changelog state about the code is what the code has: each
figure a page cites (a limit, a default, a budget, an exit code), which tests run where on which
Python and torch, the releases supported, the GPU run the README's GPU line stands for, and the
changelog's formats, links and removals. Each test reads the page and the code side by side, so a
figure that drifts fails here rather than misleading a reader.
"""

from __future__ import annotations

import inspect
import math
import re
import subprocess

import pytest

from tests.commands import CHECKOUT, run_command
from tests.docs.test_blocks import _resolve

ROOT = CHECKOUT


def _text(page: str) -> str:
    """``page``'s text with its line breaks and runs of spaces made single spaces (a figure's
    sentence may break across lines)."""
    return " ".join((ROOT / page).read_text().split())


def _words(value: object) -> str:
    """How the pages write a figure: integers with thousands separators."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _figures() -> list[tuple[str, str, tuple]]:
    """``(page, pattern, the code's values)``: each figure a page cites about the code, where it
    cites it; the pattern's groups are the figures, in order."""
    from shmsync import ShmWeightSyncScheme, WeightStore
    from shmsync.core import header, segment
    from shmsync.relay import RelaySender, messages, sealing, wire
    from shmsync.store import layout
    from shmsync.store.copies import PARALLEL_MIN_BYTES
    from shmsync.tools import cli, secret_file
    from shmsync.torchrl.distributed import READY_TIMEOUT_S
    from shmsync.torchrl.releases import NIGHTLY
    from shmsync.watch import alarm, remote_rows
    from shmsync.workers import launch, relay
    from shmsync.writer.cuda import CHUNK_BYTES
    from tests.conftest import FAST_CPU_S

    def default(fn, arg):
        return inspect.signature(fn).parameters[arg].default

    def longest_name() -> int:
        for n in range(1, 1000):
            try:
                segment.validate_name("a" * (n + 1))
            except ValueError:
                return n
        return 1000

    slots = default(WeightStore.create, "num_slots")
    scheme = [default(ShmWeightSyncScheme, a) for a in ("stale_after", "max_lag", "on_stale")]
    ls_limit = cli._parser().parse_args(["ls"]).limit
    watch_every = cli._parser().parse_args(["ls", "--watch"]).watch
    slowest = int(re.search(r"--durations=(\d+)", _makefile()["DURATIONS"]).group(1))
    relay_codes = relay.REASONS
    return [
        # Defaults.
        ("docs/protocol.md", r"`num_slots` copies \(slots\) of the weights, (\d+) by default", (slots,)),
        ("docs/memory.md", r"`num_slots`\*\* \((\d+) by default\)", (slots,)),
        ("docs/gpus.md", r"\((\d+) M by default\)", (slots,)),
        ("docs/operations.md", r"`stale_after` seconds while it runs \((\d+) by default\)", (alarm.STALE_AFTER,)),
        (
            "docs/torchrl.md",
            r"`ShmWeightSyncScheme\(stale_after=([\d.]+), max_lag=(\w+), on_stale=\"(\w+)\"\)`",
            scheme,
        ),
        ("docs/operations.md", r"`silent` after ([\d.]+) s without a report", (remote_rows.SILENT_AFTER,)),
        (
            "docs/operations.md",
            r"reads the table on a thread of its own, (twice) a second",
            ("twice",) * (alarm.TICK == 0.5),
        ),
        ("docs/operations.md", r"state `lost`, for (\d+) seconds", (remote_rows.LOST_KEEP,)),
        ("docs/operations.md", r"`--limit N` rows at most, (\d+) by default", (ls_limit,)),
        ("docs/operations.md", r"`--watch` redraws it in place (every second)", ("every second",) * (watch_every == 1)),
        ("docs/hosts.md", r"`timeout` seconds \((\d+) by default\)", (default(RelaySender, "timeout"),)),
        ("docs/security.md", r"`handshake_timeout` \((\d+) s\)", (default(RelaySender, "handshake_timeout"),)),
        ("docs/operations.md", r"threads a copy of (\d+) MB or more is split across", (PARALLEL_MIN_BYTES >> 20,)),
        ("docs/torchrl.md", r"split across the cores that sit idle from (\d+) MB on", (PARALLEL_MIN_BYTES >> 20,)),
        ("docs/gpus.md", r"fills a host slot from each new device slot in (\d+) MB chunks", (CHUNK_BYTES >> 20,)),
        ("docs/torchrl.md", r"the wait ends at its deadline \((\d+) s\)", (READY_TIMEOUT_S,)),
        ("README.md", r"`torchrl-nightly` from ([\d.]+), which counts as 0\.15", (NIGHTLY,)),
        # Limits.
        ("docs/protocol.md", r"Each store lists up to ([\d,]+) readers", (header.MAX_READERS,)),
        ("docs/operations.md", r"Names are 1 to (\d+) letters", (longest_name(),)),
        ("docs/operations.md", r"about 60 bytes a reader, at most (\d+) MiB", (remote_rows.MAX_REPORT_BYTES >> 20,)),
        ("docs/security.md", r"both sides' fresh (\d+)-byte nonces", (wire.NONCE_BYTES,)),
        ("docs/security.md", r"A connection silent for (a) second is cut", ("a",) * (messages.SILENT_CUTOFF == 1.0)),
        ("docs/security.md", r"with ([\d,]+) under way", (messages.MAX_PENDING,)),
        (
            "docs/security.md",
            r"with pieces of (\d+) KiB, or the whole payload if smaller, to (\d+) GiB",
            (sealing.MIN_PIECE_BYTES >> 10, sealing.MAX_PIECE_BYTES >> 30),
        ),
        (
            "docs/security.md",
            r"a layout is at most (\d+) MiB of JSON, ([\d,]+) tensors and (\d+) TiB",
            (header.MAX_LAYOUT_BYTES >> 20, layout.MAX_ENTRIES, layout.MAX_PAYLOAD_BYTES >> 40),
        ),
        (
            "docs/security.md",
            r"at most 2\^(\d+) above it and at most 2\^(\d+)",
            (int(math.log2(messages.MAX_VERSION_LEAP)), int(math.log2(messages.MAX_VERSION))),
        ),
        ("docs/security.md", r"at most one piece, (\d+) MiB by default", (messages.BUCKET_BYTES >> 20,)),
        ("docs/security.md", r"remembered \(the last (\d+) only\)", (messages.MAX_DROPPED,)),
        (
            "docs/security.md",
            r"at most (\d+) MiB a frame, ([\d,]+) hosts and ([\d,]+) rows a report",
            (remote_rows.MAX_REPORT_BYTES >> 20, remote_rows.MAX_REPORT_HOSTS, remote_rows.MAX_REPORT_ROWS),
        ),
        ("docs/security.md", r"printable and at most (\d+) characters", (remote_rows.MAX_NAME,)),
        ("docs/security.md", r"only this user's, at most (\d+) MiB", (remote_rows.MAX_REPORT_FILE >> 20,)),
        ("docs/security.md", r"`shmsync new-secret FILE` writes (\d+) random bytes", (secret_file.SECRET_BYTES,)),
        ("docs/security.md", r"shorter than (\d+) bytes is refused", (secret_file.MIN_SECRET_BYTES,)),
        # The shape of a relay tree.
        (
            "docs/hosts.md",
            r"a version of (\d+) pieces or more goes down a pipelined chain \(`fanout=1`\), a smaller one "
            r"down a tree of fan-out (\d+)",
            (messages.CHAIN_FROM_PIECES, messages.FANOUT),
        ),
        ("docs/hosts.md", r"in pieces \((\d+) MiB by default\)", (messages.BUCKET_BYTES >> 20,)),
        (
            "docs/performance.md",
            r"the payload once with the chain \(the default from (\d+) pieces on\), (twice) with "
            r"fan-out (\d+)",
            (messages.CHAIN_FROM_PIECES, "twice" * (messages.FANOUT == 2), messages.FANOUT),
        ),
        # Exit codes (2: argparse's, for a wrong command line).
        (
            "docs/operations.md",
            r"Exit codes: 0; (\d) a wrong command line \(an invalid name\); (\d) no store of that "
            r"name .*?; (\d) a store file that is not this user's alone",
            (2, cli.NOT_FOUND, cli.BAD_STORE),
        ),
        (
            "docs/getting-started.md",
            r"with its exit code: 0 the batches asked for were collected \(or Ctrl-C\), (\d) a "
            r"worker failed, (\d) a wrong command line, (\d) no such store, (\d) the policy does not match the store",
            (launch.EXIT_FAILED, 2, launch.EXIT_NO_STORE, launch.EXIT_MISMATCH),
        ),
        (
            "docs/hosts.md",
            r"`Relay\.run` raises `TrainerGoneError` \(the command exits (\d)\)",
            (relay.EXIT_TRAINER_GONE,),
        ),
        ("docs/hosts.md", r"key, shape or dtype that differs \(exit code (\d)\)", (relay.EXIT_MISMATCH,)),
        ("docs/hosts.md", r"`AuthenticationError` at once \(exit code (\d)\)", (relay.EXIT_AUTH,)),
        ("docs/hosts.md", r"the relay command exits (\d) with one line naming it", (relay.EXIT_PROTOCOL,)),
        ("docs/security.md", r"A wrong secret exits with code (\d)", (relay.EXIT_AUTH,)),
        (
            "docs/hosts.md",
            r"The relay command's exit codes: " + "; ".join(r"(\d+) [^;]+?" for _ in relay_codes) + r"\. Each",
            tuple(sorted(relay_codes)),
        ),
        # The tests: the fast tier's budgets (tests/conftest.py), what CI prints (the Makefile).
        ("docs/testing.md", r"all but the `full` tier, the (\d+) slowest printed", (slowest,)),
        ("docs/testing.md", r"CI prints the (\d+) slowest tests of the main tier", (slowest,)),
        (
            "docs/testing.md",
            r"processes spend more than (\d+) seconds of CPU fails",
            (FAST_CPU_S,),
        ),
    ]


def test_the_figures_the_pages_cite_are_the_codes():
    wrong = []
    for page, pattern, values in _figures():
        found = re.search(pattern, _text(page))
        if found is None:
            wrong.append(f"{page}: no longer says {pattern!r} (or the code's figure is not the page's word)")
        elif len(found.groups()) != len(values):
            wrong.append(f"{page}: {pattern!r} has {len(found.groups())} figures, the code {len(values)}")
        else:
            for said, value in zip(found.groups(), values):
                same = (
                    said == str(value)
                    if isinstance(value, str) or value is None
                    else float(said.replace(",", "")) == value
                )
                if not same:
                    wrong.append(f"{page}: says {said}, the code {_words(value)} ({pattern!r})")
    assert wrong == [], "\n".join(wrong)


def test_the_figure_check_sees_a_figure_that_drifted(monkeypatch):
    """A page whose figure differs from the code's fails the check (the drift it was written for)."""
    from shmsync.core import header

    monkeypatch.setattr(header, "MAX_READERS", 1203)
    with pytest.raises(AssertionError, match=r"docs/protocol\.md: says 1,024, the code 1,203"):
        test_the_figures_the_pages_cite_are_the_codes()


# -- which tests run where, on which Python and torch ---------------------------------------------------
def _makefile() -> dict[str, str]:
    """The Makefile's settings (``NAME ?= value``)."""
    return dict(re.findall(r"^([A-Z_][A-Z0-9_.]*) \?= (.*)$", (ROOT / "Makefile").read_text(), re.M))


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else items[0]


class Legs:
    """What the Makefile runs where: the Pythons, the torch of each, the TorchRL minors."""

    def __init__(self) -> None:
        from shmsync.torchrl.releases import NEWEST_RELEASE

        make = _makefile()
        self.pythons = make["PYTHONS"].split()
        self.newest = self.pythons[-1]
        self.others = self.pythons[:-1]
        self.current = _minor(make["CURRENT_TORCH"])
        self.main_torch = _minor(make["TORCH"].removeprefix("torch=="))
        self.full_torch = _minor(make["TORCH_FULL_LEGS"])
        self.torch_for = {v: _minor(make.get(f"TORCH_FOR_{v}", make["CURRENT_TORCH"])) for v in self.pythons}
        self.legs = make["TORCHRL_LEGS"].split()
        self.torchrl = ".".join(map(str, NEWEST_RELEASE))
        recipe = re.search(r"^test-torch:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
        self.full_marks = re.findall(r"\w+", re.search(r'-m "([^"]+)"', recipe).group(1))
        # The main tier's Python: the one the workflow makes python3 (the last it installs).
        workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
        listed = re.search(r"python-version: \|\n((?:\s+[\d.]+\n)+)", workflow).group(1).split()
        self.main_python = listed[-1]


def test_the_pages_say_which_tests_run_where_as_the_makefile_runs_them():
    legs = Legs()
    marks = " and ".join(f"`{m}`" for m in legs.full_marks if m != "or")
    says = {
        "docs/testing.md": [
            f"| the checkout, installed editable (`.venv`) | {legs.main_torch}, {legs.torchrl} |",
            f"runs the {marks} tests on torch {legs.full_torch} as well",
            f"on Python {legs.newest} in `.venv-wheel-{legs.newest}`",
            f"| {legs.current} (the current release), {legs.torchrl} |",
            f"| {legs.main_torch}; {', '.join(legs.legs)} |",
            f"against the wheel on Python {legs.newest}, the wheel's tests on {_and(legs.others)}",
            f"`.venv`'s Python (`PYTHON`, {legs.main_python} on CI)",
            *(f"| {v} | {legs.torch_for[v]}" for v in legs.pythons),
        ],
        "docs/getting-started.md": [
            f"`make test` runs the main tier on {legs.main_torch} and the wheel's tests on {legs.current}",
            f"`make test` on {legs.newest} (with torch {legs.current})",
            f"the main tier runs on {legs.main_python}",
        ],
    }
    missing = [
        f"{page}: {phrase!r}" for page, phrases in says.items() for phrase in phrases if phrase not in _text(page)
    ]
    assert missing == [], "the pages no longer say what the Makefile runs:\n" + "\n".join(missing)


# -- the marks ------------------------------------------------------------------------------------------
def test_the_testing_page_has_a_row_for_each_mark_pyproject_declares():
    block = re.search(r"^markers = \[\n(.*?)^\]", _pyproject(), re.M | re.S).group(1)
    declared = re.findall(r'^\s*"(\w+):', block, re.M)
    tiers = (ROOT / "docs" / "testing.md").read_text().split("### Tiers", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", tiers, re.M)
    assert sorted(rows) == sorted(declared), f"docs/testing.md's table names {rows}, pyproject.toml {declared}"


# -- the releases supported --------------------------------------------------------------------------------
def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


def test_the_pages_name_the_releases_the_package_supports():
    from shmsync.torchrl.releases import NEWEST_RELEASE, SUPPORTED

    text = _pyproject()
    low, high = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    major, first, last = int(low.split(".")[0]), int(low.split(".")[1]), int(high.split(".")[1]) - 1
    torch = [f"{major}.{m}" for m in range(first, last + 1)]
    pythons = Legs().pythons
    rl_first, rl_newest = ".".join(map(str, SUPPORTED[0])), ".".join(map(str, NEWEST_RELEASE))
    assert re.search(rf'"torchrl>={re.escape(rl_first)}[.\d]*,<0\.{SUPPORTED[1][1] + 1}"', text), (
        "pyproject's torchrl range"
    )
    says = {
        "README.md": [
            f"Python {_and(pythons)}, each tested",
            f"torch {_and(torch)}",
            f"torchrl {rl_first} to {rl_newest}",
        ],
        "docs/getting-started.md": [f"`torch>={low},<{high}`: {_and(torch)}", f"Python {_and(pythons)}, each tested"],
        "docs/protocol.md": [
            f"Python {pythons[0]} to {pythons[-1]}, torch {torch[0]} to {torch[-1]}, torchrl {rl_first} to {rl_newest}"
        ],
        "docs/torchrl.md": [f"torchrl {rl_first} to {rl_newest}, each with its own tensordict minor"],
    }
    missing = [
        f"{page}: {phrase!r}" for page, phrases in says.items() for phrase in phrases if phrase not in _text(page)
    ]
    assert missing == [], "the pages no longer name the releases pyproject.toml admits:\n" + "\n".join(missing)


# -- the GPU line -------------------------------------------------------------------------------------------
GPU_LINE = re.compile(
    r"- GPU: .*?Last run: (?P<date>\d{4}-\d\d-\d\d), at commit (?P<commit>[0-9a-f]{7,40}), on an? (?P<gpu>.+?) with "
    r"torch (?P<torch>\S+?)(?: \(below the torch (?P<floor>[\d.]+) shmsync now requires\))?: (?P<passed>\d+) CUDA "
    r"tests passed\.(?: Since then, without a GPU run: (?P<since>.+?)\.)?(?= - |$| ##)"
)


def gpu_line(text: str) -> re.Match:
    """The README's GPU line, read (``text``: whitespace made single spaces)."""
    found = GPU_LINE.search(text)
    assert found is not None, "README.md has no GPU line of the form benchmarks/gpu_status.py prints"
    return found


def _cuda_modules() -> list[str]:
    """The modules of the CUDA paths: those named for CUDA or device memory."""
    found = [*(ROOT / "shmsync").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]
    return sorted(p.relative_to(ROOT).as_posix() for p in found if re.search(r"cuda|device", p.stem))


def _git(*args: str) -> subprocess.CompletedProcess:
    return run_command(["git", *args], cwd=ROOT)


def test_the_readmes_gpu_line_says_what_ran_and_what_changed_since():
    line = gpu_line(_text("README.md"))
    floor = re.search(r'"torch>=([\d.]+)', _pyproject()).group(1)

    def numbers(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:2])

    below = numbers(line["torch"]) < numbers(floor)
    assert (line["floor"] == floor) if below else line["floor"] is None, (
        f"the GPU run's torch {line['torch']} against shmsync's floor {floor}: the line says {line['floor']!r}"
    )
    if _git("cat-file", "-e", f"{line['commit']}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {line['commit']} is not in this checkout's history (a shallow clone)")
    changed = _git("log", "--format=", "--name-only", f"{line['commit']}..HEAD", "--", *_cuda_modules()).stdout.split()
    unnamed = sorted(set(changed) - set(re.findall(r"`([\w/.]+\.py)`", line["since"] or "")))
    assert not unnamed, (
        f"the CUDA paths changed since the GPU run at {line['commit']} without a GPU run, and the README's GPU line "
        f"does not say so: {unnamed} (name them after 'Since then, without a GPU run:', or run "
        "benchmarks/gpu_check.sh on a GPU and paste the line it prints)"
    )


# -- the changelog ----------------------------------------------------------------------------------------
def test_the_changelog_states_the_formats_the_code_has():
    from shmsync.core.header import FORMAT
    from shmsync.relay.wire import PROTOCOL

    text = _text("CHANGELOG.md")
    newest = text[text.index("## [Unreleased]") : text.index("## [", text.index("## [Unreleased]") + 1)]
    assert re.search(rf"Store header format {FORMAT}\b", newest), (
        f"the newest entry does not say header format {FORMAT}"
    )
    assert re.search(rf"relay wire protocol {PROTOCOL}\b", newest), (
        f"the newest entry does not say wire protocol {PROTOCOL}"
    )


def test_the_changelogs_links_resolve():
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    links = dict(re.findall(r"^\[([^\]]+)\]: (\S+)$", text, re.M))
    assert sorted(headings) == sorted(links), f"versions {headings}, links {sorted(links)}"
    refs = set()
    for name, url in links.items():
        found = re.fullmatch(r"https://github\.com/shmsync/shmsync/(?:compare/(\S+)\.\.\.(\S+)|tree/(\S+))", url)
        assert found, f"[{name}]: {url} is neither a comparison nor a tree of the repository"
        refs |= {r for r in found.groups() if r and r != "HEAD"}
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a git checkout with its whole history")
    unknown = sorted(r for r in refs if _git("rev-parse", "--verify", "--quiet", f"{r}^{{commit}}").returncode != 0)
    assert not unknown, f"the changelog's links name tags or commits this repository does not have: {unknown}"


def test_what_the_changelog_lists_as_removed_is_gone():
    text = (ROOT / "CHANGELOG.md").read_text()
    removed = re.findall(r"^### Removed\n(.*?)(?=^##|\Z)", text, re.M | re.S)
    names = {n for section in removed for n in re.findall(r"`(shmsync(?:\.\w+)+)`", section)}
    assert names, "no removed names found: the check reads nothing"
    still = sorted(n for n in names if _resolve(n))
    assert not still, f"CHANGELOG.md lists as removed what the code still has: {still}"


# -- the tables the command prints, as the pages show them ---------------------------------------------
def _printed_heads() -> dict[str, list[str]]:
    """The header line of each table `shmsync ls` prints, as the code prints it (its words), by
    its first two words."""
    from shmsync.store.reader_table import HostReport, ReaderTable, Transfer, format_rows
    from shmsync.tools.cli import _table

    host = HostReport("host-b", "relay 1", "s", 0.5, "linked", 1, Transfer(2, 10, True, 1, 1, 20))
    lines = [*format_rows(ReaderTable("s", 2, [], hosts=[host])).splitlines()[1:], _table([])]
    return {" ".join(line.split()[:2]): line.split() for line in lines if line and line.isupper()}


def _shown_heads() -> list[tuple[str, list[str]]]:
    """Every header line of a `shmsync ls` table in the pages' samples: ``(page, its words)``."""
    shown = []
    for page in ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")))]:
        for line in (ROOT / page).read_text().splitlines():
            cells = re.split(r"\s{2,}", line.strip())
            if len(cells) > 3 and cells[0] in ("NAME", "HOST") and all(c.isupper() for c in cells):
                shown.append((page, line.split()))
    return shown


def test_the_pages_show_the_columns_the_command_prints():
    printed = _printed_heads()
    assert set(printed) == {"NAME VERSION", "HOST WORKER", "HOST VIA"}, sorted(printed)
    shown = _shown_heads()
    assert shown, "no sample of `shmsync ls` found in the pages"
    wrong = [f"{page}: {' '.join(words)}" for page, words in shown if printed.get(" ".join(words[:2])) != words]
    assert not wrong, "samples whose columns are not the ones `shmsync ls` prints:\n" + "\n".join(wrong)


def test_the_operations_page_lists_every_field_of_a_readers_row():
    from dataclasses import fields

    from shmsync.store.reader_table import ReaderRow

    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("| field | meaning |") : text.index("Readers whose process died")]
    rows = [line.split("|")[1] for line in table.splitlines()[2:] if line.startswith("|")]
    listed = [name for cells in rows for name in re.findall(r"`(\w+)`", cells)]
    assert sorted(listed) == sorted(f.name for f in fields(ReaderRow))


def test_the_protocol_page_lists_every_configuration_the_checker_explores():
    """One row per configuration of tests/core/test_protocol_interleavings.py, and `make test`'s
    column says which of them the main tier explores (the `full` ones: no)."""
    from _pytest.mark.structures import ParameterSet

    from tests.core.test_protocol_interleavings import CONFIGURATIONS

    text = (ROOT / "docs" / "protocol.md").read_text()
    table = text[text.index("| configuration | slots |") : text.index("About ")]
    rows = [line.split("|") for line in table.splitlines()[2:] if line.startswith("|")]
    full = sum(isinstance(c, ParameterSet) for c in CONFIGURATIONS.values())
    assert len(rows) == len(CONFIGURATIONS), f"{len(rows)} rows for {len(CONFIGURATIONS)} configurations"
    assert [r[-2].strip() for r in rows].count("no") == full
