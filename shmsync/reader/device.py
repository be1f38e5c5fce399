"""A reader's view of a store's device slots: each mapped at its first use, through the record the
writer left in the header (:mod:`shmsync.store.device_records`), checked before torch opens it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shmsync.core.header import W_PAYLOAD_BYTES
from shmsync.errors import ShmSyncError
from shmsync.store.device_records import entry_views, open_record, read_record
from shmsync.store.memory import StoreMemory


class DeviceSlotViews(Sequence):
    """Per device slot of a store, a view of every entry in layout order, mapped at first use.

    In the writer's own process the slots are its own tensors (a process cannot open its own CUDA
    IPC handle: the writer leaves them in ``memory.own_device_slots``); elsewhere each is opened
    from its record. On another GPU than the slots', copies go peer to peer.

    Args:
        memory: the store's mapping in this process.
    """

    def __init__(self, memory: StoreMemory) -> None:
        self.memory = memory
        self._views: dict[int, list[torch.Tensor]] = {}
        self._flat: dict[int, torch.Tensor] = {}  # held: the mapping lives as long as this reader

    def __len__(self) -> int:
        return self.memory.num_slots

    def __getitem__(self, slot: int) -> list[torch.Tensor]:  # type: ignore[override]
        views = self._views.get(slot)
        if views is None:
            views = self._views[slot] = entry_views(self.memory.layout, self._open(slot))
        return views

    def _open(self, slot: int) -> torch.Tensor:
        memory = self.memory
        own = memory.own_device_slots
        if own is not None:
            flat = own[slot]
        else:
            h = memory.header
            record = read_record(h, slot, memory.num_slots, h[W_PAYLOAD_BYTES], memory.name)
            flat = open_record(record) if record is not None else None
        if flat is None:
            raise ShmSyncError(f"store {memory.name!r}: device slot {slot} holds no version yet (never written)")
        self._flat[slot] = flat
        return flat
