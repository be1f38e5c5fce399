"""One version copied into a free slot of a store's host bank, and committed: the one copy every
way of publishing shares (a module or TensorDict, a relay's whole version, a relay's delta, the
opt-in background copy). What a slot lacks is what changed since the version it holds::

    write = begin(version)      a slot no reader uses, and the version it held (core.protocol)
    copy what it lacks          the leaves changed since the newest version, and those changed
                                since the version the slot held (all of them, into an empty slot)
    its records                 per leaf, the version it last changed at (core.header): what a
                                copying reader or a relay sends on
    finish(write)               the commit (the version and the latest slot: two words); the
                                listeners told, the idle slots given back on the copier's thread

Nothing is called back: each intake's copy is a method here, begun, filled and committed in line.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shmsync.core.header import (
    STORE_PAGE_LOCKED,
    W_COPIED_BYTES,
    W_PROOF,
    W_SKIPPED_BYTES,
    W_STORE_FLAGS,
    Proof,
)
from shmsync.core.protocol import SlotWriter, Write
from shmsync.errors import InvalidArgumentError, WrittenWhileCopiedError
from shmsync.store.copies import Copier, copy_all
from shmsync.store.memory import RECHECK_EMPTY_S, StoreMemory
from shmsync.writer.changes import Delta, SourceChanges

KEPT_DELTAS = 8  # versions whose delta a writer keeps: a relay sends the newest, the one it just took
COPY_ATTEMPTS = 3  # copies a checked copy tries before it gives up on a source being written


class SlotCopy:
    """Copies versions into the free slots of one store's host bank and commits them, for the
    process that holds the writer role.

    Args:
        memory: the store's mapping in this process.
        slot_writer: the host bank's slot writer.
        copier: the store's background thread (the give-backs run there).
        changes: what changed in the source since the newest version, and when each leaf last changed.

    Attributes:
        deltas: what each of the last :data:`KEPT_DELTAS` versions changed (a relay sends only
            that), noted before each commit, so that whoever sees a version finds its delta.
        listeners: called with each version this process commits, on the committing thread.
    """

    def __init__(self, memory: StoreMemory, slot_writer: SlotWriter, copier: Copier, changes: SourceChanges) -> None:
        self.memory, self.slot_writer, self.copier, self.changes = memory, slot_writer, copier, changes
        self.deltas: collections.OrderedDict[int, Delta] = collections.OrderedDict()
        self.listeners: list[Callable[[int], None]] = []
        layout = memory.layout
        # The entries holding bytes of their own (a tied entry shares its owner's): what is copied.
        self.owners, self.tied = layout.owners, layout.tied
        self.position = {entry: k for k, entry in enumerate(self.owners)}
        self.nbytes = [layout.entries[i].nbytes for i in self.owners]
        self._empty: dict[int, float] = {}  # slots seen holding no pages, and when

    # -- the intakes ----------------------------------------------------------------------------
    def copy_source(self, tensors: list[torch.Tensor], found: list[bool], version: int | None, checked: bool) -> int:
        """Publish ``tensors`` (one per entry with bytes of its own), of which ``found`` changed
        since the newest version. ``checked``: another thread may write them meanwhile, so a copy
        is committed only if, once made, every leaf still holds what it was copied with
        (:meth:`~shmsync.writer.changes.SourceChanges.written_since`); else it is made again,
        :data:`COPY_ATTEMPTS` times in all.

        The records, for the readers (see :mod:`shmsync.core.header`): a leaf found changed changed
        at the version written; one not found changed holds the newest version's bytes, so changed
        at its ``changed_at`` (or, not known, at that newest version, which can only overstate it).
        A leaf the slot did not lack keeps its record: it held the same bytes at the version the slot
        held and at every version since, so the version its record names stays a bound.

        Raises:
            WrittenWhileCopiedError: each attempt was written while it was made; nothing published.
        """
        memory, changes = self.memory, self.changes
        before = memory.header[memory.host.version]
        for _ in range(COPY_ATTEMPTS if checked else 1):
            write = self.begin(version)
            try:
                copied, reached = self._fill(write, tensors, found, before, checked)
            except BaseException:
                self.abort(write)
                raise
            if reached:  # written since found unchanged: the next attempt copies them too
                self.abort(write)
                for k in reached:
                    found[k] = True
                continue
            self._note(write, copied, changes.watch.proof, before, found)
            version = self.finish(write)
            changes.published(version, before, found)
            return version
        raise WrittenWhileCopiedError(
            f"store {memory.name!r}: the weights were written while they were being copied, "
            f"{COPY_ATTEMPTS} times in a row; nothing was published"
        )

    def _fill(
        self, write: Write, tensors: list[torch.Tensor], found: list[bool], before: int, checked: bool
    ) -> tuple[int, list[int]]:
        """Inside ``write``: copy what its slot lacks of ``tensors``, and their records. Returns the
        bytes copied, and (``checked``) the leaves a write reached meanwhile."""
        memory, owners, at = self.memory, self.owners, self.changes.changed_at
        held, dst = write.held, memory.slots[write.slot]
        lacks = [k for k, f in enumerate(found) if f or held < 0 or not 0 <= at[k] <= held]
        if lacks:  # none where nothing changed since the version the slot holds
            copy_all([dst[owners[k]] for k in lacks], [tensors[k] for k in lacks], True)
        base, records = write.slot * len(memory.layout.entries), memory.records
        for k in lacks:  # inside the write: its sequence number covers them as it covers the bytes
            records[base + owners[k]] = write.version if found[k] else at[k] if at[k] >= 0 else before
        reached = self.changes.written_since(tensors, [dst[i] for i in owners]) if checked else []
        return sum(self.nbytes[k] for k in lacks), reached

    def copy_bytes(self, fill: Callable[[memoryview, Write], None], version: int) -> int:
        """Publish a whole version that ``fill(buffer, write)`` writes into the slot (see
        :meth:`~shmsync.WeightStore.publish_bytes`): every leaf changed at it."""
        memory = self.memory
        write = self.begin(version, steps=-1)  # bytes from elsewhere: no training seen here
        try:
            with memory.slot_buffer(write.slot, writable=True) as buffer:
                fill(buffer, write)
            memory.record_all(write.slot, write.version)  # what changed is not known here
        except BaseException:
            self.abort(write)
            raise
        version = self.finish(write)
        self.forget()
        self.changes.replaced(version)  # every leaf changed at it: the next delta copies what a slot lacks
        return version

    def copy_delta(self, data: Any, version: int, base: int, leaves: Sequence[int]) -> int:
        """Publish ``version``, which differs from ``base`` (the newest version) only in ``leaves``,
        whose bytes ``data`` holds (see :meth:`~shmsync.WeightStore.publish_delta`); from the newest
        version's slot, only what the slot lacks of the rest.

        Raises:
            InvalidArgumentError: ``base`` is not the newest version, or ``leaves`` and ``data`` do
                not fit the layout; nothing is written.
        """
        memory = self.memory
        entries, h = memory.layout.entries, memory.header
        changed = check_delta(entries, data, leaves, memory.name)
        if base < 0 or base != h[memory.host.version]:
            raise InvalidArgumentError(
                f"store {memory.name!r}: a delta from version {base}, but the newest version here is "
                f"{h[memory.host.version]}; only a delta from the newest version can be published "
                "(else the whole version)"
            )
        wrote = {self.position[i] for i in changed}
        write = self.begin(version, steps=-1)  # bytes from elsewhere: no training seen here
        try:
            copied = self._fill_delta(write, changed, wrote, _bytes_tensor(data), h[memory.host.latest], base)
        except BaseException:
            self.abort(write)
            raise
        self._note(write, copied, Proof.DELTA, base, [k in wrote for k in range(len(self.owners))])
        version = self.finish(write)
        self.changes.published_delta(version, base, sorted(wrote))
        return version

    def _fill_delta(
        self, write: Write, changed: tuple[int, ...], wrote: set[int], incoming: torch.Tensor, newest: int, base: int
    ) -> int:
        """Inside ``write``: the delta's leaves from ``incoming``, what the slot lacks of the rest
        from the newest version's slot, and their records. Returns the bytes copied."""
        memory, owners, at = self.memory, self.owners, self.changes.changed_at
        entries, held = memory.layout.entries, write.held
        dst, src = memory.slot_bytes(write.slot), memory.slot_bytes(newest)
        # By position among the entries with bytes of their own (those a delta names).
        lacks = [k for k in range(len(owners)) if k not in wrote and (held < 0 or not 0 <= at[k] <= held)]
        targets, sources, offset = [], [], 0
        for i in changed:  # the delta's bytes, one leaf after the other
            e = entries[i]
            targets.append(dst[e.offset : e.offset + e.nbytes])
            sources.append(incoming[offset : offset + e.nbytes])
            offset += e.nbytes
        for k in lacks:  # what the slot lacks of the rest: the newest version's bytes
            e = entries[owners[k]]
            targets.append(dst[e.offset : e.offset + e.nbytes])
            sources.append(src[e.offset : e.offset + e.nbytes])
        if targets:
            copy_all(targets, sources, True)
        first = write.slot * len(entries)
        for i in changed:  # the records: the delta's leaves changed at this version...
            memory.records[first + i] = write.version
        for k in lacks:  # ...the rest hold the newest version's bytes, so changed when it says
            memory.records[first + owners[k]] = at[k] if at[k] >= 0 else base
        return offset + sum(self.nbytes[k] for k in lacks)

    # -- begin, finish, abort -------------------------------------------------------------------
    def begin(self, version: int | None, steps: int | None = None) -> Write:
        """Begin a write of ``version`` (None: the next) into a slot no reader uses, its pages
        there (a slot given back has them again, or the write fails cleanly)."""
        write = self.slot_writer.begin_write(version) if steps is None else self.slot_writer.begin_write(version, steps)
        if write.held < 0:
            try:
                self.memory.reserve(write.slot)
            except BaseException:
                self.abort(write)
                raise
            self._empty.pop(write.slot, None)
        return write

    def finish(self, write: Write) -> int:
        """Make ``write`` the newest version; tell the listeners; have the idle slots given back
        off this thread (the next write waits for that before it begins). Returns the version."""
        version = self.slot_writer.commit(write)
        for listener in self.listeners:
            listener(version)
        if not self.memory.header[W_STORE_FLAGS] & STORE_PAGE_LOCKED:  # else the device reads the pages it locked
            self.copier.submit(self.give_back_idle, guards_sources=False)
        return version

    def abort(self, write: Write) -> None:
        """Drop ``write`` and withdraw its promise: no reader waits for a version that will not land."""
        self.slot_writer.abort(write)
        self.slot_writer.withdraw()

    def forget(self) -> None:
        """The version just published copied every leaf, by other means than :meth:`copy_source`
        (from CUDA, in the background, bytes from a relay): no delta and no history holds."""
        h = self.memory.header
        h[W_COPIED_BYTES], h[W_SKIPPED_BYTES], h[W_PROOF] = self.memory.layout.payload_bytes, 0, Proof.NONE.word
        self.deltas.clear()
        self.changes.forget()

    def _note(self, write: Write, copied: int, proof: Proof, before: int, found: Sequence[bool]) -> None:
        """Inside ``write``, before its commit: what it copied and skipped, and how it proved the
        rest, in the header; what it changed since ``before``, in :attr:`deltas` (whoever sees
        the version sees its delta); tied entries' records, their owners'."""
        memory = self.memory
        h, records, first = memory.header, memory.records, write.slot * len(memory.layout.entries)
        for entry, owner in self.tied.items():  # a tied entry's bytes are its owner's
            records[first + entry] = records[first + owner]
        h[W_COPIED_BYTES] = copied
        h[W_SKIPPED_BYTES], h[W_PROOF] = memory.layout.payload_bytes - copied, proof.word
        self.deltas[write.version] = Delta(
            write.version, before, tuple(self.owners[k] for k, f in enumerate(found) if f)
        )
        if len(self.deltas) > KEPT_DELTAS:
            self.deltas.popitem(last=False)

    # -- idle slots -----------------------------------------------------------------------------
    def give_back_idle(self) -> None:
        """Give back the memory of the slots no reader can use (see ``SlotWriter.idle_slots``).
        Slots given back lately stay empty, unless a late reader's copy refilled them: they are
        looked at again now and then only."""
        memory, slot_writer = self.memory, self.slot_writer
        now, empty, h = time.monotonic(), self._empty, memory.header
        # Where the last publish copied less than it skipped, a slot holding a version saves more
        # copying than its memory costs: keep the next write's warm.
        keep_warm = h[W_SKIPPED_BYTES] > h[W_COPIED_BYTES]
        idle = [s for s in slot_writer.idle_slots(keep_warm) if now - empty.get(s, -RECHECK_EMPTY_S) >= RECHECK_EMPTY_S]
        try:
            for slot in idle:
                if not memory.holds_pages(slot):
                    empty[slot] = now
                    continue
                write = slot_writer.mark(slot)
                if write is not None:  # else a reader leased it meanwhile
                    try:
                        if memory.give_back(slot):
                            empty[slot] = now
                    finally:
                        slot_writer.abort(write)
        except OSError as e:
            # The version is already visible: a slot that keeps its memory costs memory, not correctness.
            warnings.warn(f"store {memory.name!r}: unused slots keep their memory ({e})", RuntimeWarning, stacklevel=2)


def check_delta(entries: Sequence[Any], data: Any, leaves: Any, store: str) -> tuple[int, ...]:
    """The leaves of a delta, checked against the layout's ``entries``: indices in range, each
    once, in order, none tied to another, and ``data`` exactly their bytes. Raises
    InvalidArgumentError naming the first thing that is off (a delta comes from a peer: nothing is
    sized from it before this)."""
    where = f"store {store!r}: a delta"
    if not isinstance(leaves, (list, tuple)) or len(leaves) > len(entries):
        raise InvalidArgumentError(f"{where}'s leaves must be a list of at most {len(entries)} indices")
    last = -1
    for i in leaves:
        if isinstance(i, bool) or not isinstance(i, int) or not last < i < len(entries):
            why = "out of range" if isinstance(i, int) and not 0 <= i < len(entries) else "not in increasing order"
            raise InvalidArgumentError(
                f"{where} names leaf {str(i)[:20]} after leaf {last}: {why} (the store has {len(entries)} leaves, "
                "each named once, in order)"
            )
        if entries[i].tied >= 0:
            raise InvalidArgumentError(
                f"{where} names leaf {i}, which is tied to leaf {entries[i].tied}: it holds no bytes of its own"
            )
        last = i
    want, got = sum(entries[i].nbytes for i in leaves), memoryview(data).nbytes
    if got != want:
        raise InvalidArgumentError(f"{where} of {got} bytes, where its {len(leaves)} leaves hold {want} bytes")
    return tuple(leaves)


def _bytes_tensor(data: Any) -> torch.Tensor:
    """``data`` (bytes-like) as a flat uint8 tensor on its memory."""
    view = memoryview(data).cast("B")
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read only here: torch warns of buffers it could write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


__all__ = ["COPY_ATTEMPTS", "KEPT_DELTAS", "SlotCopy", "check_delta"]
