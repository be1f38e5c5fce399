"""A reader's view of a store's device slots: each mapped at its first use, through the record the
writer left in the header (:mod:`shmsync.writer.device_slots`), checked before torch opens it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shmsync.core.header import W_PAYLOAD_BYTES
from shmsync.errors import ShmSyncError
from shmsync.writer.device_slots import entry_views, open_record, read_record
from shmsync.writer.store import WeightStore


class DeviceSlotViews(Sequence):
    """Per device slot of a store, a view of every entry in layout order, mapped at first use.

    In the writer's own process the slots are its own tensors (a process cannot open its own CUDA
    IPC handle); elsewhere each is opened from its record.

    Args:
        store: the store, attached in this process.
    """

    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self._views: dict[int, list[torch.Tensor]] = {}
        self._flat: dict[int, torch.Tensor] = {}  # held: the mapping lives as long as this reader

    def __len__(self) -> int:
        return self.store.memory.num_slots

    def __getitem__(self, slot: int) -> list[torch.Tensor]:  # type: ignore[override]
        views = self._views.get(slot)
        if views is None:
            views = self._views[slot] = entry_views(self.store.memory.layout, self._open(slot))
        return views

    def _open(self, slot: int) -> torch.Tensor:
        memory = self.store.memory
        own = self.store.writer.cuda
        if own is not None:
            flat = own.slots.flat[slot]
        else:
            h = memory.header
            record = read_record(h, slot, memory.num_slots, h[W_PAYLOAD_BYTES], memory.name)
            flat = open_record(record) if record is not None else None
        if flat is None:
            raise ShmSyncError(f"store {memory.name!r}: device slot {slot} holds no version yet (never written)")
        self._flat[slot] = flat
        return flat


def device_slots(store: WeightStore, cuda: torch.device | None) -> DeviceSlotViews:
    """The device slots of ``store`` as a reader on ``cuda`` loads from them (on another GPU the
    copies go peer to peer, ``copy_`` between devices)."""
    return DeviceSlotViews(store)
