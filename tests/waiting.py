"""Waiting on a condition with a deadline: a handshake's poll, never a fixed sleep.

A deadline bounds how long a broken run takes to fail; it costs nothing when things work. So each
is set for a loaded host, not a quiet one: :data:`START_S` for a process that must start an
interpreter and import torch and TorchRL before it can answer (11 s for torch alone beside two
CPU-bound loops on 2 cores, where 2 s do on a quiet host).
"""

from __future__ import annotations

import time
from collections.abc import Callable

START_S = 180.0  # seconds a fresh interpreter (torch, TorchRL, an environment) may take to answer


def wait_for(
    condition: Callable[[], bool],
    timeout: float = 30.0,
    what: str = "condition",
    alive: Callable[[], bool] | None = None,
) -> None:
    """Return once ``condition()`` is true; AssertionError after ``timeout`` seconds, or at once
    when ``alive()`` (say, that the process being waited on still runs) turns false."""
    deadline = time.monotonic() + timeout
    while not condition():
        if alive is not None and not alive():
            raise AssertionError(f"gave up waiting for {what}: what it waited on is gone")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# Seconds after which a call that returns at once when things work is stuck: a deadline that only
# a hang reaches, on a host as loaded as the suite's (where the same call takes a second at most).
STUCK_S = 60.0
