"""Device slots' records in the header (shmsync/store/device_records.py): what a reader needs to map a
device slot, read back as the writer wrote it, and every field of a bad record refused by name
before torch is asked to open anything. Runs without a GPU (the records are header words)."""

import pytest

from shmsync.core.header import DEVICE_RECORD_WORDS, HEADER_WORDS
from shmsync.errors import StoreCorruptError
from shmsync.store.device_records import Record, read_record, record_base, write_record

SLOT_BYTES = 4096
GOOD = Record(
    device=0,
    nbytes=SLOT_BYTES,
    offset=2 << 20,
    handle=b"c" + bytes(range(64)),
    counter=b"/torch_1234_5678_0",
    counter_offset=7,
    event=bytes(64),
    event_sync=True,
)


def words_with(record: Record, slot: int = 1) -> list[int]:
    h = [0] * HEADER_WORDS
    write_record(h, slot, record)
    return h


def test_a_record_reads_back_as_written():
    assert read_record(words_with(GOOD), 1, 4, SLOT_BYTES, "s") == GOOD


def test_a_slot_never_written_has_no_record():
    assert read_record([0] * HEADER_WORDS, 2, 4, SLOT_BYTES, "s") is None


@pytest.mark.parametrize(
    "word, value, field",
    [
        (0, 7, "state"),
        (1, -1, "device"),
        (1, 1 << 20, "device"),
        (2, SLOT_BYTES * 2, "nbytes"),  # would map past the slot: more than the payload
        (3, -4096, "offset"),
        (4, 1 << 40, "counter_offset"),
        (5, 2, "event_sync"),
        (6, 0, "handle length"),
        (6, 10**6, "handle length"),
        (7, 4096, "counter name length"),
        (8, 65, "event handle length"),
    ],
)
def test_a_record_field_out_of_range_is_refused_naming_it(word, value, field):
    h = words_with(GOOD)
    h[record_base(1) + word] = value
    with pytest.raises(StoreCorruptError, match=rf"store 's': device slot 1's record field {field} is {value}"):
        read_record(h, 1, 4, SLOT_BYTES, "s")


def test_a_counter_name_that_is_no_file_name_is_refused():
    with pytest.raises(StoreCorruptError, match="counter name"):
        read_record(words_with(GOOD._replace(counter=b"torch_no_slash")), 1, 4, SLOT_BYTES, "s")


def test_a_slot_index_out_of_range_is_refused():
    with pytest.raises(StoreCorruptError, match="device slot 4 is not one of its 4 slots"):
        read_record(words_with(GOOD), 4, 4, SLOT_BYTES, "s")


def test_the_records_fit_their_words():
    assert record_base(16) <= 1024 and DEVICE_RECORD_WORDS * 8 >= 9 * 8 + 128 + 96 + 64
