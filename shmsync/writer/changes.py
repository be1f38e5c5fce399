"""What changed in a writer's source since the store's newest version, leaf by leaf, and what
each version changed: what lets a publish copy only what changed, skip a whole version when
nothing did, and tell readers and relays which leaves each version changed. Which leaf changed,
and how the others are proved unchanged, is :mod:`shmsync.store.changes`' (the same for a
copying reader's reload).

A copy made while another thread may write the source is checked once it is done
(:meth:`SourceChanges.written_since`): every leaf, after every leaf was copied. If each leaf
still holds the bytes it was copied with, no write reached any leaf between its copy and its
check, and all those windows contain the moment between the last copy and the first check: the
slot holds the source's memory as it was at that moment. A comparison cannot see a write that
changes a leaf and puts its exact bytes back within that window; the written pages can. What
neither can tell is where another thread stands in a write of its own: one that sat between two
tensors of an optimizer step for the whole window is caught there, one tensor stepped and the other
not. That is why a collector's hand-out publishes only updates made by the thread that iterates it
(:mod:`shmsync.torchrl.freshness`). Where no other thread can run
(:func:`others_may_write`), a copy needs no check.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass
from types import FrameType

import torch

from shmsync.store.changes import LeafWatch


def others_may_write() -> bool:
    """Whether a thread of this process other than the caller may write a source while the caller
    copies it: any thread that runs Python code, or that Python's ``threading`` knows of, but the
    caller, shmsync's own (each named ``shmsync-...``) and the standard library's multiprocessing
    threads (a queue's feeder, the resource sharer: TorchRL's collectors start them), none of which
    writes a tensor's bytes. Torch's own worker threads write only for an operation some such
    thread started. Where this says False, a copy made by the caller is a snapshot without a check.

    Examples:
        >>> import threading
        >>> done = threading.Event()
        >>> writer = threading.Thread(target=done.wait)
        >>> writer.start()
        >>> others_may_write()
        True
        >>> done.set(); writer.join()
    """
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    frames = sys._current_frames()
    return any(
        i != me and not names.get(i, "").startswith("shmsync-") and not _started_by_multiprocessing(frames.get(i))
        for i in {*names, *frames}
    )


_MULTIPROCESSING = os.path.dirname(multiprocessing.__file__)


def _started_by_multiprocessing(frame: FrameType | None) -> bool:
    """Whether the thread whose top frame is ``frame`` runs a function of the standard library's
    multiprocessing package (the function its ``Thread.run`` called, not one it calls later)."""
    callee = None
    while frame is not None:
        if frame.f_code.co_filename == threading.__file__ and frame.f_code.co_name == "run":
            return callee is not None and os.path.dirname(callee.f_code.co_filename) == _MULTIPROCESSING
        callee, frame = frame, frame.f_back
    return False


class SourceChanges:
    """Which leaves of a store's source differ from its newest version, for one writer, and the
    version each leaf last changed at.

    Args:
        size: the number of leaves (the layout's entries).

    Attributes:
        changed_at: per leaf, the version it last changed at (-1: not known; copy it).

    Examples:
        >>> import torch
        >>> changes = SourceChanges(2)
        >>> source = [torch.zeros(4), torch.ones(1 << 16)]
        >>> held = [t.clone() for t in source]
        >>> changes.find(source, held, "publish")
        [False, False]
        >>> source[1].data[7] = 2.0  # through .data: torch's version counter does not move
        >>> changes.find(source, held, "publish")
        [False, True]
    """

    def __init__(self, size: int) -> None:
        self.watch = LeafWatch(size)
        self.changed_at = [-1] * size
        # Per leaf, whether it may differ from the newest version although none of its pages was
        # written since the last look (a look found it changed, and no publish followed).
        self._dirty = [True] * size

    def find(self, source: list[torch.Tensor], held: list[torch.Tensor] | None, moment: str) -> list[bool]:
        """Per leaf, whether ``source[i]`` differs in any byte from ``held[i]``, the newest
        version's slot (None: there is none yet, everything differs), looked at ``moment`` (a kind
        of publish: see :mod:`shmsync.store.changes`). The leaves to track until the next look are
        tracked before this returns: copy them after it."""
        watch, dirty = self.watch, self._dirty
        looked: dict = {}
        if held is None:
            found = [True] * len(source)
        else:
            looked = watch.pages_written(source)
            # Tracked, the newest version's bytes at its last look: only the bytes on pages written
            # since can differ (none written: unchanged, nothing read).
            which = [
                (i, held[i], None if dirty[i] else looked.get(i))
                for i in range(len(source))
                if dirty[i] or looked.get(i) != []
            ]
            differ = watch.differing(source, which)
            found = [i in differ for i in range(len(source))]
        self._dirty = list(found)
        watch.settle(source, found, moment, looked)
        return list(found)

    def written_since(self, source: list[torch.Tensor], copied: list[torch.Tensor]) -> list[int]:
        """After a copy of ``source`` into ``copied`` (right after :meth:`find`, or after the last
        check of a copy that failed): the leaves a write reached meanwhile, which no longer hold
        what ``copied`` holds of them. Empty: the copy holds one moment of the source.

        A leaf written since :meth:`find` found it unchanged is in the slot as it was before that
        write (it was not copied), so the caller copies it at its next attempt: this check looks
        only at what was written since the one before it.
        """
        looked = self.watch.pages_written(source)
        which = []
        for i in range(len(source)):
            spans = looked.get(i)
            if spans and self.watch.inside(i, spans):
                self._dirty[i] = True  # the look cleared their record: keep it here
            if spans != []:
                which.append((i, copied[i], spans))
        return sorted(self.watch.differing(source, which))

    def published(self, version: int, before: int, changed: list[bool]) -> None:
        """The source is ``version`` now, ``changed`` per leaf since ``before`` (the newest version
        :meth:`find` compared it with, -1 if none): those changed at ``version``, the others hold
        what they held at ``before`` at the latest, and none differs from the newest version any
        more."""
        at = self.changed_at
        for i, differs in enumerate(changed):
            if differs:
                at[i] = version
            elif at[i] < 0:
                at[i] = before  # known from now on: the same bytes as that version's
        self._dirty = [False] * len(at)

    def forget(self) -> None:
        """A version was published by other means (bytes from elsewhere): nothing is known."""
        self.changed_at = [-1] * len(self.changed_at)
        self._dirty = [True] * len(self.changed_at)

    def replaced(self, version: int) -> None:
        """``version`` was published whole from bytes from elsewhere: every leaf counts as changed at
        it (exact: a slot holding an older version lacks every leaf, one holding it lacks none), and
        the source, whatever it holds, is compared at its next publish."""
        self.changed_at = [version] * len(self.changed_at)
        self._dirty = [True] * len(self.changed_at)

    def published_delta(self, version: int, base: int, changed: list[int]) -> None:
        """``version`` was published from bytes from elsewhere that differ from ``base`` (the newest
        version before it) only in the leaves ``changed``: those changed at ``version``; the others
        hold ``base``'s bytes (known from now on where they were not); the source is compared at its
        next publish."""
        at = self.changed_at
        for i in changed:
            at[i] = version
        for i, a in enumerate(at):
            if a < 0:
                at[i] = base
        self._dirty = [True] * len(at)

    def close(self) -> None:
        """Stop tracking."""
        self.watch.close()


@dataclass(frozen=True)
class Delta:
    """What one version changed: the leaves whose bytes may differ from ``base``'s, the store's
    newest version right before ``version`` (every other leaf holds ``base``'s bytes exactly)."""

    version: int
    base: int
    leaves: tuple[int, ...]
