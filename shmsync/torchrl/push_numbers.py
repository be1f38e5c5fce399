"""What version a collector's publish gets: one object decides, from a short list of sources.

In order, the first that applies:

1. **Given**: ``update_policy_weights_(version=n)`` (say, the optimizer-step count).
2. **The trainer's number of the push being applied**, on a collector that is another process's
   remote leg (a node of shmsync's distributed collectors, a Ray actor of its ``RayCollector``):
   the trainer named it before the push (:class:`Announced`), and every host's frames carry it.
   A push that arrives unnamed is an error, never a guess.
3. **The next version** of the store (``None`` here: the store counts).

Examples:
    >>> source = VersionSource()
    >>> source.decide(given=None), source.decide(given=7)
    (None, 7)
    >>> announced = Announced()
    >>> announced.name(12)
    >>> VersionSource(announced).decide(given=None)
    12
"""

from __future__ import annotations

import threading
from typing import Protocol

from shmsync.errors import ShmSyncError


class PushNumbers(Protocol):
    """Where a remote leg learns the trainer's number of the push it is applying."""

    def take(self) -> int:
        """The number of the push being applied, taken once; raises :class:`ShmSyncError` if the
        trainer named none for it."""


class Announced:
    """The trainer's number of the next push, named by the trainer just before it pushes
    (``RayCollector``: in a call Ray runs before the push). Each number is taken by one push: a
    second push with no new number is refused rather than given the old one. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._number: int | None = None

    def name(self, number: int) -> None:
        with self._lock:
            self._number = int(number)

    def take(self) -> int:
        with self._lock:
            number, self._number = self._number, None
        if number is None:
            raise ShmSyncError(
                "a push of the trainer's weights reached this collector, but the trainer named no version for it "
                "(a collector that does not number its pushes, or a push that went around the numbering): use "
                "shmsync.torchrl.distributed.RayCollector, shmsync.torchrl.distributed.DistributedSyncCollector or "
                "shmsync.torchrl.distributed.DistributedCollector"
            )
        return number


class VersionSource:
    """Decides the version of one publish (see the module's docstring for the order).

    Args:
        pushes: the trainer's numbers of the pushes this collector applies, if it is a remote leg.
    """

    def __init__(self, pushes: PushNumbers | None = None) -> None:
        self.pushes = pushes

    def decide(self, given: int | None) -> int | None:
        """The version to publish under; None for the store's next one."""
        if given is not None:
            return int(given)
        if self.pushes is not None:
            return self.pushes.take()
        return None
