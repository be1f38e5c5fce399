"""The worker side: check a store's version cheaply and reload a module lazily.

One load, on the worker's thread (:meth:`WeightReader.poll`)::

    version word of the reader's bank == loaded?  ->  nothing to do (one load of a shared word)
    in place: table.lease_latest(row)             (shmsync.core.protocol: a slot the writer leaves alone)
              in_place.point(slot)                (the parameters view it; shmsync.reader.in_place)
    or a copy: reader.read(copy)                  (a seqlock copy, or a pinned one)
    table.update_row(row, version)                (what the readers' table shows)
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shmsync.core.header import (
    DEVICE,
    HOST,
    R_DEVICE_BYTES,
    R_FLAGS,
    ROW_DEVICE,
    ROW_DEVICE_BANK,
    ROW_WAITING,
    ROW_ZERO_COPY,
    W_DEVICE,
    W_HOST_WANTED,
    W_PROMISED,
    W_VERSION,
)
from shmsync.core.protocol import Reader, Table
from shmsync.errors import (
    NotLoadedError,
    ReloadTimeoutError,
    ShmSyncError,
    WeightMismatchError,
    WriterGoneError,
)
from shmsync.reader.in_place import InPlace, make_private
from shmsync.writer.copies import copy_all
from shmsync.writer.memory import StoreMemory
from shmsync.writer.sources import is_destinations, module_weights, parts
from shmsync.writer.store import WeightStore

log = logging.getLogger("shmsync.reader")


class WeightReader:
    """Loads the newest complete version of a store into a module, only when it changed.

    :meth:`poll` costs one read of a shared word when nothing was published: no copy, no
    syscall, no lock. When the version changed it loads the newest complete version into the
    module's parameters and buffers, on the module's device. Between calls the module holds
    exactly one version; during :meth:`poll` no other thread should run it.

    In place (``zero_copy``, the default on the CPU and on the GPU a store is published from): a
    reload copies nothing, the parameters point at the slot holding the version, leased so the
    writer leaves it alone (buffers are copied). A write into them raises
    :class:`~shmsync.errors.SharedWeightsWrittenError` at the next reload (an optimizer step
    before writing): a policy that writes its weights takes ``zero_copy=False``. When a lease is
    refused (at most ``num_slots - 2`` distinct slots may be leased), the reload copies, says so
    once, and leases again later. A GPU module elsewhere copies (peer to peer where it can).

    Args:
        store: the :class:`~shmsync.WeightStore` (attached or pickled from the trainer).
        module: the module to load into, or a mapping ``{destination: module}`` for a store
            created from a mapping. Parameters on the ``meta`` device are materialized on
            the first load (TorchRL builds worker policies so).
        device: where the module's weights should live. Default: where they are (CPU if
            they are on ``meta``).
        destination: for a store holding several destinations, which one ``module`` takes.
        timeout: seconds a reload may take before :class:`~shmsync.errors.ReloadTimeoutError`.
        zero_copy: run on the store's memory in place (see above). Default (None): where it can.
            True where it cannot raises ValueError.
        worker: the index of the worker this reader serves, shown in the readers' table
            (:meth:`WeightStore.readers`) and in the stale-reader alarm's messages.
        device_slots: a GPU module loads from the store's device slots where it can (default);
            False: through the host slots, as a GPU without peer access to them does.

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
        device_slots: bool = True,
    ) -> None:
        if not isinstance(store, WeightStore):
            raise TypeError(f"store must be a WeightStore, got {type(store).__name__}")
        if zero_copy is not None and not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be True, False or None, got {zero_copy!r}")
        if worker is not None and (isinstance(worker, bool) or not isinstance(worker, int) or worker < 0):
            raise ValueError(f"worker must be an int >= 0 or None, got {worker!r}")
        self.store = store
        self.module = module
        self.device = torch.device(device) if device is not None else None
        self.timeout = timeout
        self.reloads = 0
        self.worker = worker  # the index its collector gave it, or None
        self.device_slots = device_slots
        self._version = -1
        self._memory = memory = store.memory
        self._parts = _parts(store, module, destination)
        self._asked = zero_copy
        self.zero_copy = zero_copy is not False  # settled by the module's device at the first bind
        self._viewing: list[torch.Tensor] = []  # parameters now pointing at a leased slot
        self._in_place: InPlace | None = None
        self._said_fallback = False
        # A write into the parameters: raise (default), or go on with a private copy holding it
        # (TorchRL collectors: loading a collector's state dict writes the policy's weights).
        self.private_on_write = False
        self._use_bank(HOST)  # the host bank until the module's device says otherwise (see _bind)
        self._flags = ROW_ZERO_COPY if self.zero_copy else 0
        # A row in the readers' table (`shmsync ls`, store.readers()); -1: the table is full, unlisted.
        self._row = self._table.claim_row(worker=worker, flags=self._flags)
        self._finalizer = weakref.finalize(self, _leave, memory, self._row, self._viewing)
        self._bound = False
        self._cuda: torch.device | None = None  # the module's GPU, once bound
        self._device_seen = 0  # the store's device word when bound
        # Check the module against the store now (clear error at construction time); a module on
        # the meta device holds no weights until the first load: until then, calling it says so.
        self._unloaded_guards: list = []
        if not any(_is_meta(m) for _, m in self._parts):
            self._bind()
        else:
            self._unloaded_guards = [m.register_forward_pre_hook(_not_loaded_yet(self)) for _, m in self._parts]

    def _use_bank(self, bank: int) -> None:
        words = self._memory.host if bank == HOST else self._memory.device
        self._bank, self._words, self._hdr = bank, words, words.h
        self._version_word = words.version
        self._table = Table(words, self._memory.locks)
        self._reader = Reader(words, self._memory.locks)

    version = property(lambda self: self._version, doc="The version loaded in the module (-1 before the first load).")
    waiting = property(
        lambda self: bool(self._flags & ROW_WAITING), doc="Whether this reader says it waits for work (set_waiting)."
    )
    viewing = property(
        lambda self: bool(self._viewing), doc="Whether the module's parameters now point at shared memory (zero_copy)."
    )

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
                self._table.set_row_word(self._row, R_FLAGS, flags)

    def up_to_date(self) -> bool:
        """Whether the loaded version is the newest, none newer promised (False once closed here)."""
        try:
            return self._hdr[self._version_word] == self._version >= self._hdr[W_PROMISED]
        except ValueError:  # the header's mapping was released: poll() says so
            return False

    def poll(self) -> bool:
        """Reload if a newer version was published.

        Returns:
            True if the module was reloaded, False if it already held the latest version.
        """
        try:
            if self._hdr[self._version_word] == self._version:
                return False
        except ValueError:  # the header's mapping was released: the store was closed here
            raise ShmSyncError(f"store {self.store.name!r} is closed in this process") from None
        return self.reload()

    def reload(self) -> bool:
        """Load the newest complete version now, even if it is already loaded."""
        if not self._bound:
            self._bind()
        memory = self._memory
        if memory.closed:
            raise ShmSyncError(f"store {memory.name!r} is closed in this process")
        if memory.header[W_DEVICE]:
            self._follow_device()
        in_place = self._in_place
        if self._viewing and in_place.check_unwritten(self._version, keep=self.private_on_write):
            self._go_private()
        # Without a row in the reader table (it is full) there is no lease: copy.
        leased = None
        if self.zero_copy and self._row >= 0 and self._finalizer.alive:
            if self._viewing and self._cuda is not None:
                in_place.leave()  # the device's work on the old slot ends before its lease moves
            leased = self._table.lease_latest(self._row)
        if leased is not None:
            version = leased[1]
            in_place.point(leased[0])
        else:
            version = self._copy_latest()
        changed = version != self._version
        self._version = version
        if self._unloaded_guards:
            self._loaded()
        self.reloads += 1
        if self._finalizer.alive:
            self._table.update_row(self._row, version, self.reloads)
        return changed

    def _follow_device(self) -> None:
        """A store published from CUDA: a GPU module may run from its device slots now; host slots
        are filled on demand."""
        if self._cuda is not None and self._memory.header[W_DEVICE] != self._device_seen:
            self._bind()
        if self._bank == HOST:
            _await_host_slots(self.store, self.timeout)

    def _go_private(self) -> None:
        """The module wrote its weights, kept privately: it copies from now on."""
        self._table.release_lease(self._row)
        self.zero_copy = False
        self._set_flags(ROW_ZERO_COPY, False)
        _say_private(self.store.name, self.worker)

    def _loaded(self) -> None:
        """The first load: the module may run."""
        for guard in self._unloaded_guards:
            guard.remove()
        self._unloaded_guards = []

    def _copy_latest(self) -> int:
        """A private copy of the newest complete version (a lease refused, or none wanted)."""
        if self.zero_copy and not self._said_fallback and self._row >= 0:
            self._said_fallback = True
            _say_fallback(self.store.name, self.worker, self._memory.num_slots)
        if self._viewing:  # leasing refused: back to private memory before copying into it
            # (the old slot may be rewritten meanwhile; the copy below overwrites it all)
            make_private(self._viewing)
            self._table.release_lease(self._row)
        # Optimistic copies, or the pin at once for a reader slower than the writer.
        return self._reader.read(self._copy, timeout=self.timeout)

    def poll_promised(self, timeout: float = 60.0) -> bool:
        """Load the newest version, waiting for one a publish promised and has not landed yet (the
        next batch of a synchronous collector runs the weights just sent); True if reloaded. A
        promise withdrawn (its copy failed) ends the wait at once, the newest whole version loaded.

        Raises:
            WriterGoneError: the promised version will never come: no live process can publish
                (checked twice a second).
            ReloadTimeoutError: it did not come within ``timeout`` seconds.

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2), unsafe_background_copy=True) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     v = store.publish(torch.nn.Linear(4, 2))  # returns once promised
            ...     reader.poll_promised(), reader.version == v
            (True, True)
        """
        promised = self._memory.header[W_PROMISED]
        reloaded = self.poll()
        if self._version < promised:
            _wait_for(self, promised, timeout, f"version {promised}, promised by the trainer's last publish,", True)
            reloaded = True
        return reloaded

    def wait(self, min_version: int, timeout: float | None = None) -> int:
        """Block until at least ``min_version`` is loaded; returns the loaded version.

        Raises:
            WriterGoneError: no live process can publish any more (checked twice a second).
            ReloadTimeoutError: ``min_version`` did not come within ``timeout`` seconds.
        """
        return _wait_for(self, min_version, timeout, f"version {min_version}")

    def close(self) -> None:
        """Leave the store's reader table (the module keeps its weights)."""
        self._finalizer()

    def _bind(self) -> None:
        """Materialize meta weights, move to ``device``, match the module against the store, and
        choose the bank: the device slots for a module on the device that holds them (or one that
        can reach it peer to peer), else the host slots."""
        memory = self._memory
        targets, indices = match_parts(self.store, self._parts, self.device)
        cuda = next((t.device for t in targets if t.is_cuda), None)
        bank = bank_for(memory, cuda) if self.device_slots else HOST
        here = cuda is None or bank == DEVICE and memory.header[W_DEVICE] - 1 == cuda.index  # in place possible
        if self._asked and not here:
            raise ValueError(
                f"zero_copy=True needs a module on the CPU or on the GPU holding the store's device slots, "
                f"got weights on {cuda}: it copies"
            )
        if bank != self._bank:
            self._table.release_lease(self._row)
            self._use_bank(bank)
        self.zero_copy = here and self._asked is not False
        self._set_flags(ROW_ZERO_COPY, self.zero_copy)
        self._set_flags(ROW_DEVICE, cuda is not None)
        self._set_flags(ROW_DEVICE_BANK, bank == DEVICE)
        self._targets, self._indices, self._on_cpu, self._cuda = targets, indices, cuda is None, cuda
        self._device_seen = memory.header[W_DEVICE]
        self._slots = slots_for(self.store, bank, cuda)
        own = 0 if cuda is None or self.zero_copy else sum(t.numel() * t.element_size() for t in targets)
        self._table.set_row_word(self._row, R_DEVICE_BYTES, own)  # GPU memory of its own, for the readers' table
        self._bound = True
        if self.zero_copy:
            self._bind_in_place(targets, indices, bank, cuda)

    def _bind_in_place(self, targets: list[torch.Tensor], indices: list[int], bank: int, cuda: Any) -> None:
        # On the host, a private mapping: a write of this process's never reaches the store.
        views = self._slots if bank == DEVICE else self._memory.private_slots()
        self._in_place = InPlace(self._memory, targets, indices, self._viewing, views, cuda if bank == DEVICE else None)
        self.store.add_dependent(self)

    def _copy(self, slot: int) -> None:
        views = self._slots[slot]
        copy_all(self._targets, [views[i] for i in self._indices], self._on_cpu)

    def __repr__(self) -> str:
        return f"WeightReader(store={self.store.name!r}, version={self._version}, reloads={self.reloads})"


def _wait_for(reader: WeightReader, min_version: int, timeout: float | None, what: str, promise: bool = False) -> int:
    """:meth:`WeightReader.wait`'s loop: poll, backing off to 1 ms, until ``min_version`` is loaded.
    ``promise``: ``min_version`` was promised, and the wait ends too once the promise is withdrawn
    (the promised word fell below it: the newest whole version is then loaded)."""
    store = reader.store
    deadline = None if timeout is None else time.monotonic() + timeout
    pause, next_check = 5e-5, time.monotonic() + 0.5
    reader.poll()
    while reader.version < min_version:
        if promise and not reader._reader.promise_stands(min_version):
            reader.poll()  # landed, or withdrawn: the newest whole version is the one to run
            break
        now = time.monotonic()
        if now >= next_check or (deadline is not None and now > deadline):
            next_check = now + 0.5
            if not store.publisher_alive():
                reader.poll()  # a last look: it may have landed just before the writer died
                if reader.version >= min_version:
                    break
                info = store.info()
                raise WriterGoneError(
                    f"store {store.name!r}: {what} will never be published: its creator "
                    f"(pid {info['creator_pid']}) and last writer (pid {info['writer_pid']}) are dead "
                    f"(latest published: {store.version}, loaded: {reader.version})"
                )
        if deadline is not None and now > deadline:
            raise ReloadTimeoutError(
                f"store {store.name!r}: {what} was not published within {timeout}s "
                f"(latest published: {store.version}, loaded: {reader.version})"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.001)
        reader.poll()
    return reader.version


def _await_host_slots(store: WeightStore, timeout: float) -> None:
    """A reader of the host slots of a store published from CUDA: ask the writer to fill them (it
    does while such a reader has a row, or once asked), and wait until they hold a version."""
    h, host = store.memory.header, store.memory.host
    if h[host.version] >= h[W_VERSION]:
        return
    h[W_HOST_WANTED] += 1
    deadline = time.monotonic() + timeout
    while h[host.version] < 0:
        if time.monotonic() > deadline:
            raise ReloadTimeoutError(
                f"store {store.name!r}: its host slots held no version after {timeout}s (the trainer publishes into "
                "its GPU and fills them when asked: is it alive?)"
            )
        time.sleep(0.001)


def bank_for(memory: StoreMemory, cuda: torch.device | None) -> int:
    """The bank a module on ``cuda`` (None: the CPU) loads from: the device slots if the store has
    them and the module's GPU is theirs or reaches theirs peer to peer, else the host slots."""
    if cuda is None or not memory.header[W_DEVICE]:
        return HOST
    home = memory.header[W_DEVICE] - 1
    return DEVICE if cuda.index == home or torch.cuda.can_device_access_peer(cuda.index, home) else HOST


def slots_for(store: WeightStore, bank: int, cuda: torch.device | None) -> list[list[torch.Tensor]]:
    """Per slot, the views a reader loads from: the device slots, or for a module on the CPU this
    process's private mapping of the host slots, or for a GPU the page-locked ones."""
    if bank == DEVICE:
        from shmsync.reader.device import device_slots

        return device_slots(store, cuda)
    if cuda is None:
        return store.memory.read_slots()
    store.memory.pin_for_cuda()  # host-to-device copies become asynchronous DMA
    return store.memory.map_slots()


def match_parts(
    store: WeightStore, parts: list[tuple[tuple[str, ...], nn.Module]], device: torch.device | None
) -> tuple[list[torch.Tensor], list[int]]:
    """Each part's weights (materialized from ``meta``, moved to ``device``) matched against the
    store's layout: the tensors to load, and their entries' indices."""
    layout = store.memory.layout
    targets, indices = [], []
    for prefix, module in parts:
        if _is_meta(module):
            module.to_empty(device=device or torch.device("cpu"))
        elif device is not None:
            module.to(device)
        where = f"module given to WeightReader for store {store.name!r}" + (
            f", destination {prefix[0]!r}" if prefix else ""
        )
        targets += layout.match(module_weights(module), where, prefix=prefix)
        indices += layout.subset(prefix)
    return targets, indices


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
        for words in (memory.host, memory.device):
            Table(words, memory.locks).release_lease(row)
        Table(memory.host, memory.locks).release_row(row)


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
