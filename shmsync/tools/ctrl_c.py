"""Ctrl-C as a request to stop a training loop, never an exception in the middle of it.

A Ctrl-C in a terminal sends SIGINT to every process of the foreground group: the trainer and
each worker a collector started. By default each of them raises ``KeyboardInterrupt`` wherever it
is, inside a loss, an optimizer step or a worker's rollout, and TorchRL's cleanup code then often
fails on the half-finished state it finds, with a traceback instead of a summary. :class:`CtrlC`
turns the press into a flag that the loop reads where it can stop cleanly, and keeps the workers
out of it: processes started under :meth:`CtrlC.shielded` inherit SIGINT blocked (a blocked
signal stays blocked across ``spawn``), so only the trainer hears it, and it shuts them down.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Any

from shmsync.errors import ShmSyncError


class CtrlC:
    """Turns Ctrl-C (SIGINT) into :attr:`pressed`, inside a ``with`` block; a second press raises
    ``KeyboardInterrupt`` as usual (the user insists).

    Args:
        on_press: called once, at the first press, on the main thread (say, a trainer's
            ``request_stop``; see :meth:`when_pressed`). It must return at once.

    Examples:
        >>> import os, signal
        >>> with CtrlC() as ctrl_c:
        ...     with ctrl_c.shielded():
        ...         pass  # build the collector here: its workers never see Ctrl-C
        ...     os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C would
        ...     ctrl_c.pressed
        True
    """

    def __init__(self, on_press: Callable[[], Any] | None = None) -> None:
        self.pressed = False
        self.on_press = on_press
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is not threading.main_thread():
            raise ShmSyncError("CtrlC works on the main thread only (where Python runs signal handlers)")
        self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *_exc: Any) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def when_pressed(self, on_press: Callable[[], Any]) -> None:
        """Call ``on_press`` at the first press, or at once if Ctrl-C was pressed already (the
        trainer that should stop is often made after the block began)."""
        self.on_press = on_press
        if self.pressed:
            on_press()

    def _press(self, _signum: int, _frame: Any) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        if self.on_press is not None:
            self.on_press()

    @contextmanager
    def shielded(self) -> Iterator[None]:
        """Processes started inside the block (a collector's workers) never see Ctrl-C: they start
        with SIGINT blocked. A press meanwhile reaches this process as soon as the block ends."""
        # The first multiprocessing queue starts the resource tracker, and multiprocessing unblocks
        # SIGINT in this thread after starting it: have it running before blocking.
        resource_tracker.ensure_running()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
            if signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set()):
                warnings.warn(
                    "something in the CtrlC.shielded() block unblocked SIGINT: the processes it started "
                    "afterwards stop at a Ctrl-C on their own",
                    RuntimeWarning,
                    stacklevel=3,
                )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


__all__ = ["CtrlC"]
