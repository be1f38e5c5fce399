"""The slot protocol of ``shmsync/core/protocol.py`` as parties for :mod:`interleavings`: the writer,
a plain reader (optimistic copies, then the token and a pinned copy), a reader in place (leases),
and a reader stopped for good while it asks for a pin; each follows the code line by line, one
step per load, store and fence of a header word (the slots' contents are ``CELLS`` words).

The invariant (:func:`check`) in every state:

* no slot is being written (a write begun and not committed, or a store of it still in a buffer)
  while a reader in place uses it under its lease, nor, with 3 slots or more, while a reader
  copies it under a pin;
* a live reader's lease is counted in its slot's lease count whenever nobody changes the counts
  (they may only be too high);
* confirmed leases and the pin hold at most ``N - 2`` slots between them, so the writer always
  has one to write.

Beside it the explorer checks that the store's version never goes back, that every copy a reader
accepts is whole (its cells hold the version it read), that no party runs into a ``Fail`` (the
writer that would have to wait, a pinned copy that fails validation with 3 slots or more), and
that the parties still alive can always all get done. With ``promises`` the writer promises each
version before its copy (as a CUDA or background publish does), and the copy may fail; a waiting
reader waits for a promised version as a synchronous collector's worker does: that it always gets
done, whatever fails or dies, is what keeps no promise hanging.

With ``records``, a slot holds two leaves, each with its record (the version it last changed at,
as of the slot's version: ``shmsync/core/header.py``), and the trainer's weights change leaf by
leaf (:func:`content`): the writer copies into a slot only the leaves it lacks and their records,
inside the write (``StoreWriter._copy_changes``), and a reader that holds version 0 copies only
the leaves whose record is newer, again after a failed attempt the leaves that attempt wrote
(``shmsync/reader/held_copy.py``). Every copy a reader accepts must then hold, leaf by leaf,
exactly the version it says.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from tests.core.interleavings import (
    Accept,
    Choose,
    Explorer,
    Fail,
    Fence,
    Load,
    Lock,
    Mark,
    Party,
    Result,
    Store,
    Unlock,
)

# -- the protocol, party by party (follow ``shmsync/core/protocol.py``) ------------------------------
CELLS = 1  # a slot's contents beside its version word: a copy that mixes two writes holds a cell of another version
LEAVES = 2  # with records: a slot's leaves, each a cell with a record beside it


@dataclass(frozen=True)
class Options:
    """What the parties do, and the mutations that must make the checker fail."""

    slots: int = 3
    no_writer_full_fence: bool = False  # begin_write's fence between the odd mark and the lease load
    no_reader_full_fence: bool = False  # _move_lease's fence between the decided lease and the pin loads
    no_confirm_fence: bool = False  # _lease_holds's fence between the confirmed lease and the seq load
    latest_before_even: bool = False  # commit publishes `latest` before the slot's seq turns even
    no_commit_fence: bool = False  # commit's fence between the copy and the even seq
    no_read_fences: bool = False  # try_read's fences around the copy
    no_grant_fence: bool = False  # choose_target's fence between the ticket and the lease loads
    no_granting_check: bool = False  # _move_lease leases while a ticket waits for its grant
    no_lease_version_fence: bool = False  # lease_latest's fence between the slot's seq and its version
    no_give_way: bool = False  # choose_target never writes through a lease still being decided
    give_back: bool = False  # the writer gives back the memory of idle slots after each publish
    no_give_back_handshake: bool = False  # a slot is given back without marking it odd and looking at its leases
    give_back_pinned: bool = False  # giving back does not leave the pinned slot alone
    accept_empty: bool = False  # try_read copies a slot whose version is -1 (given back after `latest` was read)
    reloads: int = 2  # the reader in place's reloads (its lease moves between them)
    promises: bool = False  # each publish promises its version first; its copy may fail
    copy_fails: int | None = None  # with promises: 1 every copy fails, 0 none does (None: both explored)
    no_withdraw: bool = False  # a failed copy leaves its promise standing
    wait_on_withdrawn: bool = False  # a waiting reader keeps waiting for a withdrawn promise
    records: bool = False  # per-leaf records: the writer writes what a slot lacks, readers copy what changed
    takeover_publishes: int = 1  # publishes of the new writer that takes over from a dead one
    records_after_commit: bool = False  # the writer writes the records after the commit, outside the write
    record_below_truth: bool = False  # a changed leaf's record keeps the version it changed at before
    no_touched: bool = False  # a reader's retry leaves as it is a leaf its failed attempt wrote
    records_before_seq: bool = False  # a reader reads the records before the slot's sequence number


def cells(o: Options) -> int:
    """The cells of a slot: one, or with records a cell per leaf."""
    return LEAVES if o.records else CELLS


def content(o: Options, version: int, leaf: int) -> int:
    """What leaf ``leaf`` of ``version`` holds: the version itself; with records, the version the
    leaf last changed at (leaf 0, a trained head, changes at version 2 only; leaf 1, a frozen
    backbone, never), so that a reader holding version 0 lacks leaf 0 from version 2 on."""
    if not o.records:
        return version
    return (2 if version >= 2 else 0) if leaf == 0 else 0


def contents(o: Options, version: int) -> tuple[int, ...] | None:
    """What a whole copy of ``version`` holds, leaf by leaf, for an ``Accept`` (None: each cell the version)."""
    return tuple(content(o, version, leaf) for leaf in range(cells(o))) if o.records else None


def writer(o: Options, publishes: int, begun: bool = False, takeover: bool = False) -> Generator:
    """``begin_write`` (with ``choose_target`` and ``pin_candidate``), the copy, ``commit``.
    ``begun``: the first publish has already begun and copied version 1 into slot 1 (see
    :func:`initial_memory`); it goes on from there. ``takeover``: a new writer, which first takes
    the writer's lock (``acquire``) and, with promises, withdraws what a dead writer promised."""
    if takeover and o.promises:
        yield Lock("writer")
        yield from withdraw(o)
    # With records: the version each leaf last changed at, as this writer knows it (SourceChanges'
    # changed_at): the one that made the store published version 0; a new writer knows nothing.
    at = (-1 if takeover else 0,) * cells(o)
    for k in range(publishes):
        if begun and k == 0:
            yield Mark("writing", 1)
            yield from commit(o, 1, 1, 1)
            if o.give_back:
                yield from give_back_idle(o, 0)  # slot 0 was the latest
            continue
        backed_off = ()
        target = odd = -1
        for _attempt in range(4):  # the code's 1000 back-offs: more than 3 here is a writer that waits
            target, seen_latest = yield from choose_target(o, backed_off)
            if target is None:
                if not backed_off:
                    yield Fail("every slot but the latest is leased: the writer would have to wait")
                    return
                backed_off = ()
                continue
            seq = yield Load(("seq", target))
            odd = seq + 2 if seq & 1 else seq + 1
            yield Store(("seq", target), odd)
            if not o.no_writer_full_fence:
                yield Fence(full=True)
            leases = yield Load(("leases", target))
            if not leases or not (yield from row_leased(o, target, confirmed=True)):
                break
            yield Store(("seq", target), odd + 1)
            backed_off = (*backed_off, target)
        else:
            yield Fail("readers kept leasing every free slot: the writer would have to wait")
            return
        yield Mark("writing", target)
        held = -1 if odd == seq + 2 else (yield Load(("ver", target))) if o.records else 0  # mark's Write.held
        version = yield Load("version")
        version = version + 1
        if o.promises:
            promised = yield Load("promised")
            if version > promised:
                yield Store("promised", version)
        if o.records:
            at = yield from copy_changes(o, target, version, held, at)
        else:
            for cell in range(CELLS):
                yield Store(("data", target, cell), version)
        if o.promises:
            fails = o.copy_fails if o.copy_fails is not None else (yield Choose(2, "the copy fails"))
            if fails:
                yield from abort(o, target, odd)
                if not o.no_withdraw:
                    yield from withdraw(o)
                continue
        yield from commit(o, target, odd, version)
        if o.records_after_commit:
            for leaf in range(cells(o)):
                yield Store(("rec", target, leaf), at[leaf])
        if o.give_back:
            yield from give_back_idle(o, seen_latest)


def copy_changes(o: Options, target: int, version: int, held: int, at: tuple) -> Generator:
    """``StoreWriter._copy_changes``: the leaves found changed since the newest version (``version -
    1``), and those that changed since the version the slot held (all of them into an empty slot,
    or where not known), with their records; returns what the writer knows after the publish
    (``SourceChanges.published``)."""
    before = version - 1
    found = tuple(content(o, version, leaf) != content(o, before, leaf) for leaf in range(cells(o)))
    lacks = tuple(leaf for leaf in range(cells(o)) if found[leaf] or held < 0 or not 0 <= at[leaf] <= held)
    for leaf in lacks:
        yield Store(("data", target, leaf), content(o, version, leaf))
    after = tuple(version if found[leaf] else at[leaf] if at[leaf] >= 0 else before for leaf in range(cells(o)))
    if not o.records_after_commit:
        for leaf in lacks:
            changed = at[leaf] if o.record_below_truth and at[leaf] >= 0 else after[leaf]
            yield Store(("rec", target, leaf), changed)
    return after


GIVEN_BACK = -2  # a cell of a slot whose memory was given back (it reads as zeros)


def give_back_idle(o: Options, replaced: int) -> Generator:
    """``StoreWriter._give_back_idle`` (every slot with pages, as the code's default ``holds_pages``): the slots neither
    latest, nor pinned, nor leased, but the one the next write takes (none while readers hold only
    the ``replaced`` slot); each marked through the write handshake (``_mark``), its cells given
    back, then ``abort``."""
    release = yield Load("pin_release")
    grant = yield Load("pin_grant")
    pinned = (yield Load("pin_slot")) if release < grant and not o.give_back_pinned else -1
    latest = yield Load("latest")
    idle, held = (), ()
    for s in range(o.slots):
        if s == latest:
            continue
        count = yield Load(("leases", s))
        if count and (yield from row_leased(o, s)):
            held = (*held, s)
        elif s != pinned:
            idle = (*idle, s)
    keep, keep_version = -1, 0
    for s in idle:
        v = yield Load(("ver", s))
        if v >= 0 and (keep < 0 or v < keep_version):
            keep, keep_version = s, v
    if held and all(s == replaced for s in held):
        keep = -1
    for s in idle:
        if s == keep:
            continue
        if (yield Load(("data", s, 0))) in (-1, GIVEN_BACK):
            continue  # no pages to give back (the code asks the kernel: holds_pages)
        seq = yield Load(("seq", s))
        odd = seq + 2 if seq & 1 else seq + 1
        if not o.no_give_back_handshake:
            yield Store(("seq", s), odd)
            yield Fence(full=True)
            count = yield Load(("leases", s))
            if count and (yield from row_leased(o, s, confirmed=True)):
                yield Store(("seq", s), odd + 1)
                continue
        yield Mark("writing", s)
        for cell in range(cells(o)):  # the records are not given back: they lie outside the slots
            yield Store(("data", s, cell), GIVEN_BACK)
        yield Store(("ver", s), -1)  # abort
        yield Fence()
        yield Store(("seq", s), odd + 1)
        yield Mark("writing")


def abort(o: Options, target: int, odd: int) -> Generator:
    """``abort``: the slot left empty, its sequence even again."""
    yield Store(("ver", target), -1)
    yield Fence()
    yield Store(("seq", target), odd + 1)
    yield Mark("writing")


def withdraw(o: Options) -> Generator:
    """``withdraw``: promise only the version the bank holds."""
    version = yield Load("version")
    yield Store("promised", version)


def promise_stands(o: Options, target: int) -> Generator:
    """``SlotReader.promise_stands``: ``target`` has not landed, and is still promised."""
    version = yield Load("version")
    if version >= target:
        return False
    promised = yield Load("promised")
    return promised >= target or o.wait_on_withdrawn


def waiting_reader(o: Options) -> Generator:
    """``poll_promised``: the promise read once, then waited for while it stands and a writer lives
    (the code asks the writer's kernel lock, ``writer_alive``; taken here, it is free: the
    writer died, and the wait ends in ``WriterGoneError``). Its loads of the newest version are the
    plain reader's, checked there."""
    target = yield Load("promised")
    while (yield from promise_stands(o, target)):
        if (yield Lock("writer", wait=False)):
            yield Unlock("writer")
            return


def commit(o: Options, target: int, odd: int, version: int) -> Generator:
    """``commit``: the version, the even sequence, ``latest``, ``version``, the publish count."""
    yield Store(("ver", target), version)
    if not o.no_commit_fence:
        yield Fence()
    if o.latest_before_even:
        yield Store("latest", target)
        yield Store(("seq", target), odd + 1)
    else:
        yield Store(("seq", target), odd + 1)
        yield Mark("writing")
        yield Store("latest", target)
    yield Mark("writing")
    yield Store("version", version)
    count = yield Load("publish_count")
    yield Store("publish_count", count + 1)


def choose_target(o: Options, backed_off: tuple) -> Generator:
    request = yield Load("pin_request")
    grant = yield Load("pin_grant")
    if request != grant:
        if not o.no_grant_fence:
            yield Fence()
        candidate = yield from pin_candidate(o)
        yield Store("pin_slot", candidate)
        yield Fence()
        yield Store("pin_grant", request)
    release = yield Load("pin_release")
    grant = yield Load("pin_grant")
    pinned = (yield Load("pin_slot")) if release < grant else -1
    version = yield Load("version")
    latest = (yield Load("latest")) if version >= 0 else -1
    others = tuple(s for s in range(o.slots) if s != latest and s not in backed_off)
    free = ()
    for s in others:
        count = yield Load(("leases", s))
        if not count:
            free = (*free, s)
    if not free:  # a count may be too high: the rows tell
        for s in others:
            if not (yield from row_leased(o, s)):
                free = (*free, s)
    candidates = tuple(s for s in free if s != pinned)
    if not candidates and not o.no_give_way:  # a lease still being decided gives way; with 2 slots, so does a pin
        undecided = ()
        for s in others:
            if not (yield from row_leased(o, s, confirmed=True)):
                undecided = (*undecided, s)
        candidates = tuple(s for s in undecided if s != pinned) or free or undecided
    best = None
    best_key = (False, 0)
    for s in candidates:
        v = yield Load(("ver", s))
        if best is None or (v < 0, v) < best_key:  # slots holding a version first (_warm_first)
            best, best_key = s, (v < 0, v)
    return best, latest


def pin_candidate(o: Options) -> Generator:
    latest = yield Load("latest")
    for s in range(o.slots):
        if s == latest:
            continue
        count = yield Load(("leases", s))
        if count:
            seq = yield Load(("seq", s))
            if not seq & 1 and (yield from row_leased(o, s)):
                return s
    return latest


def row_leased(o: Options, slot: int, confirmed: bool = False) -> Generator:
    """``Leases.row_leased``, as the writer asks it: whether row 0 leases ``slot``."""
    lease = yield Load(("row", 0))
    return lease == slot + 1 or (not confirmed and lease == -(slot + 1))


def try_read(o: Options, have: list | None = None) -> Generator:
    """One optimistic copy of the latest slot; ``(version, cells, slot)`` or None. ``have``: with
    records, what the reader's module holds (see :func:`copy_slot`), copied into as it goes."""
    slot = yield Load("latest")
    early = (yield from load_records(o, slot)) if have is not None and o.records_before_seq else None
    seq = yield Load(("seq", slot))
    if seq & 1:
        return None
    if not o.no_read_fences:
        yield Fence()
    version = yield Load(("ver", slot))
    if version < 0 and not o.accept_empty:
        return None  # given back since `latest` was read
    got = yield from copy_slot(o, slot, version, have, early)
    if not o.no_read_fences:
        yield Fence()
    again = yield Load(("seq", slot))
    return (version, got, slot) if again == seq else None


def copy_slot(o: Options, slot: int, version: int, have: list | None, early: tuple | None = None) -> Generator:
    """The copy of ``slot`` (between the loads of its sequence number): every cell; or with
    ``have`` (``[held version, module's cells, cells written by attempts so far]``, ``HeldCopy``)
    the cells whose record is newer than the version held, and those an earlier attempt wrote,
    into the module. Returns the cells copied, or the module's."""
    if have is None:
        got = ()
        for cell in range(cells(o)):
            value = yield Load(("data", slot, cell))
            got = (*got, value)
        return got
    held, module, touched = have
    records = early if early is not None else (yield from load_records(o, slot))
    for leaf in range(cells(o)):
        if 0 <= records[leaf] <= held <= version and (leaf not in touched or o.no_touched):
            continue  # unchanged since the version the module holds
        module[leaf] = yield Load(("data", slot, leaf))
        touched.add(leaf)
    return tuple(module)


def load_records(o: Options, slot: int) -> Generator:
    records = ()
    for leaf in range(cells(o)):
        record = yield Load(("rec", slot, leaf))
        records = (*records, record)
    return records


def holding(o: Options) -> list | None:
    """With records, what a copying reader starts with: version 0, loaded before (its module holds
    it whole; no attempt of the reload to come has written anything yet)."""
    return [0, [content(o, 0, leaf) for leaf in range(cells(o))], set()] if o.records else None


def accepted(o: Options, got: tuple) -> Accept:
    return Accept(*got, expected=contents(o, got[0]))


def reader(o: Options, attempts: int = 2, outpaced: bool | None = None) -> Generator:
    """``read``: optimistic copies, then ``read_pinned`` (the token, a ticket, a pinned copy).
    ``outpaced``: whether its copies outlast the writer's interval (None: both are explored)."""
    if outpaced is None:
        outpaced = yield Choose(2, "the reader's copies outlast the writer's interval")
    have = holding(o)
    if not outpaced:
        for _ in range(attempts):
            got = yield from try_read(o, have)
            if got is not None:
                yield accepted(o, got)
                return
    token = yield Lock("token", wait=False)
    while not token:
        got = yield from try_read(o, have)
        if got is not None:
            yield accepted(o, got)
            return
        holder = yield Load("token_pid")
        steal = (yield Choose(2, "the token's holder is seen stopped")) if holder == STOPPED_PID else 0
        if steal:
            break
        token = yield Lock("token", wait=False)
    if token:
        yield Store("token_pid", READER_PID)
    while True:
        request = yield Load("pin_request")
        ticket = request + 1
        yield Store("pin_request", ticket)
        got = yield from await_pin(o, ticket, have)
        yield Fence()
        yield Store("pin_release", ticket)
        if got is not None:
            break
    if token:
        yield Store("token_pid", 0)
        yield Unlock("token")
    yield accepted(o, got)


def await_pin(o: Options, ticket: int, have: list | None = None) -> Generator:
    published = yield Load("publish_count")
    while True:
        grant = yield Load("pin_grant")
        if grant == ticket:
            yield Fence()
            slot = yield Load("pin_slot")
            yield Mark("pinned", slot)
            seq = yield Load(("seq", slot))
            if seq & 1:
                yield Mark("pinned")
                return None
            yield Fence()
            version = yield Load(("ver", slot))
            if version < 0:  # never: a pin is on the latest or a leased slot (copy_validated's check)
                yield Mark("pinned")
                return None
            got = yield from copy_slot(o, slot, version, have)
            yield Fence()
            again = yield Load(("seq", slot))
            yield Mark("pinned")
            if again != seq:
                if o.slots > 2:
                    yield Fail(f"a pinned copy of slot {slot} failed validation")
                    return None
                return None  # 2 slots only
            return (version, got, slot, True)
        count = yield Load("publish_count")
        if count != published:
            published = count
        elif (yield Choose(2, "the writer stayed quiet past the patience")):
            got = yield from try_read(o, have)
            if got is not None:
                return got


def in_place_reader(o: Options) -> Generator:
    """``reload`` of a reader in place, ``o.reloads`` times, through its bank's ``Leases``:
    ``lease_latest`` (``_move_lease``, ``_lease_holds``) and a copy-free use of the slot, or,
    refused, ``release_lease`` and a copy; at the end ``release_lease``. Its row is row 0, and the
    model's word ``("row", 0)`` is that row's lease word of the bank (``ROW_WORDS[0][R_LEASE]``):
    the row's other words are no part of the protocol (``ReaderRows``)."""
    for _ in range(o.reloads):
        leased = yield from lease_latest(o)
        if leased is not None:
            slot, version = leased
            yield Mark("leased", slot)
            got = yield from copy_slot(o, slot, version, None)  # what the module reads in place
            yield accepted(o, (version, got, slot))
            yield Mark("leased")  # the module stays on the slot, but is not read until the next reload
            continue
        yield from release_lease(o)
        for _ in range(3):  # as a plain reader (its pinned fallback is the reader's, checked there)
            got = yield from try_read(o)  # back from in place: a copy of every leaf (HeldCopy.forget)
            if got is not None:
                yield accepted(o, got)
                break
    yield from release_lease(o)


def lease_latest(o: Options) -> Generator:
    """``Leases.lease_latest`` for row 0: the slot and version leased, or None if refused."""
    yield Lock("table")
    slot = yield Load("latest")
    seq = yield Load(("seq", slot))
    if not o.no_lease_version_fence:
        yield Fence()
    version = yield Load(("ver", slot))
    if seq & 1 or version < 0:
        yield Unlock("table")
        return None
    moved = yield from move_lease(o, slot)
    yield Unlock("table")
    if not moved:
        return None
    yield Store(("row", 0), slot + 1)  # _lease_holds: confirmed
    if not o.no_confirm_fence:
        yield Fence(full=True)
    again = yield Load(("seq", slot))
    if again == seq:
        return slot, version
    yield from release_lease(o)
    return None


def move_lease(o: Options, slot: int) -> Generator:
    """``Leases._move_lease`` for row 0, the table's lock held: whether the lease was decided."""
    previous = abs((yield Load(("row", 0))))
    yield Store(("row", 0), -(slot + 1))  # being decided
    counts = ()
    for s in range(o.slots):
        count = yield Load(("leases", s))
        counts = (*counts, count)
    if previous:
        counts = tuple(c - (s == previous - 1) for s, c in enumerate(counts))
    counts = tuple(c + (s == slot) for s, c in enumerate(counts))
    leased = frozenset(s for s, c in enumerate(counts) if c > 0)
    if len(leased) > o.slots - 2:
        leased = yield from recount(o)
    else:
        for s in sorted({slot, previous - 1} - {-1}):
            yield Store(("leases", s), counts[s])
    if not o.no_reader_full_fence:
        yield Fence(full=True)
    request = yield Load("pin_request")
    grant = yield Load("pin_grant")
    release = yield Load("pin_release")
    pinned = frozenset({(yield Load("pin_slot"))}) if release < grant else frozenset()
    granting = request != grant and request != release and not o.no_granting_check
    if granting or len(leased | pinned) > o.slots - 2:
        yield Store(("row", 0), 0)
        yield from recount(o)
        return False
    return True


def recount(o: Options) -> Generator:
    """``Leases.recount``: the counts from the rows of live readers (the one reader in place's row
    is its own)."""
    lease = abs((yield Load(("row", 0))))
    for s in range(o.slots):
        yield Store(("leases", s), int(lease == s + 1))
    return frozenset({lease - 1}) if lease else frozenset()


def release_lease(o: Options) -> Generator:
    """``Leases.release_lease`` for row 0."""
    lease = abs((yield Load(("row", 0))))
    if not lease:
        return
    yield Fence()
    yield Lock("table")
    yield Store(("row", 0), 0)
    count = yield Load(("leases", lease - 1))
    yield Store(("leases", lease - 1), max(0, count - 1))
    yield Unlock("table")


def stopping_reader(o: Options) -> Generator:
    """A reader that takes the token, asks for a pin, and is stopped there for good (SIGSTOP)."""
    token = yield Lock("token", wait=False)
    if token:
        yield Store("token_pid", STOPPED_PID)
        request = yield Load("pin_request")
        yield Store("pin_request", request + 1)
    yield Mark("stopped")


READER_PID, STOPPED_PID = 7, 9


def initial_memory(slots: int, begun: bool = False, records: bool = False) -> dict:
    """A fresh store holding version 0 in slot 0 (as ``create`` leaves it); ``begun``: and the
    writer's first publish has marked slot 1 and copied version 1 into it, not committed yet.
    ``records``: each slot's leaves with their records (those of the empty slots zeros, as in a
    new file; slot 0's, version 0's)."""
    mem = {"version": 0, "latest": 0, "publish_count": 1, "token_pid": 0, "promised": 0}
    mem |= {"pin_request": 0, "pin_grant": 0, "pin_slot": 0, "pin_release": 0, ("row", 0): 0}
    for s in range(slots):
        mem[("seq", s)] = 2 if s == 0 else 0
        mem[("ver", s)] = 0 if s == 0 else -1
        mem[("leases", s)] = 0
        for cell in range(LEAVES if records else CELLS):
            mem[("data", s, cell)] = 0 if s == 0 else -1
            if records:
                mem[("rec", s, cell)] = 0
    if begun:
        mem[("seq", 1)] = 1
        for cell in range(CELLS):
            mem[("data", 1, cell)] = 1
    return mem


# -- the invariant -------------------------------------------------------------------------------------
def observe(x: Explorer, state: tuple) -> tuple:
    """What :func:`check` looks at in ``state``."""
    slots = x.slots
    writing = x.regions(state, "writing") | {w[1] for w in x.buffered(state, "data") | x.buffered(state, "rec")}
    row = x.word(state, ("row", 0))
    return (
        slots,
        frozenset(writing),
        frozenset(x.regions(state, "leased")),
        frozenset(x.regions(state, "pinned")),
        tuple(x.word(state, ("leases", s)) for s in range(slots)),
        row,
        x.held(state, "table"),
        x.held(state, "row0"),
        x.word(state, "pin_slot") if x.word(state, "pin_release") < x.word(state, "pin_grant") else -1,
    )


def check(facts: tuple) -> str | None:
    slots, writing, leased, pinned_copy, leases, row, table_held, row_alive, pinned = facts
    if writing & leased:
        return f"slot {min(writing & leased)} is being written while a reader in place uses it under its lease"
    if slots > 2 and writing & pinned_copy:
        return f"slot {min(writing & pinned_copy)} is being written while a reader copies it under a pin"
    if not table_held and row_alive and row and leases[abs(row) - 1] < 1:  # counts change under the table lock
        return f"slot {abs(row) - 1}'s lease count is 0, but a live reader's row leases it"
    held = ({row - 1} if row > 0 else set()) | ({pinned} if pinned >= 0 else set())
    if len(held) > max(1, slots - 2):
        return f"{len(held)} slots are under a confirmed lease or a pin, more than {slots - 2}"
    return None


# -- configurations ------------------------------------------------------------------------------------
WRITER_STORES = frozenset(
    {"seq", "data", "rec", "ver", "latest", "version", "publish_count", "pin_slot", "pin_grant", "promised"}
)
READER_STORES = frozenset({"token_pid", "pin_request", "pin_release"})


def explorer(
    mode: str,
    options: Options | None = None,
    *,
    publishes: int = 3,
    readers: str = "plain,in-place",
    crashes: bool = False,
    new_writer: bool = True,
    begun: bool = False,
    **kwargs: Any,
) -> Explorer:
    """The writer publishing ``publishes`` times beside ``readers``, explored in ``mode``.

    ``readers``: a comma-separated list of ``plain`` (optimistic copies first, or the pin at once
    when its copies outlast the writer's interval: both explored), ``optimistic`` and ``pinned``
    (each of those two alone), ``in-place``, ``stopped`` (takes the token, asks for a pin and
    is stopped there for good) and ``waiting`` (waits for a promised version, with
    ``promises``). With ``crashes``, any party may die anywhere; with ``new_writer``
    a new writer publishing once then takes over from a dead one, without it the readers must
    still get done on what the dead writer left. With ``begun`` the exploration starts with the
    writer's first publish copied and not yet committed (the readers may start anywhere after)."""
    o = options or Options()
    held = ("writer",) if o.promises else ()  # the writer's kernel lock, which a waiting reader asks
    parties = [Party("writer", lambda: writer(o, publishes, begun), locks=held, stores=WRITER_STORES, writer=True)]
    for kind in readers.split(","):
        if kind in ("plain", "pinned", "optimistic"):
            outpaced = {"plain": None, "pinned": True, "optimistic": False}[kind]
            parties.append(Party(f"{kind} reader", lambda oc=outpaced: reader(o, outpaced=oc), stores=READER_STORES))
        elif kind == "in-place":
            parties.append(
                Party(
                    "reader in place",
                    lambda: in_place_reader(o),
                    locks=("row0",),
                    stores=frozenset({"row", "leases"}),
                )
            )
        elif kind == "stopped":
            parties.append(
                Party(
                    "stopped reader",
                    lambda: stopping_reader(o),
                    stops=True,
                    stores=frozenset({"token_pid", "pin_request"}),
                )
            )
        elif kind == "waiting":
            parties.append(Party("waiting reader", lambda: waiting_reader(o)))
        else:
            raise ValueError(f"reader {kind!r}: plain, pinned, in-place, stopped or waiting")
    replacement = (
        Party("new writer", lambda: writer(o, o.takeover_publishes, takeover=True), stores=WRITER_STORES, writer=True)
        if crashes and new_writer
        else None
    )
    if o.records and begun:
        raise ValueError("records start from a store holding version 0 alone: not begun")
    x = Explorer(
        parties,
        initial_memory(o.slots, begun, o.records),
        mode,
        observe=observe,
        check=check,
        crashes=crashes,
        replacement=replacement,
        monotonic=("version",),
        **kwargs,
    )
    x.slots = o.slots
    return x


def explore(mode: str, options: Options | None = None, **kwargs: Any) -> Result:
    """:func:`explorer`'s configuration, explored."""
    return explorer(mode, options, **kwargs).run()
