"""Facts about other processes on this host: whether one is stopped, when one started (only ever
compared and displayed: liveness comes from the kernel's locks, see :mod:`shmsync.core.segment`);
and ending a worker process with its parent, so no reader outlives the trainer that fed it."""

from __future__ import annotations

import functools
import os
import threading
import time

import psutil


def pid_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger); False for 0 or a running one."""
    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def process_start_ns(pid: int) -> int:
    """Start time of ``pid`` in ns (0 if it does not exist): tells a reused pid apart."""
    try:
        return int(psutil.Process(pid).create_time() * 1e9)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


@functools.cache
def _own_start_ns(pid: int) -> int:
    return process_start_ns(pid)


def own_start_ns() -> int:
    """This process's start time in ns (asked once per process)."""
    return _own_start_ns(os.getpid())


_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-sleep",
    "T": "stopped",
    "t": "tracing-stop",
    "Z": "zombie",
    "X": "dead",
    "x": "dead",
    "I": "idle",
    "P": "parked",
    "W": "waking",
    "K": "wake-kill",
}


@functools.cache
def _ticks() -> tuple[float, float]:
    """(boot time in s, clock ticks per s), as psutil computes a process's start time from them."""
    return psutil.boot_time(), float(os.sysconf("SC_CLK_TCK"))


def process_state(pid: int, start_ns: int = 0) -> str:
    """Process ``pid``'s state as psutil names it (``running``, ``sleeping``, ``stopped``,
    ``zombie``...), ``gone`` if there is no such process, or ``unknown`` if its start time is not
    ``start_ns`` (when given): the pid was reused, or belongs to another PID namespace. One read
    of ``/proc/PID/stat`` (a pid is input: only a positive int is looked up)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return "unknown"
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "unknown"
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return "unknown"
    finally:
        os.close(fd)
    # "pid (comm) S ...": comm may hold anything, so the fields start after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return "unknown"
    if start_ns:
        boot, ticks = _ticks()
        started = int((boot + int(fields[19]) / ticks) * 1e9)
        if abs(started - start_ns) > 20_000_000:
            return "unknown"
    return _STATES.get(fields[0].decode(errors="replace"), "unknown")


def process_uss(pid: int) -> int | None:
    """Process ``pid``'s private memory in bytes (its unique set size), None if it cannot be read."""
    try:
        return int(psutil.Process(pid).memory_full_info().uss)
    except (psutil.Error, OSError):
        return None


def exit_with_parent(parent_pid: int | None = None, *, period: float = 0.2, exit_code: int = 3) -> threading.Thread:
    """End this process within ``period`` seconds of its parent's death.

    A plain :class:`~shmsync.WeightReader` in a child process keeps polling a store nobody
    publishes to when the trainer dies (``shmsync ls`` then shows the store "orphaned"). Call
    this first thing in such a child: a daemon thread watches for the process being handed to
    another parent and exits it with ``os._exit(exit_code)`` (no clean-up runs; attached stores
    need none). TorchRL's collectors and :mod:`shmsync.workers` do this already.

    Args:
        parent_pid: the process to outlive no longer. Default: the current parent.
        period: seconds between checks (one ``getppid()`` each).
        exit_code: the exit status of this process when the parent is gone.

    Returns:
        The watching thread (a daemon; it never returns while the parent lives).

    Examples:
        >>> from shmsync import exit_with_parent
        >>> exit_with_parent().daemon  # in a worker process, before its loop
        True
    """
    parent = os.getppid() if parent_pid is None else parent_pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        os._exit(exit_code)

    thread = threading.Thread(target=watch, name="shmsync-exit-with-parent", daemon=True)
    thread.start()
    return thread
