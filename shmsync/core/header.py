"""The header of a segment: 136 KiB of int64 words at its start (no torch needed to read it).

Layout of the words::

    [0, 64)        the store's own words: identity, sizes, the newest version, the promised one
    [64, 128)      bank 0, the host slots: their versions, sequence numbers, leases and pin
    [128, 192)     bank 1, the device slots (a store published from CUDA), the same words
    [192, 960)     one record per device slot: how another process maps it (CUDA IPC)
    [960, 1024)    the optimizer steps each of the last 64 versions had seen (a ring)
    [1024, ...)    the reader table: one row of 16 words per reader

After the header come the layout (JSON), then, from the next page, the host slots' records
(one word per slot and leaf: the version each leaf last changed at, :data:`W_RECORDS_OFFSET`),
then, from the next page, the slots.

A *bank* is one set of slots under the slot protocol (:mod:`shmsync.core.protocol`): the host
bank's slots are pages of the store's file, the device bank's live in the trainer's GPU memory.
A store published from CPU tensors has only the host bank; one published from CUDA versions its
device slots first, and fills host slots from them for the readers that need host memory.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from typing import Any

from shmsync.errors import ShmSyncError, StoreCorruptError, StoreNotFoundError, warn_deprecated

MAGIC = 0x534D5359_4E433031  # "SMSYNC01"
FORMAT = 7  # 7: the optimizer steps of each version; 6: two banks of slots, the promised version, rows of 16 words
MAX_SLOTS = 16
ALIGN = 64
PAGE = 4096
MAX_LAYOUT_BYTES = 64 << 20  # the layout JSON: ~60 bytes per tensor, so about a million tensors

# The store's own words.
W_MAGIC = 0
W_FORMAT = 1
W_VERSION = 2  # the newest complete version in any bank: the store's version
W_NUM_SLOTS = 4  # slots per bank
W_CREATOR_PID = 5
W_CREATOR_START = 6  # creator's process start time (ns), tells a reused pid apart
W_WRITER_PID = 7
W_PUBLISH_NS = 8  # wall-clock time of the last publish that made a new version
W_CREATE_NS = 9
W_LAYOUT_OFFSET = 14
W_LAYOUT_BYTES = 15
W_DATA_OFFSET = 16
W_SLOT_BYTES = 17
W_PAYLOAD_BYTES = 18
W_PUBLISH_COUNT = 19  # new versions published
W_CREATOR_PPID = 20  # lets a test's leak check find stores made by its children
W_ROWS = 23  # rows of the reader table ever claimed: the table is read up to there (see shmsync.store.reader_table)
W_STORE_FLAGS = 24  # STORE_* bits below, only ever set
STORE_PAGE_LOCKED = 1  # a process page-locked the host slots for CUDA copies: their memory is never given back
W_GIVE_BACK_BEGUN = 25  # give-backs the writer began, and
W_GIVE_BACK_DONE = 26  # ended (see shmsync.store.memory.StoreMemory.page_lock_for_cuda)
W_PROMISED = 27  # the newest version a publish has promised: >= W_VERSION, reached once it lands
W_DEVICE = 28  # the device bank's CUDA device index + 1; 0: the store has no device bank
W_DEVICE_BYTES = 29  # bytes of device memory the device bank holds now (the writer's GPU)
W_HOST_WANTED = 30  # bumped by a reader of the host bank that finds it behind: fill it
W_STEPS = 31  # optimizer steps the writer's process has taken on the store's weights so far; -1: not counted
W_COPIED_BYTES = 32  # bytes the last publish copied into its slot, and
W_SKIPPED_BYTES = 33  # the bytes it did not: the slot held them already (unchanged since its version)
W_PROOF = 34  # how the last publish proved leaves unchanged: a Proof's word
W_RECORDS_OFFSET = 35  # where the host slots' records start in the file: the first page after the layout
W_RECORD_ENTRIES = 36  # entries of one record: one per leaf of the layout

# The records: per host slot, per leaf of the layout (in its order), one int64 word: a version
# at or after which the leaf last changed, as of the version the slot holds (never before it: a
# record may overstate, which costs a reader a copy, never understate). A reader holding version r
# of the leaf's bytes needs no copy of it from a slot of version v when record <= r <= v. They
# lie in the file between the layout and the slots, so that no give-back of a slot's pages drops
# them, and are written inside the write of their slot (see shmsync.writer.store): the slot's
# sequence number covers them as it covers its bytes.
RECORD_BYTES = 8
MAX_LEAVES = 1 << 17  # tensors a store holds (the layout's entries): far more than any model has

# Banks: 64 words each, from W_BANKS.
W_BANKS = 64
BANK_WORDS = 64
HOST, DEVICE = 0, 1
NUM_BANKS = 2
B_VERSION = 0  # the bank's last completed version
B_LATEST = 1  # the slot holding it
B_PIN_REQUEST = 2  # pin protocol, see shmsync.core.protocol
B_PIN_GRANT = 3
B_PIN_SLOT = 4
B_PIN_RELEASE = 5
B_TOKEN_PID = 6  # pid of the reader holding the bank's starvation token, 0 if none
B_PUBLISH_COUNT = 7  # commits into the bank
B_PUBLISH_INTERVAL = 8  # ns between the last two commits: tells a slow reader to ask for a pin at once
B_PUBLISH_NS = 9
B_PROGRESS = 10  # bytes of the write in flight that have landed (the host bank, filled from the device)
B_SEQ = 16  # B_SEQ + i: slot i's sequence number, odd while it is being written
B_SLOT_VERSION = 32  # B_SLOT_VERSION + i: the version slot i holds
B_LEASES = 48  # B_LEASES + i: readers whose modules view slot i in place

# Device slots: how another process maps each (see shmsync.store.device_records).
W_DEVICE_RECORDS = 192
DEVICE_RECORD_WORDS = 48

# The steps ring: for the last STEP_RING versions, the optimizer steps each had seen, one word a
# version at W_STEP_RING + version % STEP_RING, written by the commit that makes the version
# (shmsync.core.protocol) in one store: the version's low RING_TAG_BITS bits above its steps'
# RING_STEPS_BITS (all ones: not counted). What the readers' table reads to say how many optimizer
# steps behind the trainer each reader runs.
W_STEP_RING = 960
STEP_RING = 64
RING_STEPS_BITS = 40
RING_TAG_BITS = 23  # with the steps' bits, 63: the word stays a positive int64

# Reader table: one row per attached reader, each row written only by its own reader (and its
# lease words also by a recount of the leases, which clears a dead reader's, or by whoever claims a
# dead reader's row again).
W_READERS = 1024
READER_WORDS = 16
MAX_READERS = 1024
HEADER_WORDS = W_READERS + READER_WORDS * MAX_READERS
HEADER_BYTES = HEADER_WORDS * 8  # 136 KiB, mostly the reader table
# The words of a row. Only the lease words take part in the slot protocol; the others are what
# the readers' table shows, written by the row's reader alone.
R_PID = 0
R_VERSION = 1  # the version loaded, -1 before the first load
R_RELOADS = 2
R_RELOAD_NS = 3  # wall-clock time of the last reload
R_LEASE = 4  # leased host slot + 1, negative while being decided, 0 if none
R_WORKER = 5  # the worker index its collector gave it, + 1 (0: none)
R_FLAGS = 6  # ROW_* bits below
R_START_NS = 7  # its process's start time: tells a reused pid, or one of another namespace, apart
R_DEVICE_LEASE = 8  # leased device slot + 1, as R_LEASE
R_DEVICE_BYTES = 9  # bytes of device memory the reader holds of its own (a private device copy)
R_COPIED_BYTES = 10  # bytes its last reload copied into its module (what changed, for a copying reader)
ROW_WAITING = 1  # between rollouts: waiting for work, not running stale weights
ROW_ZERO_COPY = 2  # in place where it can (see Mode)
ROW_DEVICE = 4  # a private copy in, or a view of, an accelerator's memory (see Mode)
ROW_LINK = 8  # a relay's link sending versions to another host (leases to send from; loads nothing)
ROW_DEVICE_BANK = 16  # reads the device bank (a GPU reader beside the trainer's GPU)

LEASE_COLUMNS = (R_LEASE, R_DEVICE_LEASE)  # per bank
# The one place a row's words are addressed: ROW_WORDS[row][field] is the header index of word
# `field` (an R_* constant) of reader-table row `row`: a reader's own row, a bank's lease column, the
# tools' reads. Indexing ranges, not calling a function: a reader's poll addresses its row so.
ROW_WORDS = tuple(range(W_READERS + r * READER_WORDS, W_READERS + (r + 1) * READER_WORDS) for r in range(MAX_READERS))


class _ModeType(enum.EnumMeta):
    """Mode's class, which answers 0.2.0's name for :attr:`Mode.COPY` with a warning."""

    def __getattr__(cls, name: str) -> Any:
        if name == "PRIVATE":  # 0.2.0's name, where it also meant DEVICE
            warn_deprecated("Mode.PRIVATE", "Mode.COPY, or mode.private (which covers Mode.DEVICE too)", "0.4.0")
            return cls.COPY
        parent = getattr(enum.EnumMeta, "__getattr__", None)  # Python 3.10 finds members there
        if parent is not None:
            return parent(cls, name)
        raise AttributeError(name)


class Mode(str, enum.Enum, metaclass=_ModeType):
    """How a reader's module holds its weights: the one value its
    :class:`~shmsync.WeightReader` keeps, writes into its row as it changes (its ``flags``, beside
    the lease its leases keep), and the readers' table reads back from the row (:meth:`of_row`).
    Each value is the word the readers' table shows; their order is the relays' wire format (an
    index), so new ones go last. Each has ``viewing`` (the parameters view a leased slot),
    ``private`` (a private copy for good: it never leases) and ``flags`` (its row's ``ROW_*`` bits).

    Examples:
        >>> Mode.of_row(Mode.IN_PLACE.flags, lease=2, device_lease=0)
        <Mode.IN_PLACE: 'in place'>
        >>> Mode.of_row(Mode.IN_PLACE.flags, lease=0, device_lease=0)  # no lease: a copy this time
        <Mode.FALLEN_BACK: 'copy (fallback)'>
        >>> Mode.DEVICE_IN_PLACE.viewing, Mode.FALLEN_BACK.viewing, Mode.FALLEN_BACK.private
        (True, False, False)
    """

    viewing: bool  # the parameters view a leased slot (shared memory)
    private: bool  # the module keeps a private copy for good (it never leases)
    flags: int  # the row's ROW_* bits that say this mode (with the row's lease words)

    COPY = "copy"  # a private copy for good: asked for, or the module wrote its weights
    IN_PLACE = "in place"  # the parameters view a leased host slot
    FALLEN_BACK = "copy (fallback)"  # in place where it can, on no slot now: not loaded yet, or none to lease
    DEVICE = "device"  # a private copy for good, in an accelerator's memory
    DEVICE_IN_PLACE = "device in place"  # the parameters view a leased device slot

    # Shown, formatted and sent (JSON) as its word alone, as a plain string would be.
    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]

    @classmethod
    def of_row(cls, flags: int, lease: int, device_lease: int) -> Mode:
        """The mode a row says from its flags and its lease words (:data:`R_FLAGS`,
        :data:`R_LEASE`, :data:`R_DEVICE_LEASE`)."""
        if not flags & ROW_ZERO_COPY:
            return cls.DEVICE if flags & ROW_DEVICE else cls.COPY
        if not lease and not device_lease:
            return cls.FALLEN_BACK
        return cls.DEVICE_IN_PLACE if flags & ROW_DEVICE else cls.IN_PLACE


# Plain attributes, not properties: a reader's poll reads them, and calls nothing it need not.
for _mode in Mode:
    _mode.viewing = _mode in (Mode.IN_PLACE, Mode.DEVICE_IN_PLACE)
    _mode.private = _mode in (Mode.COPY, Mode.DEVICE)
    _mode.flags = (0 if _mode.private else ROW_ZERO_COPY) | (
        ROW_DEVICE if _mode in (Mode.DEVICE, Mode.DEVICE_IN_PLACE) else 0
    )
del _mode


class Proof(str, enum.Enum):
    """How the leaves a copy left as they were were proved to hold the bytes they should: the one
    value a publish writes into the header (:data:`W_PROOF`, as its ``word``) and a copying
    reader tells (``WeightReader.unchanged_proof``). Each value is the words the tools show.

    Examples:
        >>> Proof.of_word(2), Proof.WRITTEN_PAGES.word
        (<Proof.WRITTEN_PAGES: 'written pages'>, 2)
    """

    word: int  # its header word

    NONE = "none: every leaf copied"  # from CUDA, in the background, a whole version from a relay
    COMPARISON = "comparison"  # the bytes compared (write tracking unavailable, or a leaf not tracked)
    WRITTEN_PAGES = "written pages"  # the pages the kernel says were written, compared where they were
    DELTA = "a delta: its sender proved the rest unchanged"  # a relay's delta (the trainer's proof)
    IN_PLACE = "in place"  # a reader's module views a slot: nothing is copied (never a publish's)

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]

    @classmethod
    def of_word(cls, word: int) -> Proof:
        """The proof a header word names (:data:`NONE` for a word out of range: a file is input)."""
        return _PROOF_OF_WORD.get(word, cls.NONE)


for _word, _proof in enumerate(Proof):
    _proof.word = _word
_PROOF_OF_WORD = {p.word: p for p in Proof}
del _word, _proof


def __getattr__(name: str) -> object:
    if name == "PROOFS":  # 0.2.0's names of the proofs, by header word
        warn_deprecated("shmsync.core.header.PROOFS", "shmsync.core.header.Proof (Proof.of_word(word))", "0.4.0")
        return tuple(p.value for p in Proof if p is not Proof.IN_PLACE)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bank_base(bank: int) -> int:
    """The first header word of bank ``bank`` (:data:`HOST` or :data:`DEVICE`)."""
    return W_BANKS + bank * BANK_WORDS


def bank_word(bank: int, word: int) -> int:
    """Header index of a bank's word (a ``B_*`` constant, plus a slot index for the per-slot ones)."""
    return W_BANKS + bank * BANK_WORDS + word


def header_view(buf) -> memoryview:
    """The header words of a mapping as a memoryview of int64.

    Indexing it yields plain Python ints, which makes a version check a single
    load; call ``release()`` on it before unmapping.
    """
    return memoryview(buf)[:HEADER_BYTES].cast("q")


def reader_column(h, field: int) -> list[int]:
    """Word ``field`` (an ``R_*`` constant) of every row of the reader table, in one strided read
    of header words ``h`` (a memoryview, a list or an int64 array)."""
    column = h[ROW_WORDS[0][field] : ROW_WORDS[-1][field] + 1 : READER_WORDS]
    return column.tolist() if hasattr(column, "tolist") else [int(w) for w in column]


def reader_rows(h) -> list[tuple[int, list[int]]]:
    """``(row, words)`` for every claimed row of the reader table in header words ``h`` (a
    memoryview or an int64 array), up to its high-water mark, ``words`` indexed by the ``R_*``
    constants; pids may be dead. The flags are read before the rest (see :mod:`shmsync.store.reader_table`)."""
    rows = min(max(int(h[W_ROWS]), 0), MAX_READERS)
    end = W_READERS + rows * READER_WORDS
    flags = h[W_READERS + R_FLAGS : end : READER_WORDS]
    flags = flags.tolist() if hasattr(flags, "tolist") else [int(w) for w in flags]
    block = h[W_READERS:end]
    block = block.tolist() if hasattr(block, "tolist") else [int(w) for w in block]
    out = []
    for row in itertools.compress(range(rows), block[R_PID::READER_WORDS]):
        words = block[row * READER_WORDS : (row + 1) * READER_WORDS]
        words[R_FLAGS] = flags[row]
        out.append((row, words))
    return out


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def check_words(h, file_size: int, name: str) -> tuple[int, int]:
    """Check every header word that sizes, places or indexes anything against the file's size,
    before anything is mapped; returns ``(layout offset, layout bytes)``.

    ``h`` is the header's words (read with ``pread``, not mapped). A store is made by one
    shmsync function (``WeightStore.create``), so every field must be exactly as it writes it.

    Raises:
        StoreNotFoundError: no magic word yet (a store still being created) or a short file.
        ShmSyncError: a store of another format.
        StoreCorruptError: naming the first field out of range and its value.
    """
    if file_size < HEADER_BYTES or len(h) < HEADER_WORDS:
        raise StoreNotFoundError(
            f"store {name!r} is still being created or is corrupt ({file_size} bytes, shorter than its "
            f"{HEADER_BYTES}-byte header)"
        )
    if h[W_MAGIC] != MAGIC:
        raise StoreNotFoundError(f"{name!r} is not a shmsync store, or it is still being created (no magic word)")
    if h[W_FORMAT] != FORMAT:
        raise ShmSyncError(f"store {name!r} has format {h[W_FORMAT]}, this shmsync reads {FORMAT}")

    def bad(field: str, value: int, rule: str) -> StoreCorruptError:
        return StoreCorruptError(f"store {name!r}: header field {field} is {value}: {rule}; the store was not opened")

    n = h[W_NUM_SLOTS]
    if not 2 <= n <= MAX_SLOTS:
        raise bad("num_slots", n, f"it must be between 2 and {MAX_SLOTS}")
    lo, ln = _check_sizes(h, n, file_size, bad)
    if h[W_VERSION] < -1:
        raise bad("version", h[W_VERSION], "versions are -1 (none yet) or more")
    if not 0 <= h[W_ROWS] <= MAX_READERS:
        raise bad("rows", h[W_ROWS], f"a count of reader-table rows, 0 to {MAX_READERS}")
    if not 0 <= h[W_DEVICE] <= 1 << 16:
        raise bad("device", h[W_DEVICE], "a CUDA device index + 1, or 0 for none")
    for bank in range(NUM_BANKS):
        _check_bank(h, bank, n, bad)
    return lo, ln


def _check_sizes(h, n: int, file_size: int, bad: Callable) -> tuple[int, int]:
    """The words that place the layout and the slots: where each starts, how long, how many."""
    lo, ln = h[W_LAYOUT_OFFSET], h[W_LAYOUT_BYTES]
    if lo != HEADER_BYTES:
        raise bad("layout_offset", lo, f"the layout starts right after the header, at {HEADER_BYTES}")
    if not 1 <= ln <= MAX_LAYOUT_BYTES:
        raise bad("layout_bytes", ln, f"it must be between 1 and {MAX_LAYOUT_BYTES}")
    data = _check_records(h, n, lo + ln, bad)
    stride, payload = h[W_SLOT_BYTES], h[W_PAYLOAD_BYTES]
    if not 1 <= payload <= file_size:
        raise bad("payload_bytes", payload, f"it must be between 1 and the file's {file_size} bytes")
    if stride != _align(payload, PAGE):
        raise bad("slot_bytes", stride, f"a slot is the payload rounded up to a page, {_align(payload, PAGE)}")
    if data + stride * n != file_size:
        raise bad(
            "slot_bytes",
            stride,
            f"{n} slots of it from offset {data} make {data + stride * n} bytes, the file has {file_size}",
        )
    return lo, ln


def _check_records(h, n: int, layout_end: int, bad: Callable) -> int:
    """The words that place the records (see :data:`RECORD_BYTES`): from the first page after the
    layout, one entry per slot and leaf; returns where the slots start, the first page after them."""
    records, entries = h[W_RECORDS_OFFSET], h[W_RECORD_ENTRIES]
    if records != _align(layout_end, PAGE):
        raise bad(
            "records_offset",
            records,
            f"the records start at the first page after the layout, {_align(layout_end, PAGE)}",
        )
    if not 1 <= entries <= MAX_LEAVES:
        raise bad("record_entries", entries, f"one per tensor of the layout, 1 to {MAX_LEAVES}")
    data, want = h[W_DATA_OFFSET], _align(records + n * entries * RECORD_BYTES, PAGE)
    if data != want:
        raise bad("data_offset", data, f"the slots start at the first page after the records, {want}")
    return data


def _check_bank(h, bank: int, n: int, bad: Callable) -> None:
    """The words of one bank that index slots or count readers: versions, latest, leases, the pin,
    and every row's lease word of that bank."""
    where = "host" if bank == HOST else "device"
    version, latest = h[bank_word(bank, B_VERSION)], h[bank_word(bank, B_LATEST)]
    if version < -1:
        raise bad(f"{where} version", version, "versions are -1 (none yet) or more")
    if not 0 <= latest < n:
        raise bad(f"{where} latest", latest, f"it indexes one of the {n} slots")
    for i in range(n):
        if h[bank_word(bank, B_SLOT_VERSION + i)] < -1:
            raise bad(f"{where} slot_version[{i}]", h[bank_word(bank, B_SLOT_VERSION + i)], "-1 (empty) or more")
        if not 0 <= h[bank_word(bank, B_LEASES + i)] <= MAX_READERS:
            raise bad(
                f"{where} leases[{i}]", h[bank_word(bank, B_LEASES + i)], f"a count of readers, 0 to {MAX_READERS}"
            )
    if not 0 <= h[bank_word(bank, B_PIN_SLOT)] < n:
        raise bad(f"{where} pin_slot", h[bank_word(bank, B_PIN_SLOT)], f"it indexes one of the {n} slots")
    for row, lease in enumerate(reader_column(h, LEASE_COLUMNS[bank])):
        if not -n <= lease <= n:
            raise bad(
                f"reader row {row} {where} lease", lease, f"a slot + 1, negative while being decided, -{n} to {n}"
            )


def slot_index(value: int, num_slots: int, field: str, name: str) -> int:
    """``value``, read from the header as a slot index, if it is one (else StoreCorruptError)."""
    if 0 <= value < num_slots:
        return value
    raise StoreCorruptError(f"store {name!r}: header field {field} is {value}, not a slot index (0 to {num_slots - 1})")
