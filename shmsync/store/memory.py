"""One store's shared memory as mapped in this process: its header and the protocol's words of
each bank, the tensor layout, per slot the tensor views that copies go through, and the pages.

What clients of a store build on (the store's publish, the readers, the CUDA writer, relays,
tools and tests): they copy through :attr:`StoreMemory.slots` (a writer's) or
:meth:`StoreMemory.private_slots` (a reader's) between the protocol's steps, and build its classes
(:mod:`shmsync.core.protocol`) on :attr:`StoreMemory.host` or :attr:`StoreMemory.device`.

Memory: a new store reserves its head and one slot; any other slot gets its pages when it is
first written (:meth:`StoreMemory.reserve`, so a full ``/dev/shm`` is an ``OSError``, never a
SIGBUS), and gives them back once no reader can use it (:meth:`StoreMemory.give_back`, for the
slots the writer finds idle after a publish).
"""

from __future__ import annotations

import array
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shmsync.core import fences
from shmsync.core.header import (
    DEVICE,
    FORMAT,
    HEADER_BYTES,
    HOST,
    MAGIC,
    MAX_SLOTS,
    RECORD_BYTES,
    STORE_PAGE_LOCKED,
    W_COPIED_BYTES,
    W_CREATE_NS,
    W_CREATOR_PID,
    W_CREATOR_PPID,
    W_CREATOR_START,
    W_DATA_OFFSET,
    W_DEVICE,
    W_DEVICE_BYTES,
    W_FORMAT,
    W_GIVE_BACK_BEGUN,
    W_GIVE_BACK_DONE,
    W_LAYOUT_BYTES,
    W_LAYOUT_OFFSET,
    W_MAGIC,
    W_NUM_SLOTS,
    W_PAYLOAD_BYTES,
    W_PROMISED,
    W_PROOF,
    W_PUBLISH_COUNT,
    W_PUBLISH_NS,
    W_RECORD_ENTRIES,
    W_RECORDS_OFFSET,
    W_SKIPPED_BYTES,
    W_SLOT_BYTES,
    W_STEPS,
    W_STORE_FLAGS,
    W_VERSION,
    W_WRITER_PID,
    check_words,
    header_view,
)
from shmsync.core.pages import address_of, holds_pages, punch, reserve, resident_bytes
from shmsync.core.processes import process_start_ns
from shmsync.core.protocol import SlotReader, Words, initialize
from shmsync.core.segment import CREATOR_LOCK, WRITER_LOCK, Segment, SegmentLocks, not_found_hint
from shmsync.errors import ClosedError, InvalidArgumentError, ShmSyncError, StoreCorruptError, StoreNotFoundError
from shmsync.store.copies import copy_all
from shmsync.store.layout import Layout, segment_bytes

_FACTS = {
    "version": W_VERSION,
    "promised": W_PROMISED,
    "creator_pid": W_CREATOR_PID,
    "creator_start_ns": W_CREATOR_START,
    "creator_ppid": W_CREATOR_PPID,
    "writer_pid": W_WRITER_PID,
    "publish_count": W_PUBLISH_COUNT,
    "last_publish_ns": W_PUBLISH_NS,
    "create_ns": W_CREATE_NS,
    "payload_bytes": W_PAYLOAD_BYTES,
    "device_bytes": W_DEVICE_BYTES,
    "steps": W_STEPS,
    "copied_bytes": W_COPIED_BYTES,
    "skipped_bytes": W_SKIPPED_BYTES,
    "unchanged_proof": W_PROOF,
}
RECHECK_EMPTY_S = 10.0  # a slot given back is looked at again this often (a late reader's copy refills it)


def new_segment(
    layout: Layout, destinations: Any, make_segment: Callable[..., Segment], name: str, num_slots: int, track: bool
) -> Segment:
    """A new store's segment, sized for ``num_slots`` slots of ``layout``, its layout and header
    written (the magic word last: nobody attaches to a half-written header), no version yet; this
    process holds its creator lock. ``make_segment(name, size, head, reserve_bytes=..., track=...)``
    makes the file; only the head and the first slot are reserved.

    Raises:
        InvalidArgumentError: ``num_slots`` out of range.
    """
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 2 <= num_slots <= MAX_SLOTS:
        raise InvalidArgumentError(f"num_slots must be an int between 2 and {MAX_SLOTS}, got {num_slots!r}")
    doc = layout.to_json(destinations)
    entries = len(layout.entries)
    layout_offset, records_offset, data_offset, size = segment_bytes(doc, layout.slot_bytes, num_slots, entries)
    segment = make_segment(name, size, data_offset, reserve_bytes=data_offset + layout.slot_bytes, track=track)
    h = header_view(segment.buf)
    try:
        segment.lock(CREATOR_LOCK, exclusive=True, wait=False)
        segment.buf[layout_offset : layout_offset + len(doc)] = doc
        pid = os.getpid()
        for word, value in (
            (W_FORMAT, FORMAT),
            (W_CREATOR_PID, pid),
            (W_CREATOR_PPID, os.getppid()),
            (W_CREATOR_START, process_start_ns(pid)),
            (W_CREATE_NS, time.time_ns()),
            (W_LAYOUT_OFFSET, layout_offset),
            (W_LAYOUT_BYTES, len(doc)),
            (W_RECORDS_OFFSET, records_offset),
            (W_RECORD_ENTRIES, entries),
            (W_DATA_OFFSET, data_offset),
            (W_SLOT_BYTES, layout.slot_bytes),
            (W_PAYLOAD_BYTES, layout.payload_bytes),
        ):
            h[word] = value
        initialize(h, num_slots)
        fences.ordering()[1]()  # everything above before the magic word
        h[W_MAGIC] = MAGIC  # last: attach() refuses a half-initialised header
    except BaseException:
        h.release()
        segment.unlink()
        segment.close()
        raise
    h.release()
    return segment


def read_layout(fd: int, st: os.stat_result, name: str) -> tuple[int, tuple[Layout, Any]]:
    """Where store ``name``'s slots begin, and its layout and destinations, its file (``fd``,
    ``st``) read with ``pread``: every header word that sizes, places or indexes anything, and
    every layout field, checked against the file's size before anything is mapped.

    Raises:
        StoreNotFoundError: a file too short for a header (a store still being made).
        StoreCorruptError: naming the first field out of range.
    """
    if st.st_size < HEADER_BYTES:
        check_words((), st.st_size, name)  # raises, saying why
    h = memoryview(os.pread(fd, HEADER_BYTES, 0)).cast("q")
    lo, ln = check_words(h, st.st_size, name)
    layout, destinations = Layout.from_json(os.pread(fd, ln, lo), f"store {name!r}: layout")
    if layout.payload_bytes != h[W_PAYLOAD_BYTES]:
        raise StoreCorruptError(
            f"store {name!r}: header field payload_bytes is {h[W_PAYLOAD_BYTES]}, its layout holds "
            f"{layout.payload_bytes} bytes; the store was not opened"
        )
    if len(layout.entries) != h[W_RECORD_ENTRIES]:
        raise StoreCorruptError(
            f"store {name!r}: header field record_entries is {h[W_RECORD_ENTRIES]}, its layout holds "
            f"{len(layout.entries)} tensors (one record entry each); the store was not opened"
        )
    return h[W_DATA_OFFSET], (layout, destinations)


class StoreMemory:
    """The mapping of one store in this process.

    Attributes:
        segment: the mapped segment (name, locks, lifetime).
        header: its header words (int64 memoryview; a private copy of the last state once closed).
        locks: the readers' locks (:class:`~shmsync.core.segment.SegmentLocks`).
        host, device: the protocol's words of the host bank and of the device bank.
        layout: where each tensor lives inside a slot; destinations: their names, or None.
        slots: per slot, a writable view of every tensor in layout order, on the store's own pages
            (what a writer copies into; mapped at first use, see :meth:`map_slots`).
        records: the host slots' records, one int64 word per slot and tensor (slot ``s``'s entry
            for tensor ``i`` at ``s * len(layout.entries) + i``): the version the tensor last
            changed at, as of the version the slot holds (see :mod:`shmsync.core.header`).
            Written by the writer inside a slot's write; read by a copying reader inside its copy.
    """

    def __init__(
        self, segment: Segment, header: memoryview, layout: Layout, destinations, *, unlink_at_exit: bool = False
    ) -> None:
        self.segment = segment
        self.header = h = header
        self.name = segment.name
        self.layout, self.destinations = layout, destinations
        self.num_slots = h[W_NUM_SLOTS]
        offset, entries = h[W_RECORDS_OFFSET], h[W_RECORD_ENTRIES]
        with memoryview(segment.buf) as whole:  # the head's mapping: header, layout and records
            self.records = whole[offset : offset + self.num_slots * entries * RECORD_BYTES].cast("q")
        self.locks = SegmentLocks(segment)
        self.host = Words(h, HOST, name=segment.name)
        self.device = Words(h, DEVICE, name=segment.name)
        self.slots: list[list[torch.Tensor]] = []  # per slot, views of the store's pages (a writer's)
        self._private: list[list[torch.Tensor]] = []  # per slot, views of a private mapping (a reader's)
        self._page_locked: list = []  # (pointer, view) of page-locked memory, for CUDA copies
        # This process's device slots when it is the writer (a process cannot open its own CUDA
        # IPC handles): given by the CUDA writer (set_own_device_slots), read by a reader on that GPU.
        self.own_device_slots: list[torch.Tensor | None] | None = None
        self._dependents: weakref.WeakSet = weakref.WeakSet()  # closed before the memory goes
        self.closed = False
        # Garbage collected or at exit: views dropped, unlinked if asked (by the creator only).
        self._finalizer = weakref.finalize(
            self, _release, segment, (self.slots, self._private), h[W_CREATOR_PID], self._page_locked, unlink_at_exit
        )

    def set_own_device_slots(self, slots: list[torch.Tensor | None]) -> None:
        """Set :attr:`own_device_slots`: the device slots this process's CUDA writer made (one flat
        tensor per slot, None until written), for a reader in this process: a process cannot
        open its own CUDA IPC handles, so it maps these instead of the records'."""
        self.own_device_slots = slots

    @classmethod
    def create(
        cls,
        layout: Layout,
        destinations: tuple[str, ...] | None,
        name: str,
        num_slots: int,
        *,
        unlink_at_exit: bool,
        make_segment: Callable[..., Segment] = Segment.create,
    ) -> StoreMemory:
        """A new store's file (see :func:`new_segment`), mapped: no version yet, this process its creator."""
        segment = new_segment(layout, destinations, make_segment, name, num_slots, track=unlink_at_exit)
        try:
            return cls(segment, header_view(segment.buf), layout, destinations, unlink_at_exit=unlink_at_exit)
        except BaseException:
            segment.unlink()
            segment.close()
            raise

    @classmethod
    def attach(cls, name: str) -> StoreMemory:
        """Store ``name``'s file, checked (see :func:`read_layout`), then mapped.

        Raises:
            StoreNotFoundError: there is no such store (or it was unlinked).
        """
        try:
            segment, (layout, destinations) = Segment.open(name, lambda fd, st: read_layout(fd, st, name))
        except StoreNotFoundError as e:
            raise StoreNotFoundError(f"{e}{not_found_hint(name)}") from None
        try:
            return cls(segment, header_view(segment.buf), layout, destinations)
        except BaseException:
            segment.close()
            raise

    def copy_latest(self, slot_reader: SlotReader, timeout: float) -> tuple[int, list[torch.Tensor]]:
        """A private copy of the newest complete version in the host slots, read with ``slot_reader``:
        its version and tensors, in layout order."""
        tensors = [torch.empty(e.shape, dtype=e.dtype) for e in self.layout.entries]
        slots = self.read_slots()
        version = slot_reader.read(lambda slot: copy_all(tensors, slots[slot]), timeout=timeout)
        return version, tensors

    def check_open(self) -> None:
        """Raise :class:`~shmsync.errors.ClosedError` if this process closed the store."""
        if self.closed:
            raise ClosedError(f"store {self.name!r} is closed in this process")

    def writer_alive(self) -> bool:
        """Whether a live process can still publish (it holds the writer role, or is the creator
        with the store open), told by the kernel's locks, whatever the PID namespace."""
        segment = self.segment
        return not self.closed and (segment.held_anywhere(WRITER_LOCK) or segment.held_anywhere(CREATOR_LOCK))

    def add_dependent(self, obj: Any) -> None:
        """Call ``obj.close()`` (held weakly) when this memory closes, before it is unmapped (a
        reader in place gives its parameters private memory and its lease back then)."""
        self._dependents.add(obj)

    @property
    def page_locked(self) -> bool:
        """Whether the slots are page-locked in this process (see :meth:`page_lock_for_cuda`)."""
        return bool(self._page_locked)

    def map_slots(self) -> list[list[torch.Tensor]]:
        """Map the store's pages writable (once) and return :attr:`slots`."""
        if not self.slots:
            self.slots += self._slot_views(shared=True)
        return self.slots

    def private_slots(self) -> list[list[torch.Tensor]]:
        """Per slot, a view of every tensor in layout order, on a private mapping of the store's
        pages: what a reader copies from, or points its parameters at. A write through them
        copies the page for this process alone (see :func:`shmsync.core.written_pages.private_copies`)."""
        if not self._private:
            self._private += self._slot_views(shared=False)
        return self._private

    def read_slots(self) -> list[list[torch.Tensor]]:
        """Views to copy out of: the writer's, where this process has them, else the private ones."""
        return self.slots or self.private_slots()

    def _slot_views(self, *, shared: bool) -> list[list[torch.Tensor]]:
        buf, base = self.segment.data(shared=shared)
        data, stride = self.header[W_DATA_OFFSET] - base, self.header[W_SLOT_BYTES]
        return [self.layout.slot_views(buf, data + i * stride) for i in range(self.num_slots)]

    def slot_range(self, slot: int) -> tuple[int, int]:
        """Slot ``slot``'s ``(offset, length)`` in the file."""
        h = self.header
        return h[W_DATA_OFFSET] + slot * h[W_SLOT_BYTES], h[W_SLOT_BYTES]

    def private_address(self, slot: int) -> int:
        """The address of slot ``slot``'s first byte in this process's private mapping."""
        self.private_slots()
        buf, base = self.segment.data(shared=False)
        return address_of(buf) + self.slot_range(slot)[0] - base

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s payload as one flat writable ``uint8`` tensor (all entries, in layout
        order, with their alignment gaps), on the store's pages."""
        buf, base = self.segment.data(shared=True)
        offset = self.slot_range(slot)[0] - base
        return torch.frombuffer(buf, dtype=torch.uint8, count=self.header[W_PAYLOAD_BYTES], offset=offset)

    def slot_buffer(self, slot: int, *, writable: bool = False) -> memoryview:
        """Slot ``slot``'s payload bytes as a memoryview (read-only unless ``writable``): what
        sockets send from and receive into. Release it before the store closes
        (``with memory.slot_buffer(s) as view: ...``)."""
        shared = writable or self.segment.mapped(shared=True)
        buf, base = self.segment.data(shared=shared)
        offset = self.slot_range(slot)[0] - base
        with memoryview(buf) as whole:
            view = whole[offset : offset + self.header[W_PAYLOAD_BYTES]]
            return view if writable else view.toreadonly()

    def record_all(self, slot: int, version: int) -> None:
        """Record every tensor of host slot ``slot`` as changed at ``version`` (inside a write of
        that version that filled the whole slot, with no history of what changed: bytes from a
        relay, a fill from the device slots, a background copy). Readers copy all of it."""
        n = len(self.layout.entries)
        self.records[slot * n : (slot + 1) * n] = array.array("q", [version]) * n

    # -- pages ----------------------------------------------------------------------------------
    def reserve(self, slot: int) -> None:
        """Before the writer writes an empty slot: its pages, or an OSError if there is no room."""
        offset, length = self.slot_range(slot)
        reserve(self.segment.fd, offset, length, f"a slot of store {self.name!r}")

    def holds_pages(self, slot: int) -> bool:
        """Whether slot ``slot`` holds any page (one ``lseek``)."""
        offset, length = self.slot_range(slot)
        return holds_pages(self.segment.fd, offset, length)

    def give_back(self, slot: int) -> bool:
        """Drop the pages of ``slot`` (marked being written by the caller: see
        :meth:`~shmsync.core.protocol.SlotWriter.idle_slots`); none once a process page-locked the slots
        for CUDA copies (the device would keep reading the pages it locked). True if given back."""
        h, full_fence, fence = self.header, self.host.full_fence, self.host.fence
        h[W_GIVE_BACK_BEGUN] += 1
        full_fence()  # the count before the flag's load (page_lock_for_cuda: the flag, then the count)
        given = not h[W_STORE_FLAGS] & STORE_PAGE_LOCKED
        if given:
            offset, length = self.slot_range(slot)
            punch(self.segment.fd, offset, length)
        fence()
        h[W_GIVE_BACK_DONE] += 1
        return given

    @property
    def layout_description(self) -> bytes:
        """The layout (keys, shapes, dtypes, offsets, destinations) as bytes: equal descriptions,
        equal bytes (a relay makes another host's store from it)."""
        return self.layout.to_json(self.destinations)

    @property
    def device_bytes(self) -> int:
        """Bytes of GPU memory the store's device slots take now."""
        return self.header[W_DEVICE_BYTES]

    def facts(self) -> dict[str, int]:
        """The header's facts (see :meth:`shmsync.WeightStore.info`)."""
        h = self.header
        facts = {name: h[word] for name, word in _FACTS.items()}
        device = h[W_DEVICE]
        extra = {"shm_bytes": self.segment.size, "resident_bytes": self.resident_bytes()}
        return {**facts, **extra, "num_slots": self.num_slots, "device": device - 1 if device else -1}

    def resident_bytes(self) -> int:
        """Bytes of memory the store's file takes now (header and the slots holding pages)."""
        return resident_bytes(self.segment.fd)

    def page_lock_for_cuda(self) -> None:
        """Page-lock the host slots in this process (once), so CUDA copies are asynchronous DMA.

        From then on the writer gives no slot's memory back (the device would go on reading the
        pages it locked): a store whose host slots feed a GPU holds all of them in host memory."""
        if self._page_locked or not torch.cuda.is_available():
            return
        h = self.header
        h[W_STORE_FLAGS] |= STORE_PAGE_LOCKED
        self.host.full_fence()  # the flag before the count's load below
        buf, base = self.segment.data(shared=True)
        region = torch.frombuffer(
            buf, dtype=torch.uint8, count=h[W_SLOT_BYTES] * self.num_slots, offset=h[W_DATA_OFFSET] - base
        )
        # A give-back the writer began before it could see the flag may still drop pages: wait
        # for it to end (see give_back: of the flag and the count, one side sees the other's).
        began, deadline = h[W_GIVE_BACK_BEGUN], time.monotonic() + 5.0
        while h[W_GIVE_BACK_DONE] < began:
            if time.monotonic() > deadline:
                return  # a writer that died mid-give-back: copies stay synchronous
            time.sleep(0.001)
        self._page_locked.append((register_host(region), region))

    def close(self) -> None:
        """Drop the views and unmap (unlinking, if so made). The header stays readable: a
        private copy of its last state replaces the mapped one."""
        if not self.closed:
            for dependent in list(self._dependents):
                dependent.close()  # while mapped: private copies made, leases given back
            self.closed = True
            mapped = self.header
            self.header = memoryview(bytearray(mapped.tobytes())).cast("q")
            # The protocol objects' words view the mapping still: released, any use of them raises ValueError.
            mapped.release()
            self.records.release()
            self._finalizer()


def register_host(tensor: torch.Tensor) -> int:
    """Page-lock the memory behind a CPU tensor (``cudaHostRegister``); returns its pointer for
    :func:`unregister_host`."""
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise ShmSyncError(f"cudaHostRegister of {size} bytes failed with CUDA error {int(err)}")
    return ptr


def unregister_host(ptr: int) -> None:
    """Undo :func:`register_host` (before the memory is unmapped)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _release(
    segment: Segment, views: tuple[list, ...], creator_pid: int, page_locked: list, unlink: bool = False
) -> None:
    for ptr, _view in page_locked:
        unregister_host(ptr)  # before the memory is unmapped
    page_locked.clear()
    for v in views:
        v.clear()
    if unlink and os.getpid() == creator_pid:
        segment.unlink()
    try:
        segment.close()
    except BufferError:
        pass  # tensors of the caller still view the mapping; it goes when they do
