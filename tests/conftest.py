"""The whole suite's fixtures and rules: the tiers a test's marks put it in, the leak check every
test passes, and how the tests' child processes start.

Marks (docs/testing.md) say two things. What a test costs, its tier: none for the **fast** tier,
``slow`` for the **main** tier (``make test``), ``full`` for the **full** tier (``make test-full``
only); a test's tier comes from these alone. Where it runs besides: ``torchrl`` (replayed under
TorchRL's nightly and other releases), ``minors`` (under every older TorchRL minor in ``make
test``), ``shipped`` (against the installed wheel and sdist), ``cuda`` (needs a GPU),
``distributed`` (engines on loopback). The marks sit where each test is defined
(``@pytest.mark.slow``, ``pytest.param(..., marks=...)``); this file checks them and selects by
them (``--tier fast|main|full``, every target of the Makefile): a mark combination that makes no
sense stops the run, and a fast-tier test whose process tree spends more than :data:`FAST_CPU_S`
seconds of CPU fails, asking to be marked ``slow``.
"""

import fcntl
import multiprocessing as mp
import os
import resource
import signal
import time

# Ray swaps a node address of 127.0.0.1 for the host's network address, and binds its servers
# there, unless it runs as a single-node cluster: keep every server the tests start on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray starts its workers at niceness 15: beside other CPU-bound work they get a few percent of a
# core and an actor takes minutes to import torch. The tests want them on equal terms.
os.environ.setdefault("RAY_worker_niceness", "0")

import psutil
import pytest

from shmsync.core import segment
from shmsync.testing import helper_pids, stores_created_by

# The tests' children (the `start` fixture's, and TorchRL's workers in the collector tests) start
# from a forkserver that has torch, TorchRL, gymnasium and the tests' helpers imported already:
# a child starts in milliseconds instead of the seconds those imports take. It is a fresh process
# all the same: arguments pickled as under spawn, no state of the test's process inherited. The
# spawn path a user's script takes runs wherever a test starts an interpreter of its own (the
# examples, the docs' blocks, the TorchRL plays, the workers' and relays' commands).
FORKSERVER_PRELOAD = [
    "torch",
    "tensordict",
    "gymnasium",
    "torchrl.envs",
    "torchrl.collectors",
    "shmsync",
    "shmsync.torchrl.scheme",
    "tests.weights",
    "tests.processes",
    "tests.relay.peers",
    "tests.torchrl.collectors",
]
mp.set_start_method("forkserver", force=True)
mp.set_forkserver_preload(FORKSERVER_PRELOAD)

# -- tiers ----------------------------------------------------------------------------------------
TIERS = ("fast", "main", "full")  # each runs the tests of those before it too
# What a fast-tier test may spend: CPU seconds of its whole process tree (:func:`_tree_cpu_seconds`),
# the same on a busy host as on a quiet one. Well above what the fast tier's tests take (3 s at
# most), well below what a test that starts interpreters takes.
FAST_CPU_S = 10.0


def tier(item: pytest.Item) -> str:
    """``"full"``, ``"main"`` or ``"fast"``: the smallest target that runs ``item``, from its cost
    marks alone (``full``, ``slow``)."""
    if item.get_closest_marker("full"):
        return "full"
    return "main" if item.get_closest_marker("slow") else "fast"


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=TIERS,
        default="full",
        help="run the tests of this tier and of the tiers below it (fast < main < full; default: full, every test)",
    )


def _mark_problems(item: pytest.Item) -> list[str]:
    marks = {m.name for m in item.iter_markers()}
    problems = []
    if "fast" in marks:
        problems.append("`fast` is this file's, set on each test of the fast tier: a fast test carries no cost mark")
    if "minors" in marks and "torchrl" not in marks:
        problems.append("`minors` replays a TorchRL path under older minors: mark it `torchrl` too")
    if "shipped" in marks and "full" in marks:
        problems.append("`shipped` tests run in `make test` against the installed package: not `full`")
    return problems


# Started first: the longest tests (30-100 s), so that under xdist none of them begins last and
# keeps one worker busy while the others sit idle. The rest run as collected: under `make test`
# the other legs start interpreters of their own meanwhile, and quick tests between the heavy ones
# keep the load on two cores even (every heavy test first would start more processes at once than
# two cores hold, and take longer).
LONGEST_FIRST = ("tests/core/test_protocol_interleavings.py::", "tests/torchrl/test_distributed.py::")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: an expression may name `fast`
def pytest_collection_modifyitems(config, items):
    wrong = [f"{item.nodeid}: {p}" for item in items for p in _mark_problems(item)]
    if wrong:
        raise pytest.UsageError("marks that make no sense together:\n" + "\n".join(wrong))
    highest = TIERS.index(config.getoption("tier"))
    kept, left = [], []
    for item in items:
        if tier(item) == "fast":
            item.add_marker("fast")
        (kept if TIERS.index(tier(item)) <= highest else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
    kept.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable: otherwise as collected
    items[:] = kept


# multiprocessing's helpers, as their command lines name them (shmsync.testing tells them the same way).
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _proc(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read()
    except OSError:  # gone (its time then counts in its reaper's)
        return ""


def _children(pid: int) -> list[int]:
    """``pid``'s children, from each of its threads' ``children`` file: a few reads, not a scan of
    every process on the host (psutil's walk, where the kernel keeps no such file)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    if not os.path.exists(f"/proc/{pid}/task/{tasks[0]}/children"):
        return [p.pid for p in psutil.Process(pid).children()]
    return [int(child) for task in tasks for child in _proc(pid, f"task/{task}/children").split()]


def _tree_cpu_seconds() -> float:
    """CPU seconds spent so far by this process (all its threads) and by its descendants: those
    running, and those reaped by this process or by one of them (a forkserver reaps the processes
    it started). multiprocessing's helpers (the forkserver, the resource tracker) outlive a test and
    start once per session: their own time is not a test's, the processes they reaped are."""
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + own.ru_utime + own.ru_stime
    stack = [(child, True) for child in _children(os.getpid())]
    while stack:
        pid, direct = stack.pop()
        stat = _proc(pid, "stat").rsplit(")", 1)[-1].split()  # after the command's name: the state, ...
        if len(stat) < 15:
            continue
        utime, stime, reaped_utime, reaped_stime = (int(x) * TICK_S for x in stat[11:15])
        helper = direct and any(h in _proc(pid, "cmdline") for h in HELPERS)
        total += reaped_utime + reaped_stime + (0.0 if helper else utime + stime)
        stack += [(child, False) for child in _children(pid)]
    return total


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if tier(item) != "fast":
        return (yield)
    before = _tree_cpu_seconds()
    result = yield
    cpu = _tree_cpu_seconds() - before
    if cpu > FAST_CPU_S:
        pytest.fail(
            f"this fast-tier test's processes spent {cpu:.1f} s of CPU (the fast tier allows {FAST_CPU_S:.0f}): "
            "mark it slow (or make it cheaper)",
            pytrace=False,
        )
    return result


# -- what every test leaves behind -----------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_leaks(shm_leak_check):
    """Every test must leave no store and no child process behind."""
    yield


@pytest.fixture(scope="session", autouse=True)
def _suite_leaves_no_store():
    before = set(segment.list_names())
    yield
    left = stores_created_by({os.getpid(), *helper_pids()}) - before
    assert not left, f"the suite left stores in {segment.SHM_DIR}: {sorted(left)}"


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """A store folder of this test's own, where this process makes and looks for stores (a child
    or a command is given it with ``SHMSYNC_DIR``); group-writable files are not trusted there."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setattr(segment, "SHM_DIR", str(path))
    monkeypatch.delenv("SHMSYNC_TRUST_GROUP", raising=False)
    return path


@pytest.fixture
def host(tmp_path):
    """Another host's shared memory, for a test that plays several hosts on this one: a store
    folder of its own (a process given it with ``SHMSYNC_DIR`` sees only that host's stores)."""
    path = tmp_path / "host-b"
    path.mkdir()
    return str(path)


@pytest.fixture
def one_ray_cluster(tmp_path_factory):
    """Held while a test runs a Ray cluster: one at a time across xdist workers (two clusters
    at once on two cores slow each other several times over)."""
    # The base temp folder's parent is shared by every xdist worker of this run.
    path = tmp_path_factory.getbasetemp().parent / "ray-cluster.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the test's timeout bounds the wait
        yield


# -- children ---------------------------------------------------------------------------------------
@pytest.fixture
def ctx():
    """The multiprocessing context the tests' children start from (the preloaded forkserver)."""
    return mp.get_context("forkserver")


class Child:
    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn

    @property
    def pid(self):
        return self.proc.pid

    def expect(self, tag, timeout=120.0):
        """The next message, which must start with ``tag``: a handshake, with a deadline that a
        busy host meets (the child is alive and working until then, or the test fails saying so)."""
        if not self.conn.poll(timeout):
            raise AssertionError(f"child {self.pid} sent nothing for {timeout}s (alive: {self.proc.is_alive()})")
        msg = self.conn.recv()
        assert msg[0] == tag, msg
        return msg[1:]


@pytest.fixture
def start(ctx):
    """``start(target, *args)`` runs ``target(*args, conn)`` in a child process; all are killed
    after the test."""
    started = []

    def _start(target, *args, daemon=True):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child), daemon=daemon)
        proc.start()
        child.close()
        started.append(proc)
        return Child(proc, parent)

    yield _start
    for proc in started:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.kill()
        proc.join(10)


def pytest_terminal_summary(terminalreporter):
    """The state counts the protocol's interleaving checker explored (recorded as "explored")."""
    lines = {
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        for name, value in getattr(report, "user_properties", ())
        if name == "explored"
    }
    if lines:
        terminalreporter.section("protocol interleavings explored")
        for line in sorted(lines):
            terminalreporter.write_line(line)
