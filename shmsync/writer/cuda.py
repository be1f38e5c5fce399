"""Publishing from CUDA tensors: versions in device slots on the trainer's GPU, host slots filled
from them once per version for the readers that need host memory.

One publish, on the trainer's thread (:meth:`CudaWriter.enqueue`)::

    write = device slot writer.begin_write()  a device slot no reader uses (shmsync.core.protocol)
    copy the tensors into it                   device to device, on the trainer's current stream:
                                               after the step that made them, before the next
    record an event; promise the version       the trainer's thread returns here

and on the store's copier thread: wait for the event, commit the device slot (readers on the same
GPU run it in place from now on), and, while a reader needs the host slots (a CPU worker, a GPU
worker without peer access, a relay), copy the device slot into a host slot in chunks on a side
stream and commit that. One write is open at a time: the next publish waits (``WeightStore.flush``)
only if the previous copy has not landed (the copy engine is slower than the trainer publishes).
"""

from __future__ import annotations

import os
import threading
from typing import cast

import torch

from shmsync.core.header import (
    R_FLAGS,
    R_PID,
    ROW_DEVICE_BANK,
    W_DEVICE,
    W_DEVICE_BYTES,
    W_HOST_WANTED,
    reader_rows,
)
from shmsync.core.protocol import Leases, SlotWriter
from shmsync.store.copies import Copier
from shmsync.store.memory import StoreMemory
from shmsync.writer.device_slots import DeviceSlots, host_readers

CHUNK_BYTES = 64 << 20  # device-to-host copies of the host fill, one chunk at a time
WATCH_EVERY_S = 0.02  # how often an idle CUDA writer looks for a reader asking for the host slots


class CudaWriter:
    """The writing of a store published from CUDA tensors: copies them into its device slots,
    and fills its host slots from those. Held by the store's ``Writer`` from the first
    publish from CUDA on.

    Args:
        memory: the store's mapping in this process.
        host: the slot writer of its host bank (fills it).
        copier: the store's background thread (lands each copy).
        device: the trainer's GPU, where the device slots live.
    """

    def __init__(self, memory: StoreMemory, host: SlotWriter, copier: Copier, device: torch.device) -> None:
        self.memory, self.host, self.copier, self.device = memory, host, copier, device
        self.slot_writer = SlotWriter(memory.device, Leases(memory.device, memory.locks))
        self.slots = DeviceSlots(memory.header, memory.layout, memory.num_slots, device)
        memory.set_own_device_slots(self.slots.flat)  # a reader in this process maps these (it cannot open its own)
        self.stream = torch.cuda.Stream(device)  # the host fills' copies
        self._wanted = memory.header[W_HOST_WANTED]
        self._closing = threading.Event()
        memory.header[W_DEVICE] = device.index + 1  # readers on GPUs choose the device bank from now on
        self._watch = threading.Thread(target=self._watch_host, name=f"shmsync-host-fill-{memory.name}", daemon=True)
        self._watch.start()

    def enqueue(self, tensors: list[torch.Tensor], version: int | None) -> int:
        """Copy ``tensors`` into a free device slot on the current stream and promise the version;
        it lands on the copier's thread. Returns the version. The write before it has landed
        (the caller waited for it)."""
        slot_writer = self.slot_writer
        write = slot_writer.begin_write(version)
        version = write.version
        try:
            views = self.slots.take(write.slot)
            with torch.no_grad():
                torch._foreach_copy_(views, tensors)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        except BaseException:
            slot_writer.abort(write)
            raise
        slot_writer.promise(version)
        self.copier.submit(lambda: self._land(write, version, event))
        return version

    def _land(self, write, version: int, event: torch.cuda.Event) -> None:
        """On the copier's thread: the device copy ended; commit it, then fill the host slots."""
        slot_writer = self.slot_writer
        try:
            event.synchronize()
        except BaseException:
            slot_writer.abort(write)
            slot_writer.withdraw()
            raise
        slot_writer.commit(write)
        self.memory.header[W_DEVICE_BYTES] = self.slots.nbytes
        if self._host_wanted():
            self._fill_host(write.slot, version)

    def _host_wanted(self) -> bool:
        h = self.memory.header
        wanted = h[W_HOST_WANTED]
        asked, self._wanted = wanted != self._wanted, wanted
        return asked or host_readers(h)

    def _fill_host(self, slot: int, version: int) -> None:
        """Copy device slot ``slot`` (the latest: never rewritten while this thread lands nothing
        else) into a host slot, chunk by chunk on the side stream, and commit it as ``version``."""
        memory, host = self.memory, self.host
        if not memory.page_locked:
            memory.page_lock_for_cuda()  # device-to-host copies become DMA into the store's own pages
        write = host.begin_write(version)  # the device slot's version, filled into a host slot
        try:
            if write.held < 0:
                memory.reserve(write.slot)
            src = cast(torch.Tensor, self.slots.flat[slot])  # the latest: written, so allocated
            dst = memory.slot_bytes(write.slot)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for start in range(0, src.numel(), CHUNK_BYTES):
                    dst[start : start + CHUNK_BYTES].copy_(src[start : start + CHUNK_BYTES], non_blocking=True)
            self.stream.synchronize()
            memory.record_all(write.slot, version)  # the whole slot, with no history: readers copy all of it
        except BaseException:
            host.abort(write)
            raise
        host.commit(write)

    def _watch_host(self) -> None:
        """An idle trainer still serves a reader that starts on the host slots: when one asks
        (``W_HOST_WANTED``) and the host slots are behind, fill them from the latest device slot."""
        memory = self.memory
        while not self._closing.wait(WATCH_EVERY_S):
            try:
                h = memory.header
                if memory.closed or h[W_HOST_WANTED] == self._wanted or self.copier.pending:
                    continue
                if h[memory.host.version] < h[memory.device.version]:
                    self.copier.submit(self._fill_latest)
                else:
                    self._wanted = h[W_HOST_WANTED]
            except (ValueError, RuntimeError):  # the store closed meanwhile
                return

    def _fill_latest(self) -> None:
        h = self.memory.header
        self._wanted = h[W_HOST_WANTED]
        version = h[self.memory.device.version]
        if h[self.memory.host.version] < version:
            self._fill_host(h[self.memory.device.latest], version)

    def newest_views(self) -> list[torch.Tensor] | None:
        """The newest device slot's tensors (None before the first lands): the writer compares a
        source with them before it publishes again."""
        h = self.memory.header
        if h[self.memory.device.version] < 0:
            return None
        return self.slots.views[h[self.memory.device.latest]]

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        """The newest version as CPU tensors (in this process: the device slots are its own)."""
        h = self.memory.header
        slot = h[self.memory.device.latest]
        return h[self.memory.device.version], [v.to("cpu") for v in self.slots.views[slot]]

    def close(self) -> None:
        """Stop watching; let the device slots go (kept while a reader elsewhere may map them)."""
        self._closing.set()
        self._watch.join(5)
        me = os.getpid()
        rows = [row for row, w in reader_rows(self.memory.header) if w[R_FLAGS] & ROW_DEVICE_BANK and w[R_PID] != me]
        self.slots.close(bool(self.memory.locks.rows_alive(rows)))
