"""One party's protocol objects, as the protocol's tests drive them: the classes of
:mod:`shmsync.core.protocol` on a process's words of the host bank (its own, so that a test can
hook its fences)."""

from __future__ import annotations

import time
from typing import Any

from shmsync.core.protocol import Leases, Locks, ReaderRows, SlotReader, SlotWriter, Words


class Party:
    """A reader's protocol objects (:class:`SlotReader`, :class:`ReaderRows` and :class:`Leases`) on words of its own.

    Attribute lookups go to the reader, then the leases, then the rows (``try_read``, ``lease_latest``,
    ``claim_row``, ...);
    ``fence`` and ``full_fence`` are the words' own."""

    def __init__(self, h: Any, locks: Locks, *, pid: int, ordering: str | None = None, **kwargs: Any) -> None:
        self.words = Words(h, ordering=ordering)
        self.rows = ReaderRows(h, locks, pid=pid, clock=kwargs.get("clock", time.time_ns))
        self.leases = Leases(self.words, locks)
        self.reader = SlotReader(self.words, locks, pid=pid, **kwargs)

    def __getattr__(self, name: str) -> Any:
        for obj in (self.__dict__["reader"], self.__dict__["leases"], self.__dict__["rows"]):
            if hasattr(obj, name):
                return getattr(obj, name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("fence", "full_fence"):
            setattr(self.words, name, value)
        elif name in ("outpaced",):
            setattr(self.reader, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def fence(self) -> Any:
        return self.words.fence

    @property
    def full_fence(self) -> Any:
        return self.words.full_fence


class WriterParty(Party):
    """The writer's protocol objects: :class:`SlotWriter` first, then the reader's, the rows' and the leases'."""

    def __init__(self, h: Any, locks: Locks, *, pid: int = 1, ordering: str | None = None, **kwargs: Any) -> None:
        super().__init__(h, locks, pid=pid, ordering=ordering, **kwargs)
        object.__setattr__(self, "writer", SlotWriter(self.words, self.leases, pid=pid))

    def __getattr__(self, name: str) -> Any:
        writer = self.__dict__["writer"]
        return getattr(writer, name) if hasattr(writer, name) else super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("clock", "writing"):
            setattr(self.writer, name, value)
        else:
            super().__setattr__(name, value)

    def give_back_idle(self, give_back: Any, holds_pages: Any = lambda slot: True) -> list[int]:
        """What a store does after a publish: each idle slot that holds pages marked, given back
        with ``give_back(slot)``, then aborted. Returns the slots given back."""
        given = []
        for slot in self.writer.idle_slots():
            if not holds_pages(slot):
                continue
            write = self.writer.mark(slot)
            if write is None:
                continue  # a reader leased it meanwhile
            self.writer.writing = write
            try:
                give_back(slot)
            finally:
                self.writer.abort(write)
            given.append(slot)
        return given
