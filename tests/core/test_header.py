"""Corrupt store files: every header word that sizes, places or indexes anything, and every
layout field, is checked against the file before it is mapped. A bad value is refused with a
shmsync error naming the field and its value; nothing is written and no descriptor is left."""

import json
import os
import struct

import pytest
import torch

from shmsync import StoreNotFoundError, WeightReader, WeightStore
from shmsync.core import segment
from shmsync.core.header import (
    B_LATEST,
    B_LEASES,
    B_PIN_SLOT,
    B_SLOT_VERSION,
    B_VERSION,
    DEVICE,
    FORMAT,
    HEADER_BYTES,
    HOST,
    R_DEVICE_LEASE,
    R_LEASE,
    ROW_WORDS,
    W_DATA_OFFSET,
    W_DEVICE,
    W_FORMAT,
    W_LAYOUT_BYTES,
    W_LAYOUT_OFFSET,
    W_MAGIC,
    W_NUM_SLOTS,
    W_PAYLOAD_BYTES,
    W_RECORD_ENTRIES,
    W_RECORDS_OFFSET,
    W_SLOT_BYTES,
    W_VERSION,
    bank_word,
)
from shmsync.errors import ShmSyncError, StoreCorruptError
from shmsync.testing import write_header_word
from tests.core.descriptors import open_fds


@pytest.fixture
def store_file(tmp_path, monkeypatch):
    """The path of a valid store's file (``Linear(4, 2)``: 96 payload bytes, 3 slots) in a store
    folder of this test's own; no process holds it."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(segment, "SHM_DIR", str(folder))
    store = WeightStore.create(torch.nn.Linear(4, 2), name="victim", unlink_at_exit=False)
    store.close()
    return folder / "shmsync-victim"


def _set_word(path, word, value):
    with open(path, "r+b") as f:
        f.seek(8 * word)
        f.write(struct.pack("<q", value))


def _word(path, word):
    with open(path, "rb") as f:
        f.seek(8 * word)
        return struct.unpack("<q", f.read(8))[0]


def _refused(path, error, match):
    """Attach fails with ``error`` matching ``match``, writes nothing, leaves no descriptor."""
    before, content = open_fds(path.parent), path.read_bytes()
    with pytest.raises(error, match=match):
        WeightStore.attach("victim")
    assert open_fds(path.parent) == before, "a descriptor was left open"
    assert path.read_bytes() == content, "the file was written"


@pytest.mark.parametrize(
    "word, value, match",
    [
        (W_NUM_SLOTS, 10**8, r"num_slots is 100000000: it must be between 2 and 16"),
        (W_NUM_SLOTS, 1, r"num_slots is 1"),
        (W_DATA_OFFSET, 0, r"data_offset is 0"),
        (W_DATA_OFFSET, HEADER_BYTES, rf"data_offset is {HEADER_BYTES}"),
        (W_SLOT_BYTES, 0, r"slot_bytes is 0"),
        (W_SLOT_BYTES, -4096, r"slot_bytes is -4096"),
        (W_LAYOUT_OFFSET, 8, r"layout_offset is 8"),
        (W_LAYOUT_BYTES, 1 << 40, r"layout_bytes is 1099511627776"),
        (W_LAYOUT_BYTES, 0, r"layout_bytes is 0"),
        (W_PAYLOAD_BYTES, 0, r"payload_bytes is 0"),
        (W_PAYLOAD_BYTES, 1 << 50, r"payload_bytes is 1125899906842624"),
        (bank_word(HOST, B_LATEST), -1, r"host latest is -1"),
        (bank_word(HOST, B_LATEST), 4, r"host latest is 4: it indexes one of the 4 slots"),
        (bank_word(DEVICE, B_LATEST), 4, r"device latest is 4: it indexes one of the 4 slots"),
        (W_VERSION, -2, r"version is -2"),
        (bank_word(DEVICE, B_VERSION), -5, r"device version is -5"),
        (bank_word(HOST, B_SLOT_VERSION + 1), -7, r"host slot_version\[1\] is -7"),
        (bank_word(HOST, B_PIN_SLOT), 99, r"host pin_slot is 99"),
        (bank_word(DEVICE, B_PIN_SLOT), 16, r"device pin_slot is 16"),
        (bank_word(HOST, B_LEASES), -1, r"host leases\[0\] is -1"),
        (bank_word(DEVICE, B_LEASES + 3), 10**6, r"device leases\[3\] is 1000000"),
        (ROW_WORDS[0][R_LEASE], 77, r"reader row 0 host lease is 77"),
        (ROW_WORDS[0][R_DEVICE_LEASE], -9, r"reader row 0 device lease is -9"),
        (W_DEVICE, -1, r"device is -1"),
    ],
)
def test_a_header_word_out_of_range_is_refused_naming_it(store_file, word, value, match):
    _set_word(store_file, word, value)
    _refused(store_file, StoreCorruptError, match)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda w: {W_RECORDS_OFFSET: 0}, r"records_offset is 0: the records start at the first page after the layout"),
        (lambda w: {W_RECORDS_OFFSET: w[W_RECORDS_OFFSET] + 4096}, r"records_offset is \d+"),
        (lambda w: {W_RECORD_ENTRIES: 0}, r"record_entries is 0: one per tensor of the layout, 1 to 131072"),
        (lambda w: {W_RECORD_ENTRIES: 1 << 40}, r"record_entries is 1099511627776"),
        (lambda w: {W_RECORD_ENTRIES: -2}, r"record_entries is -2"),
        # Records for 3 tensors where the layout holds 2, slots placed to match: the layout tells.
        (lambda w: {W_RECORD_ENTRIES: 3}, r"record_entries is 3, its layout holds 2 tensors"),
        # The records of 4 slots of 2 tensors end within their page: the slots may not start later.
        (
            lambda w: {W_DATA_OFFSET: w[W_DATA_OFFSET] + 4096},
            r"data_offset is \d+: the slots start at the first page after the records",
        ),
    ],
)
def test_a_malformed_record_region_is_refused_naming_the_field(store_file, change, match):
    """The host slots' records lie between the layout and the slots: where they start, how many
    entries each holds, and where the slots start after them are checked before anything is mapped."""
    words = {w: _word(store_file, w) for w in (W_RECORDS_OFFSET, W_RECORD_ENTRIES, W_DATA_OFFSET)}
    assert words[W_RECORD_ENTRIES] == 2 and words[W_DATA_OFFSET] == words[W_RECORDS_OFFSET] + 4096
    for word, value in change(words).items():
        _set_word(store_file, word, value)
    _refused(store_file, StoreCorruptError, match)


def test_another_format_and_no_magic_are_told_apart(store_file):
    _set_word(store_file, W_FORMAT, 3)
    _refused(store_file, ShmSyncError, rf"has format 3, this shmsync reads {FORMAT}")
    _set_word(store_file, W_MAGIC, 0)
    _refused(store_file, StoreNotFoundError, r"not a shmsync store, or it is still being created")


@pytest.mark.parametrize("size, match", [(100, r"still being created or is corrupt \(100 bytes"), (None, "file has")])
def test_a_file_of_the_wrong_size_is_refused(store_file, size, match):
    with open(store_file, "r+b") as f:
        f.truncate(size if size is not None else os.path.getsize(store_file) + 4096)
    _refused(store_file, (StoreNotFoundError, StoreCorruptError), match)


def _rewrite_layout(path, change):
    """Replace the layout JSON with ``change(doc)`` (a dict to dump, or raw bytes); it stays within
    the layout's page, so that only the layout is wrong."""
    offset, length = _word(path, W_LAYOUT_OFFSET), _word(path, W_LAYOUT_BYTES)
    with open(path, "r+b") as f:
        f.seek(offset)
        doc = json.loads(f.read(length))
        new = change(doc)
        raw = new if isinstance(new, bytes) else json.dumps(new, separators=(",", ":")).encode()
        assert offset + len(raw) <= _word(path, W_DATA_OFFSET), "the test's layout must stay in its page"
        f.seek(offset)
        f.write(raw.ljust(length))
    _set_word(path, W_LAYOUT_BYTES, max(len(raw), 1))


def _entry(i, field, value):
    def change(doc):
        doc["entries"][i][field] = value
        return doc

    return change


def _smaller(doc):  # a consistent layout, but of 80 payload bytes where the header says 96
    doc["entries"][1][1], doc["entries"][1][4] = [2, 2], 16
    return doc


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda doc: b"{not json", r"not valid JSON"),
        (lambda doc: b"[]", r"want an object with 'destinations' and 'entries'"),
        (lambda doc: {**doc, "extra": 1}, r"want an object"),
        (lambda doc: {**doc, "entries": []}, r"'entries' must be a list of 1 to"),
        (lambda doc: {**doc, "destinations": ["a", "a"]}, r"'destinations' must be null or a list of distinct"),
        (lambda doc: {**doc, "destinations": ["policy"]}, r"key 'bias' is under no destination"),
        (_entry(0, 2, "load"), r"entry 0 \('bias'\): unknown dtype 'load'"),
        (_entry(0, 2, 5), r"unknown dtype '5'"),
        (_entry(0, 1, [-1]), r"shape must be up to 64 sizes >= 0"),
        (_entry(0, 4, 9), r"nbytes is 9, shape \[2\] of float32 takes 8"),
        (_entry(1, 3, 8), r"entry 1 \('weight'\): offset is 8, the next 64-byte boundary is 64"),
        (_entry(1, 0, []), r"entry 1: key must be a list of 1 to 32 non-empty names"),
        (_entry(1, 0, ["bias"]), r"entry 1: key 'bias' is out of order or repeated"),
        (_smaller, r"payload_bytes is 96, its layout holds 80"),
        (_entry(1, 5, 3), r"entry 1 \('weight'\): tied is 3; it is -1, or the index of an earlier entry"),
        (_entry(1, 5, "0"), r"tied is 0; it is -1"),
        (_entry(1, 5, 0), r"entry 1 \('weight'\): tied to entry 0, which it does not match"),
        (lambda doc: {**doc, "entries": [row[:5] for row in doc["entries"]]}, r"entry 0 must be \[key, shape"),
    ],
)
def test_a_bad_layout_is_refused_naming_the_field(store_file, change, match):
    _rewrite_layout(store_file, change)
    _refused(store_file, StoreCorruptError, match)


def test_a_header_word_that_turns_bad_later_is_refused_where_it_is_used(store_factory):
    store = store_factory(torch.nn.Linear(4, 2))
    reader = WeightReader(WeightStore.attach(store.name), torch.nn.Linear(4, 2))
    assert reader.poll()
    write_header_word(store, bank_word(HOST, B_LATEST), 99)  # a process of this user wrote it after the reader attached
    with pytest.raises(StoreCorruptError, match=r"latest is 99, not a slot index \(0 to 3\)"):
        reader.reload()
    write_header_word(store, bank_word(HOST, B_LATEST), 0)
    assert store.publish(torch.nn.Linear(4, 2)) == 1 and reader.poll() and reader.version == 1


def test_a_layout_holding_more_lists_than_its_tensors_could_is_refused_before_it_is_parsed():
    """30 MiB of ``[],`` would be ten million lists (751 MiB and 10 s to parse): refused at once."""
    import tracemalloc

    from shmsync.store.layout import Layout

    raw = b'{"destinations":null,"entries":[' + b"[]," * (10 << 20) + b"[]]}"
    tracemalloc.start()
    try:
        with pytest.raises(StoreCorruptError, match=r"10485762 lists; a layout of at most 131072 tensors"):
            Layout.from_json(raw, "a peer's layout")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Counted, not parsed: parsing would hold ten million lists, hundreds of MB beyond the raw bytes.
    assert peak < len(raw) + (8 << 20), peak


def test_a_layout_past_one_tebibyte_is_refused_naming_the_entry():
    from shmsync.store.layout import Layout

    rows = [[["w"], [(1 << 38) + 1], "float32", 0, ((1 << 38) + 1) * 4, -1]]
    raw = json.dumps({"destinations": None, "entries": rows}).encode()
    with pytest.raises(StoreCorruptError, match=r"entry 0 \('w'\) ends at byte 1099511627780, past 1099511627776"):
        Layout.from_json(raw, "a peer's layout")
