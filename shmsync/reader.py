"""The worker side: check a store's version cheaply and reload a module lazily."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shmsync.core.copies import copy_all
from shmsync.core.header import ROW_DEVICE, ROW_WAITING, ROW_ZERO_COPY, W_VERSION
from shmsync.core.mapping import StoreMemory
from shmsync.errors import (
    NotLoadedError,
    ReloadTimeoutError,
    ShmSyncError,
    WeightMismatchError,
    WriterGoneError,
)
from shmsync.in_place import InPlace, make_private
from shmsync.sources import is_destinations, module_weights, parts
from shmsync.store import WeightStore

log = logging.getLogger("shmsync.reader")


class WeightReader:
    """Loads the newest complete version of a store into a module, only when it changed.

    :meth:`poll` costs one read of a shared word when nothing was published: no copy, no
    syscall, no lock (the docs' Performance page has the figure). When the version changed
    it copies the newest complete version into the module's parameters and buffers, in
    place, on the module's device. Between calls the module always holds exactly one version; during
    :meth:`poll` it is being written, like during ``load_state_dict``, so no other
    thread should run it at that moment.

    A module on the CPU runs on the store's memory in place (``zero_copy``, the default
    there): a reload copies nothing, its parameters point at the slot holding the version,
    leased so the writer leaves it alone, and no reader holds a copy of the weights of its
    own (buffers are copied: BatchNorm writes its own). A write into such parameters stays
    in this process, and the next reload undoes it and raises
    :class:`~shmsync.errors.SharedWeightsWrittenError` (an optimizer step raises before
    writing): a policy that writes its weights takes ``zero_copy=False``, a private copy.
    When a lease is refused (at most ``num_slots - 2`` distinct slots may be leased, so the
    writer never waits), the reload copies, says so once, and leases again later. A module
    on a GPU always copies (its device copy).

    Args:
        store: the :class:`~shmsync.WeightStore` (attached or pickled from the trainer).
        module: the module to load into, or a mapping ``{destination: module}`` for a store
            created from a mapping. Parameters on the ``meta`` device are materialized on
            the first load (TorchRL builds worker policies so).
        device: where the module's weights should live. Default: where they are (CPU if
            they are on ``meta``).
        destination: for a store holding several destinations, which one ``module`` takes.
            Not needed when the store holds a single destination.
        timeout: seconds a reload may take before :class:`~shmsync.errors.ReloadTimeoutError`.
        zero_copy: run on the store's memory in place (see above). Default (None): on the CPU,
            yes; on a GPU, no. True for a GPU module raises ValueError.
        worker: the index of the worker this reader serves, shown in the readers' table
            (:meth:`WeightStore.readers`) and in the stale-reader alarm's messages.

    Examples:
        >>> import torch
        >>> from shmsync import WeightStore, WeightReader
        >>> trainer_policy = torch.nn.Linear(3, 1)
        >>> store = WeightStore.create(trainer_policy)
        >>> worker_policy = torch.nn.Linear(3, 1)
        >>> reader = WeightReader(store, worker_policy)
        >>> reader.poll()          # first load
        True
        >>> reader.poll()          # nothing new: no copy
        False
        >>> with torch.no_grad():
        ...     _ = trainer_policy.weight.fill_(1.0)
        >>> store.publish(trainer_policy)
        1
        >>> reader.poll(), float(worker_policy.weight.detach().sum())
        (True, 3.0)
        >>> reader.viewing  # its parameters run on the store's memory: nothing was copied
        True
        >>> private = WeightReader(store, torch.nn.Linear(3, 1), zero_copy=False)
        >>> private.poll(), private.viewing  # a private copy, for a policy that writes its weights
        (True, False)
        >>> store.close()
    """

    def __init__(
        self,
        store: WeightStore,
        module: nn.Module | Mapping[str, nn.Module],
        device: torch.device | str | None = None,
        *,
        destination: str | None = None,
        timeout: float = 60.0,
        zero_copy: bool | None = None,
        worker: int | None = None,
    ) -> None:
        if not isinstance(store, WeightStore):
            raise TypeError(f"store must be a WeightStore, got {type(store).__name__}")
        self.store = store
        self.module = module
        self.device = torch.device(device) if device is not None else None
        self.timeout = timeout
        self.reloads = 0
        self._version = -1
        self._memory = memory = store.memory
        self._protocol = memory.protocol
        self._hdr = memory.header
        self._parts = _parts(store, module, destination)
        self._targets: list[torch.Tensor] | None = None
        self._sources: list[list[torch.Tensor]] = []
        self._on_cpu = True
        if zero_copy is not None and not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be True, False or None, got {zero_copy!r}")
        self._asked = zero_copy
        self.zero_copy = zero_copy is not False  # settled by the module's device at the first bind
        self._viewing: list[torch.Tensor] = []  # parameters now pointing at a leased slot
        self._said_fallback = False
        # A write into the parameters: raise (default), or go on with a private copy holding it
        # (TorchRL collectors: loading a collector's state dict writes the policy's weights).
        self.private_on_write = False
        if worker is not None and (isinstance(worker, bool) or not isinstance(worker, int) or worker < 0):
            raise ValueError(f"worker must be an int >= 0 or None, got {worker!r}")
        self._flags = ROW_ZERO_COPY if self.zero_copy else 0
        self.worker = worker  # the index its collector gave it, or None
        # A row in the readers' table (`shmsync ls`, store.readers()); -1: the table is full, unlisted.
        self._row = self._protocol.claim_row(worker=worker, flags=self._flags)
        self._finalizer = weakref.finalize(self, _leave, memory, self._row, self._viewing)
        # Check the module against the store now (clear error at construction time); a module on
        # the meta device holds no weights until the first load: until then, calling it says so.
        self._unloaded_guards: list = []
        if not any(_is_meta(m) for _, m in self._parts):
            self._bind()
        else:
            self._unloaded_guards = [m.register_forward_pre_hook(_not_loaded_yet(self)) for _, m in self._parts]

    @property
    def version(self) -> int:
        """The version loaded in the module (-1 before the first load)."""
        return self._version

    @property
    def waiting(self) -> bool:
        """Whether this reader says it waits for work (see :meth:`set_waiting`)."""
        return bool(self._flags & ROW_WAITING)

    def set_waiting(self, waiting: bool) -> None:
        """Say whether the process is between rollouts, waiting for work rather than running the
        weights it loaded: the readers' table shows it, and the stale-reader alarm leaves a
        waiting reader alone unless its process is stopped. Poll before you stop waiting.

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     reader.set_waiting(True)
            ...     store.readers()[0].waiting
            True
        """
        self._set_flags(ROW_WAITING, waiting)

    def _set_flags(self, bit: int, on: bool) -> None:
        flags = self._flags | bit if on else self._flags & ~bit
        if flags != self._flags:
            self._flags = flags
            if self._finalizer.alive and not self._memory.closed:
                self._protocol.set_row_flags(self._row, flags)

    @property
    def viewing(self) -> bool:
        """Whether the module's parameters now point at shared memory (``zero_copy``)."""
        return bool(self._viewing)

    def poll(self) -> bool:
        """Reload if a newer version was published.

        Returns:
            True if the module was reloaded, False if it already held the latest version.
        """
        try:
            if self._hdr[W_VERSION] == self._version:
                return False
        except ValueError:  # the header's mapping was released: the store was closed here
            raise ShmSyncError(f"store {self.store.name!r} is closed in this process") from None
        return self.reload()

    def reload(self) -> bool:
        """Load the newest complete version now, even if it is already loaded."""
        if self._targets is None:
            self._bind()
        memory, protocol = self._memory, self._protocol
        if memory.closed:
            raise ShmSyncError(f"store {memory.name!r} is closed in this process")
        if self._viewing and self._in_place.check_unwritten(self._version, keep=self.private_on_write):
            protocol.release_lease(self._row)  # the module wrote its weights, kept privately: copy from now on
            self.zero_copy = False
            self._set_flags(ROW_ZERO_COPY, False)
            _say_private(self.store.name, self.worker)
        # Without a row in the reader table (it is full) there is no lease: copy.
        can_view = self.zero_copy and self._finalizer.alive and self._row >= 0
        version = self._view_latest() if can_view else None
        if version is None:
            if can_view and not self._said_fallback:
                self._said_fallback = True
                _say_fallback(self.store.name, self.worker, self._memory.num_slots)
            if self._viewing:  # leasing refused: back to private memory before copying into it
                # (the old slot may be rewritten meanwhile; the copy below overwrites it all)
                make_private(self._viewing)
                protocol.release_lease(self._row)
            # Optimistic copies, or the pin at once for a reader slower than the writer.
            version = protocol.read(self._copy, timeout=self.timeout)
        changed = version != self._version
        self._version = version
        for guard in self._unloaded_guards:
            guard.remove()  # loaded: the module may run
        self._unloaded_guards = []
        self.reloads += 1
        if self._finalizer.alive:
            protocol.update_row(self._row, version, self.reloads)
        return changed

    def wait(self, min_version: int, timeout: float | None = None) -> int:
        """Block until at least ``min_version`` is loaded; returns the loaded version.

        Raises:
            WriterGoneError: no live process can publish any more (the trainer died): the
                version will never come. Checked about twice a second.
            ReloadTimeoutError: ``min_version`` was not published within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 5e-5
        next_check = time.monotonic() + 0.5
        self.poll()
        while self._version < min_version:
            now = time.monotonic()
            if now >= next_check or (deadline is not None and now > deadline):
                next_check = now + 0.5
                if not self.store.publisher_alive():
                    self.poll()  # a last look: it may have landed just before the writer died
                    if self._version >= min_version:
                        break
                    info = self.store.info()
                    raise WriterGoneError(
                        f"store {self.store.name!r}: version {min_version} will never be published: its creator "
                        f"(pid {info['creator_pid']}) and last writer (pid {info['writer_pid']}) are dead "
                        f"(latest published: {self.store.version}, loaded: {self._version})"
                    )
            if deadline is not None and now > deadline:
                raise ReloadTimeoutError(
                    f"store {self.store.name!r}: version {min_version} was not published within {timeout}s "
                    f"(latest published: {self.store.version}, loaded: {self._version})"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
            self.poll()
        return self._version

    def close(self) -> None:
        """Leave the store's reader table (the module keeps its weights)."""
        self._finalizer()

    def _bind(self) -> None:
        """Materialize meta weights, move to ``device``, match the module against the store."""
        memory = self._memory
        targets, indices = self._match_parts()
        self._on_cpu = not any(t.is_cuda for t in targets)
        if self._asked and not self._on_cpu:
            raise ValueError(
                f"zero_copy=True needs a module on the CPU, got weights on "
                f"{next(t.device for t in targets if t.is_cuda)}: reloads to a GPU always copy"
            )
        if not self._on_cpu:
            self.zero_copy = False
            self._set_flags(ROW_ZERO_COPY, False)
            memory.pin_for_cuda()  # host-to-device copies become asynchronous DMA
        self._set_flags(ROW_DEVICE, not self._on_cpu)
        self._targets = targets
        # Per slot, the views this reader copies from, so a reload is one batched copy: the
        # page-locked store's pages for a GPU, else this process's private mapping of them.
        slots = memory.read_slots() if self._on_cpu else memory.slots
        self._sources = [[views[i] for i in indices] for views in slots]
        if self.zero_copy:
            self._bind_views(targets, indices)

    def _match_parts(self) -> tuple[list[torch.Tensor], list[int]]:
        """Each part's weights (materialized from ``meta``, moved to ``device``) matched against
        the layout: the tensors to load, and their entries' indices."""
        layout = self._memory.layout
        targets, indices = [], []
        for prefix, module in self._parts:
            if _is_meta(module):
                module.to_empty(device=self.device or torch.device("cpu"))
            elif self.device is not None:
                module.to(self.device)
            where = f"module given to WeightReader for store {self.store.name!r}" + (
                f", destination {prefix[0]!r}" if prefix else ""
            )
            targets += layout.match(module_weights(module), where, prefix=prefix)
            indices += layout.subset(prefix)
        return targets, indices

    def _bind_views(self, targets: list[torch.Tensor], indices: list[int]) -> None:
        self._in_place = InPlace(self._memory, targets, indices, self._viewing)
        self.store.add_dependent(self)

    def _copy(self, slot: int) -> None:
        copy_all(self._targets, self._sources[slot], self._on_cpu)

    def _view_latest(self) -> int | None:
        """Lease the latest slot and point the parameters at it; its version, or None if refused."""
        leased = self._protocol.lease_latest(self._row)
        if leased is None:
            return None
        slot, version = leased
        self._in_place.point(slot)
        return version

    def __repr__(self) -> str:
        return f"WeightReader(store={self.store.name!r}, version={self._version}, reloads={self.reloads})"


def _say_private(store: str, worker: int | None) -> None:
    who = "reader" if worker is None else f"worker {worker}"
    log.warning(
        "store %r: the module of %s wrote its parameters in place: it keeps a private copy from now on", store, who
    )


def _say_fallback(store: str, worker: int | None, num_slots: int) -> None:
    log.warning(
        "store %r: reader%s could not lease a slot (at most %d distinct versions may be held in "
        "place); it copies into private memory until a later reload leases one. More slots "
        "(num_slots, which cost memory only while held) let every reader lease",
        store,
        "" if worker is None else f" of worker {worker}",
        num_slots - 2,
    )


def _not_loaded_yet(reader: WeightReader):
    def hook(module, args):
        raise NotLoadedError(
            f"this module's weights come from store {reader.store.name!r} and are not loaded yet (they are on the "
            "meta device): call reader.poll() or reader.wait(0) before running it"
        )

    return hook


def _leave(memory: StoreMemory, row: int, viewing: list[torch.Tensor]) -> None:
    # The module may outlive its reader: it keeps the weights it has, in private memory.
    if viewing:
        make_private(viewing)
    if not memory.closed:
        memory.protocol.release_lease(row)
        memory.protocol.release_row(row)


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module_weights(module).values(include_nested=True, leaves_only=True))


def _parts(store: WeightStore, module: Any, destination: str | None) -> list[tuple[tuple[str, ...], nn.Module]]:
    """(key prefix in the store, module) pairs this reader loads."""
    what = f"modules given to WeightReader for store {store.name!r}"
    dests = store.destinations
    if isinstance(module, Mapping):
        if destination is not None:
            raise ValueError(f"{what}: pass a mapping of destinations or destination=, not both")
        if not is_destinations(module):
            raise TypeError(f"{what}: want a mapping of destinations to modules, got a mapping holding tensors")
        return parts(module, dests, what, subset=True)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module or a mapping of them, got {type(module).__name__}")
    if dests is None:
        if destination is not None:
            raise WeightMismatchError(
                f"store {store.name!r} holds a single module, it has no destination {destination!r}"
            )
        return [((), module)]
    if destination is None:
        if len(dests) != 1:
            raise WeightMismatchError(
                f"store {store.name!r} holds destinations {list(dests)}: say which one this module takes "
                "(destination=...), or pass a mapping"
            )
        destination = dests[0]
    if destination not in dests:
        raise WeightMismatchError(f"store {store.name!r} has no destination {destination!r} (it has {list(dests)})")
    return [((destination,), module)]
