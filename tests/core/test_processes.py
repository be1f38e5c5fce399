"""exit_with_parent: a child that calls it ends with its parent, however the parent dies."""

import os
import signal
import time

import psutil
import pytest

from tests.core.parents import parent_of_a_watching_child

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_exit_with_parent(start):
    parent = start(parent_of_a_watching_child, daemon=False)
    (pid,) = parent.expect("watching", timeout=120)  # the handshake: its watch has begun
    child = psutil.Process(pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.proc.join(10)
    deadline = time.monotonic() + 30  # its watch wakes every 0.2 s; a busy machine may delay it
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = _running(child)
    if outlived:  # re-parented away from us: no fixture would find it
        child.kill()
    assert not outlived, "the child outlived its parent"


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an exited child nobody reaped yet is not running)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
