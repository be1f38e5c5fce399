import fcntl
import multiprocessing as mp
import os
import signal

# Ray swaps a node address of 127.0.0.1 for the host's network address, and binds its servers
# there, unless it runs as a single-node cluster: keep every server the tests start on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray starts its workers at niceness 15: beside other CPU-bound work they get a few percent of a
# core and an actor takes minutes to import torch. The tests want them on equal terms.
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest

from shmsync.core import segment
from shmsync.testing import stores_created_by


@pytest.fixture(autouse=True)
def _no_leaks(shm_leak_check):
    """Every test must leave no store and no child process behind."""
    yield


@pytest.fixture(scope="session", autouse=True)
def _suite_leaves_no_store():
    before = set(segment.list_names())
    yield
    left = stores_created_by({os.getpid()}) - before
    assert not left, f"the suite left stores in {segment.SHM_DIR}: {sorted(left)}"


@pytest.fixture
def one_ray_cluster(tmp_path_factory):
    """Held while a test runs a Ray cluster: one at a time across xdist workers (two clusters
    at once on two cores slow each other several times over)."""
    # The base temp folder's parent is shared by every xdist worker of this run.
    path = tmp_path_factory.getbasetemp().parent / "ray-cluster.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the test's timeout bounds the wait
        yield


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


class Child:
    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn

    @property
    def pid(self):
        return self.proc.pid

    def expect(self, tag, timeout=60.0):
        """The next message, which must start with ``tag``."""
        if not self.conn.poll(timeout):
            raise AssertionError(f"child {self.pid} sent nothing for {timeout}s (alive: {self.proc.is_alive()})")
        msg = self.conn.recv()
        assert msg[0] == tag, msg
        return msg[1:]


@pytest.fixture
def start(ctx):
    """``start(target, *args)`` runs ``target(*args, conn)`` in a spawned child; all are killed after the test."""
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
