"""Facts about other processes on this host: whether one is stopped, when one started. Only ever
compared and displayed: liveness comes from the kernel's locks (see :mod:`shmsync._segment`)."""

from __future__ import annotations

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
