"""Where a reader's module loads from: its weights matched against the store's layout, and the bank
of slots they load from (the host slots, or the device slots of the GPU it runs on)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shmsync.core.header import DEVICE, HOST, W_DEVICE
from shmsync.core.protocol import Leases, SlotReader, Words
from shmsync.errors import ArgumentTypeError, InvalidArgumentError, WeightMismatchError
from shmsync.reader.held_copy import HeldCopy
from shmsync.reader.in_place import InPlace
from shmsync.store.memory import StoreMemory
from shmsync.store.sources import is_destinations, module_weights, parts

Parts = list[tuple[tuple[str, ...], nn.Module]]  # (key prefix in the store, module) pairs


class Binding:
    """A module's weights matched against a store's layout, and the bank of slots they load from.
    Its job is what to load and from where; the :class:`~shmsync.WeightReader` holding it decides
    when. Made at the reader's first load, and again when the store's device slots move.

    Args:
        memory: the store's mapping in this process.
        parts: the modules to load, each with its key prefix in the store (see :func:`parts_of`).
            Weights on the ``meta`` device are materialized here.
        device: where the weights should live (None: where they are; the CPU for ``meta``).
        device_slots: a GPU module may load from the store's device slots.
        zero_copy: the reader's wish to run in place (None: where it can).
        viewing: the list that holds the parameters while they point at a slot (see
            :class:`~shmsync.reader.in_place.InPlace`).

    Attributes:
        targets: the module's tensors, matched; indices: their entries in the layout.
        cuda: the module's GPU, or None on the CPU.
        bank: :data:`~shmsync.core.header.HOST` or :data:`~shmsync.core.header.DEVICE`.
        leases, slot_reader: the bank's leases, and the protocol's reader side copying from it
            (each holds the bank's words).
        slots: per slot, a view of every entry in layout order, as this process reads it.
        held: the module's private copy, when it copies: the version it holds, and reloads that
            copy only what changed since (:class:`~shmsync.reader.held_copy.HeldCopy`).
        in_place: how the parameters point at a leased slot, when they run in place (else None).
    """

    def __init__(
        self,
        memory: StoreMemory,
        parts: Parts,
        device: torch.device | None,
        *,
        device_slots: bool,
        zero_copy: bool | None,
        viewing: list[torch.Tensor],
    ) -> None:
        self.targets, self.indices = match_parts(memory, parts, device)
        self.cuda = next((t.device for t in self.targets if t.is_cuda), None)
        self.bank = bank_for(memory, self.cuda) if device_slots else HOST
        here = self.cuda is None or self.bank == DEVICE and memory.header[W_DEVICE] - 1 == self.cuda.index
        if zero_copy and not here:
            raise InvalidArgumentError(
                f"zero_copy=True needs a module on the CPU or on the GPU holding the store's device slots, "
                f"got weights on {self.cuda}: it copies"
            )
        words: Words = memory.host if self.bank == HOST else memory.device
        self.leases = Leases(words, memory.locks)
        self.slot_reader = SlotReader(words, memory.locks)
        self.device_seen = memory.header[W_DEVICE]  # the store's device word when bound
        self.slots = slots_for(memory, self.bank, self.cuda)
        self.held = HeldCopy(memory, self.targets, self.indices, self.slots, records=self.bank == HOST)
        self.in_place: InPlace | None = None
        if here and zero_copy is not False:
            # On the host, a private mapping: a write of this process's never reaches the store.
            views = self.slots if self.bank == DEVICE else memory.private_slots()
            device_of_slots = self.cuda if self.bank == DEVICE else None
            self.in_place = InPlace(memory, self.targets, self.indices, viewing, views, device_of_slots)

    def drop_in_place(self) -> None:
        """From now on the module loads by copying (it wrote its weights: see
        :meth:`~shmsync.WeightReader.reload`)."""
        self.in_place = None

    @property
    def own_device_bytes(self) -> int:
        """GPU memory of the module's own (a private copy on a GPU), for the readers' table."""
        if self.cuda is None or self.in_place is not None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.targets)


def bank_for(memory: StoreMemory, cuda: torch.device | None) -> int:
    """The bank a module on ``cuda`` (None: the CPU) loads from: the device slots if the store has
    them and the module's GPU is theirs or reaches theirs peer to peer, else the host slots."""
    if cuda is None or not memory.header[W_DEVICE]:
        return HOST
    home = memory.header[W_DEVICE] - 1
    return DEVICE if cuda.index == home or torch.cuda.can_device_access_peer(cuda.index, home) else HOST


def slots_for(memory: StoreMemory, bank: int, cuda: torch.device | None) -> Any:
    """Per slot, the views a reader loads from: the device slots, or for a module on the CPU this
    process's private mapping of the host slots, or for a GPU the page-locked ones."""
    if bank == DEVICE:
        from shmsync.reader.device import DeviceSlotViews

        return DeviceSlotViews(memory)
    if cuda is None:
        return memory.read_slots()
    memory.page_lock_for_cuda()  # host-to-device copies become asynchronous DMA
    return memory.map_slots()


def match_parts(memory: StoreMemory, parts: Parts, device: torch.device | None) -> tuple[list[torch.Tensor], list[int]]:
    """Each part's weights (materialized from ``meta``, moved to ``device``) matched against the
    store's layout: the tensors to load, and their entries' indices."""
    layout = memory.layout
    targets: list[torch.Tensor] = []
    indices: list[int] = []
    for prefix, module in parts:
        if is_meta(module):
            module.to_empty(device=device or torch.device("cpu"))
        elif device is not None:
            module.to(device)
        where = f"module given to WeightReader for store {memory.name!r}" + (
            f", destination {prefix[0]!r}" if prefix else ""
        )
        targets += layout.match(module_weights(module), where, prefix=prefix)
        indices += layout.subset(prefix)
    return targets, indices


def is_meta(module: nn.Module) -> bool:
    """Whether ``module`` has weights on the ``meta`` device (no memory yet)."""
    return any(t.is_meta for t in module_weights(module).values(include_nested=True, leaves_only=True))


def parts_of(memory: StoreMemory, module: Any, destination: str | None) -> Parts:
    """The (key prefix in the store, module) pairs a reader of ``module`` loads."""
    what = f"modules given to WeightReader for store {memory.name!r}"
    dests = memory.destinations
    if isinstance(module, Mapping):
        if destination is not None:
            raise InvalidArgumentError(f"{what}: pass a mapping of destinations or destination=, not both")
        if not is_destinations(module):
            raise ArgumentTypeError(f"{what}: want a mapping of destinations to modules, got a mapping holding tensors")
        return parts(module, dests, what, subset=True)
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"module must be an nn.Module or a mapping of them, got {type(module).__name__}")
    if dests is None:
        if destination is not None:
            raise WeightMismatchError(
                f"store {memory.name!r} holds a single module, it has no destination {destination!r}"
            )
        return [((), module)]
    if destination is None:
        if len(dests) != 1:
            raise WeightMismatchError(
                f"store {memory.name!r} holds destinations {list(dests)}: say which one this module takes "
                "(destination=...), or pass a mapping"
            )
        destination = dests[0]
    if destination not in dests:
        raise WeightMismatchError(f"store {memory.name!r} has no destination {destination!r} (it has {list(dests)})")
    return [((destination,), module)]
