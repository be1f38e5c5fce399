"""Device slots in the writer's process: a store's versions in the trainer's GPU memory, each slot
allocated the first time the writer takes it and shared through its record in the header
(:mod:`shmsync.store.device_records`)."""

from __future__ import annotations

import threading

import torch

from shmsync.core.header import R_FLAGS, ROW_DEVICE_BANK, reader_rows
from shmsync.store.device_records import entry_views, share, write_record
from shmsync.store.layout import Layout

_KEPT: list = []  # slots whose store closed while readers mapped them: kept for the life of this process
_KEPT_LOCK = threading.Lock()


def host_readers(h) -> bool:
    """Whether a reader that needs the host slots has a row: one not reading the device bank (a
    CPU worker, a GPU worker elsewhere, a relay's link). Rows of dead readers count until reused."""
    return any(not words[R_FLAGS] & ROW_DEVICE_BANK for _, words in reader_rows(h))


class DeviceSlots:
    """The device slots of one store in the writer's process: allocated at first use, shared
    through the header's records.

    Args:
        h: the store's header words.
        layout: its layout (each slot holds a payload of it).
        num_slots: the slots of a bank.
        device: the trainer's GPU.
    """

    def __init__(self, h, layout: Layout, num_slots: int, device: torch.device) -> None:
        self.h = h
        self.layout = layout
        self.device = device
        self.flat: list[torch.Tensor | None] = [None] * num_slots
        self.views: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]

    @property
    def nbytes(self) -> int:
        """Bytes of GPU memory the slots take now."""
        return sum(t.numel() for t in self.flat if t is not None)

    def take(self, slot: int) -> list[torch.Tensor]:
        """Device slot ``slot``'s views, allocating and sharing it first if it is new."""
        if self.flat[slot] is None:
            flat = torch.empty(max(self.layout.payload_bytes, 1), dtype=torch.uint8, device=self.device)
            self.flat[slot] = flat
            self.views[slot] = entry_views(self.layout, flat)
            write_record(self.h, slot, share(flat))
        return self.views[slot]

    def close(self, mapped_elsewhere: bool) -> None:
        """Let the slots go. While a reader in another process may still map them
        (``mapped_elsewhere``), they are kept for the life of this process instead: CUDA memory that
        another process mapped must outlive its use there."""
        if mapped_elsewhere:
            with _KEPT_LOCK:
                _KEPT.append(self.flat)
        self.flat = [None] * len(self.flat)
        self.views = [[] for _ in self.views]
