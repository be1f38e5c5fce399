"""The header of a segment: 48 KiB of int64 words at its start (no torch needed to read it)."""

from __future__ import annotations

MAGIC = 0x534D5359_4E433031  # "SMSYNC01"
FORMAT = 3
HEADER_BYTES = 48 * 1024  # mostly the reader table: room for 1,203 readers
HEADER_WORDS = HEADER_BYTES // 8
MAX_SLOTS = 16
ALIGN = 64
PAGE = 4096

# Header word indices.
W_MAGIC = 0
W_FORMAT = 1
W_VERSION = 2  # last completed version
W_LATEST = 3  # slot holding it
W_NUM_SLOTS = 4
W_CREATOR_PID = 5
W_CREATOR_START = 6  # creator's process start time (ns), tells a reused pid apart
W_WRITER_PID = 7
W_PUBLISH_NS = 8  # wall-clock time of the last completed publish
W_CREATE_NS = 9
W_PIN_REQUEST = 10  # pin protocol, see _protocol.py
W_PIN_GRANT = 11
W_PIN_SLOT = 12
W_PIN_RELEASE = 13
W_LAYOUT_OFFSET = 14
W_LAYOUT_BYTES = 15
W_DATA_OFFSET = 16
W_SLOT_BYTES = 17
W_PAYLOAD_BYTES = 18
W_PUBLISH_COUNT = 19
W_CREATOR_PPID = 20  # lets a test's leak check find stores made by its children
W_TOKEN_PID = 21  # pid of the reader holding the starvation token, 0 if none (see _protocol.py)
W_PUBLISH_INTERVAL = 22  # ns between the last two publishes: tells a slow reader to ask for a pin at once
W_SEQ = 32  # W_SEQ + i: slot i's sequence number, odd while it is being written
W_SLOT_VERSION = 64  # W_SLOT_VERSION + i: the version slot i holds
W_LEASES = 96  # W_LEASES + i: readers whose modules view slot i in place (see _protocol.py)
# Reader table: one row per attached reader, each row written only by its own reader
# (and its lease word also by whoever reclaims a dead reader's row).
W_READERS = 128
READER_WORDS = 5  # pid, loaded version, reloads, time of the last reload (ns), leased slot + 1
MAX_READERS = (HEADER_WORDS - W_READERS) // READER_WORDS


def header_view(buf) -> memoryview:
    """The header words of a mapping as a memoryview of int64.

    Indexing it yields plain Python ints, which makes a version check a single ~40 ns
    load; call ``release()`` on it before unmapping.
    """
    return memoryview(buf)[:HEADER_BYTES].cast("q")


def row_base(row: int) -> int:
    """The first header word of reader-table row ``row``."""
    return W_READERS + row * READER_WORDS


def reader_column(h, field: int) -> list[int]:
    """Word ``field`` (0: pid ... 4: leased slot + 1) of every row of the reader table, in one
    strided read of header words ``h`` (a memoryview, a list or an int64 array)."""
    return [int(w) for w in h[W_READERS + field : W_READERS + MAX_READERS * READER_WORDS : READER_WORDS]]


def reader_rows(h) -> list[tuple[int, int, int, int, int]]:
    """``(row, pid, loaded version, reloads, last reload ns)`` for every claimed row of the
    reader table in header words ``h`` (a memoryview or an int64 array); pids may be dead."""
    out = []
    for row, pid in enumerate(reader_column(h, 0)):
        if pid:
            base = row_base(row)
            out.append((row, pid, int(h[base + 1]), int(h[base + 2]), int(h[base + 3])))
    return out
