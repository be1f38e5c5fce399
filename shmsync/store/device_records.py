"""The records of device slots: how a version in the trainer's GPU memory is shared, and mapped elsewhere.

Each device slot is one flat ``uint8`` tensor on the trainer's GPU, allocated the first time the
writer takes it. Torch's own CUDA IPC (``torch.multiprocessing.reductions``: ``reduce_tensor`` in
the trainer, ``rebuild_cuda_tensor`` in a reader) shares it; the fields ``reduce_tensor`` gives
are kept in the store's header, one record per slot (``W_DEVICE_RECORDS``), never pickled:

====  =====================================================================================
word  field
====  =====================================================================================
0     state: 0 none yet, 1 written (stored last, after a fence: a reader never sees half a record)
1     the CUDA device index
2     the storage's bytes (the slot's, exactly)
3     the storage's offset in its CUDA allocation
4     the reference counter's offset
5     whether the consumer waits for the producer's event (0 or 1)
6-8   the lengths of the three handles below, in bytes
9-    the allocation's IPC handle (up to 128 bytes), the reference counter's file name (up to 96),
      the event's IPC handle (up to 64)
====  =====================================================================================

A record read from the header is input like any other: every length, index and size is checked
(:func:`read_record`) before torch is asked to open anything, and a bad one is refused naming its
field. The producer keeps each slot until the store closes in its process, and past that for as
long as a reader that mapped it may live (see :class:`shmsync.writer.device_slots.DeviceSlots`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shmsync.core import fences
from shmsync.core.header import DEVICE_RECORD_WORDS, MAX_SLOTS, W_DEVICE_RECORDS
from shmsync.errors import ShmSyncError, StoreCorruptError
from shmsync.store.layout import Layout

MAX_HANDLE = 128
MAX_COUNTER_NAME = 96
MAX_EVENT_HANDLE = 64
_FIELDS = 9


class Record(NamedTuple):
    """What a reader needs to map one device slot (the fields of ``reduce_tensor``)."""

    device: int
    nbytes: int
    offset: int
    handle: bytes
    counter: bytes
    counter_offset: int
    event: bytes
    event_sync: bool


def record_base(slot: int) -> int:
    """The first header word of device slot ``slot``'s record."""
    return W_DEVICE_RECORDS + slot * DEVICE_RECORD_WORDS


def share(tensor: torch.Tensor) -> Record:
    """Share ``tensor`` (a device slot) through torch's CUDA IPC: what another process needs to map it.

    Raises:
        RuntimeError: torch's handles do not fit a record (a torch that changed them).
    """
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)
    device, handle, nbytes, offset, counter, counter_offset, event, event_sync = args[6:8] + args[8:10] + args[11:15]
    record = Record(int(device), int(nbytes), int(offset), bytes(handle), bytes(counter), int(counter_offset),
                    bytes(event), bool(event_sync))  # fmt: skip
    if (
        len(record.handle) > MAX_HANDLE
        or len(record.counter) > MAX_COUNTER_NAME
        or len(record.event) > MAX_EVENT_HANDLE
    ):
        raise ShmSyncError(
            f"torch's CUDA IPC handles are longer than a store's record holds ({len(record.handle)}, "
            f"{len(record.counter)}, {len(record.event)} bytes; at most {MAX_HANDLE}, {MAX_COUNTER_NAME}, "
            f"{MAX_EVENT_HANDLE})"
        )
    return record


def write_record(h, slot: int, record: Record) -> None:
    """Write ``record`` into device slot ``slot``'s words of header ``h``, the state word last."""
    base = record_base(slot)
    h[base] = 0
    fields = (record.device, record.nbytes, record.offset, record.counter_offset, int(record.event_sync),
              len(record.handle), len(record.counter), len(record.event))  # fmt: skip
    for i, value in enumerate(fields, 1):
        h[base + i] = value
    blob = (
        record.handle.ljust(MAX_HANDLE, b"\0")
        + record.counter.ljust(MAX_COUNTER_NAME, b"\0")
        + record.event.ljust(MAX_EVENT_HANDLE, b"\0")
    )
    for i, word in enumerate(memoryview(bytearray(blob)).cast("q")):
        h[base + _FIELDS + i] = word
    fences.ordering()[1]()  # the record before its state word
    h[base] = 1


def read_record(h, slot: int, num_slots: int, slot_bytes: int, name: str) -> Record | None:
    """Device slot ``slot``'s record, every field checked (None if the writer has not written it).

    Raises:
        StoreCorruptError: naming the first field out of range.
    """
    if not 0 <= slot < min(num_slots, MAX_SLOTS):
        raise StoreCorruptError(f"store {name!r}: device slot {slot} is not one of its {num_slots} slots")
    base = record_base(slot)
    state = h[base]
    if state == 0:
        return None
    fences.ordering()[0]()  # the state before the fields

    def bad(field: str, value: int, rule: str) -> StoreCorruptError:
        return StoreCorruptError(
            f"store {name!r}: device slot {slot}'s record field {field} is {value}: {rule}; the slot was not mapped"
        )

    device, nbytes, offset, counter_offset, event_sync, lh, lc, le = (h[base + i] for i in range(1, _FIELDS))
    checks = (
        ("state", state, state == 1, "1 once written"),
        ("device", device, 0 <= device < max(torch.cuda.device_count(), 1), "a CUDA device of this host"),
        ("nbytes", nbytes, nbytes == slot_bytes, f"a device slot holds the payload, {slot_bytes} bytes"),
        ("offset", offset, 0 <= offset <= 1 << 48, "an offset into a CUDA allocation"),
        ("counter_offset", counter_offset, 0 <= counter_offset < 1 << 20, "an index of torch's counters"),
        ("event_sync", event_sync, event_sync in (0, 1), "0 or 1"),
        ("handle length", lh, 1 <= lh <= MAX_HANDLE, f"1 to {MAX_HANDLE}"),
        ("counter name length", lc, 0 <= lc <= MAX_COUNTER_NAME, f"0 to {MAX_COUNTER_NAME}"),
        ("event handle length", le, 0 <= le <= MAX_EVENT_HANDLE, f"0 to {MAX_EVENT_HANDLE}"),
    )
    for field, value, ok, rule in checks:
        if not ok:
            raise bad(field, value, rule)
    words = [h[base + _FIELDS + i] for i in range((MAX_HANDLE + MAX_COUNTER_NAME + MAX_EVENT_HANDLE) // 8)]
    blob = memoryview(bytearray(len(words) * 8)).cast("q")
    for i, word in enumerate(words):
        blob[i] = word
    raw = blob.cast("B").tobytes()
    handle = raw[:lh]
    counter = raw[MAX_HANDLE : MAX_HANDLE + lc]
    event = raw[MAX_HANDLE + MAX_COUNTER_NAME : MAX_HANDLE + MAX_COUNTER_NAME + le]
    if counter and not counter.startswith(b"/") or b"\0" in counter:
        raise bad("counter name", lc, "a shared-memory file name")
    return Record(device, nbytes, offset, handle, counter, counter_offset, event, bool(event_sync))


def open_record(record: Record) -> torch.Tensor:
    """The device slot ``record`` describes, mapped in this process (through torch's
    ``rebuild_cuda_tensor``)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([record.nbytes]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        record.device,
        record.handle,
        record.nbytes,
        record.offset,
        False,
        record.counter,
        record.counter_offset,
        record.event,
        record.event_sync,
    )


def entry_views(layout: Layout, flat: torch.Tensor) -> list[torch.Tensor]:
    """Tensors viewing a flat ``uint8`` slot, one per entry of ``layout``, in entry order."""
    views = []
    for e in layout.entries:
        raw = flat[e.offset : e.offset + e.nbytes]
        views.append(
            raw.view(e.dtype).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=e.dtype, device=flat.device)
        )
    return views
