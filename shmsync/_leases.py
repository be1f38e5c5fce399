"""Slot leases: readers whose modules use a slot's memory in place, without copying it.

A reader in zero-copy mode points its module's parameters at the read-only views of
one slot and holds a *lease* on it; the writer never writes a leased slot. Leases are
recorded in the reader table (each row's lease word, ``slot + 1``) and summed per slot
into ``W_LEASES + i``, which is all the writer reads.

Rules that keep the writer from ever waiting:

* a reader leases only the ``latest`` slot, and gives up its previous lease in the same
  step (its module is not in use while it reloads);
* a lease is refused if afterwards more than ``num_slots - 2`` distinct slots would be
  leased or pinned (for a starving copying reader, see the store): the writer then always
  has a slot that is neither latest, nor leased, nor pinned. A refused reader copies
  instead, like a reader without zero-copy. The writer pins a leased slot when there is
  one besides the latest, so a pin costs no slot of its own;
* lease changes happen under the table lock (readers only: the writer never takes it)
  and update the per-slot counts. A count may only be too high (a reader that died
  holding a lease, a lease given up without the lock); the rows are the truth. So a
  reader about to be refused first recomputes the counts from the rows of live
  processes, and the writer, when a count says a slot is leased, asks the rows
  (:func:`row_leased`) before believing it.

Handshake with the writer (the store's ``_begin_write``): the writer marks its target
odd, issues a full fence, then reads the target's lease count, and backs off to another
slot if it is leased. A reader records its lease, issues a full fence, then checks that
the slot's sequence number did not move. Of two such racing parties at least one sees
the other, so a slot is never both written and leased.
"""

from __future__ import annotations

import platform
import threading
import time

from ._header import (
    MAX_READERS,
    READER_WORDS,
    W_LATEST,
    W_LEASES,
    W_PIN_GRANT,
    W_PIN_RELEASE,
    W_PIN_SLOT,
    W_READERS,
    W_SEQ,
    W_SLOT_VERSION,
)
from ._segment import TABLE_LOCK, Segment

# full_fence() relies on a locked instruction being a full barrier, as on x86-64;
# elsewhere leases are refused and zero-copy readers copy.
SUPPORTED = platform.machine() in ("x86_64", "AMD64")
_FENCE = threading.Lock()


def full_fence() -> None:
    """Order the stores above before the loads below (a locked instruction on x86-64)."""
    with _FENCE:
        pass


def lease_word(row: int) -> int:
    return W_READERS + row * READER_WORDS + 4


def row_leased(h, slot: int) -> bool:
    """Whether any row of the reader table leases ``slot`` (dead readers' rows included)."""
    want = slot + 1
    return any(h[lease_word(row)] == want for row in range(MAX_READERS))


def _recount(h, num_slots: int, alive) -> set[int]:
    """Recompute the per-slot lease counts from the rows of live readers; the leased slots."""
    counts = [0] * num_slots
    for row in range(MAX_READERS):
        word = lease_word(row)
        pid, lease = h[W_READERS + row * READER_WORDS], h[word]
        if lease and pid and alive(pid):
            counts[lease - 1] += 1
        elif lease:
            h[word] = 0  # a dead reader's lease
    for slot, n in enumerate(counts):
        h[W_LEASES + slot] = n
    return {slot for slot, n in enumerate(counts) if n}


class TableLock:
    """The reader table's lock, for this process's threads too (an OFD lock does not exclude
    threads sharing one file description, so each segment also has a thread lock). With
    ``patience`` (seconds) both are given up after that long in all (a stopped holder must not
    stall a reload: the caller then copies instead) and ``with`` yields whether it was taken;
    None waits for it."""

    def __init__(self, segment: Segment, patience: float | None = 0.01) -> None:
        self.segment, self.patience = segment, patience

    def __enter__(self) -> bool:
        threads = self.segment.thread_lock
        if self.patience is None:
            threads.acquire()
            self.segment.lock(TABLE_LOCK, exclusive=True, wait=True)
            return True
        deadline = time.monotonic() + self.patience
        if not threads.acquire(timeout=self.patience):
            return False
        while not self.segment.lock(TABLE_LOCK, exclusive=True, wait=False):
            if time.monotonic() > deadline:
                threads.release()
                return False
            time.sleep(0.0001)
        return True

    def __exit__(self, *exc) -> None:
        if self.segment.held(TABLE_LOCK):
            self.segment.unlock(TABLE_LOCK)
            self.segment.thread_lock.release()


def lease_latest(h, segment: Segment, row: int, num_slots: int, alive) -> tuple[int, int] | None:
    """Move ``row``'s lease to the latest slot. Returns ``(slot, version)``, or None if the
    lease is refused (the row then keeps its previous lease, if any)."""
    if not SUPPORTED:
        return None
    word = lease_word(row)
    with TableLock(segment) as locked:
        if not locked:
            return None
        slot = h[W_LATEST]
        seq = h[W_SEQ + slot]
        version = h[W_SLOT_VERSION + slot]
        if seq & 1 or version < 0:
            return None  # `latest` moved on and that slot is already being rewritten
        previous = h[word]
        counts = [h[W_LEASES + s] for s in range(num_slots)]
        if previous:
            counts[previous - 1] -= 1
        counts[slot] += 1
        h[word] = slot + 1
        pinned = {h[W_PIN_SLOT]} if h[W_PIN_RELEASE] != h[W_PIN_GRANT] else set()
        if len({s for s, n in enumerate(counts) if n > 0} | pinned) <= num_slots - 2:
            for s in {slot, previous - 1} - {-1}:
                h[W_LEASES + s] = counts[s]
        elif len(_recount(h, num_slots, alive) | pinned) > num_slots - 2:  # dead readers' leases dropped
            h[word] = previous
            _recount(h, num_slots, alive)
            return None
    full_fence()  # the lease stores above before the sequence load below
    # A writer that starts on `slot` from now on sees the lease; one that started before
    # has already moved its sequence.
    if h[W_SEQ + slot] != seq:
        release(h, segment, row, num_slots, alive)
        return None
    return slot, version


def release(h, segment: Segment, row: int, num_slots: int, alive) -> None:
    """Give up ``row``'s lease. If the table stays busy, the counts are left for the next
    lease change to recompute: the writer avoids that slot a little longer, which is safe."""
    word = lease_word(row)
    if not h[word]:
        return
    with TableLock(segment) as locked:
        slot = h[word] - 1
        h[word] = 0
        if locked:
            h[W_LEASES + slot] = max(0, h[W_LEASES + slot] - 1)
