"""The weight store: versioned copies of a model's weights in shared memory, and publishing into it.

One publish, on the trainer's thread (:meth:`WeightStore.publish`, then :meth:`StoreWriter.write`)::

    tensors = the source matched against the layout     (shmsync.store.sources)
    write = slot_writer.begin_write(version)           (shmsync.core.protocol: a slot no reader uses,
                                                        and the version it will hold)
    copy the tensors into the slot                     (shmsync.store.copies)
    slot_writer.commit(write)                          (the version and the latest slot: two words)
    give back the slots no reader can use              (on the copier's thread: idle_slots, their pages)

A version is a snapshot: ``publish()`` returns once the weights are copied into the slot (from
CPU tensors), or once the copy is enqueued on the trainer's current CUDA stream (from CUDA tensors,
:mod:`shmsync.writer.cuda`), so that any later write of the source reaches no version. Only the
opt-in ``unsafe_background_copy=True`` returns before the bytes are copied: the copy, the commit
and the give-backs then run on the store's :class:`~shmsync.store.copies.Copier` thread, reading
the caller's live tensors.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from shmsync.core.header import (
    STORE_PAGE_LOCKED,
    W_COPIED_BYTES,
    W_PAYLOAD_BYTES,
    W_PROMISED,
    W_PROOF,
    W_SKIPPED_BYTES,
    W_STEPS,
    W_STORE_FLAGS,
    W_VERSION,
    W_WRITER_PID,
    Proof,
)
from shmsync.core.protocol import Leases, ReaderRows, SlotReader, SlotWriter, Write, steps_of
from shmsync.core.segment import WRITER_LOCK, Segment, default_name
from shmsync.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    ShmSyncError,
    WriterBusyError,
    WrittenWhileCopiedError,
    warn_deprecated,
)
from shmsync.store.copies import Copier, copy_all
from shmsync.store.layout import Layout
from shmsync.store.memory import RECHECK_EMPTY_S, StoreMemory
from shmsync.store.reader_table import ReaderTable, RemoteSources, assemble, local_rows
from shmsync.store.sources import SourceMatcher, as_tensordict
from shmsync.writer.changes import Delta, SourceChanges, others_may_write
from shmsync.writer.steps import OptimizerSteps

KEPT_DELTAS = 8  # versions whose delta a writer keeps: a relay sends the newest, the one it just took
COPY_ATTEMPTS = 3  # copies publish_if_changed tries before it gives up on a source being written


class Snapshot(NamedTuple):
    """A private copy of one complete version."""

    version: int
    weights: TensorDict


class StoreWriter:
    """This process's writing into one store: the slot writer of its host bank, the check of each
    source against the layout, the background copier, the CUDA writer, and the give-backs. Held by
    a :class:`WeightStore` (its ``writer``), whose publishing methods call it; nothing else does.

    Args:
        memory: the store's mapping in this process.
        leases: the leases of its host bank (asked whether a slot is leased).
    """

    def __init__(self, memory: StoreMemory, leases: Leases) -> None:
        self.memory = memory
        self.name = memory.name
        self.slot_writer = SlotWriter(memory.host, leases)
        self.unsafe_background = False  # see WeightStore.create(unsafe_background_copy=...)
        self.lock = threading.Lock()  # one publish at a time, whichever thread calls
        self.holding = False  # this process holds the writer role
        self.seconds = 0.0  # time spent publishing by this process
        self.copier = Copier(f"shmsync-publish-{memory.name}")
        self.cuda: Any = None  # the CUDA writer (shmsync.writer.cuda), from the first CUDA publish on
        self.listeners: list[Callable[[int], None]] = []
        self.steps = OptimizerSteps(memory.header)  # counting once this process takes the writer role
        self._matcher = SourceMatcher(memory.layout, memory.destinations)
        # The entries that hold bytes of their own (a tied entry shares its owner's): what is
        # compared and copied; the entries' other lists are read through it.
        self._owners = memory.layout.owners
        self._position = {entry: k for k, entry in enumerate(self._owners)}
        self.changes = SourceChanges(len(self._owners))  # what a publish need not copy
        # What each of the last KEPT_DELTAS versions committed here changed (a relay sends only
        # that), noted before the commit, so that whoever sees a version finds its delta.
        self.deltas: collections.OrderedDict[int, Delta] = collections.OrderedDict()
        self._nbytes = [memory.layout.entries[i].nbytes for i in self._owners]
        self._what = f"weights published to store {memory.name!r}"
        self._empty: dict[int, float] = {}  # slots seen holding no pages, and when

    def write(
        self,
        source: Any,
        version: int | None = None,
        unsafe_background: bool | None = None,
        *,
        only: Collection[str] | None = None,
        checked: bool = False,
        if_changed: bool = False,
    ) -> int | None:
        """Match ``source``, then copy what changed of it into a slot and commit it (see
        :meth:`WeightStore.publish`); ``unsafe_background`` overrides the store's setting, ``only``
        keeps the newest version's weights for the other destinations, ``checked`` makes sure that
        no write by another thread reached the copy (see :meth:`_copy_checked`), ``if_changed``
        publishes nothing (and returns None) where nothing differs from the newest version.
        Returns the version."""
        with self.lock:  # a publishing thread beside the trainer's: one version after the other
            start = time.perf_counter()
            tensors = self._matcher.match(source, self._what)
            if self.memory.layout.tied:
                self.memory.layout.check_tied(tensors, self._what)
            self._begin(version)
            self.steps.tensors = tensors  # optimizers holding them count from now on
            newest = self._newest_views()
            if newest is not None and only is not None:
                tensors = self._keep_others(tensors, newest, only)
            background = self.unsafe_background if unsafe_background is None else unsafe_background
            on_cuda = self.cuda is not None or any(t.is_cuda for t in tensors)
            if on_cuda or background and not (checked or if_changed):
                if if_changed and not any(self.changes.find(tensors, newest, "checked")):
                    return None
                self.deltas.clear()
                if on_cuda:  # stream order makes it a snapshot: writes enqueued after it on the stream come after
                    version = self._cuda(tensors).enqueue(tensors, version)
                else:
                    version = self._in_background(tensors, version)
                self._copied_all()
            else:
                version = self._publish_changes(tensors, newest, version, checked or if_changed, if_changed)
            self.seconds += time.perf_counter() - start
            return version

    def _publish_changes(
        self,
        tensors: list[torch.Tensor],
        newest: list[torch.Tensor] | None,
        version: int | None,
        checked: bool,
        if_changed: bool,
    ) -> int | None:
        """The CPU publish: what changed since the newest version, copied (checked, where other
        threads may write the source) into a slot and committed; None where nothing changed and
        ``if_changed``."""
        tensors, newest = self._owned(tensors), None if newest is None else self._owned(newest)
        found = self.changes.find(tensors, newest, "checked" if checked else "plain")
        if if_changed and not any(found):
            return None
        if checked:
            return self._copy_checked(tensors, found, version)
        return self._copy_changes(tensors, found, version)

    def differs(self, source: Any, only: Collection[str] | None = None) -> bool:
        """See :meth:`WeightStore.differs`."""
        with self.lock:
            tensors = self._matcher.match(source, self._what)
            self._begin(None)  # the write in flight landed: the newest version is whole in its slot
            newest = self._newest_views()
            if newest is not None and only is not None:
                tensors = self._keep_others(tensors, newest, only)
            held = None if newest is None else self._owned(newest)
            return any(self.changes.find(self._owned(tensors), held, "checked"))

    def _begin(self, version: int | None) -> None:
        """How every write begins, under the lock: the store still open here, ``version`` (when one
        is named) higher than every version promised, the writer role held, and the write in flight,
        with its give-backs, landed (one write open at a time).

        Raises:
            ClosedError: this process closed the store.
            InvalidArgumentError, ArgumentTypeError: ``version`` is not an int above the last one.
            WriterBusyError: another live process holds the writer role.
            ShmSyncError: the write in flight failed (its error is the cause).
        """
        if self.memory.closed:  # one word read on the trainer's path: the call only to raise
            self.memory.check_open()
        if version is not None:
            check_version(version, self.promised, self.name)
        if not self.holding:
            self.acquire()
        if self.copier.pending:
            self.flush()

    def _newest_views(self) -> list[torch.Tensor] | None:
        """The newest version's slot, viewed in this process (the writer's), or None before any."""
        if self.cuda is not None:
            return self.cuda.newest_views()
        h, host = self.memory.header, self.memory.host
        return self.memory.slots[h[host.latest]] if h[host.version] >= 0 else None

    def _owned(self, per_entry: list[torch.Tensor]) -> list[torch.Tensor]:
        """The items of a per-entry list that belong to entries holding bytes of their own."""
        return per_entry if len(self._owners) == len(per_entry) else [per_entry[i] for i in self._owners]

    def _keep_others(
        self, tensors: list[torch.Tensor], newest: list[torch.Tensor], only: Collection[str]
    ) -> list[torch.Tensor]:
        """``tensors``, but the newest version's for every destination not in ``only``."""
        layout, keep = self.memory.layout, list(tensors)
        for destination in self.memory.destinations or ():
            if destination not in only:
                for i in layout.subset((destination,)):
                    keep[i] = newest[i]
        return keep

    def _copy_changes(self, tensors: list[torch.Tensor], found: list[bool], version: int | None, checked=False) -> int:
        """Copy into a free slot what it lacks of ``tensors``: the leaves ``found`` changed since the
        newest version, and those that changed since the version the slot held (all of them, into
        an empty slot), and the slot's record of each leaf copied (the version it last changed at);
        then commit it. ``checked``: commit only if, once copied, every leaf still holds what was
        copied (see :meth:`_copy_checked`).

        The records, for the readers (see :mod:`shmsync.core.header`): a leaf found changed changed
        at the version written; one not found changed holds the newest version's bytes, so changed
        at ``changed_at`` (or, not known, at that newest version, which can only overstate it). A
        leaf the slot did not lack keeps its record: it held the same bytes at the version the slot
        held and at every version since, so the version its record names stays a bound."""
        memory, changes, nbytes, deltas = self.memory, self.changes, self._nbytes, self.deltas
        at, h, records = changes.changed_at, memory.header, memory.records

        owners, tied = self._owners, memory.layout.tied

        def copy(write: Write) -> None:
            held, dst = write.held, self._owned(memory.slots[write.slot])
            lacks = [i for i, f in enumerate(found) if f or held < 0 or not 0 <= at[i] <= held]
            if lacks:  # none where nothing changed since the version the slot holds
                copy_all([dst[i] for i in lacks], [tensors[i] for i in lacks], True)
            base, written = write.slot * len(memory.layout.entries), write.version
            for i in lacks:  # inside the write: its sequence number covers them as it covers the bytes
                records[base + owners[i]] = written if found[i] else at[i] if at[i] >= 0 else before
            for entry, owner in tied.items():  # a tied entry's bytes are its owner's
                records[base + entry] = records[base + owner]
            reached = changes.written_since(tensors, dst) if checked else []
            for i in reached:  # changed since found unchanged: the next attempt copies them too
                found[i] = True
            if reached:
                raise WrittenWhileCopiedError(
                    f"store {self.name!r}: the weights were written while they were being copied, "
                    f"{COPY_ATTEMPTS} times in a row; nothing was published"
                )
            h[W_COPIED_BYTES] = copied = sum(nbytes[i] for i in lacks)
            h[W_SKIPPED_BYTES], h[W_PROOF] = memory.layout.payload_bytes - copied, changes.proof.word
            # Before the commit: whoever sees the version sees what it changed since the one before.
            deltas[write.version] = Delta(write.version, before, tuple(owners[i] for i, f in enumerate(found) if f))
            if len(deltas) > KEPT_DELTAS:
                deltas.popitem(last=False)

        before = h[memory.host.version]
        version = self._copy_and_commit(copy, version)
        changes.published(version, before, found)
        return version

    def _copy_checked(self, tensors: list[torch.Tensor], found: list[bool], version: int | None = None) -> int:
        """Copy what changed of ``tensors`` into a slot and commit it if, once copied, every leaf
        still holds what was copied (no other thread wrote them meanwhile: see
        :mod:`shmsync.writer.changes`); else drop that copy and try again, :data:`COPY_ATTEMPTS`
        times in all."""
        if not others_may_write():  # no thread but this one can write them: a plain copy is a snapshot
            return self._copy_changes(tensors, found, version)
        for attempt in range(COPY_ATTEMPTS):
            try:
                return self._copy_changes(tensors, found, version, checked=True)
            except WrittenWhileCopiedError:
                if attempt == COPY_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _copied_all(self) -> None:
        """The last publish copied every leaf (from CUDA, or in the background): no history of changes holds."""
        h = self.memory.header
        h[W_COPIED_BYTES], h[W_SKIPPED_BYTES], h[W_PROOF] = self.memory.layout.payload_bytes, 0, Proof.NONE.word
        self.changes.forget()

    def _in_background(self, tensors: list[torch.Tensor], version: int | None) -> int:
        """Begin the write and promise its version; the copy and the commit run on the copier's
        thread, reading the caller's live tensors (``unsafe_background_copy``). A write to them that
        moves a version counter meanwhile is found, and the promise withdrawn; a write through
        ``.data`` is not, and may be published mixed."""
        slot_writer, memory = self.slot_writer, self.memory
        write = slot_writer.begin_write(version)
        version = write.version
        slot_writer.promise(version)
        seen = [t._version for t in tensors]  # bumped by every in-place write (an optimizer step too)

        def copy(write: Write) -> None:
            copy_all(memory.slots[write.slot], tensors, True)
            memory.record_all(write.slot, write.version)
            if [t._version for t in tensors] != seen:  # written while copied: the copy is no version at all
                raise ShmSyncError(
                    f"store {self.name!r}: the weights were written while version {version} was being copied in the "
                    "background, so it was not published and its promise was withdrawn; with "
                    "unsafe_background_copy=True, wait with store.flush() before writing them (an optimizer step "
                    "waits by itself), or leave it off: a publish then copies before it returns"
                )

        self.copier.submit(lambda: self._copy_and_commit(copy, write=write))
        return version

    def _copy_and_commit(
        self, copy: Callable[[Write], None], version: int | None = None, write: Write | None = None
    ) -> int:
        """Begin a write of ``version`` (None: the next; or take ``write``, begun already),
        ``copy(write)`` into its slot, commit it, tell the listeners, and have the idle slots given back."""
        slot_writer, memory = self.slot_writer, self.memory
        if write is None:
            write = slot_writer.begin_write(version)
        try:
            if write.held < 0:  # its pages may have been given back: have them again, or fail cleanly
                memory.reserve(write.slot)
                self._empty.pop(write.slot, None)
            copy(write)
        except BaseException:
            slot_writer.abort(write)
            slot_writer.withdraw()
            raise
        version = slot_writer.commit(write)
        for listener in self.listeners:
            listener(version)
        if not memory.header[W_STORE_FLAGS] & STORE_PAGE_LOCKED:  # else the device reads the pages it locked
            # Off the trainer's thread: the next publish waits for it before it begins a write.
            self.copier.submit(self._give_back_idle, guards_sources=False)
        return version

    def _give_back_idle(self) -> None:
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
                    self._empty[slot] = now
                    continue
                write = slot_writer.mark(slot)
                if write is not None:  # else a reader leased it meanwhile
                    try:
                        if memory.give_back(slot):
                            self._empty[slot] = now
                    finally:
                        slot_writer.abort(write)
        except OSError as e:
            # The version is already visible: a slot that keeps its memory costs memory, not correctness.
            warnings.warn(f"store {self.name!r}: unused slots keep their memory ({e})", RuntimeWarning, stacklevel=2)

    def write_bytes(self, fill: Callable[[memoryview, Write], None], version: int) -> int:
        """See :meth:`WeightStore.publish_bytes`."""
        with self.lock:
            self._begin(version)
            self.deltas.clear()
            write = self.slot_writer.begin_write(version, steps=-1)  # bytes from elsewhere: no training seen here

            def copy(write: Write) -> None:
                with self.memory.slot_buffer(write.slot, writable=True) as buffer:
                    fill(buffer, write)
                self.memory.record_all(write.slot, write.version)  # what changed is not known here

            version = self._copy_and_commit(copy, write=write)
            self._copied_all()
            self.changes.replaced(version)  # every leaf changed at it: the next delta copies what a slot lacks
            return version

    def write_delta(self, data: Any, version: int, base: int, leaves: Sequence[int]) -> int:
        """See :meth:`WeightStore.publish_delta`."""
        with self.lock:
            memory = self.memory
            changed = check_delta(memory.layout.entries, data, leaves, self.name)
            self._begin(version)
            h, host = memory.header, memory.host
            if base < 0 or base != h[host.version]:
                raise InvalidArgumentError(
                    f"store {self.name!r}: a delta from version {base}, but the newest version here is "
                    f"{h[host.version]}; only a delta from the newest version can be published (else the whole version)"
                )
            newest, at, entries = h[host.latest], self.changes.changed_at, memory.layout.entries
            incoming, records = _bytes_tensor(data), memory.records
            owners, position, tied = self._owners, self._position, memory.layout.tied

            def copy(write: Write) -> None:
                dst, src = memory.slot_bytes(write.slot), memory.slot_bytes(newest)
                held, wrote = write.held, {position[i] for i in changed}
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
                # The records of what was written (see _copy_changes): the delta's leaves changed at
                # this version; the rest hold the newest version's bytes, so changed when it says.
                first = write.slot * len(entries)
                for i in changed:
                    records[first + i] = version
                for k in lacks:
                    records[first + owners[k]] = at[k] if at[k] >= 0 else base
                for entry, owner in tied.items():
                    records[first + entry] = records[first + owner]
                h[W_COPIED_BYTES] = copied = offset + sum(entries[owners[k]].nbytes for k in lacks)
                h[W_SKIPPED_BYTES] = memory.layout.payload_bytes - copied
                h[W_PROOF] = Proof.DELTA.word
                self.deltas[version] = Delta(version, base, changed)
                if len(self.deltas) > KEPT_DELTAS:
                    self.deltas.popitem(last=False)

            write = self.slot_writer.begin_write(version, steps=-1)  # bytes from elsewhere: no training seen here
            version = self._copy_and_commit(copy, write=write)
            self.changes.published_delta(version, base, [position[i] for i in changed])
            return version

    def _cuda(self, tensors: list[torch.Tensor]) -> Any:
        """The CUDA writer, made at the first publish from CUDA tensors: the store's versions live
        on their GPU from then on (CPU tensors published later are copied there)."""
        if self.cuda is None:
            from shmsync.writer.cuda import CudaWriter

            device = next(t.device for t in tensors if t.is_cuda)
            self.cuda = CudaWriter(self.memory, self.slot_writer, self.copier, device)
        return self.cuda

    def check(self, source: Any, version: int | None = None) -> None:
        """See :meth:`WeightStore.check`."""
        self._matcher.match(source, f"weights for store {self.name!r}")
        if version is not None:
            check_version(version, self.promised, self.name)

    @property
    def promised(self) -> int:
        """The newest promised version (see :attr:`WeightStore.promised`): a new one must be higher."""
        return max(self.memory.header[W_VERSION], self.memory.header[W_PROMISED])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the writes this process handed to the copier landed, and the give-backs after
        them (see :meth:`WeightStore.flush`): the one wait for a write in flight. A publish waits
        here only when it comes before the last one's copy is done."""
        self.copier.wait(timeout)

    def acquire(self) -> None:
        """Take the writer role (never waits).

        Raises:
            WriterBusyError: another live process holds it.
        """
        if not self.memory.segment.lock(WRITER_LOCK, exclusive=True, wait=False):
            raise WriterBusyError(
                f"store {self.name!r} is being published by another process (last writer pid "
                f"{self.memory.header[W_WRITER_PID]}); one process publishes at a time: publish from "
                "that process, or call release_writer()/close() there first"
            )
        self.memory.map_slots()
        self.holding = True
        self.steps.start()
        self.slot_writer.withdraw()  # a promise a dead writer left: it will never land

    def release(self) -> None:
        """Give up the writer role, after every publish of this process landed."""
        self.flush()
        if self.holding:
            self.memory.segment.unlock(WRITER_LOCK)
            self.holding = False

    def close(self) -> None:
        """Wait for the publishes in flight, then end the copier's thread and the CUDA writer."""
        try:
            self.copier.close()
        finally:
            self.steps.close()
            self.changes.close()
            if self.cuda is not None:
                self.cuda.close()


class WeightStore:
    """A store open in this process: versioned weights in shared memory, published by one process,
    read by many. Its job is the store's versions: where they live is its :attr:`memory`'s (a
    :class:`~shmsync.store.memory.StoreMemory`: file, header, slots, sizes), this process's
    publishing its :attr:`writer`'s (:class:`StoreWriter`).

    Make it in the trainer with :meth:`create`; open it elsewhere with :meth:`attach`, or pickle it
    to a child process. Readers (:class:`~shmsync.WeightReader`) load the newest complete version.

    Args:
        memory: its mapping in this process; owner: this process created it (a ``with`` unlinks it).

    Attributes:
        rows: the readers' rows; leases: the leases of its host slots; slot_reader: the protocol's reader side
            :meth:`snapshot` reads with.
        remote_rows: the sources of other hosts' rows in :meth:`readers` (a relay's sender adds its own).

    Examples:
        >>> import torch
        >>> from shmsync import WeightReader, WeightStore
        >>> policy = torch.nn.Linear(4, 2)
        >>> with WeightStore.create(policy) as store:
        ...     v = store.publish(policy)
        ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
        ...     reader.poll(), reader.version == v
        (True, True)
    """

    def __init__(self, memory: StoreMemory | None = None, *, owner: bool = False) -> None:
        if not isinstance(memory, StoreMemory):
            raise ArgumentTypeError(
                "make a store with WeightStore.create(source) or open one with WeightStore.attach(name)"
            )
        self.memory = memory
        self.owner = owner
        self.rows = ReaderRows(memory.header, memory.locks)
        self.leases = Leases(memory.host, memory.locks)
        self.writer = StoreWriter(memory, self.leases)
        self.slot_reader = SlotReader(memory.host, memory.locks)
        self.remote_rows = RemoteSources()

    @classmethod
    def create(
        cls,
        source: Any,
        name: str | None = None,
        *,
        num_slots: int = 4,
        unlink_at_exit: bool = True,
        version: int = 0,
        unsafe_background_copy: bool = False,
    ) -> WeightStore:
        """Allocate a store shaped like ``source`` and publish its weights as version 0.

        Args:
            source: an ``nn.Module`` (its parameters and buffers), a ``TensorDict``, or a
                mapping ``{destination: module or TensorDict}``. Several destinations live in one
                store and are published together under one version. Tensors may be on any
                device: published from CUDA, versions are kept in device memory too (the GPUs page).
            name: a name to attach by: 1 to 200 letters, digits, ``_``, ``.`` and ``-``.
                Default: a unique name, so concurrent test processes never collide.
            num_slots: slots, each room for one copy of the weights; only those holding the latest
                version, the next write or a version a reader runs in place hold memory. Readers in
                place hold at most ``num_slots - 2`` distinct versions (the others copy).
            unlink_at_exit: remove the shared memory when this process exits or the store is
                garbage collected. Existing readers keep their mapping.
            version: the version of these first weights. Default 0.
            unsafe_background_copy: CPU publishes return before their copy, which reads the live
                source on a background thread: this gives up the snapshot. Write the source only
                once it landed (:meth:`flush`; an optimizer step waits by itself): a write through
                ``.data`` meanwhile may publish a mix of two states (other writes are found, and
                that version withdrawn). Default False: each publish copies before it returns.

        Returns:
            The store at ``version``, this process its writer; only this user may open it.

        Raises:
            StoreExistsError: ``name`` is taken.
            InvalidArgumentError: ``name`` is not a valid store name, or ``version`` below 0.
            WeightMismatchError: ``source`` holds no tensors, or tensors on ``meta``.
        """
        check_version(version, -1)
        td, destinations = as_tensordict(source, "WeightStore.create() source")
        layout = Layout.from_tensordict(td)
        layout.match(td, "weights given to WeightStore.create()")
        name = default_name() if name is None else name
        store = cls.create_empty(layout, destinations, name, num_slots=num_slots, unlink_at_exit=unlink_at_exit)
        store.writer.unsafe_background = bool(unsafe_background_copy)
        try:
            store.writer.write(source, version, unsafe_background=False)
            store.flush()
        except BaseException:
            store.unlink()
            store.close()
            raise
        return store

    @classmethod
    def create_empty(
        cls,
        layout: Layout,
        destinations: tuple[str, ...] | None,
        name: str,
        *,
        num_slots: int,
        unlink_at_exit: bool,
        make_segment: Callable[..., Segment] = Segment.create,
    ) -> WeightStore:
        """A new store of ``layout`` with no version yet, this process its creator and writer
        (``make_segment`` makes its file: see :func:`~shmsync.store.memory.new_segment`)."""
        memory = StoreMemory.create(
            layout, destinations, name, num_slots, unlink_at_exit=unlink_at_exit, make_segment=make_segment
        )
        store = cls(memory, owner=True)
        try:
            store.writer.acquire()
        except BaseException:
            store.unlink()
            store.close()
            raise
        return store

    @classmethod
    def attach(cls, name: str) -> WeightStore:
        """Open the store called ``name`` from any process on this host. Its file is checked before
        it is mapped: a regular file only this user may write, every header and layout field in range.

        Raises:
            StoreNotFoundError: there is no such store (or it was unlinked).
            StoreUntrustedError: the file is not one this user alone could have written.
            StoreCorruptError: a header or layout field is out of range (naming it).
            InvalidArgumentError: ``name`` is not a valid store name.
        """
        return cls(StoreMemory.attach(name))

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (WeightStore.attach, (self.name,))  # a child process attaches by name

    # -- facts ----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name other processes attach by."""
        return self.memory.name

    @property
    def version(self) -> int:
        """The newest complete version: published, so readers can load it (it only goes up; 0 is
        the weights given to :meth:`create`)."""
        return self.memory.header[W_VERSION]

    @property
    def promised(self) -> int:
        """The newest promised version: that of the last publish begun, whose copy may still be in
        flight (from CUDA, or in the background); :attr:`version` once it landed, never below it."""
        return self.writer.promised

    @property
    def steps(self) -> int:
        """Optimizer steps the writer's process has taken on the weights it publishes here so far:
        steps of any optimizer holding a tensor last published (see :mod:`shmsync.writer.steps`)."""
        return self.memory.header[W_STEPS]

    def steps_of(self, version: int) -> int | None:
        """The optimizer steps ``version`` had seen when it was published (so ``store.steps -
        store.steps_of(v)`` is how many steps behind the trainer weights of version ``v`` are);
        None for a version this store no longer knows (in the writer's process, one of the last
        4096; elsewhere, of the last 64), or whose writer counted none (a relay's).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(2, 1)
            >>> optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
            >>> with WeightStore.create(policy) as store:
            ...     for _ in range(3):
            ...         policy(torch.ones(1, 2)).sum().backward()
            ...         optimizer.step()
            ...     v = store.publish(policy)
            ...     optimizer.step()
            ...     store.steps_of(0), store.steps_of(v), store.steps
            (0, 3, 4)
        """
        writers = [self.writer.slot_writer, *([self.writer.cuda.slot_writer] if self.writer.cuda is not None else [])]
        known = next((w.steps[version] for w in writers if version in w.steps), None)
        return known if known is not None else steps_of(self.memory.header, version, self.version)

    @property
    def destinations(self) -> tuple[str, ...] | None:
        """The destination names, or None for a store made from one module or TensorDict."""
        return self.memory.destinations

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the weights."""
        return self.memory.header[W_PAYLOAD_BYTES]

    @property
    def closed(self) -> bool:
        """Whether this process closed it."""
        return self.memory.closed

    def info(self) -> dict[str, int]:
        """Header facts: versions (published and promised), creator and writer pids, publish count
        and times (ns), bytes of host and device memory (``shm_bytes``, ``resident_bytes``,
        ``device_bytes``), ``num_slots``, the device (-1: none), the optimizer ``steps`` counted
        (-1: none), and of the last publish: ``copied_bytes``, ``skipped_bytes`` (unchanged since
        the version its slot held) and ``unchanged_proof``, how unchanged leaves were proved so: 0
        none (every leaf copied: from CUDA, in the background, a whole version from a relay), 1
        comparison, 2 the pages written (see :mod:`shmsync.writer.changes`), 3 the delta a relay
        received (:meth:`publish_delta`: the trainer proved them unchanged).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 2))
            >>> with WeightStore.create(policy, num_slots=2) as store:  # two slots: each publish writes the older
            ...     for _ in range(3):
            ...         with torch.no_grad():
            ...             _ = policy[1].bias.add_(1.0)  # the head trains, the rest stays
            ...         _ = store.publish(policy)
            ...     info = store.info()
            >>> info["copied_bytes"] < 10_000 < info["skipped_bytes"]
            True
        """
        return self.memory.facts()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version={self.version}"
        return f"WeightStore(name={self.name!r}, {state}, nbytes={self.nbytes})"

    # -- publishing (this process's StoreWriter) ------------------------------------------------
    def publish(
        self,
        source: Any,
        *,
        version: int | None = None,
        only: Collection[str] | None = None,
        checked: bool = False,
    ) -> int:
        """Copy ``source``'s weights in and make them visible as one new version.

        Never waits for readers. The version is a snapshot of ``source`` as it is now: CPU
        tensors are copied before this returns, so ``source`` may be written any way at once.
        From CUDA the copy is enqueued on the current stream (later writes on it come after; see
        the GPUs page for other streams) and the version promised until it lands (:meth:`flush`
        waits for it). One process publishes at a time; any of its threads may.

        Args:
            source: the same kind of object the store was created from, with the same keys,
                shapes and dtypes (on any device).
            version: this version number instead of the next one (say, the optimizer-step count),
                higher than every version before: versions may skip, never go back.
            only: for a store of destinations, the destinations to take from ``source``; the
                others keep the newest version's weights. Default: all.
            checked: other threads may write ``source`` during the call: a copy that a write
                reached while it was made is dropped and made again, as
                :meth:`publish_if_changed` does (a comparison of what was copied, after the copy).

        Returns:
            The new version.

        Raises:
            WeightMismatchError: a key, shape or dtype differs; nothing is written.
            InvalidArgumentError: ``version`` is not higher than the last one; nothing is written.
            WriterBusyError: another live process holds the writer role.
            ShmSyncError: the previous CUDA or background publish failed (its error is the cause).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(4, 2)
            >>> with WeightStore.create(policy) as store:
            ...     store.publish(policy), store.publish(policy, version=10), store.version
            (1, 10, 10)
        """
        return self.writer.write(source, version, only=only, checked=checked)  # type: ignore[return-value]

    def publish_if_changed(self, source: Any, *, only: Collection[str] | None = None) -> int | None:
        """Publish ``source`` as a new version if it differs in any byte from the newest version;
        else publish nothing. Unlike :meth:`publish`, it may be called while other threads write
        ``source``: a copy that a write reached while it was made is dropped and made again, so
        the version holds the weights' memory as it was at one moment (with a thread that is in
        the middle of a write of its own at that moment caught where it stands: see
        :mod:`shmsync.writer.changes`).

        How a TorchRL collector hands its workers the weights as they are when their work starts
        (see the TorchRL page): the update call publishes a snapshot, and the hand-out of the
        next batch publishes again only what training changed since.

        Args:
            source: what :meth:`publish` takes.
            only: for a store of destinations, the destinations to take from ``source``; the
                others keep the newest version's weights. Default: all.

        Returns:
            The new version, or None if ``source`` holds the newest version's bytes.

        Raises:
            WrittenWhileCopiedError: each of the copies it made was written while it was being
                made; nothing was published.
            WeightMismatchError: a key, shape or dtype differs; nothing is written.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(4, 2)
            >>> with WeightStore.create(policy) as store:
            ...     unchanged = store.publish_if_changed(policy)
            ...     with torch.no_grad():
            ...         _ = policy.bias.add_(1.0)
            ...     unchanged, store.publish_if_changed(policy), store.version
            (None, 1, 1)
        """
        return self.writer.write(source, only=only, if_changed=True)

    def delta_of(self, version: int) -> Delta | None:
        """What ``version`` changed, where this process published it from its own weights: the
        leaves whose bytes may differ from the version before it (a relay sends a host holding
        that version only those); None for a version published any other way, or too long ago.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
            >>> with WeightStore.create(policy) as store:
            ...     with torch.no_grad():
            ...         _ = policy[1].bias.add_(1.0)
            ...     v = store.publish(policy)
            ...     store.delta_of(v).leaves  # 1.bias: the layout's third entry (0.bias, 0.weight, 1.bias, ...)
            (2,)
        """
        return self.writer.deltas.get(version)

    def differs(self, source: Any, *, only: Collection[str] | None = None) -> bool:
        """Whether ``source`` differs in any byte from the newest version (publishes nothing; waits
        for this process's write in flight). ``only``: as :meth:`publish_if_changed`.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(4, 2)
            >>> with WeightStore.create(policy) as store:
            ...     before = store.differs(policy)
            ...     policy.weight.data[0, 0] = 7.0  # a write torch's version counter does not see
            ...     before, store.differs(policy)
            (False, True)
        """
        return self.writer.differs(source, only)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until this process's publishes landed and idle slots went back; returns the version readers see.

        Raises:
            WaitTimeoutError: still copying after ``timeout`` seconds.
            ShmSyncError: a CUDA or background publish failed (its error is the cause).
        """
        self.writer.flush(timeout)
        return self.version

    def publish_bytes(self, fill: Callable[[memoryview, Write], None], *, version: int) -> int:
        """Publish a version whose bytes ``fill(buffer, write)`` writes straight into a free slot:
        how a relay publishes what it receives, with no copy in between.

        Args:
            fill: writes :attr:`nbytes` bytes, in the store's layout, into ``buffer`` (a writable
                memoryview valid while it runs); ``write`` is the slot being written (a relay's
                links forward from it as it fills). If ``fill`` raises, the slot is left empty
                and nothing is published.
            version: the version's number, higher than every version before.

        Returns:
            ``version``.

        Raises:
            InvalidArgumentError: ``version`` is not higher than the last one; nothing is written.
            WriterBusyError: another live process holds the writer role.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(2, 2)) as store:
            ...     ones = lambda buffer, write: buffer.cast("B").__setitem__(slice(None), b"\\x01" * len(buffer))
            ...     store.publish_bytes(ones, version=7), store.version
            (7, 7)
        """
        return self.writer.write_bytes(fill, version)

    def publish_delta(self, data: Any, *, version: int, base: int, leaves: Sequence[int]) -> int:
        """Publish ``version``, which differs from ``base``, this store's newest version, only in the
        leaves ``leaves`` (indices into the layout, in increasing order), whose bytes ``data`` holds
        one after the other: how a relay publishes a version whose changes alone came over the
        network. The slot it writes gets those bytes, and from the newest version's slot only what
        it lacks (the leaves that changed since the version it held); later publishes know which
        leaves changed at ``version``.

        Args:
            data: the bytes of the leaves named, in layout order, without the layout's gaps.
            version: the version's number, higher than every version before.
            base: the version the delta is from: the newest one here.
            leaves: the leaves that changed since ``base`` (every other leaf holds its bytes).

        Returns:
            ``version``.

        Raises:
            InvalidArgumentError: ``version`` is not higher than the last one, ``base`` is not the
                newest version, a leaf index is out of range or out of order, or ``data`` does not
                hold exactly those leaves' bytes; nothing is written.
            WriterBusyError: another live process holds the writer role.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> weights = {"frozen": torch.zeros(1000), "head": torch.zeros(2)}
            >>> with WeightStore.create(weights, num_slots=2) as store:  # version 0 in one slot
            ...     for v in (1, 2):  # the other slot, then the first again: it lacks only the head
            ...         head = torch.tensor([float(v), 2.0 * v])
            ...         _ = store.publish_delta(head.numpy().tobytes(), version=v, base=v - 1, leaves=[1])
            ...     store.snapshot().weights["head"].tolist(), store.info()["copied_bytes"]
            ([2.0, 4.0], 8)
        """
        return self.writer.write_delta(data, version, base, leaves)

    def check(self, source: Any, version: int | None = None) -> None:
        """Raise what :meth:`publish` would raise for ``source`` (and ``version``), writing nothing:
        an update that reaches several stores checks each before it writes any.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     store.check(torch.nn.Linear(3, 2))
            Traceback (most recent call last):
            ...
            shmsync.errors.WeightMismatchError: ...
        """
        self.writer.check(source, version)

    def add_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(version)`` right after each version this process publishes turns visible,
        on the thread that made it visible (a relay's links wake on it instead of polling). It must
        return at once and never raise."""
        self.writer.listeners.append(listener)

    def remove_listener(self, listener: Callable[[int], None]) -> None:
        """Undo :meth:`add_listener`."""
        if listener in self.writer.listeners:
            self.writer.listeners.remove(listener)

    @property
    def publish_seconds(self) -> float:
        """Seconds this process spent in :meth:`publish` (the calls, not copies landing later)."""
        return self.writer.seconds

    def release_writer(self) -> None:
        """Give up the writer role so another process may publish (once this process's publishes landed)."""
        self.writer.release()

    def writer_alive(self) -> bool:
        """Whether a live process can still publish, as the kernel's locks tell (any PID namespace).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     store.writer_alive()
            True
        """
        return self.memory.writer_alive()

    @property
    def table(self) -> ReaderRows:
        """Deprecated: :attr:`rows` (renamed in 0.2.0, removed in 0.3.0)."""
        warn_deprecated("WeightStore.table", "WeightStore.rows", "0.3.0")
        return self.rows

    @property
    def reader(self) -> SlotReader:
        """Deprecated: :attr:`slot_reader` (renamed in 0.2.0, removed in 0.3.0)."""
        warn_deprecated("WeightStore.reader", "WeightStore.slot_reader", "0.3.0")
        return self.slot_reader

    def publisher_alive(self) -> bool:
        """Deprecated: :meth:`writer_alive` (renamed in 0.2.0, removed in 0.3.0)."""
        warn_deprecated("WeightStore.publisher_alive()", "WeightStore.writer_alive()", "0.3.0")
        return self.writer_alive()

    # -- reading --------------------------------------------------------------------------------
    def snapshot(self, timeout: float = 60.0) -> Snapshot:
        """A private copy of the newest complete version (this process's publishes landed first):
        ``Snapshot(version, weights)``, ``weights`` a TensorDict shaped like the source.

        Raises:
            ReloadTimeoutError: no complete copy could be made within ``timeout`` seconds.
        """
        memory = self.memory
        memory.check_open()
        self.flush(timeout)
        if self.writer.cuda is not None:
            version, tensors = self.writer.cuda.snapshot()
            return Snapshot(version, memory.layout.as_tensordict(tensors))
        version, tensors = memory.copy_latest(self.slot_reader, timeout)
        return Snapshot(version, memory.layout.as_tensordict(tensors))

    def readers(self, *, processes: bool = True, memory: bool | None = None) -> ReaderTable:
        """The readers' table (:mod:`shmsync.store.reader_table`): every reader attached in a live
        process, worst lagging first, and those on other hosts that relays report here. No message,
        no wait.

        Args:
            processes: look up each local reader's process state and private memory (USS), a few
                milliseconds a reader; False for the versions alone (microseconds a reader).
            memory: look up the private memory (default: as ``processes``).

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     _ = reader.poll()
            ...     [(row.version, row.behind, row.mode) for row in store.readers()]
            [(0, 0, 'zero-copy')]
        """
        mapped = self.memory
        version, alive = mapped.header[W_VERSION], mapped.locks.rows_alive
        live, gone = local_rows(self.name, mapped.header, alive, version, processes=processes, memory=memory)
        return assemble(self.name, version, live, gone, self.remote_rows)

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of the store here (unlinking it if this process created it to), once this process's
        publishes landed; other processes keep their mapping. ``version`` and :meth:`info` still tell."""
        if not self.closed:
            try:
                self.writer.close()
            finally:
                self.memory.close()  # its dependents (readers in place) first

    def unlink(self) -> None:
        """Remove the store's name from the host: no new process can attach. Mappings stay valid."""
        self.memory.segment.unlink()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self.owner:
            self.unlink()
        self.close()


def check_delta(entries: Sequence[Any], data: Any, leaves: Any, store: str) -> tuple[int, ...]:
    """The leaves of a delta, checked against the layout's ``entries``: indices in range, each
    once, in order, and ``data`` exactly their bytes. Raises InvalidArgumentError naming the first
    thing that is off (a delta comes from a peer: nothing is sized from it before this)."""
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


def check_version(version: Any, last: int, store: str = "") -> None:
    """Raise unless ``version`` is an int higher than ``last`` (the store's newest promised
    version, :attr:`StoreWriter.promised`; -1 for a store's first version): the one check of a
    version a caller names."""
    where = f"store {store!r}: " if store else ""
    if isinstance(version, bool) or not isinstance(version, int):
        raise ArgumentTypeError(f"{where}version must be an int, got {type(version).__name__}")
    if version <= last:
        raise InvalidArgumentError(
            f"{where}version {version} is not higher than the last published version {last}; versions only go up"
            if last >= 0
            else f"{where}version must be an int >= 0, got {version!r}"
        )


__all__ = ["WeightStore", "Snapshot"]
