"""The opt-in background copy (``unsafe_background_copy=True``): a publish that returns before its
copy, which reads the caller's live tensors on the store's copier thread.

It gives up the snapshot: the version is promised at once (synchronous collectors' workers wait
for it), and copied later. A write to the source that moves a version counter meanwhile (an
in-place op, an optimizer step, which also waits for the copy by itself: see
:class:`~shmsync.store.copies.Copier`) is found, and the promise withdrawn; a write through
``.data`` is not, and may be published mixed.
"""

from __future__ import annotations

import torch

from shmsync.core.protocol import Write
from shmsync.errors import ShmSyncError
from shmsync.store.copies import copy_all
from shmsync.writer.slot_copy import SlotCopy


class InBackground:
    """Publishes on the store's copier thread, for a store made with ``unsafe_background_copy``.

    Args:
        copy: the store's slot copy (its write begun here, filled and committed on the copier's thread).
    """

    def __init__(self, copy: SlotCopy) -> None:
        self.copy = copy

    def publish(self, tensors: list[torch.Tensor], version: int | None) -> int:
        """Begin the write of ``tensors`` (one per entry) and promise its version; the copy and the
        commit run on the copier's thread. Returns the version promised."""
        copy = self.copy
        write = copy.begin(version)
        copy.slot_writer.promise(write.version)
        seen = [t._version for t in tensors]  # bumped by every in-place write (an optimizer step too)
        copy.copier.submit(lambda: self._land(write, tensors, seen))
        copy.forget()
        return write.version

    def _land(self, write: Write, tensors: list[torch.Tensor], seen: list[int]) -> None:
        """On the copier's thread: the copy, then the commit, unless the source was written meanwhile."""
        copy, memory = self.copy, self.copy.memory
        try:
            copy_all(memory.slots[write.slot], tensors, True)
            memory.record_all(write.slot, write.version)
            if [t._version for t in tensors] != seen:  # written while copied: the copy is no version at all
                raise ShmSyncError(
                    f"store {memory.name!r}: the weights were written while version {write.version} was being copied "
                    "in the background, so it was not published and its promise was withdrawn; with "
                    "unsafe_background_copy=True, wait with store.flush() before writing them (an optimizer step "
                    "waits by itself), or leave it off: a publish then copies before it returns"
                )
        except BaseException:
            copy.abort(write)
            raise
        copy.finish(write)


__all__ = ["InBackground"]
