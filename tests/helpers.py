"""Helpers shared by the tests (module-level, so spawned children can import them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def open_fds() -> set[int]:
    """This process's open file descriptors."""
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Return once ``condition()`` is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def cli(*args: str, env: dict | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m shmsync.cli ARGS``; its result (asserting exit 0 with ``check``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "shmsync.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def use_store_dir(path: str) -> None:
    """Make this process look for stores in ``path`` (a test's own ``SHMSYNC_DIR``)."""
    from shmsync import _segment

    _segment.SHM_DIR = path


def hold_store(store_dir: str, name: str, zero_copy: bool, conn) -> None:
    """Attach to ``name`` in ``store_dir`` and load it (``zero_copy``: leasing its latest slot);
    report ``("holding", viewing, version)``, then wait to be killed."""
    use_store_dir(store_dir)
    import torch

    from shmsync import WeightReader, WeightStore

    store = WeightStore.attach(name)
    reader = WeightReader(store, torch.nn.Linear(64, 64), zero_copy=zero_copy)
    reader.poll()
    conn.send(("holding", reader.viewing, reader.version))
    time.sleep(3600)


def create_in_dir_and_hang(store_dir: str, name: str, conn) -> None:
    """Create store ``name`` in ``store_dir`` (this process its creator), then wait to be killed."""
    use_store_dir(store_dir)
    import torch

    from shmsync import WeightStore

    WeightStore.create(torch.nn.Linear(64, 64), name=name, unlink_at_exit=False)
    conn.send(("created",))
    time.sleep(3600)


def canary(conn) -> None:
    """A process that records every catchable signal it gets; answers "report" with the list."""
    import signal

    received = []
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(sig, lambda s, _frame: received.append(int(s)))
            except (OSError, ValueError):
                pass
    conn.send(("ready", os.getpid()))
    while True:
        if conn.poll(0.05) and conn.recv() == "report":
            conn.send(("received", received))
