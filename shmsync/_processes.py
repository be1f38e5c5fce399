"""Facts about other processes on this host, as the protocol needs them (alive, stopped)."""

from __future__ import annotations

import psutil


def pid_alive(pid: int, start_ns: int = 0) -> bool:
    """Whether ``pid`` runs (a zombie does not) and, if ``start_ns`` is given, is the same
    process (not a reused pid). A process we may not inspect counts as alive."""
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if start_ns and abs(int(proc.create_time() * 1e9) - start_ns) > 50_000_000:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


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
