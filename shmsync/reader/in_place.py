"""A module running on a store's memory in place: its parameters pointed at one slot of this
process's private mapping of the store (see :class:`~shmsync.WeightReader`, ``zero_copy``).

The slot is leased by the reader (the protocol keeps the writer off it); here is only what the
module's tensors go through: pointing the parameters at a slot and copying the buffers (modules
such as BatchNorm write theirs), finding out whether this process wrote the parameters (their
version counters, and the pages of the private mapping that became this process's own), and
giving them private memory again.

Parameters that view shared memory are read-only in spirit: a write to one stays in this process
(a private mapping) or, on a device slot, would reach every reader. So that the usual way to write
them, an optimizer step, fails as a Python error instead, viewing parameters stop requiring
gradients and a global optimizer step pre-hook (registered at the first such parameter) refuses
any optimizer that holds one.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shmsync.core.page_map import private_copies
from shmsync.errors import SharedMemoryError, SharedWeightsWrittenError, ShmSyncError
from shmsync.store.copies import copy_all
from shmsync.store.memory import StoreMemory

MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class InPlace:
    """The parameters of ``targets`` (matched against the layout at ``indices``) pointed at a slot.

    Args:
        memory: the store's mapping in this process.
        targets: the module's weights, in the order of ``indices``.
        indices: their entries in the store's layout.
        viewing: the list that holds the parameters while they point at a slot (the reader's
            finalizer gives them private memory again from it).
        slots: per slot, a view of every entry in layout order: the private mapping of the host
            slots (default), or the device slots.
        device: the CUDA device of device slots (None: host slots). Work queued on the device may
            still read a slot: the reader's stream is synchronized before it lets a slot go.
    """

    def __init__(
        self,
        memory: StoreMemory,
        targets: list[torch.Tensor],
        indices: list[int],
        viewing: list[torch.Tensor],
        slots: list[list[torch.Tensor]] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.memory = memory
        order = sorted(range(len(targets)), key=lambda i: not isinstance(targets[i], nn.Parameter))
        params = [i for i in order if isinstance(targets[i], nn.Parameter)]
        self.params = [targets[i] for i in params]
        self.names = [".".join(memory.layout.entries[indices[i]].key) for i in params]
        self.buffers = [targets[i] for i in order[len(params) :]]
        # What a reload in place copies (the buffers) and does not (the parameters), in bytes.
        self.buffer_bytes = sum(t.numel() * t.element_size() for t in self.buffers)
        self.param_bytes = sum(t.numel() * t.element_size() for t in self.params)
        self.device = device
        self.on_cpu = device is None
        self._slots = memory.private_slots() if slots is None else slots
        self._order = [indices[i] for i in order]
        # Per slot, views of the parameters first, then of the buffers (made at the slot's first use).
        self.views: dict[int, list[torch.Tensor]] = {}
        # Where each host slot lies in the private mapping, for the pagemap check at every reload.
        self.ranges = (
            [(memory.private_address(s), memory.slot_range(s)[1]) for s in range(memory.num_slots)]
            if device is None
            else None
        )
        self.viewing = viewing
        self.slot = -1
        # torch's version counters (`_version`) of the parameters as pointed: each write moves one
        self.write_counts: list[int] = []

    def point(self, slot: int) -> None:
        """Point the parameters at ``slot`` (leased) and copy its buffers."""
        views = self.views.get(slot)
        if views is None:
            views = self.views[slot] = [self._slots[slot][i] for i in self._order]
        with torch.no_grad():
            for p, v in zip(self.params, views[: len(self.params)]):
                p.set_(v)  # type: ignore[call-overload]  # torch's stubs lack its set_(Tensor)
        if self.buffers:  # the slot is leased: it cannot change under this copy
            copy_all(self.buffers, views[len(self.params) :], self.on_cpu)
        if not self.viewing:
            mark(self.params, self.names, self.memory.name)
        self.viewing[:] = self.params
        self.slot = slot
        self.write_counts = [p._version for p in self.params]

    def leave(self) -> None:
        """Before the lease on the slot goes: the device work queued on it has ended."""
        if self.device is not None and self.viewing:
            torch.cuda.current_stream(self.device).synchronize()

    def undo_writes(self, version: int, *, keep: bool = False) -> bool:
        """Undo what this process wrote into the parameters, before they leave their slot. A write
        shows in a parameter's version counter, or (through ``.data`` or C code) as pages of the
        private mapping that are this process's own. Either is undone, so that the slot shows the
        store's pages again when it is leased next, and then raised, unless ``keep``. A device slot
        has no private pages: a write there is seen by its version counter alone, cannot be undone,
        and reached every reader of the slot.

        Args:
            version: the version the parameters hold, named in the error.
            keep: the parameters first take private copies of what they hold, the writes included,
                and nothing is raised.

        Returns:
            True if there were writes and they were kept (``keep``); False if there were none.

        Raises:
            SharedWeightsWrittenError: there were writes (without ``keep``), naming what was written
                and the fix.
        """
        written = [n for p, n, v in zip(self.params, self.names, self.write_counts) if p._version != v]
        address, length = self.ranges[self.slot] if self.ranges is not None else (0, 0)
        own = private_copies(address, length) if self.ranges is not None else 0
        if not written and not own:
            return False
        if keep:
            make_private(self.viewing)  # before the pages go: they hold the writes
        if self.ranges is not None:
            discard_private(address, length)
        self.write_counts = [p._version for p in self.params]
        if keep:
            return True
        what = f"parameters {written}" if written else f"{own} pages of its parameters"
        stayed = "stayed in this process and is undone" if self.ranges is not None else "reached the device slot"
        raise SharedWeightsWrittenError(
            f"this process wrote {what}, which run in place on the shared memory of store "
            f"{self.memory.name!r} (version {version}): the write {stayed}. A policy that writes its own "
            "weights needs a private copy: WeightReader(..., zero_copy=False), or "
            "ShmWeightSyncScheme(zero_copy=False) for TorchRL collectors"
        )


def make_private(params: list[torch.Tensor]) -> None:
    """Give parameters that point at shared memory private copies of their current values."""
    with torch.no_grad():
        for p in params:
            p.set_(p.detach().clone())  # type: ignore[call-overload]  # as above
    unmark(params)
    params.clear()


# id(parameter) -> (the parameter, its name, the store's name, its requires_grad before).
_VIEWING: dict[int, tuple[weakref.ref, str, str, bool]] = {}
# Re-entrant: a reader in place's finalizer unmarks its parameters, and garbage collection can
# run it on a thread that is inside mark() or unmark() (any allocation can collect).
_LOCK = threading.RLock()
_HOOKED = False


def mark(params: list[torch.Tensor], names: list[str], store: str) -> None:
    """Record ``params`` as viewing ``store`` and stop them requiring gradients."""
    global _HOOKED
    with _LOCK:
        for p, name in zip(params, names):
            if id(p) not in _VIEWING:
                _VIEWING[id(p)] = (weakref.ref(p), name, store, p.requires_grad)
            p.requires_grad_(False)
        if not _HOOKED:
            register_optimizer_step_pre_hook(_refuse_viewing)
            _HOOKED = True


def unmark(params: list[torch.Tensor]) -> None:
    """``params`` hold private memory again: they require gradients as they did before."""
    with _LOCK:
        for p in params:
            entry = _VIEWING.pop(id(p), None)
            if entry is not None and entry[0]() is p:
                p.requires_grad_(entry[3])


def _refuse_viewing(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _VIEWING:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _VIEWING.get(id(p))
            if entry is not None and entry[0]() is p:
                raise ShmSyncError(
                    f"parameter {entry[1]!r} views the read-only shared memory of store {entry[2]!r} "
                    "(a zero_copy reader): an optimizer step would write to it. Train a module of its own "
                    "(the trainer's), or read this store with zero_copy=False"
                )


def discard_private(address: int, length: int) -> None:
    """Drop this process's own copies of pages in ``[address, address + length)`` (a private file
    mapping): the mapping shows the file's pages again."""
    start = address - address % _PAGE
    if _libc.madvise(start, address + length - start, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise SharedMemoryError(err, f"madvise(MADV_DONTNEED) failed: {os.strerror(err)}")
