"""The protocol between one writer and many readers of a bank of slots (no torch here).

Three classes work on the shared words of one bank (:class:`Words`): the :class:`SlotWriter` (the
one process that publishes), a :class:`SlotReader` (each process that copies a version out) and
the bank's :class:`Leases` (which slot each row holds leased: a reader in place's, a relay
link's). Each holds the words; the slot writer also holds the leases, to ask whether a slot is
leased. The readers' rows in the header (:class:`ReaderRows`: a reader's pid, version, reloads)
are the store's, not a bank's: they outlive the banks, and each row holds one lease word per
bank (its address, as every row word's: :data:`~shmsync.core.header.ROW_WORDS`).

Nothing here moves bytes: a caller copies between its own calls (the writer between
:meth:`SlotWriter.begin_write` and :meth:`SlotWriter.commit`, a reader inside the ``copy(slot)``
it hands to :meth:`SlotReader.read`), so every interleaving below can be driven step by step in
tests, on a plain list of ints, without processes or torch.

Slots and words
---------------
A bank has ``N >= 2`` slots (4 by default), each a full copy of the weights. Its words hold
``version`` (the last completed version), ``latest`` (the slot holding it), and per slot a
sequence number ``seq[i]`` (odd while it is being written) and the version it holds. A store has
one bank of host slots, and, once published from CUDA, a second one of device slots: the same
protocol on each (see :mod:`shmsync.core.header`).

SlotWriter (one process at a time, enforced by a kernel lock the store takes)::

    target = a slot that is neither `latest`, nor pinned, nor leased (one holding a version
             first, the least recently written)
    seq[target] += 1            # odd: being written; then a full fence, and back off if leased
    copy the weights into target                                   (SlotWriter.begin_write)
    slot_version[target] = v; fence; seq[target] += 1   # even: complete
    latest = target; version = v                                   (SlotWriter.commit)

The writer never reads anything a reader writes except three pin words and the per-slot
lease counts, and never waits: publishing is a copy plus a handful of word stores. One
writer has at most one write open at a time (a second ``begin_write`` raises).

SlotReader, optimistic path (seqlock validation, :meth:`SlotReader.try_read`)::

    s = seq[latest]; fence; v = slot_version[latest]; copy the slot; fence; valid iff seq is still s

A slot is rewritten only once it is no longer ``latest``: the writer must finish one whole
publish and start the next while one reader copy runs before that copy is invalidated, so
retries are rare. Validation guarantees that a reader never *accepts* a mixed copy, whatever
the timing.

Memory given back (:meth:`SlotWriter.idle_slots`): after a publish, the writer gives back the
pages of every slot that is neither latest, nor pinned, nor leased, but one: the slot its
next write takes. That is the one holding a version, least recently written (empty slots are
written last: their pages would have to come back first). While nobody leases, the writer so
alternates between two slots, and the others hold no memory. Giving a slot back is a write
of zeros, made like any write: marked odd through the write handshake (:meth:`SlotWriter.mark`),
then aborted (its version -1). So a reader leasing it meanwhile keeps it, and an optimistic
copy of it fails validation.

SlotReader, bounded fallback (slot pinning, :meth:`SlotReader.read_pinned`): after
``max_attempts`` failed optimistic copies a reader takes the bank's single reader token
(a kernel lock, released if the reader dies) and asks the writer to pin a slot by writing
a fresh ticket into ``pin_request``. At the start of its next publish the writer sets
``pin_slot = latest`` (or a slot leased by a reader in place, already safe from it) and
``pin_grant = ticket``, and from then on never writes into ``pin_slot`` until
``pin_release >= pin_grant`` (tickets only grow: a ticket released before its grant, by a
reader whose optimistic copy succeeded meanwhile, pins nothing). With 3 slots there is always a
slot that is neither latest nor pinned, so the writer still never waits, and the pinned reader's
copy cannot be invalidated: it completes in one copy. A writer that is idle grants nothing, but then an
optimistic copy succeeds, so the reader keeps trying those while it waits. A reader that
dies while pinned only costs the writer one slot until the next ticket replaces its pin.
A reader whose last copy took longer than the writer, publishing at its current pace, leaves
a slot alone (one publish interval, from ``publish_interval``)
skips the optimistic copies that would only fail and asks for a pin at once: it loads in one
copy (:meth:`SlotReader.outpaced`).

The token bounds the wait of the others: its holder's pinned copy completes, so the next
reader waits at most one copy for it. A holder that is *stopped* (SIGSTOP, a debugger)
cannot block them either: the holder writes its pid into ``token_pid``, and once it is
seen stopped the others issue a ticket without the token, which moves the pin; the stopped
reader's copy, if it ever resumes, fails validation and is retried. A holder that runs,
however slowly, keeps its pin: two slow readers taking the pin off each other would never
finish.

Leases (readers in place, :meth:`Leases.lease_latest`)
--------------------------------------------------------
A reader in place points its module's parameters at the read-only memory of one slot and
holds a *lease* on it; the writer never writes a leased slot. Leases are recorded in the
reader table (each row's lease word of the bank: ``slot + 1``, or ``-(slot + 1)`` while the
lease is being decided) and summed per slot into ``leases[i]``, which is what the writer reads
first. A lease is taken in two steps, each ended by a full fence:

1. *decided*: under the table lock, the row's lease word turns negative and the counts move
   to the new slot; then the reader looks at the pin words and is refused if afterwards
   more than ``N - 2`` distinct slots would be leased or pinned, or while a pin is being
   granted (a ticket waits: its slot is not known yet);
2. *confirmed*: the lease word turns positive; then the reader checks that the slot's
   sequence number did not move. Only now does it use the slot.

Rules that keep the writer from waiting:

* a reader leases only the ``latest`` slot, and gives up its previous lease in the same
  step (its module is not in use while it reloads); a reader without a row of the reader
  table (the table is full) never leases: it copies. A refused reader leases nothing, not
  even its previous slot (it may be rewritten from the moment the lease moved), and copies;
* confirmed leases and pins never hold more than ``N - 2`` distinct slots, and at most one
  lease is being decided at a time (the table lock): the writer always has a slot that is
  neither latest, nor pinned, nor under a confirmed lease. It prefers one that nobody
  leases; failing that, it writes through a lease being decided (whose reader then sees the
  sequence move and gives it up), never into a pin (but with 2 slots, where the pinned
  reader retries). The writer pins a leased slot when there is one besides the latest, so
  a pin costs no slot of its own;
* lease changes happen under the table lock (readers only: the writer never takes it)
  and update the per-slot counts. A count may only be too high (a reader that died
  holding a lease, a lease given up without the lock); the rows are the truth. So a
  reader about to be refused first recomputes the counts from the rows of live readers
  (each row's reader holds that row's kernel lock while it lives, so a reader in another
  PID namespace, or one whose pid was reused, is told apart), and the writer, when a count
  says a slot is leased, asks the rows before believing it.

Handshakes, each a store, a full fence, then a load on both sides, so that of two racing
parties at least one sees the other:

* *a write against a lease*: the writer marks its target odd, issues a full fence, then reads
  the target's lease count and rows, and backs off to another slot if a confirmed lease is
  on it. The reader confirms its lease, issues a full fence, then checks that the slot's
  sequence number did not move. So a slot is never both written and used by a lease.
* *a pin against a lease*: the pinned reader's ticket, then the writer's look at the leases
  (``pin_candidate``), then its grant; the leasing reader's decided lease, a full fence,
  then its look at the pin words. Either the leasing reader sees the ticket (and is refused
  until the pin's slot is known, and then if it is another slot), or the ticket came after
  its lease, and the writer, looking after the ticket, sees the lease and pins the leased
  slot (or the latest, if that is the one leased). So a confirmed lease and a pin never
  hold more than ``N - 2`` slots between them.

Without the second handshake and the writer's way through a lease being decided, a reader
that read ``latest`` just before a publish and a writer granting a pin just after it would
hold three slots of three between them, and the writer would have to write into the pin
(both found by ``tests/core/protocol_model.py``, the exhaustive checker of this protocol).

The promise
-----------
A publish that returns before its version is visible (a CUDA copy, or the opt-in background copy
of CPU tensors) first *promises* the version (:meth:`SlotWriter.promise`, the store's ``promised``
word). A reader that must run the newest weights at the start of its next batch waits while
:meth:`SlotReader.promise_stands`: until its bank's version reaches the promise, or the promise is
withdrawn. No promise is left hanging:

* a copy that fails is aborted and its promise withdrawn at once (:meth:`SlotWriter.withdraw`: the
  promised word back to the version the bank holds), so the waiting reader goes on with the
  newest whole version;
* a writer that dies leaves its promise, but its kernel lock goes with it: a waiting reader looks
  at that lock twice a second and stops waiting (the store's ``writer_alive``); a new writer
  withdraws the dead one's promise when it takes the role.

``tests/core/protocol_model.py`` checks both over every interleaving, the writer dying at every step,
and finds a waiting reader stuck for good when either rule is taken away. The promise is a hint
for liveness, never for safety: what a reader accepts is decided by the words above alone.

Ordering
--------
``fence`` orders stores with stores and loads with loads; ``full_fence`` also a store
before a later load. On x86-64 the former is only a compiler barrier (see
:mod:`shmsync.core.fences`); elsewhere both are a real barrier. A store that ends the use of
shared memory (a pin or lease release) is preceded by a fence so the copy's loads cannot drift
after it.

Crashes
-------
A writer killed in the middle of a copy leaves ``seq[target]`` odd and ``latest``
untouched: readers keep loading the last complete version, and the next writer rewrites
that slot from scratch. A copy that raises is aborted (:meth:`SlotWriter.abort`): the slot is
marked empty, and nobody reads it.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator, MutableSequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple
from typing import Protocol as Interface

from shmsync.core import fences, header
from shmsync.core.header import (
    B_LATEST,
    B_LEASES,
    B_PIN_GRANT,
    B_PIN_RELEASE,
    B_PIN_REQUEST,
    B_PIN_SLOT,
    B_PROGRESS,
    B_PUBLISH_COUNT,
    B_PUBLISH_INTERVAL,
    B_PUBLISH_NS,
    B_SEQ,
    B_SLOT_VERSION,
    B_TOKEN_PID,
    B_VERSION,
    HOST,
    LEASE_COLUMNS,
    MAX_READERS,
    NUM_BANKS,
    R_COPIED_BYTES,
    R_RELOAD_NS,
    R_RELOADS,
    R_VERSION,
    READER_WORDS,
    RING_STEPS_BITS,
    RING_TAG_BITS,
    ROW_WORDS,
    STEP_RING,
    W_NUM_SLOTS,
    W_PROMISED,
    W_PUBLISH_COUNT,
    W_PUBLISH_NS,
    W_ROWS,
    W_STEP_RING,
    W_STEPS,
    W_VERSION,
    W_WRITER_PID,
    bank_base,
    reader_column,
    slot_index,
)
from shmsync.core.processes import own_start_ns, pid_stopped
from shmsync.errors import ReloadTimeoutError, ShmSyncError, warn_deprecated

CopyFn = Callable[[int], None]  # copies out of (or into) the slot with that index
KEPT_STEPS = 4096  # versions whose optimizer steps a writer keeps in its own memory
_NOT_COUNTED = (1 << RING_STEPS_BITS) - 1
_TAG = (1 << RING_TAG_BITS) - 1
# A header's int64 words: a memoryview cast to "q" in a store, a list of ints in tests.
HeaderWords = MutableSequence[int] | memoryview


class Locks(Interface):
    """The locks readers take; the writer takes none of them. There is a token per bank, the
    table's lock, and one lock per row of the reader table, which that row's reader holds for as
    long as it lives. A store's are kernel locks (:class:`shmsync.core.segment.SegmentLocks`), which
    a process that dies releases; the protocol's tests use :class:`LocalLocks`."""

    def try_token(self, bank: int = HOST) -> bool:
        """Take bank ``bank``'s reader token if it is free, without waiting.

        Returns:
            Whether the token was taken.
        """

    def release_token(self, bank: int = HOST) -> None:
        """Release bank ``bank``'s reader token, which this process holds."""

    def table(self, patience: float | None) -> AbstractContextManager[bool]:
        """Hold the reader table's lock for the ``with`` block.

        Args:
            patience: the seconds to wait for it (None: as long as it takes).

        Returns:
            A context manager that yields whether the lock was taken in time.
        """

    def hold_row(self, row: int) -> bool:
        """Take row ``row``'s lock if no live reader holds it, without waiting.

        Returns:
            Whether the lock was taken.
        """

    def release_row(self, row: int) -> None:
        """Release row ``row``'s lock, which this process holds."""

    def row_alive(self, row: int) -> bool:
        """Say whether a live reader holds row ``row``'s lock."""


class LocalLocks:
    """The :class:`Locks` of a header shared by the threads of one process, as the protocol's tests
    use them (a store uses :class:`shmsync.core.segment.SegmentLocks`). A test kills a row's reader
    by discarding the row from ``rows``.

    Examples:
        >>> locks = LocalLocks()
        >>> locks.hold_row(3), locks.hold_row(3), locks.row_alive(3)
        (True, False, True)
    """

    def __init__(self) -> None:
        self.tokens = [threading.Lock() for _ in range(NUM_BANKS)]
        self.table_lock = threading.Lock()
        self.rows: set[int] = set()  # rows whose reader lives; a test "kills" one by discarding it

    def try_token(self, bank: int = HOST) -> bool:
        """Do what :meth:`Locks.try_token` says, with a lock of this process."""
        return self.tokens[bank].acquire(blocking=False)

    def release_token(self, bank: int = HOST) -> None:
        """Do what :meth:`Locks.release_token` says, with a lock of this process."""
        self.tokens[bank].release()

    @contextmanager
    def table(self, patience: float | None) -> Iterator[bool]:
        """Do what :meth:`Locks.table` says, with a lock of this process."""
        taken = self.table_lock.acquire(timeout=-1 if patience is None else patience)
        try:
            yield taken
        finally:
            if taken:
                self.table_lock.release()

    def hold_row(self, row: int) -> bool:
        """Do what :meth:`Locks.hold_row` says, with a lock of this process."""
        if row in self.rows:
            return False
        self.rows.add(row)
        return True

    def release_row(self, row: int) -> None:
        """Do what :meth:`Locks.release_row` says, with a lock of this process."""
        self.rows.discard(row)

    def row_alive(self, row: int) -> bool:
        """Do what :meth:`Locks.row_alive` says, with a lock of this process."""
        return row in self.rows


class Write(NamedTuple):
    """A write in progress, as :meth:`SlotWriter.begin_write` or :meth:`SlotWriter.mark` return it.

    Attributes:
        slot: the slot being written.
        seq: the odd sequence number the slot carries while it is written.
        held: the version the slot held whole before. It is -1 when it held none, or where a write
            there never ended; its memory may then have been given back, and must be reserved
            before the copy.
        version: the version the slot will hold once committed (-1 for a slot being given back).
        steps: the optimizer steps the writer had counted when the write began, which is the
            training the version has seen (-1: not counted).
    """

    slot: int
    seq: int
    held: int = -1
    version: int = -1
    steps: int = -1


class Lease(NamedTuple):
    """A lease a reader holds, as :meth:`Leases.lease_latest` returns it.

    Attributes:
        slot: the slot its parameters run on.
        version: the version that slot holds.
    """

    slot: int
    version: int


def initialize(h: HeaderWords, num_slots: int) -> None:
    """Set the protocol's words of a fresh header: no version yet, and every slot of every bank empty.

    Args:
        h: the header words, all zeros.
        num_slots: the slots of each bank.

    Examples:
        >>> h = [0] * 20480
        >>> initialize(h, 3)
        >>> Words(h).num_slots, h[W_VERSION]
        (3, -1)
    """
    h[W_VERSION] = -1
    h[W_PROMISED] = -1
    h[W_STEPS] = -1
    h[W_NUM_SLOTS] = num_slots
    for bank in range(NUM_BANKS):
        base = bank_base(bank)
        h[base + B_VERSION] = -1
        h[base + B_LATEST] = 0
        for i in range(num_slots):
            h[base + B_SLOT_VERSION + i] = -1


def steps_of(h: HeaderWords, version: int, latest: int) -> int | None:
    """Read the optimizer steps ``version`` had seen from the header's steps ring. Any process may
    read it.

    Args:
        h: the header words.
        version: the version asked about.
        latest: the store's newest version.

    Returns:
        The steps, or None when the ring no longer holds the version (``STEP_RING`` versions before
        ``latest`` or more), when its writer counted none, or when the word makes no sense.

    Examples:
        >>> h = [0] * 20480
        >>> initialize(h, 3)
        >>> words = Words(h)
        >>> writer = SlotWriter(words, Leases(words, LocalLocks()))
        >>> h[W_STEPS] = 1234  # the optimizer steps counted so far
        >>> version = writer.commit(writer.begin_write(70))
        >>> steps_of(h, 70, latest=75), steps_of(h, 6, latest=75), steps_of(h, 70, latest=200)
        (1234, None, None)
    """
    if not 0 <= version <= latest < version + STEP_RING:
        return None
    word = h[W_STEP_RING + version % STEP_RING]
    steps = word & _NOT_COUNTED
    return steps if word >> RING_STEPS_BITS == version & _TAG and steps != _NOT_COUNTED else None


class Words:
    """The shared words of one bank of slots, as this process reaches them. It holds the header
    ``h`` (a memoryview of int64 in a store, any list of ints in tests), the index of each of the
    bank's words, the store's name for errors, and the fences of this CPU's memory order.

    Args:
        h: the header words.
        bank: :data:`~shmsync.core.header.HOST` (0) or :data:`~shmsync.core.header.DEVICE` (1).
        name: the store's name, for error messages.
        ordering: ``"tso"`` or ``"weak"`` (see :mod:`shmsync.core.fences`); default: this CPU's.

    Examples:
        >>> h = [0] * 20480
        >>> initialize(h, 3)
        >>> words = Words(h)
        >>> words.num_slots, h[words.version]
        (3, -1)
    """

    def __init__(self, h: HeaderWords, bank: int = HOST, *, name: str = "store", ordering: str | None = None):
        self.h = h
        self.bank = bank
        self.name = name
        self.num_slots = n = int(h[W_NUM_SLOTS])
        self.fence, self.full_fence = fences.ordering(ordering)
        base = bank_base(bank)
        self.version, self.latest, self.progress = base + B_VERSION, base + B_LATEST, base + B_PROGRESS
        self.pin_request, self.pin_grant = base + B_PIN_REQUEST, base + B_PIN_GRANT
        self.pin_slot, self.pin_release, self.token_pid = base + B_PIN_SLOT, base + B_PIN_RELEASE, base + B_TOKEN_PID
        self.publish_count, self.publish_interval = base + B_PUBLISH_COUNT, base + B_PUBLISH_INTERVAL
        self.publish_ns = base + B_PUBLISH_NS
        # Per slot, the index of each of its words.
        self.seq = tuple(base + B_SEQ + i for i in range(n))
        self.slot_version = tuple(base + B_SLOT_VERSION + i for i in range(n))
        self.leases = tuple(base + B_LEASES + i for i in range(n))
        self.lease = LEASE_COLUMNS[bank]  # a row's lease word of this bank: ROW_WORDS[row][lease]


class ReaderRows:
    """The readers' rows in the header: each reader's row (its pid, the version it loaded, its
    reloads, its flags), claimed when it starts and given back when it leaves. A store has one, and
    so has each reader, whatever bank it loads from: the rows outlive the banks (a reader that moves
    to the device slots keeps its row). The readers' table that operators read
    (:class:`~shmsync.store.reader_table.ReaderTable`) is made from these rows. A row's lease words
    are each bank's :class:`Leases`'.

    Args:
        h: the header words.
        locks: the table's and the rows' locks.
        pid: this process's id as written into a row. Default: this process's; a test passes its
            own, and the row then shows no start time.
        clock: wall-clock time in ns (the time of a reload, shown in the readers' table).

    Examples:
        >>> h = [0] * 20480
        >>> initialize(h, 3)
        >>> rows = ReaderRows(h, LocalLocks(), pid=1234)
        >>> row = rows.claim_row(worker=0)
        >>> rows.update_row(row, version=5, reloads=1)
        >>> row, h[ROW_WORDS[row][header.R_PID]], h[ROW_WORDS[row][R_VERSION]]
        (0, 1234, 5)
    """

    def __init__(
        self,
        h: HeaderWords | Words,
        locks: Locks,
        *,
        pid: int | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._bank: Leases | None = None  # for 0.2.0's calls of a bank's lease methods on the rows
        if isinstance(h, Words):  # 0.2.0 made the rows from a bank's words
            warn_deprecated(
                "ReaderRows(words, locks)",
                "ReaderRows(words.h, locks) for the rows, Leases(words, locks) for a bank's leases",
                "0.4.0",
            )
            self._bank, h = Leases(h, locks), h.h
        self.h = h
        self.locks = locks
        self.pid = os.getpid() if pid is None else pid
        self.start_ns = own_start_ns() if pid is None else 0
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        """Deprecated: a bank's lease methods, called on the rows as in 0.2.0 (use :class:`Leases`)."""
        if name in _LEASE_METHODS:
            warn_deprecated(f"ReaderRows.{name}", f"Leases.{name} (WeightStore.leases)", "0.4.0")
            bank = self._bank  # None: made from the header words, as now
            return getattr(bank or Leases(Words(self.h), self.locks), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def claim_row(self, patience: float | None = 5.0, *, worker: int | None = None, flags: int = 0) -> int:
        """Claim a free row of the reader table for this process.

        Args:
            patience: seconds to wait for the table's lock (None: as long as it takes).
            worker: the index a collector gave the reader, shown in the readers' table.
            flags: the row's ``ROW_*`` bits, shown in the readers' table.

        Returns:
            The row, or -1 if the table is full or its lock stayed busy: the reader then copies,
            unlisted.
        """
        h = self.h
        with self.locks.table(patience) as locked:
            if not locked:
                return -1
            pids = reader_column(h, header.R_PID)
            # Free rows first, then rows whose reader died (its lock is free; its leases stay
            # counted until a recount). The row's lock, not its pid, says who lives.
            candidates = [row for row, pid in enumerate(pids) if pid == 0]
            candidates += [row for row, pid in enumerate(pids) if pid != 0]
            for row in candidates:
                if self.locks.hold_row(row):
                    words = ROW_WORDS[row]
                    h[words[R_VERSION]] = -1
                    for field in (R_RELOADS, R_RELOAD_NS, R_COPIED_BYTES, header.R_DEVICE_BYTES, *LEASE_COLUMNS):
                        h[words[field]] = 0
                    h[words[header.R_WORKER]] = 0 if worker is None else worker + 1
                    h[words[header.R_FLAGS]], h[words[header.R_START_NS]] = flags, self.start_ns
                    h[words[header.R_PID]] = self.pid  # last: the row is listed from now on
                    if h[W_ROWS] <= row:
                        h[W_ROWS] = row + 1  # how far the readers' table is read
                    return row
            return -1

    def update_row(self, row: int, version: int, reloads: int, copied: int = 0) -> None:
        """Record what reader ``row`` loaded (for ``shmsync ls`` and ``store.readers()``).

        Args:
            row: the reader's row (-1: none, and nothing is recorded).
            version: the version it loaded.
            reloads: how many times it loaded one.
            copied: the bytes that reload copied into its module.
        """
        if row >= 0:
            h, words = self.h, ROW_WORDS[row]
            h[words[R_VERSION]], h[words[R_RELOADS]] = version, reloads
            h[words[R_RELOAD_NS]], h[words[R_COPIED_BYTES]] = self.clock(), copied

    def set_row_word(self, row: int, field: int, value: int) -> None:
        """Set word ``field`` (an ``R_*`` constant, not a lease) of reader ``row``'s row: its flags or
        its device bytes, which the readers' table shows and the protocol never reads. Nothing is
        set for row -1 (no row)."""
        if row >= 0:
            self.h[ROW_WORDS[row][field]] = value

    def release_row(self, row: int) -> None:
        """Give row ``row`` back (its pid cleared, its lock released); release its leases first,
        with each bank's :meth:`Leases.release_lease`. Nothing is done for row -1 (no row)."""
        if row >= 0:
            self.h[ROW_WORDS[row][header.R_PID]] = 0
            self.locks.release_row(row)


_LEASE_METHODS = frozenset({"row_leased", "recount", "lease_latest", "lease_written", "release_lease"})


class Leases:
    """The leases of one bank: which slot each row holds leased, a reader in place's or a relay
    link's (its row's lease word of the bank) and how many rows hold each slot (the bank's
    ``leases[i]`` counts). A reader holds one per bank it loads from, made with the bank; the
    writer of a bank holds one to ask whether a slot is leased. The rows they live in are
    :class:`ReaderRows`'; the rules are in the module's *Leases* above.

    Args:
        words: the bank's words.
        locks: the table's and the rows' locks (a lease changes under the table's lock).

    Examples:
        >>> h = [0] * 20480
        >>> initialize(h, 3)
        >>> words, locks = Words(h), LocalLocks()
        >>> writer, leases = SlotWriter(words, Leases(words, locks)), Leases(words, locks)
        >>> _ = writer.commit(writer.begin_write())
        >>> row = ReaderRows(h, locks, pid=1234).claim_row()
        >>> lease = leases.lease_latest(row)
        >>> lease, leases.row_leased(lease.slot)
        (Lease(slot=0, version=0), True)
        >>> leases.release_lease(row)
        >>> leases.row_leased(0)
        False
    """

    def __init__(self, words: Words, locks: Locks) -> None:
        self.words = words
        self.locks = locks

    def row_leased(self, slot: int, confirmed: bool = False) -> bool:
        """Say whether any row of the reader table leases ``slot`` (dead readers' rows included).

        Args:
            slot: the slot of this bank asked about.
            confirmed: count only leases past their handshake, not those still being decided.
        """
        h = self.words.h
        start = ROW_WORDS[0][self.words.lease]
        column = h[start : start + min(max(h[W_ROWS], 0), MAX_READERS) * READER_WORDS : READER_WORDS]
        return slot + 1 in column or (not confirmed and -(slot + 1) in column)

    def recount(self) -> set[int]:
        """Recompute the per-slot lease counts from the rows of live readers, and clear the lease
        words of dead ones. Call it with the table's lock held.

        Returns:
            The slots leased by live readers.
        """
        w = self.words
        h, n = w.h, w.num_slots
        counts = [0] * n
        for row, lease in enumerate(reader_column(h, w.lease)):
            if not lease:
                continue
            slot = slot_index(abs(lease) - 1, n, f"reader row {row} lease", w.name)
            if self.locks.row_alive(row):
                counts[slot] += 1
            else:
                h[ROW_WORDS[row][w.lease]] = 0  # a dead reader's lease
        for slot, c in enumerate(counts):
            h[w.leases[slot]] = c
        return {slot for slot, c in enumerate(counts) if c}

    def lease_latest(self, row: int) -> Lease | None:
        """Move ``row``'s lease to the latest slot (the two steps of the module's *Leases* above). After a refusal
        the previous slot may be rewritten at any moment: stop using it, and :meth:`release_lease`
        what is left.

        Args:
            row: the reader's row (-1: none, and the lease is refused: it would live in the row).

        Returns:
            The :class:`Lease`, or None if the lease is refused.

        Raises:
            StoreCorruptError: the latest slot's word, or the row's lease word, is no slot.
        """
        if row < 0:
            return None
        w = self.words
        h = w.h
        with self.locks.table(0.01) as locked:
            if not locked:
                return None
            slot = h[w.latest]
            if not 0 <= slot < w.num_slots:
                slot_index(slot, w.num_slots, "latest", w.name)  # raises, naming it
            seq = h[w.seq[slot]]
            w.fence()  # the sequence before the version, as in try_read
            version = h[w.slot_version[slot]]
            if seq & 1 or version < 0:
                return None  # `latest` moved on and that slot is already being rewritten
            if not self._move_lease(row, slot):
                return None
        return Lease(slot, version) if self._lease_holds(row, slot, (seq,)) else None

    def lease_written(self, row: int, write: Write) -> bool:
        """Move ``row``'s lease to the slot of ``write``, a write this process has open or has just
        committed (a relay forwards the bytes of a version while it still receives them). As for
        :meth:`lease_latest`, after a refusal the previous slot is no longer safe.

        Returns:
            Whether the lease holds: False if the rules above would break, or if the slot has moved
            on to another write meanwhile.
        """
        if row < 0:
            return False
        with self.locks.table(0.01) as locked:
            if not locked or not self._move_lease(row, write.slot):
                return False
        return self._lease_holds(row, write.slot, (write.seq, write.seq + 1))  # this write or its commit

    def _move_lease(self, row: int, slot: int) -> bool:
        """With the table lock held: lease ``slot`` for ``row``, for now as a lease being decided,
        instead of its previous slot, unless afterwards more than ``N - 2`` distinct slots would be
        leased or pinned, or a pin is being granted; refused, the row leases nothing."""
        w = self.words
        h, n = w.h, w.num_slots
        word = ROW_WORDS[row][w.lease]
        previous = abs(h[word])
        h[word] = -(slot + 1)  # being decided: counted, pinned by a writer that sees it, not yet used
        counts = [h[w.leases[s]] for s in range(n)]
        if previous:
            if previous > n:
                slot_index(previous - 1, n, f"reader row {row} lease", w.name)  # raises, naming it
            counts[previous - 1] -= 1
        counts[slot] += 1
        leased = {s for s, c in enumerate(counts) if c > 0}
        if len(leased) > n - 2:
            leased = self.recount()  # dead readers' leases dropped (this row's new one counted)
        else:
            for s in {slot, previous - 1} - {-1}:
                h[w.leases[s]] = counts[s]
        w.full_fence()  # the lease before the pin words (a pin against a lease, see Handshakes)
        request, grant, release = h[w.pin_request], h[w.pin_grant], h[w.pin_release]
        pinned = {h[w.pin_slot]} if release < grant else set()
        granting = request != grant and request != release  # a ticket waits: its slot is unknown
        if granting or len(leased | pinned) > n - 2:
            h[word] = 0
            self.recount()
            return False
        return True

    def _lease_holds(self, row: int, slot: int, seqs: tuple[int, ...]) -> bool:
        """The reader's half of the write handshake: confirm the lease, then, after a full fence,
        is ``slot`` still at one of ``seqs``? A writer that starts on it from now on sees the
        confirmed lease; one that started before, or went through the lease while it was being
        decided, has already moved its sequence, and the lease is given up."""
        w = self.words
        w.h[ROW_WORDS[row][w.lease]] = slot + 1
        w.full_fence()  # the confirmed lease before the sequence load below
        if w.h[w.seq[slot]] in seqs:
            return True
        self.release_lease(row)
        return False

    def release_lease(self, row: int) -> None:
        """Give up ``row``'s lease on this bank, if it holds one (nothing for row -1). If the table's
        lock stays busy, the counts are left for the next lease change to recompute: the writer
        avoids that slot a little longer, which is safe.

        Raises:
            StoreCorruptError: the row's lease word is no slot.
        """
        if row < 0:
            return
        w = self.words
        h = w.h
        word = ROW_WORDS[row][w.lease]
        if not h[word]:
            return
        w.fence()  # the module's last loads from the slot before the release
        with self.locks.table(0.01) as locked:
            slot = slot_index(abs(h[word]) - 1, w.num_slots, f"reader row {row} lease", w.name)
            h[word] = 0
            if locked:
                h[w.leases[slot]] = max(0, h[w.leases[slot]] - 1)


class SlotWriter:
    """The writer of one bank: it chooses a slot no reader uses, marks it, and commits it as the
    latest version once the caller copied into it. One process at a time writes a store (the
    store's writer lock sees to it), and it never waits for a reader.

    Args:
        words: the bank's words.
        leases: the bank's leases, asked whether a slot is leased.
        pid: this process's id as written into the header.
        clock: wall-clock time in ns, for publish times that other processes read.

    Examples:
        >>> h = [0] * 20480
        >>> initialize(h, 3)
        >>> words = Words(h)
        >>> writer = SlotWriter(words, Leases(words, LocalLocks()))
        >>> write = writer.begin_write()
        >>> writer.commit(write), h[words.version]
        (0, 0)
    """

    def __init__(
        self, words: Words, leases: Leases, *, pid: int | None = None, clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.words = words
        self.leases = leases
        self.pid = os.getpid() if pid is None else pid
        self.clock = clock
        self.writing: Write | None = None  # the write this writer has open
        self.replaced = -1  # the slot that was latest before this writer's last commit
        self.seen_latest = -1  # the latest slot as the open write's choice saw it
        # The optimizer steps of the last KEPT_STEPS versions this writer committed (the header's
        # ring holds the last STEP_RING for other processes).
        self.steps: collections.OrderedDict[int, int] = collections.OrderedDict()

    def begin_write(self, version: int | None = None, steps: int | None = None) -> Write:
        """Choose a slot, mark it as being written, and decide the version it will hold. This is the
        one place a version is decided. It never waits.

        Args:
            version: the version to write, a caller's number higher than every version before.
                Default: one more than the store's last.
            steps: the optimizer steps the version has seen. Default: the store's count now
                (``W_STEPS``); -1: not counted.

        Returns:
            The :class:`Write`; copy into its slot, then :meth:`commit` it (or :meth:`abort` it).

        Raises:
            ShmSyncError: this writer already has a write open (say, a CUDA publish in flight).
        """
        if self.writing is not None:
            raise ShmSyncError(
                f"store {self.words.name!r}: this process is still writing slot {self.writing.slot}; "
                "one publish at a time (wait for the pending one)"
            )
        backed_off: tuple[int, ...] = ()
        for _ in range(1000):
            target = self.choose_target(backed_off)
            if target is None:
                if not backed_off:  # at most num_slots - 2 slots are leased: unreachable
                    raise ShmSyncError(f"store {self.words.name!r}: every slot but the latest is leased by a reader")
                backed_off = ()  # those leases may have been brief: look again
                continue
            write = self.mark(target, self.words.h[W_VERSION] + 1 if version is None else version)
            if write is not None:
                if steps is not None:
                    write = write._replace(steps=steps)
                self.writing = write
                return write
            backed_off += (target,)
        raise ShmSyncError(f"store {self.words.name!r}: readers kept leasing every free slot")

    def mark(self, target: int, version: int = -1) -> Write | None:
        """Take the writer's half of the write handshake: mark ``target`` odd, then, after a full
        fence, look for a confirmed lease on it.

        Args:
            target: the slot to write.
            version: the version the write will commit (-1 for a slot being given back).

        Returns:
            The :class:`Write`, or None if a reader leased the slot meanwhile. The slot is then left
            untouched, its sequence moved on to the next even number.
        """
        w = self.words
        h = w.h
        seq = h[w.seq[target]]
        odd = seq + 2 if seq & 1 else seq + 1  # odd already: a writer died mid-copy
        h[w.seq[target]] = odd
        w.full_fence()  # the store above before the lease loads below
        if not h[w.leases[target]] or not self.leases.row_leased(target, confirmed=True):
            held = -1 if seq & 1 else h[w.slot_version[target]]  # a write that never ended left no version whole
            return Write(target, odd, held, version, h[W_STEPS])
        h[w.seq[target]] = odd + 1
        return None

    def commit(self, write: Write) -> int:
        """Make the written slot the latest complete version, the one its write began with.

        Args:
            write: the write this writer has open, its copy done.

        Returns:
            The version committed.
        """
        w = self.words
        h, slot, version = w.h, write.slot, write.version
        h[w.slot_version[slot]] = version
        w.fence()  # the copy's stores and the version before the sequence
        h[w.seq[slot]] = write.seq + 1
        self.replaced = self.seen_latest  # idle_slots' hint: readers leave that slot next
        h[w.latest] = slot
        h[w.version] = version
        now, last = self.clock(), h[w.publish_ns]
        h[w.publish_interval] = now - last if last else 0
        h[w.publish_ns] = now
        h[w.publish_count] += 1
        if version > h[W_VERSION]:  # a new version of the store (a fill from another bank is not)
            h[W_VERSION] = version
            h[W_PUBLISH_NS] = now
            h[W_PUBLISH_COUNT] += 1
            h[W_WRITER_PID] = self.pid
            # The steps ring (see shmsync.core.header): the version's tag and its steps in one
            # store, so that no reader of the ring takes one version's steps for another's.
            steps = write.steps if 0 <= write.steps < _NOT_COUNTED else _NOT_COUNTED
            h[W_STEP_RING + version % STEP_RING] = (version & _TAG) << RING_STEPS_BITS | steps
            self.steps[version] = write.steps
            if len(self.steps) > KEPT_STEPS:
                self.steps.popitem(last=False)
        self.writing = None
        return version

    def abort(self, write: Write) -> None:
        """Give up a write whose copy failed. The slot is left empty: it is never the latest, and no
        reader copies it.

        Args:
            write: the write this writer has open.
        """
        w = self.words
        w.h[w.slot_version[write.slot]] = -1
        w.fence()
        w.h[w.seq[write.slot]] = write.seq + 1
        self.writing = None

    def promise(self, version: int) -> None:
        """Say that ``version`` is on its way, for a publish that returns before it is visible. A
        reader waiting for it waits while :meth:`SlotReader.promise_stands`.

        Args:
            version: the version promised (a lower one than already promised changes nothing).
        """
        h = self.words.h
        if version > h[W_PROMISED]:
            h[W_PROMISED] = version

    def withdraw(self) -> None:
        """Withdraw a promise whose version will not come, because its copy failed or a writer died
        before it landed. The promise falls back to the version this bank holds, so that readers
        waiting for it go on at once."""
        h = self.words.h
        h[W_PROMISED] = h[self.words.version]

    def choose_target(self, backed_off: tuple[int, ...] = ()) -> int | None:
        """Serve a pending pin request, then pick the slot to write. It never waits.

        Args:
            backed_off: slots a reader leased while this write marked them, left alone this time.

        Returns:
            The slot, or None if every slot but the latest is leased or backed off from.
        """
        w = self.words
        h = w.h
        request = h[w.pin_request]
        if request != h[w.pin_grant]:
            self.serve_pin_request(request)
        pinned = h[w.pin_slot] if h[w.pin_release] < h[w.pin_grant] else -1
        latest = h[w.latest] if h[w.version] >= 0 else -1
        self.seen_latest = latest  # only the writer moves it: still the latest at the commit
        others = [s for s in range(w.num_slots) if s != latest and s not in backed_off]
        free = [s for s in others if not h[w.leases[s]]]
        candidates = [s for s in free if s != pinned]
        if not candidates:
            candidates = self._writable(others, free, pinned)
        # Slots holding a version (their memory is there) before empty ones, the oldest first.
        versions = {s: h[w.slot_version[s]] for s in candidates}
        return min(candidates, key=lambda s: (versions[s] < 0, versions[s])) if candidates else None

    def _writable(self, others: list[int], free: list[int], pinned: int) -> list[int]:
        """Of ``others`` (``free``: those no count says leased), when none of ``free`` may be written:
        the ones the writer may write, asking the rows if every count says leased (a count may be too
        high), or failing those, a lease still being decided."""
        if not free:
            free = [s for s in others if not self.leases.row_leased(s)]
        candidates = [s for s in free if s != pinned]
        if not candidates:  # a lease still being decided gives way (see Handshakes)
            undecided = [s for s in others if not self.leases.row_leased(s, confirmed=True)]
            # With 2 slots, so does a pin: the pinned reader retries.
            candidates = [s for s in undecided if s != pinned] or free or undecided
        return candidates

    def idle_slots(self, keep_warm: bool = False) -> list[int]:
        """List the slots whose memory may be given back: those neither latest, nor pinned, nor
        leased, except the one the next write takes. No slot is kept while readers hold only the
        version the last commit replaced, since its slot is the next write's once they reload. It
        never waits. Give each slot back as it is written: :meth:`mark` it (None: a reader leased it
        meanwhile, so keep it), drop its pages, then :meth:`abort` the write.

        Args:
            keep_warm: keep the next write's slot even then. A slot that holds a version is cheaper
                to write than an empty one (the writer copies only what changed since it), and the
                next write may come before the readers move on.

        Returns:
            The slots, none while a write is open.
        """
        if self.writing is not None:
            return []
        w = self.words
        h = w.h
        pinned = h[w.pin_slot] if h[w.pin_release] < h[w.pin_grant] else -1
        latest = h[w.latest]
        idle, held = [], []
        for s in range(w.num_slots):
            if s != latest:
                if h[w.leases[s]] and self.leases.row_leased(s):
                    held.append(s)
                elif s != pinned:
                    idle.append(s)
        keep = self._kept(idle, held, keep_warm)
        return [s for s in idle if s != keep]

    def _kept(self, idle: list[int], held: list[int], keep_warm: bool) -> int:
        """Of the ``idle`` slots, the one kept for the next write (-1: none): the one holding a
        version, least recently written. Unless ``keep_warm``, none is kept while readers hold only
        the version just replaced (``held``): they move on at their next reload, and its slot is
        then the next write's."""
        w = self.words
        versions = {s: w.h[w.slot_version[s]] for s in idle}  # only this writer changes them
        warm = [s for s in idle if versions[s] >= 0]
        if not warm or not keep_warm and held and all(s == self.replaced for s in held):
            return -1
        return min(warm, key=versions.__getitem__)

    def serve_pin_request(self, request: int) -> None:
        """Grant ticket ``request``, which waits: pin a slot for the reader that asked, the one
        :meth:`pin_candidate` chooses.

        Args:
            request: the ticket in the bank's ``pin_request`` word.
        """
        w = self.words
        h = w.h
        w.fence()  # the ticket before the leases pin_candidate reads (see Handshakes)
        h[w.pin_slot] = self.pin_candidate()
        w.fence()
        h[w.pin_grant] = request

    def pin_candidate(self) -> int:
        """Choose the slot to pin for a reader whose copies keep failing. A slot that a reader in
        place leases, besides the latest, is chosen if there is one: it is already safe from the
        writer, so the pin costs no slot, and its version is older but complete.

        Returns:
            That slot, or else the latest.
        """
        w = self.words
        h = w.h
        latest = h[w.latest]
        for s in range(w.num_slots):
            if s != latest and h[w.leases[s]] and not h[w.seq[s]] & 1 and self.leases.row_leased(s):
                return s
        return latest


class SlotReader:
    """The reader's side of the protocol on one bank: a copy validated by its sequence word, or, as
    the fallback, a copy of a slot pinned for it. A :class:`~shmsync.WeightReader` holds one.

    Args:
        words: the bank's words.
        locks: the locks through which the bank's reader token is taken.
        pid: this process's id as written into the header.
        stopped: says whether a pid is a stopped process, whose reader token may be taken over.
        clock: wall-clock time in ns, to tell the writer's pace.
        timer: a monotonic ns counter, to time a copy. Tests drive it and ``clock`` by hand.

    Examples:
        >>> h = [0] * 20480
        >>> initialize(h, 3)
        >>> words = Words(h)
        >>> writer = SlotWriter(words, Leases(words, LocalLocks()))
        >>> slots = [None] * 3
        >>> write = writer.begin_write()
        >>> slots[write.slot] = "weights v0"
        >>> writer.commit(write)
        0
        >>> got = []
        >>> SlotReader(words, LocalLocks()).try_read(lambda slot: got.append(slots[slot])), got
        (0, ['weights v0'])
    """

    def __init__(
        self,
        words: Words,
        locks: Locks,
        *,
        pid: int | None = None,
        stopped: Callable[[int], bool] = pid_stopped,
        clock: Callable[[], int] = time.time_ns,
        timer: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.words = words
        self.locks = locks
        self.pid = os.getpid() if pid is None else pid
        self.stopped = stopped
        self.clock, self.timer = clock, timer
        self.retries = 0  # optimistic copies that failed validation
        self.pinned_reads = 0  # reads that needed the pinned fallback
        self.copy_ns = 0  # how long this reader's last copy took

    def read(self, copy: CopyFn, *, max_attempts: int = 2, timeout: float = 60.0) -> int:
        """Run ``copy(slot)`` on the newest complete slot until one copy validates: optimistic copies
        first, then the pinned fallback.

        Args:
            copy: copies out of the slot of that index; it must have finished reading the slot
                when it returns.
            max_attempts: the optimistic copies tried before a pin is asked for.
            timeout: the seconds a copy may take to validate.

        Returns:
            The version copied.

        Raises:
            ReloadTimeoutError: no copy validated within ``timeout`` seconds.
        """
        if not self.outpaced():
            for _ in range(max_attempts):
                version = self.try_read(copy)
                if version is not None:
                    return version
        return self.read_pinned(copy, time.monotonic() + timeout)

    def outpaced(self) -> bool:
        """Say whether this reader's copies take longer than the writer, publishing now, surely
        leaves the latest slot alone. An optimistic copy could then fail, so the reader asks for a
        pin at once and loads in one copy. A writer publishing back to back may rewrite that slot
        at the second publish after it was written (it alternates between two slots while nobody
        leases: see :meth:`SlotWriter.choose_target`), and the reader finds it at any point of the
        first interval: one interval is what is sure."""
        w = self.words
        interval = w.h[w.publish_interval]
        if not interval or self.copy_ns <= interval:
            return False
        return self.clock() - w.h[w.publish_ns] < 4 * interval  # still publishing at that pace

    def try_read(self, copy: CopyFn) -> int | None:
        """Make one optimistic copy of the latest slot.

        Args:
            copy: copies out of the slot of that index.

        Returns:
            The version copied, or None if the copy did not validate.

        Raises:
            StoreCorruptError: the bank's ``latest`` word is no slot.
        """
        w = self.words
        slot = w.h[w.latest]
        if not 0 <= slot < w.num_slots:
            slot_index(slot, w.num_slots, "latest", w.name)  # raises, naming it
        version = self.copy_validated(slot, copy)  # None: `latest` moved on, being rewritten
        if version is None:
            self.retries += 1
        return version

    def copy_validated(self, slot: int, copy: CopyFn) -> int | None:
        """Make the seqlock read of one slot: ``copy(slot)`` between two loads of its sequence number.

        Args:
            slot: the slot to copy.
            copy: copies out of the slot of that index.

        Returns:
            The slot's version if both loads saw the same even number, else None: the slot is being,
            or was, rewritten meanwhile, and the copy must not be used. None comes at once for an
            empty slot (one given back after the reader took it for the latest, its sequence even
            again).
        """
        w = self.words
        h = w.h
        seq = h[w.seq[slot]]
        if seq & 1:
            return None
        w.fence()  # the sequence before the version and the bytes
        version = h[w.slot_version[slot]]
        if version < 0:
            return None  # given back (or a write aborted) since `slot` was read as latest: nothing to copy
        began = self.timer()
        copy(slot)
        self.copy_ns = self.timer() - began
        w.fence()  # the bytes before the sequence, again
        return version if h[w.seq[slot]] == seq else None

    def read_pinned(self, copy: CopyFn, deadline: float, steal_after: float = 0.25) -> int:
        """Take the bounded fallback: hold the bank's reader token and copy a slot the writer pinned.

        Args:
            copy: copies out of the slot of that index.
            deadline: the :func:`time.monotonic` time by which a copy must have validated.
            steal_after: the seconds after which a token held by a stopped process is taken over.

        Returns:
            The version copied.

        Raises:
            ReloadTimeoutError: no copy validated by ``deadline``.
        """
        w, locks, bank = self.words, self.locks, self.words.bank
        h = w.h
        self.pinned_reads += 1
        waited_since = time.monotonic()
        looked = 0.0
        token = locks.try_token(bank)
        while not token:
            # Another reader holds the token; it finishes in one copy. Keep trying meanwhile.
            version = self.try_read(copy)
            if version is not None:
                return version
            self._check_deadline(deadline, "waiting for the reader token")
            now = time.monotonic()
            if now - waited_since > steal_after and now - looked > 0.05:
                looked = now
                if self.stopped(h[w.token_pid]):
                    break  # a stopped holder: take over its pin without the token (see above)
            time.sleep(0.0005)
            token = locks.try_token(bank)
        if token:
            h[w.token_pid] = self.pid
        try:
            while True:
                ticket = h[w.pin_request] + 1
                h[w.pin_request] = ticket
                try:
                    version = self._await_pin(copy, ticket, deadline)
                finally:
                    w.fence()  # the copy's loads before the release
                    h[w.pin_release] = ticket  # a newer ticket's pin stays active: GRANT > this
                if version is not None:
                    return version
        finally:
            if token:
                h[w.token_pid] = 0
                locks.release_token(bank)

    def _await_pin(self, copy: CopyFn, ticket: int, deadline: float) -> int | None:
        w = self.words
        h = w.h
        published = h[w.publish_count]
        waited_since = time.monotonic()
        # A writer that publishes every `interval` grants within about that; only one that
        # stays quiet longer is idle, and then an optimistic copy succeeds.
        patience = max(0.002, 2e-9 * h[w.publish_interval]) if self.outpaced() else 0.002
        while True:
            if h[w.pin_grant] == ticket:
                w.fence()  # the grant before the pinned slot's words
                slot = slot_index(h[w.pin_slot], w.num_slots, "pin_slot", w.name)
                return self.copy_validated(slot, copy)  # None: with 2 slots only
            # No grant yet. A writer that has not published for `patience` is idle or in a
            # long copy; an optimistic copy then succeeds (or at worst fails once). The wait
            # counts from the writer's last publish, not from the request: a writer may publish
            # once more without seeing the ticket, and then stop.
            count = h[w.publish_count]
            if count != published:
                published, waited_since = count, time.monotonic()
            elif time.monotonic() - waited_since > patience:
                version = self.try_read(copy)
                if version is not None:
                    return version
                waited_since = time.monotonic()
            self._check_deadline(deadline, "waiting for the writer to pin a slot")
            time.sleep(0.0001)

    def promise_stands(self, target: int) -> bool:
        """Say whether version ``target``, once promised, may still land in this bank: it has not
        landed (the bank's version is below it) and it was not withdrawn (the promised word is still
        at or above it). A reader waiting for ``target`` stops waiting when this turns False."""
        h = self.words.h
        return h[self.words.version] < target and h[W_PROMISED] >= target

    def _check_deadline(self, deadline: float, doing: str) -> None:
        if time.monotonic() > deadline:
            raise ReloadTimeoutError(f"store {self.words.name!r}: no complete version could be read in time ({doing})")
