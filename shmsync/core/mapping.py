"""One store's shared memory as mapped in this process: the header and its protocol, the
tensor layout, and per slot the tensor views that copies go through.

This is what clients of a store build on (the store's publish, the readers, the CUDA
publisher, tools and tests): they copy through :attr:`StoreMemory.slots` inside the
protocol's ``copy(slot)`` callbacks, and never touch header words themselves.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shmsync.core import fences
from shmsync.core.header import (
    FORMAT,
    HEADER_BYTES,
    MAGIC,
    MAX_SLOTS,
    W_CREATE_NS,
    W_CREATOR_PID,
    W_CREATOR_PPID,
    W_CREATOR_START,
    W_DATA_OFFSET,
    W_FORMAT,
    W_LAYOUT_BYTES,
    W_LAYOUT_OFFSET,
    W_MAGIC,
    W_NUM_SLOTS,
    W_PAYLOAD_BYTES,
    W_SLOT_BYTES,
    check_words,
    header_view,
)
from shmsync.core.layout import Layout, segment_bytes
from shmsync.core.processes import process_start_ns
from shmsync.core.protocol import Protocol, initialize
from shmsync.core.segment import CREATOR_LOCK, Segment, SegmentLocks
from shmsync.errors import StoreCorruptError


def new_segment(
    layout: Layout, destinations: Any, make_segment: Callable[..., Segment], name: str, num_slots: int, track: bool
) -> Segment:
    """A new store's segment, sized for ``num_slots`` slots of ``layout``, its layout and header
    written (the magic word last: nobody attaches to a half-written header), no version yet; this
    process holds its creator lock. ``make_segment(name, size, track=...)`` makes the file.

    Raises:
        ValueError: ``num_slots`` out of range.
    """
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 2 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"num_slots must be an int between 2 and {MAX_SLOTS}, got {num_slots!r}")
    doc = layout.to_json(destinations)
    layout_offset, data_offset, size = segment_bytes(doc, layout.slot_bytes, num_slots)
    segment = make_segment(name, size, track=track)
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


def read_layout(fd: int, st: os.stat_result, name: str) -> tuple[Layout, Any]:
    """Store ``name``'s layout and destinations, its file (``fd``, ``st``) read with ``pread``:
    every header word that sizes, places or indexes anything, and every layout field, checked
    against the file's size before anything is mapped.

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
    return layout, destinations


class StoreMemory:
    """The mapping of one store in this process.

    Attributes:
        segment: the mapped segment (name, locks, lifetime).
        header: its header words (int64 memoryview).
        protocol: this process's side of the slot protocol (:class:`~shmsync.core.protocol.Protocol`).
        layout: where each tensor lives inside a slot; destinations: their names, or None.
        slots: per slot, a writable view of every tensor, in layout order.
    """

    def __init__(
        self, segment: Segment, header: memoryview, layout: Layout, destinations, *, unlink_at_exit: bool = False
    ) -> None:
        self.segment = segment
        self.header = h = header
        self.layout, self.destinations = layout, destinations
        self.num_slots = h[W_NUM_SLOTS]
        self.protocol = Protocol(h, SegmentLocks(segment), name=segment.name)
        self.slots = self._slot_views(segment.buf)
        self._readonly: list[list[torch.Tensor]] = []
        self._pinned: list = []  # (pointer, view) of page-locked memory, for CUDA copies
        # Garbage collected or at exit: views dropped, unlinked if asked (by the creator only).
        self._finalizer = weakref.finalize(
            self, _release, segment, (self.slots, self._readonly), h[W_CREATOR_PID], self._pinned, unlink_at_exit
        )

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def pinned(self) -> bool:
        """Whether the slots are page-locked in this process (see :meth:`pin_for_cuda`)."""
        return bool(self._pinned)

    def readonly_slots(self) -> list[list[torch.Tensor]]:
        """Per slot, read-only views of every entry (a write through them faults)."""
        if not self._readonly:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self._readonly += self._slot_views(self.segment.readonly())
        return self._readonly

    def _slot_views(self, buf) -> list[list[torch.Tensor]]:
        """Per slot, a view of every entry in mapping ``buf``."""
        data, stride = self.header[W_DATA_OFFSET], self.header[W_SLOT_BYTES]
        return [self.layout.slot_views(buf, data + i * stride) for i in range(self.num_slots)]

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s payload as one flat writable ``uint8`` tensor (all entries, in layout
        order, with their alignment gaps)."""
        h = self.header
        offset = h[W_DATA_OFFSET] + slot * h[W_SLOT_BYTES]
        return torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=h[W_PAYLOAD_BYTES], offset=offset)

    def slot_buffer(self, slot: int, *, writable: bool = False) -> memoryview:
        """Slot ``slot``'s payload bytes as a memoryview of the mapping (read-only unless
        ``writable``): what sockets send from and receive into. Release it before the store
        closes (``with memory.slot_buffer(s) as view: ...``)."""
        h = self.header
        offset = h[W_DATA_OFFSET] + slot * h[W_SLOT_BYTES]
        buf = self.segment.buf if writable else self.segment.readonly()
        with memoryview(buf) as whole:
            return whole[offset : offset + h[W_PAYLOAD_BYTES]]

    def pin_for_cuda(self) -> None:
        """Page-lock the slots in this process (once), so CUDA copies are asynchronous DMA."""
        if self._pinned or not torch.cuda.is_available():
            return
        from shmsync.core.page_lock import register_host

        h = self.header
        region = torch.frombuffer(
            self.segment.buf, dtype=torch.uint8, count=h[W_SLOT_BYTES] * self.num_slots, offset=h[W_DATA_OFFSET]
        )
        self._pinned.append((register_host(region), region))

    def close(self) -> None:
        """Drop the views and unmap (unlinking, if so made). The header stays readable: a
        private copy of its last state replaces the mapped one."""
        if self._finalizer.alive:
            mapped = self.header
            self.header = self.protocol.h = memoryview(bytearray(mapped.tobytes())).cast("q")
            mapped.release()  # so the mapping can go now
            self._finalizer()


def _release(segment: Segment, views: tuple[list, ...], creator_pid: int, pinned: list, unlink: bool = False) -> None:
    if pinned:
        from shmsync.core.page_lock import unregister_host

        for ptr, _view in pinned:
            unregister_host(ptr)  # before the memory is unmapped
        pinned.clear()
    for v in views:
        v.clear()
    if unlink and os.getpid() == creator_pid:
        segment.unlink()
    try:
        segment.close()
    except BufferError:
        pass  # tensors of the caller still view the mapping; it goes when they do
