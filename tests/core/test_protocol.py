"""The slot protocol, step by step: chosen interleavings of one writer and its readers on a
plain list of header words, without torch or processes (see shmsync/core/protocol.py)."""

import itertools
import threading
import time

import pytest

from shmsync.core.header import (
    B_LATEST,
    B_LEASES,
    B_PIN_GRANT,
    B_PIN_RELEASE,
    B_PIN_REQUEST,
    B_PIN_SLOT,
    B_SLOT_VERSION,
    HEADER_WORDS,
    HOST,
    MAX_READERS,
    R_LEASE,
    ROW_WORDS,
    W_VERSION,
    bank_word,
)
from shmsync.core.protocol import LocalLocks, ReaderRows, Words, initialize
from shmsync.errors import ReloadTimeoutError, ShmSyncError
from tests.commands import python, run_command
from tests.core.parties import Party, WriterParty

# The host bank's words, as these tests poke them.
W_LATEST = bank_word(HOST, B_LATEST)
W_LEASES = bank_word(HOST, B_LEASES)
W_PIN_GRANT = bank_word(HOST, B_PIN_GRANT)
W_PIN_RELEASE = bank_word(HOST, B_PIN_RELEASE)
W_PIN_REQUEST = bank_word(HOST, B_PIN_REQUEST)
W_PIN_SLOT = bank_word(HOST, B_PIN_SLOT)
W_SLOT_VERSION = bank_word(HOST, B_SLOT_VERSION)


def lease_word(row: int) -> int:
    return ROW_WORDS[row][R_LEASE]


ORDERINGS = ["tso", "weak"]  # "weak" runs the real fences of non-x86 CPUs, on any CPU


class Store:
    """A header, ``n`` slots of two words each, and a writer whose steps can be run one at a time."""

    def __init__(self, num_slots: int = 3, ordering: str = "tso") -> None:
        self.h = [0] * HEADER_WORDS
        initialize(self.h, num_slots)
        self.locks = LocalLocks()
        self.slots = [[None, None] for _ in range(num_slots)]
        self.ordering = ordering
        self.writer = WriterParty(self.h, self.locks, ordering=ordering, pid=1)
        self.publish(0)

    def protocol(self, pid: int, **kwargs) -> Party:
        return Party(self.h, self.locks, ordering=self.ordering, pid=pid, **kwargs)

    def publish_steps(self, version: int):
        """A publish of ``version`` as a generator: one step per store into shared memory."""
        write = self.writer.begin_write(version)
        yield
        self.slots[write.slot][0] = version
        yield
        self.slots[write.slot][1] = version
        yield
        self.writer.commit(write)

    def publish(self, version: int) -> None:
        for _ in self.publish_steps(version):
            pass


def writer_steps(store: Store, first: int, publishes: int):
    """Every step of ``publishes`` publishes, versions ``first``, ``first + 1``..., one at a time."""
    for v in range(first, first + publishes):
        yield from store.publish_steps(v)
        yield


def run(steps, n: int) -> None:
    for _ in range(n):
        if next(steps, StopIteration) is StopIteration:
            return


def copy_during(store: Store, publishes: int, before: int, between: int = 0, after: int = 0):
    """One optimistic read of ``store`` with the writer's next ``publishes`` publishes run, step by
    step, ``before`` steps before the copy's first word, ``between`` the words and ``after`` the
    second. Returns (the version the read accepted or None, the words it copied)."""
    steps = writer_steps(store, store.h[W_VERSION] + 1, publishes)
    got = []

    def copy(slot):
        run(steps, before)
        got.append(store.slots[slot][0])
        run(steps, between)
        got.append(store.slots[slot][1])
        run(steps, after)

    version = store.protocol(2).try_read(copy)
    run(steps, 4 * publishes)  # the rest
    return version, got


@pytest.mark.parametrize("ordering", ORDERINGS)
@pytest.mark.parametrize("num_slots", [2, 3, 4])
def test_an_optimistic_copy_is_accepted_only_if_no_write_touched_it(num_slots, ordering):
    """Every split of up to 4 publishes around the two words of one reader copy."""
    publishes = 4
    total = 4 * publishes
    accepted = rejected = 0
    for before, between, after in itertools.product(range(total + 1), repeat=3):
        if before + between + after > total:
            continue
        version, got = copy_during(Store(num_slots, ordering), publishes, before, between, after)
        if version is None:
            rejected += 1
            continue
        accepted += 1
        assert got == [version, version], f"accepted a mixed copy {got} as v{version} ({before}, {between}, {after})"
    assert accepted and rejected


def test_a_copy_is_overtaken_only_once_the_writer_starts_a_second_publish():
    """A copy of the latest slot survives one whole publish. The writer takes slots holding a
    version before empty ones (their memory is there), so it alternates between two slots."""
    assert copy_during(Store(3), 2, before=4) == (0, [0, 0])
    assert copy_during(Store(3), 2, before=4 + 1)[0] is None


def test_the_writer_alternates_between_two_slots_and_leaves_the_others_empty():
    store = Store(4)
    written = []
    for v in range(1, 7):
        write = store.writer.begin_write(v)
        written.append(write.slot)
        store.writer.commit(write)
    assert written == [1, 0, 1, 0, 1, 0]
    assert [store.h[W_SLOT_VERSION + s] for s in (2, 3)] == [-1, -1]


@pytest.mark.parametrize("ordering", ORDERINGS)
def test_a_starving_reader_gets_a_pinned_slot_and_finishes_in_one_more_copy(ordering):
    """A reader whose every copy spans 3 publishes never validates optimistically; the pin
    bounds it: the writer keeps publishing, into the other slots."""
    store = Store(3, ordering)
    reader = store.protocol(2)
    version = [10]
    copies = []

    def slow_copy(slot):
        first = store.slots[slot][0]
        for _ in range(3):
            store.publish(version[0])
            version[0] += 1
        copies.append([first, store.slots[slot][1]])

    got = reader.read(slow_copy, max_attempts=2, timeout=10)
    assert reader.retries == 2 and reader.pinned_reads == 1
    assert len(copies) == 3, f"{len(copies)} copies: the pin did not bound the reader"
    assert copies[-1] == [got, got]


def test_a_reader_slower_than_the_writer_loads_in_one_copy_once_it_knows():
    """The writer publishes every millisecond of a clock driven by the test; each copy of the
    reader takes 6 of them. After its first load shows that, later loads skip the optimistic
    copies that would only fail and ask for the pin at once (before: two failed copies a load)."""
    now = [1_000_000_000]

    def clock():
        return now[0]

    store = Store(3)
    store.writer.clock = clock
    reader = store.protocol(2, clock=clock, timer=clock)
    version = [1]
    got = []

    def slow_copy(slot):
        first = store.slots[slot][0]
        for _ in range(6):  # the writer keeps its pace while the copy runs
            now[0] += 1_000_000
            store.publish(version[0])
            version[0] += 1
        got.append([first, store.slots[slot][1]])

    reader.read(slow_copy, timeout=10)
    learned = reader.retries
    assert learned >= 1, "the writer never overtook a copy: the test does not test anything"
    for _ in range(5):
        got.clear()
        loaded = reader.read(slow_copy, timeout=10)
        assert got[-1] == [loaded, loaded] and len(got) == 1, f"a load took {len(got)} copies"
    assert reader.retries == learned, (
        f"{reader.retries - learned} failed copies in 5 loads of a reader known to be slow"
    )


def _token_holder_in_copy(store: Store, a: Party, during):
    """Reader ``a`` takes the token, and its next publish pins the slot ``a`` copies; in the
    middle of that copy ``during()`` runs and the writer publishes twice more. Returns
    (a's version, the words it copied last, what ``during`` returned)."""
    out = []

    def copy(slot):
        first = store.slots[slot][0]
        if not out:
            store.publish(50)  # serves a's ticket: pins the latest slot, the one a copies
            out.append(during())
            store.publish(60)  # the writer keeps going, around the pin if it still holds
            store.publish(70)
        out.append([first, store.slots[slot][1]])

    version = a.read_pinned(copy, time.monotonic() + 10, steal_after=0.0)
    return version, out[-1], out[0]


def _overtaking_copy(store: Store, first_version: int, unless_ticket_moved_from: int | None = None):
    """A copy during which the writer publishes 3 times (it never validates optimistically)."""
    version = [first_version]

    def copy(slot):
        if unless_ticket_moved_from is not None and store.h[W_PIN_REQUEST] != unless_ticket_moved_from:
            return  # its own pin now: left alone
        for _ in range(3):
            store.publish(version[0])
            version[0] += 1

    return copy


def test_a_running_token_holder_keeps_its_pin_from_another_slow_reader():
    store = Store(3)
    a = store.protocol(2, stopped=lambda pid: False)
    b = store.protocol(3, stopped=lambda pid: False)

    def b_tries():
        ticket = store.h[W_PIN_REQUEST]
        with pytest.raises(ReloadTimeoutError, match="reader token"):
            b.read(_overtaking_copy(store, 1000), max_attempts=1, timeout=0.3)
        return store.h[W_PIN_REQUEST] == ticket

    version, got, pin_untouched = _token_holder_in_copy(store, a, b_tries)
    assert pin_untouched, "a reader took the pin off a token holder that was running"
    assert got == [version, version] and a.pinned_reads == 1


def test_a_stopped_token_holder_loses_its_pin_and_its_copy_is_then_rejected():
    store = Store(3)
    a = store.protocol(2)
    b = store.protocol(3, stopped=lambda pid: pid == 2)

    def b_reads():
        ticket = store.h[W_PIN_REQUEST]
        got = b.read(_overtaking_copy(store, 1000, unless_ticket_moved_from=ticket), max_attempts=1, timeout=5)
        return got, store.h[W_PIN_REQUEST] > ticket

    version, got, (b_version, b_took_pin) = _token_holder_in_copy(store, a, b_reads)
    assert b_took_pin and b_version >= 1000
    assert got == [version, version], f"a resumed copy was accepted mixed: {got} as v{version}"
    assert a.retries >= 1, "the copy whose pin was taken over was not rejected"


def test_one_write_at_a_time_per_process():
    store = Store(3)
    write = store.writer.begin_write()
    with pytest.raises(ShmSyncError, match="still writing slot"):
        store.writer.begin_write()
    assert store.writer.commit(write) == 1
    store.writer.abort(store.writer.begin_write())
    assert store.writer.commit(store.writer.begin_write()) == 2


def test_an_aborted_write_is_never_read():
    store = Store(3)
    write = store.writer.begin_write()
    store.slots[write.slot] = ["garbage", "garbage"]
    store.writer.abort(write)
    reader = store.protocol(2)
    got = []
    assert reader.try_read(lambda slot: got.extend(store.slots[slot])) == 0 and got == [0, 0]
    assert store.writer.choose_target() == write.slot  # rewritten first


def test_the_reader_table_holds_1024_readers_and_a_reader_without_a_row_never_leases():
    assert MAX_READERS >= 1024
    store = Store(4)
    readers = [store.protocol(10 + i) for i in range(MAX_READERS)]
    rows = [r.claim_row() for r in readers]
    assert sorted(rows) == list(range(MAX_READERS))
    late = store.protocol(99_999)
    assert late.claim_row() == -1
    before = list(store.h)
    assert late.lease_latest(-1) is None
    late.release_lease(-1)
    assert store.h == before, "a reader without a row wrote into the header"
    # A dead reader's row (its lock dropped, its pid still written) is claimed again once the table
    # is full; a live reader's row never is, whatever its pid says.
    store.locks.rows.discard(rows[7])
    again = store.protocol(123_456)
    assert again.claim_row() == rows[7]
    assert store.protocol(7).claim_row() == -1


def test_a_lease_taken_while_the_writer_starts_on_that_slot_is_refused_or_seen():
    """The handshake: the writer commits and starts on the slot a reader is leasing, in the
    window between the reader's lease store and its check. One of them must back off."""
    store = Store(4)

    class Hooked(LocalLocks):
        def __init__(self, then):
            super().__init__()
            self.then = then

        def table(self, patience):
            inner = super().table(patience)

            class Ctx:
                def __enter__(s):
                    return inner.__enter__()

                def __exit__(s, *exc):
                    out = inner.__exit__(*exc)
                    self.then()
                    return out

            return Ctx()

    writes, armed = [], []

    def writer_moves():
        if armed and not writes:
            store.publish(1)  # the leased slot is no longer latest
            writes.append(store.writer.begin_write())

    reader = Party(store.h, Hooked(writer_moves), pid=2)
    row = reader.claim_row()
    armed.append(True)
    leased = reader.lease_latest(row)
    assert writes, "the writer did not run inside the lease"
    assert leased is not None and store.h[lease_word(row)] == leased[0] + 1
    assert writes[0].slot != leased[0], "the writer is writing the slot a reader leases"


def test_leases_leave_the_writer_a_free_slot():
    store = Store(3)
    a, b = (store.protocol(pid) for pid in (2, 3))
    ra, rb = a.claim_row(), b.claim_row()
    slot, _ = a.lease_latest(ra)
    store.publish(1)
    assert b.lease_latest(rb) is None, "two leased slots of three leave the writer none"
    for v in range(2, 6):
        store.publish(v)
        assert store.slots[slot] == [0, 0], "the writer wrote a leased slot"
    a.release_lease(ra)
    assert b.lease_latest(rb) is not None


class Turns:
    """Real protocol calls in threads, each stopped at a chosen point and let go by the test: a
    schedule the interleaving checker found, replayed on the code itself."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.stopped: set[str] = set()
        self.threads: list[threading.Thread] = []
        self.results: dict[str, object] = {}

    def stop_here(self, who: str) -> None:
        with self.cv:
            self.stopped.add(who)
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: who not in self.stopped, 10), f"{who} was never let go"

    def run(self, who: str, call) -> None:
        thread = threading.Thread(target=lambda: self.results.__setitem__(who, call()), daemon=True)
        self.threads.append(thread)
        thread.start()

    def wait_stopped(self, who: str) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: who in self.stopped, 10), f"{who} never reached its stop"

    def go(self, who: str) -> None:
        with self.cv:
            self.stopped.discard(who)
            self.cv.notify_all()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10)
            assert not thread.is_alive()


def stop_at_call(turns: Turns, who: str, fence, n: int):
    """``fence``, stopping ``who`` at its ``n``-th call (counted from 1)."""
    calls = [0]

    def wrapped():
        calls[0] += 1
        fence()
        if calls[0] == n:
            turns.stop_here(who)

    return wrapped


def test_a_lease_decided_while_a_pin_is_granted_never_leaves_the_writer_short():
    """The checker's schedule (tests/core/test_protocol_interleavings.py, no_granting_check): a
    reader in place reads ``latest`` just before a publish; a reader's ticket comes in; the
    writer picks the pin's slot (the new latest, no lease being there yet), and before it grants
    it, the reader in place leases the old latest. The lease and the pin would hold 2 slots of
    3, and the writer would have to write into one of them. The lease must be refused."""
    store = Store(3)
    zero_copy = store.protocol(3)
    row = zero_copy.claim_row()
    turns = Turns()
    zero_copy.fence = stop_at_call(turns, "reader", zero_copy.fence, 1)  # latest and its seq read
    turns.run("reader", lambda: zero_copy.lease_latest(row))
    turns.wait_stopped("reader")
    store.publish(1)
    store.h[W_PIN_REQUEST] += 1  # a starving reader's ticket
    store.writer.fence = stop_at_call(turns, "writer", store.writer.fence, 2)  # the pin's slot chosen, not granted
    turns.run("writer", lambda: store.publish(2))
    turns.wait_stopped("writer")
    turns.go("reader")
    turns.threads[0].join(10)
    turns.go("writer")
    turns.join()
    h = store.h
    assert turns.results["reader"] is None, "a lease was taken while the pin's slot was being chosen"
    pinned = {h[W_PIN_SLOT]} if h[W_PIN_RELEASE] < h[W_PIN_GRANT] else set()
    leased = {h[lease_word(row)] - 1} if h[lease_word(row)] > 0 else set()
    assert len(pinned | leased) <= 1
    h[W_PIN_RELEASE] = h[W_PIN_GRANT]  # the pinned reader is done
    assert zero_copy.lease_latest(row) is not None


def test_with_two_slots_a_lease_being_decided_and_a_pin_never_make_the_writer_wait():
    """The checker's schedule for 2 slots: a reader copies the old latest under a pin while a
    reader in place decides a lease on it. The only slot the writer may write is both: it writes
    through them (the lease is then given up when its reader checks the sequence, and the pinned
    reader retries, as with 2 slots it must)."""
    store = Store(2)
    zero_copy = store.protocol(3)
    row = zero_copy.claim_row()
    h = store.h
    h[W_PIN_REQUEST] = h[W_PIN_GRANT] = 1  # a pin granted on slot 0 while it was latest
    h[W_PIN_SLOT] = 0
    store.publish(1)  # into slot 1
    h[lease_word(row)] = -1  # a lease of slot 0 being decided
    h[W_LEASES + 0] = 1
    store.publish(2)
    assert h[W_LATEST] == 0 and store.slots[0] == [2, 2]


def test_the_protocol_needs_no_torch():
    code = "import sys, shmsync.core.protocol, shmsync.core.fences; assert 'torch' not in sys.modules, 'torch imported'"
    run_command(python("-c", code), check=True)


# -- memory given back ---------------------------------------------------------------------------------
def holds_a_version(store: Store):
    return lambda slot: store.h[W_SLOT_VERSION + slot] >= 0  # what holds pages in these tests


def given_back_after(store: Store, publish: int) -> list[int]:
    store.publish(publish)
    given = store.writer.give_back_idle(lambda slot: store.slots.__setitem__(slot, [0, 0]), holds_a_version(store))
    return sorted(given)


def test_giving_back_keeps_the_latest_and_the_next_writes_slot_and_gives_back_the_rest():
    store = Store(4)
    reader = store.protocol(2)
    row = reader.claim_row()
    leased, _ = reader.lease_latest(row)  # slot 0, version 0
    assert given_back_after(store, 1) == []  # slot 1 latest; 0 leased; 2 and 3 never written
    assert given_back_after(store, 2) == []  # into slot 2 (0 is leased); 1 kept for the next write
    reader.release_lease(row)
    # Version 3 goes into slot 0 (free now, the least recently written); of 1 and 2, 1 is kept.
    assert given_back_after(store, 3) == [2]
    assert store.h[W_SLOT_VERSION + 2] == -1 and store.slots[2] == [0, 0]
    assert store.writer.begin_write().slot == 1, "the writer took an empty slot over one holding a version"


def test_giving_back_never_gives_back_a_pinned_slot_or_one_a_reader_leases_meanwhile():
    store = Store(4)
    store.publish(1)
    store.publish(2)  # slots 1, 0 hold versions; latest is 0
    store.h[W_PIN_SLOT], store.h[W_PIN_GRANT], store.h[W_PIN_RELEASE] = 1, 5, 4  # a reader copies slot 1
    refuse = lambda slot: pytest.fail(f"gave back slot {slot}")  # noqa: E731
    assert store.writer.give_back_idle(refuse, holds_a_version(store)) == []
    store.h[W_PIN_RELEASE] = 5  # released: slot 1 is the next write's, kept
    assert store.writer.give_back_idle(refuse, holds_a_version(store)) == []


def test_an_optimistic_copy_during_a_give_back_fails_validation():
    store = Store(4)
    store.publish(1)  # slot 1 latest, slot 0 holds version 0
    store.publish(2)  # slot 0 latest (version 2), slot 1 holds 1
    store.h[W_SLOT_VERSION + 2] = 0  # a third slot holding a version: slot 1 is no longer the one kept
    reader = store.protocol(2)
    got = []

    def copy(slot):
        got.append(store.slots[slot][0])
        store.writer.give_back_idle(lambda s: store.slots.__setitem__(s, [0, 0]))  # gives back the slot being copied
        got.append(store.slots[slot][1])

    assert reader.copy_validated(1, copy) is None and got == [1, 0]


def test_0_2_0s_rows_made_from_a_banks_words_still_lease_with_a_warning():
    store = Store()
    words = Words(store.h)
    with pytest.warns(DeprecationWarning, match="Leases"):
        rows = ReaderRows(words, store.locks, pid=7)
    row = rows.claim_row()
    with pytest.warns(DeprecationWarning, match="Leases.lease_latest"):
        lease = rows.lease_latest(row)
    assert lease is not None and store.h[lease_word(row)] == lease.slot + 1
    with pytest.warns(DeprecationWarning, match="Leases.release_lease"):
        rows.release_lease(row)
    assert store.h[lease_word(row)] == 0
