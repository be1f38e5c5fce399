"""Who may write a store: the writer role.

One process at a time writes a store. The role is a kernel lock on the store's file (other
processes see it, on any PID namespace; the kernel drops it when the holder dies), and within the
holder, one thread at a time writes (a lock every write takes). A process that takes the role from
a writer that died withdraws the promise that writer may have left: its copy will never land.
"""

from __future__ import annotations

import threading
from typing import Any

from shmsync.core.header import W_PROMISED, W_VERSION, W_WRITER_PID
from shmsync.core.protocol import SlotWriter
from shmsync.core.segment import WRITER_LOCK
from shmsync.errors import ArgumentTypeError, InvalidArgumentError, WriterBusyError
from shmsync.store.memory import StoreMemory
from shmsync.writer.steps import OptimizerSteps


class WriterRole:
    """This process's right to write one store, and the one write at a time among its threads.

    Args:
        memory: the store's mapping in this process.
        slot_writer: the host bank's slot writer (a dead writer's promise is withdrawn through it).
        steps: the optimizer steps counted for the store: counted from the moment the role is held.

    Attributes:
        lock: taken by every write, whichever thread makes it.
        holding: whether this process holds the role.

    Examples:
        >>> import torch
        >>> from shmsync import WeightStore
        >>> with WeightStore.create(torch.nn.Linear(2, 2)) as store:  # the creator takes the role
        ...     role = store.writer.role
        ...     before = role.holding
        ...     store.release_writer()
        ...     before, role.holding
        (True, False)
    """

    def __init__(self, memory: StoreMemory, slot_writer: SlotWriter, steps: OptimizerSteps) -> None:
        self.memory, self.slot_writer, self.steps = memory, slot_writer, steps
        self.lock = threading.Lock()
        self.holding = False

    @property
    def promised(self) -> int:
        """The newest promised version: a version a write names must be higher."""
        h = self.memory.header
        return max(h[W_VERSION], h[W_PROMISED])

    def claim(self, version: int | None) -> None:
        """How every write begins, under :attr:`lock`: the store still open here, ``version`` (when
        one is named) higher than every version promised, the role held.

        Raises:
            ClosedError: this process closed the store.
            InvalidArgumentError, ArgumentTypeError: ``version`` is not an int above the last one.
            WriterBusyError: another live process holds the role.
        """
        if self.memory.closed:  # one word read on the trainer's path: the call only to raise
            self.memory.check_open()
        if version is not None:
            check_version(version, self.promised, self.memory.name)
        if not self.holding:
            self.acquire()

    def acquire(self) -> None:
        """Take the role (never waits), withdrawing a promise a dead writer left.

        Raises:
            WriterBusyError: another live process holds it.
        """
        memory = self.memory
        if not memory.segment.lock(WRITER_LOCK, exclusive=True, wait=False):
            raise WriterBusyError(
                f"store {memory.name!r} is being published by another process (last writer pid "
                f"{memory.header[W_WRITER_PID]}); one process publishes at a time: publish from "
                "that process, or call release_writer()/close() there first"
            )
        memory.map_slots()
        self.holding = True
        self.steps.start()
        self.slot_writer.withdraw()  # a promise a dead writer left: it will never land

    def release(self) -> None:
        """Give the role up (the caller made sure this process's writes landed)."""
        if self.holding:
            self.memory.segment.unlock(WRITER_LOCK)
            self.holding = False


def check_version(version: Any, last: int, store: str = "") -> None:
    """Raise unless ``version`` is an int higher than ``last`` (the store's newest promised
    version; -1 for a store's first version): the one check of a version a caller names.

    Examples:
        >>> check_version(3, 2)
        >>> check_version(2, 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        shmsync.errors.InvalidArgumentError: version 2 is not higher than the last published version 2; ...
    """
    where = f"store {store!r}: " if store else ""
    if isinstance(version, bool) or not isinstance(version, int):
        raise ArgumentTypeError(f"{where}version must be an int, got {type(version).__name__}")
    if version <= last:
        raise InvalidArgumentError(
            f"{where}version {version} is not higher than the last published version {last}; versions only go up"
            if last >= 0
            else f"{where}version must be an int >= 0, got {version!r}"
        )


__all__ = ["WriterRole", "check_version"]
