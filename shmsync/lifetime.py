"""Ending a worker process with its parent, so no reader outlives the trainer that fed it."""

from __future__ import annotations

import os
import threading
import time


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
