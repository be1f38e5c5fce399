"""Publishing from CUDA tensors without stalling the trainer: a client of the store's memory,
beside the store (page-locking the slots lives below, in :mod:`shmsync.core.page_lock`).

Publishing from CUDA tensors (:class:`AsyncPublisher`) uses *a snapshot on the device*
rather than stream ordering alone:

1. on the trainer's current stream, copy the weights into a private device buffer
   (device-to-device, an order of magnitude faster than the PCIe copy). The trainer's
   next optimizer step is queued after it on the same stream, so it cannot change the
   weights before they are captured;
2. on a side stream that waits for (1), copy the snapshot into the target slot
   (device-to-host, asynchronous into pinned memory) and record an event;
3. a completion thread waits for that event, then marks the slot complete and bumps the
   version. Readers never see the version before the bytes are in host memory.

The trainer's Python thread only enqueues work and returns. The next publish first waits
for the previous one to complete (the snapshot buffer is reused), which is back-pressure
only when publishing faster than the copy engine can move the bytes.
"""

from __future__ import annotations

import threading

import torch

from shmsync.core.header import W_VERSION
from shmsync.core.mapping import StoreMemory


class AsyncPublisher:
    """Publishes CUDA tensors into a store; see the module docstring for the protocol."""

    def __init__(self, memory: StoreMemory, device: torch.device) -> None:
        self.memory = memory
        self.name = memory.name
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.snapshot = [torch.empty(e.shape, dtype=e.dtype, device=device) for e in memory.layout.entries]
        self._done = threading.Event()
        self._done.set()
        self._error: BaseException | None = None
        self.pending_version: int | None = None  # queued, not yet visible

    def publish(self, tensors: list[torch.Tensor], version: int | None = None) -> int:
        self.wait()
        memory, protocol = self.memory, self.memory.protocol
        current = torch.cuda.current_stream(self.device)
        with torch.no_grad():
            torch._foreach_copy_(self.snapshot, tensors)  # (1) on the trainer's stream
        write = protocol.begin_write()  # stays open until (3): no other write can take the slot
        if version is None:
            version = protocol.h[W_VERSION] + 1  # completions are serialized, so this is exact
        try:
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream), torch.no_grad():  # (2)
                for dst, src in zip(memory.slots[write.slot], self.snapshot):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        except BaseException:
            protocol.abort(write)
            raise
        self._done.clear()
        self.pending_version = version
        threading.Thread(target=self._complete, args=(event, write, version), daemon=True).start()  # (3)
        return version

    def _complete(self, event: torch.cuda.Event, write, version: int) -> None:
        protocol = self.memory.protocol
        try:
            try:
                event.synchronize()
            except BaseException:
                protocol.abort(write)
                raise
            self.memory.commit(write, version)
        except BaseException as e:  # surfaced by the next wait()
            self._error = e
        finally:
            self.pending_version = None
            self._done.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last publish is visible to readers."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"store {self.name!r}: a CUDA publish did not complete in {timeout}s")
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"store {self.name!r}: an asynchronous CUDA publish failed") from error
