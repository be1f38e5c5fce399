"""A module running on a store's memory in place: its parameters pointed at one slot of this
process's private mapping of the store (see :class:`~shmsync.WeightReader`, ``zero_copy``).

The slot is leased by the reader (the protocol keeps the writer off it); here is only what the
module's tensors go through: pointing the parameters at a slot and copying the buffers (modules
such as BatchNorm write theirs), finding out whether this process wrote the parameters, and
giving them private memory again.
"""

from __future__ import annotations

import torch
from torch import nn

from shmsync import read_only
from shmsync.core.copies import copy_all
from shmsync.core.mapping import StoreMemory
from shmsync.core.pages import discard_private, private_pages
from shmsync.errors import SharedWeightsWrittenError


class InPlace:
    """The parameters of ``targets`` (matched against the layout at ``indices``) pointed at a slot.

    Args:
        memory: the store's mapping in this process.
        targets: the module's weights, in the order of ``indices``.
        indices: their entries in the store's layout.
        viewing: the list that holds the parameters while they point at a slot (the reader's
            finalizer gives them private memory again from it).
    """

    def __init__(
        self, memory: StoreMemory, targets: list[torch.Tensor], indices: list[int], viewing: list[torch.Tensor]
    ) -> None:
        self.memory = memory
        order = sorted(range(len(targets)), key=lambda i: not isinstance(targets[i], nn.Parameter))
        params = [i for i in order if isinstance(targets[i], nn.Parameter)]
        self.params = [targets[i] for i in params]
        self.names = [".".join(memory.layout.entries[indices[i]].key) for i in params]
        self.buffers = [targets[i] for i in order[len(params) :]]
        # Per slot, views of the parameters first, then of the buffers.
        self.views = [[views[indices[i]] for i in order] for views in memory.private_slots()]
        # Where each slot lies in the private mapping, for the pagemap check at every reload.
        self.ranges = [(memory.private_address(s), memory.slot_range(s)[1]) for s in range(memory.num_slots)]
        self.viewing = viewing
        self.slot = -1
        self.versions: list[int] = []  # the parameters' version counters as pointed: a write moves one

    def point(self, slot: int) -> None:
        """Point the parameters at ``slot`` (leased) and copy its buffers."""
        views = self.views[slot]
        with torch.no_grad():
            for p, v in zip(self.params, views[: len(self.params)]):
                p.set_(v)
        if self.buffers:  # the slot is leased: it cannot change under this copy
            copy_all(self.buffers, views[len(self.params) :], on_cpu=True)
        if not self.viewing:
            read_only.mark(self.params, self.names, self.memory.name)
        self.viewing[:] = self.params
        self.slot = slot
        self.versions = [p._version for p in self.params]

    def check_unwritten(self, version: int, *, keep: bool = False) -> bool:
        """Before the parameters leave their slot: did this process write them? A write shows in a
        parameter's version counter, or (through ``.data`` or C code) as pages of the private
        mapping that are this process's own. Either is undone, so that the slot shows the store's
        pages again when it is leased next, and raised; with ``keep``, the parameters first take
        private copies of what they hold (the writes included), and True is returned.

        Raises:
            SharedWeightsWrittenError: naming what was written and the fix (without ``keep``).
        """
        memory = self.memory
        written = [n for p, n, v in zip(self.params, self.names, self.versions) if p._version != v]
        address, length = self.ranges[self.slot]
        own = private_pages(address, length)
        if not written and not own:
            return False
        if keep:
            make_private(self.viewing)  # before the pages go: they hold the writes
        discard_private(address, length)
        self.versions = [p._version for p in self.params]
        if keep:
            return True
        what = f"parameters {written}" if written else f"{own} pages of its parameters"
        raise SharedWeightsWrittenError(
            f"this process wrote {what}, which run in place on the shared memory of store "
            f"{memory.name!r} (version {version}): the write stayed in this process and is undone. A policy "
            "that writes its own weights needs a private copy: WeightReader(..., zero_copy=False), or "
            "ShmWeightSyncScheme(zero_copy=False) for TorchRL collectors"
        )


def make_private(params: list[torch.Tensor]) -> None:
    """Give parameters that point at shared memory private copies of their current values."""
    with torch.no_grad():
        for p in params:
            p.set_(p.detach().clone())
    read_only.unmark(params)
    params.clear()
