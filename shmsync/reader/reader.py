"""The worker side: check a store's version cheaply and reload a module lazily.

One load, on the worker's thread (:meth:`WeightReader.poll`)::

    version word of the reader's bank == loaded?  ->  nothing to do (one load of a shared word)
    in place: leases.lease_latest(row)            (shmsync.core.protocol: a slot the writer leaves alone)
              in_place.point(slot)                (the parameters view it; shmsync.reader.in_place)
    or a copy: held.load(slot_reader)             (a seqlock copy, or a pinned one, of what the
                                                  module lacks: shmsync.reader.held_copy)
    rows.update_row(row, version, copied)         (what the readers' table shows)
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from shmsync.core.header import (
    DEVICE,
    HOST,
    R_DEVICE_BYTES,
    R_FLAGS,
    ROW_DEVICE_BANK,
    ROW_WAITING,
    W_DEVICE,
    W_HOST_WANTED,
    W_PROMISED,
    W_VERSION,
    Mode,
    Proof,
)
from shmsync.core.pages import human_bytes
from shmsync.core.protocol import Leases, ReaderRows
from shmsync.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    NotLoadedError,
    ReloadTimeoutError,
    WriterGoneError,
    warn_deprecated,
)
from shmsync.reader.binding import Binding, is_meta, parts_of
from shmsync.reader.in_place import InPlace, make_private
from shmsync.store.memory import StoreMemory

log = logging.getLogger("shmsync.reader")


class WeightReader:
    """Loads the newest complete version of a store into a module, only when it changed. The reader
    decides when to load; its :class:`~shmsync.reader.binding.Binding` says what to load and from
    where.

    :meth:`poll` costs one read of a shared word when nothing was published: no copy, no
    syscall, no lock. When the version changed it loads the newest complete version into the
    module's parameters and buffers, on the module's device. Between calls the module holds
    exactly one version; during :meth:`poll` no other thread should run it. By default the
    parameters run on the store's memory in place, leased so the writer leaves that slot alone
    (the Memory page of the docs: what a write into them does, when a reload copies instead).

    Args:
        store: the :class:`~shmsync.WeightStore` (attached or pickled from the trainer).
        module: the module to load into, or a mapping ``{destination: module}`` for a store
            created from a mapping. Parameters on the ``meta`` device are materialized on
            the first load (TorchRL builds worker policies so).
        device: where the module's weights should live. Default: where they are (CPU if
            they are on ``meta``).
        destination: for a store holding several destinations, which one ``module`` takes.
        timeout: seconds a reload may take before :class:`~shmsync.errors.ReloadTimeoutError`.
        zero_copy: run on the store's memory in place. Default (None): where it can (the CPU, and
            the GPU the store publishes from); True where it cannot raises
            :class:`~shmsync.errors.InvalidArgumentError`; False: a private copy, for a policy
            that writes its own weights.
        worker: the index of the worker this reader serves, shown in the readers' table
            (:meth:`WeightStore.readers`) and in the stale-reader alarm's messages.
        device_slots: a GPU module loads from the store's device slots where it can (default);
            False: through the host slots, as a GPU without peer access to them does.
        keep_writes: a write into parameters that run in place makes them a private copy that
            keeps the write (with a warning) instead of raising
            :class:`~shmsync.errors.SharedWeightsWrittenError` at the next reload (TorchRL's
            collectors load state dicts into their policies: its scheme asks for this).

    Attributes:
        mode: how the module holds its weights, a :class:`~shmsync.core.header.Mode`: the one
            fact from which :attr:`zero_copy`, :attr:`viewing` and the reader's row follow.
        copied_bytes: the bytes the last reload copied into the module. A private copy reloads what
            changed since the version it holds (and what its own process wrote since: see
            :mod:`shmsync.reader.held_copy`), all of it at its first load; in place, the buffers.
        skipped_bytes: the bytes of the module the last reload left as they were (proved
            unchanged, or viewed in place).
        reloads: the reloads made.
        fallbacks: the reloads that could not lease a slot, and copied instead.
        keep_writes: as the argument: a write into parameters in place is kept in a private copy.

    Raises:
        ArgumentTypeError: ``store`` is no store, or ``zero_copy`` no bool or None.
        InvalidArgumentError: ``worker`` is no index, or ``zero_copy=True`` where the module
            cannot run in place.
        WeightMismatchError: the module's weights do not match the store's.

    Examples:
        >>> import torch
        >>> from shmsync import WeightStore, WeightReader
        >>> trainer_policy = torch.nn.Linear(3, 1)
        >>> store = WeightStore.create(trainer_policy)
        >>> worker_policy = torch.nn.Linear(3, 1)
        >>> reader = WeightReader(store, worker_policy)
        >>> reader.poll(), reader.poll()  # the first load, then nothing new: no copy
        (True, False)
        >>> with torch.no_grad():
        ...     _ = trainer_policy.weight.fill_(1.0)
        >>> store.publish(trainer_policy)
        1
        >>> reader.poll(), float(worker_policy.weight.detach().sum()), reader.viewing  # in place
        (True, 3.0, True)
        >>> store.close()
    """

    def __init__(
        self,
        store: Any,
        module: nn.Module | Mapping[str, nn.Module],
        device: torch.device | str | None = None,
        *,
        destination: str | None = None,
        timeout: float = 60.0,
        zero_copy: bool | None = None,
        worker: int | None = None,
        device_slots: bool = True,
        keep_writes: bool = False,
    ) -> None:
        memory = getattr(store, "memory", None)
        if not isinstance(memory, StoreMemory):
            raise ArgumentTypeError(f"store must be a WeightStore, got {type(store).__name__}")
        if zero_copy is not None and not isinstance(zero_copy, bool):
            raise ArgumentTypeError(f"zero_copy must be True, False or None, got {zero_copy!r}")
        if worker is not None and (isinstance(worker, bool) or not isinstance(worker, int) or worker < 0):
            raise InvalidArgumentError(f"worker must be an int >= 0 or None, got {worker!r}")
        self.store = store
        self.module = module
        self.device = torch.device(device) if device is not None else None
        self.timeout = timeout
        self.reloads = 0
        self.worker = worker  # the index its collector gave it, or None
        self.device_slots = device_slots
        self.keep_writes = keep_writes  # a write into the parameters: a private copy, not an error
        self.fallbacks = 0  # reloads that could not lease a slot (a copy instead)
        self.copied_bytes = 0  # bytes the last reload copied into the module
        self.skipped_bytes = 0  # bytes of the module the last reload did not copy: in place, or unchanged
        # How the module holds its weights: changed by _set_mode alone, which writes it into the row.
        self.mode = Mode.COPY if zero_copy is False else Mode.FALLEN_BACK  # on no slot until the first load
        self._asked = zero_copy  # the argument: True where the module cannot run in place raises
        self._waiting = False  # between rollouts (set_waiting), shown in the row beside the mode
        self._version = -1
        self._parts = parts_of(memory, module, destination)
        self._viewing: list[torch.Tensor] = []  # the parameters while they point at a leased slot
        self._binding: Binding | None = None
        self._words = memory.host  # the bank whose version word poll() loads: the host bank until bound
        self._rows = ReaderRows(memory.header, memory.locks)
        # A row in the readers' table (`shmsync ls`, store.readers()); -1: the table is full, unlisted.
        self._row = self._rows.claim_row(worker=worker, flags=self.mode.flags)
        self._finalizer = weakref.finalize(self, _leave, memory, self._row, self._viewing)
        # Matched now (a clear error here); a module on `meta` says it is not loaded until its first load.
        self._unloaded_guards: list = []
        if not any(is_meta(m) for _, m in self._parts):
            self._bind()
        else:
            self._unloaded_guards = [m.register_forward_pre_hook(_not_loaded_yet(memory.name)) for _, m in self._parts]

    @property
    def version(self) -> int:
        """The version loaded in the module, -1 before the first load."""
        return self._version

    @property
    def zero_copy(self) -> bool:
        """Whether the module runs on the store's memory in place where it can, as the ``zero_copy``
        argument asks: True while it copies for want of a slot to lease (:attr:`mode` is
        ``Mode.FALLEN_BACK``), False once it keeps a private copy for good. Whether it views a slot
        now is :attr:`viewing`."""
        return not self.mode.private

    @property
    def private_on_write(self) -> bool:
        """Deprecated: :attr:`keep_writes` (``WeightReader(..., keep_writes=True)``); goes in 0.4.0."""
        warn_deprecated("WeightReader.private_on_write", "WeightReader(..., keep_writes=True)", "0.4.0")
        return self.keep_writes

    @private_on_write.setter
    def private_on_write(self, keep: bool) -> None:
        warn_deprecated("WeightReader.private_on_write", "WeightReader(..., keep_writes=True)", "0.4.0")
        self.keep_writes = keep

    @property
    def waiting(self) -> bool:
        """Whether this reader says it waits for work, as :meth:`set_waiting` last said."""
        return self._waiting

    @property
    def viewing(self) -> bool:
        """Whether the module's parameters now view a leased slot of the store (shared memory), as its
        row in the readers' table says (``ReaderRow.viewing``)."""
        return self.mode.viewing

    @property
    def unchanged_proof(self) -> Proof:
        """How the last copy into the module proved the tensors it did not copy unchanged (a
        :class:`~shmsync.core.header.Proof`, a string): ``"written pages"`` (this process's write
        tracking, and comparison for the tensors it does not track), ``"comparison"`` (write
        tracking unavailable here), ``"none: every leaf copied"`` (a module on a GPU, or copying
        from the device slots), or ``"in place"`` while the module runs on the store's memory
        (nothing is copied but its buffers). See :mod:`shmsync.store.changes`.

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2), zero_copy=False)
            ...     _ = reader.poll()
            ...     reader.unchanged_proof in ("written pages", "comparison")
            True
        """
        if self.mode.viewing:
            return Proof.IN_PLACE
        return self._binding.held.proof if self._binding is not None else Proof.NONE

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
        if waiting != self._waiting:
            self._waiting = waiting
            self._write_flags()

    def _set_mode(self, mode: Mode, binding: Binding | None) -> None:
        """The one place the module's mode changes, with what it owns: leaving a view of a slot, the
        parameters take private copies of what they hold, then the lease on that slot is given up
        (from then on the writer may rewrite it) and the private copy forgotten (it holds what the
        slot held, not what it last copied); a private copy for good drops the way to run in place;
        then the mode, and the row that shows it.

        Args:
            mode: the new mode.
            binding: the binding whose slot the module leaves (None: none, or closed).
        """
        if self.mode.viewing and not mode.viewing:
            if self._viewing:
                make_private(self._viewing)
            if binding is not None:
                binding.leases.release_lease(self._row)
                binding.held.forget()
        if mode.private and binding is not None:
            binding.drop_in_place()
        self.mode = mode
        self._write_flags()

    def _write_flags(self) -> None:
        """Write the row's flags: its mode's bits, waiting, and the device bank where it loads from it."""
        flags = self.mode.flags | (ROW_WAITING if self._waiting else 0)
        if self._binding is not None and self._binding.bank == DEVICE:
            flags |= ROW_DEVICE_BANK
        if self._finalizer.alive and not self.store.memory.closed:
            self._rows.set_row_word(self._row, R_FLAGS, flags)

    def up_to_date(self) -> bool:
        """Say whether the loaded version is the newest, with none newer promised.

        Returns:
            True if so; False if not, or once the store was closed in this process.
        """
        try:
            h = self._words.h
            return h[self._words.version] == self._version >= h[W_PROMISED]
        except ValueError:  # the header's mapping was released: poll() says so
            return False

    def poll(self) -> bool:
        """Reload if a newer version was published.

        Returns:
            True if the module was reloaded, False if it already held the latest version.

        Raises:
            ShmSyncError: the store was closed in this process.
        """
        try:
            if self._words.h[self._words.version] == self._version:
                return False
        except ValueError:  # the header's mapping was released: the store was closed here
            self.store.memory.check_open()
        return self.reload()

    def reload(self) -> bool:
        """Load the newest complete version now, even if it is already loaded. This method decides
        when and from which bank (the module is bound again when the store's device slots moved);
        :meth:`_load` loads, then the reader's row says what was loaded.

        Returns:
            True if the version loaded differs from the one the module held.

        Raises:
            ShmSyncError: the store was closed in this process.
            SharedWeightsWrittenError: this process wrote parameters that run in place (see
                ``zero_copy``).
            ReloadTimeoutError: no copy validated within ``timeout`` seconds.
        """
        memory = self.store.memory
        if memory.closed:
            memory.check_open()  # raises
        binding = self._binding if self._binding is not None else self._bind()
        if memory.header[W_DEVICE]:
            binding = self._follow_device(binding)
        version = self._load(binding)
        changed = version != self._version
        self._version = version
        if self._unloaded_guards:
            self._first_loaded()
        self.reloads += 1
        if self._finalizer.alive:
            self._rows.update_row(self._row, version, self.reloads, self.copied_bytes)
        return changed

    def _load(self, binding: Binding) -> int:
        """Load the newest complete version into the module as its mode says: on a leased slot in
        place (unless this process wrote the weights there, which makes it a private copy for good),
        else by a copy. Returns the version loaded."""
        if not self.mode.private:
            in_place = cast(InPlace, binding.in_place)  # bound to run in place (else _bind said private)
            if self.mode.viewing and in_place.undo_writes(self._version, keep=self.keep_writes):
                self._set_mode(_private(binding), binding)  # the module wrote its weights, kept privately
                _warn_private_copy(self.store.memory.name, self.worker)
            elif self._row < 0:  # no row in the readers' table (it is full): no lease, a copy
                return self._fall_back(binding)
            else:
                if self.mode.viewing and binding.cuda is not None:
                    in_place.leave()  # the device's work on the old slot ends before its lease moves
                lease = binding.leases.lease_latest(self._row)
                if lease is None:
                    return self._fall_back(binding)
                in_place.point(lease.slot)
                if not self.mode.viewing:
                    self._set_mode(Mode.DEVICE_IN_PLACE if binding.bank == DEVICE else Mode.IN_PLACE, binding)
                self.copied_bytes, self.skipped_bytes = in_place.buffer_bytes, in_place.param_bytes  # buffers copied
                return lease.version
        return self._copy_latest(binding)

    def _first_loaded(self) -> None:
        """Let the module run, now that it holds weights."""
        for guard in self._unloaded_guards:
            guard.remove()
        self._unloaded_guards = []

    def _follow_device(self, binding: Binding) -> Binding:
        """Follow a store published from CUDA: a GPU module may run from its device slots now, and
        host slots are filled on demand. Returns the binding to load through."""
        memory = self.store.memory
        if binding.cuda is not None and memory.header[W_DEVICE] != binding.device_seen:
            binding = self._bind()
        if binding.bank == HOST:
            _await_host_slots(memory, self.timeout)
        return binding

    def _fall_back(self, binding: Binding) -> int:
        """Copy this time, for want of a slot to lease: readers in place hold every slot the writer
        may not write, or this reader has no row. The first time, a warning says so (the readers'
        table says so at every reload: ``shmsync ls``); a later reload leases again. Returns the
        version copied."""
        self.fallbacks += 1
        memory = self.store.memory
        if self.fallbacks == 1 and self._row >= 0:
            _warn_no_lease(memory.name, self.worker, memory.num_slots)
        # Back to private memory before copying into it (the old slot may be rewritten meanwhile;
        # the copy overwrites it all).
        self._set_mode(Mode.FALLEN_BACK, binding)
        return self._copy_latest(binding)

    def _copy_latest(self, binding: Binding) -> int:
        """Copy the newest complete version into the module's private memory, when a lease was
        refused or none is wanted. Only what the module lacks is copied: the tensors that changed
        since the version it holds (see :mod:`shmsync.reader.held_copy`). Returns the version."""
        held = binding.held
        # Optimistic copies, or the pin at once for a reader slower than the writer.
        version = held.load(binding.slot_reader, self.timeout)
        self.copied_bytes, self.skipped_bytes = held.copied_bytes, held.skipped_bytes
        return version

    def poll_promised(self, timeout: float = 60.0) -> bool:
        """Load the newest version, waiting for one a publish promised and has not landed yet, so
        that the next batch of a synchronous collector runs the weights just sent. A promise that is
        withdrawn (its copy failed) ends the wait at once, with the newest whole version loaded.

        Args:
            timeout: the seconds to wait for the promised version.

        Returns:
            True if the module was reloaded.

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
        promised = self.store.memory.header[W_PROMISED]
        reloaded = self.poll()
        if self._version < promised:
            self._wait(promised, timeout, f"version {promised}, promised by the trainer's last publish,", True)
            reloaded = True
        return reloaded

    def wait(self, min_version: int, timeout: float | None = None) -> int:
        """Block until at least ``min_version`` is loaded.

        Args:
            min_version: the version to wait for.
            timeout: the seconds to wait (None: as long as a process may still publish).

        Returns:
            The version loaded.

        Raises:
            WriterGoneError: no live process can publish any more (checked twice a second).
            ReloadTimeoutError: ``min_version`` did not come within ``timeout`` seconds.

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     reader.wait(0, timeout=5)
            0
        """
        return self._wait(min_version, timeout, f"version {min_version}")

    def _wait(self, min_version: int, timeout: float | None, what: str, promise: bool = False) -> int:
        """Run :meth:`wait`'s loop: poll, backing off to 1 ms, until ``min_version`` is loaded.
        ``promise``: ``min_version`` was promised, and the wait ends too once the promise is
        withdrawn (the promised word fell below it: the newest whole version is then loaded)."""
        memory = self.store.memory
        deadline = None if timeout is None else time.monotonic() + timeout
        pause, next_check = 5e-5, time.monotonic() + 0.5
        self.poll()
        while self._version < min_version:
            binding = self._binding
            if promise and binding is not None and not binding.slot_reader.promise_stands(min_version):
                self.poll()  # landed, or withdrawn: the newest whole version is the one to run
                break
            now = time.monotonic()
            if now >= next_check or (deadline is not None and now > deadline):
                next_check = now + 0.5
                self._check_writer_alive(min_version, what)
            if deadline is not None and now > deadline:
                raise ReloadTimeoutError(
                    f"store {memory.name!r}: {what} was not published within {timeout}s "
                    f"(latest published: {memory.header[W_VERSION]}, loaded: {self._version})"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.001)
            self.poll()
        return self._version

    def _check_writer_alive(self, min_version: int, what: str) -> None:
        """Raise :class:`~shmsync.errors.WriterGoneError` if ``min_version`` can never come: no
        live process can publish, and it had not landed just before the writer died."""
        memory = self.store.memory
        if memory.writer_alive():
            return
        self.poll()  # a last look: it may have landed just before the writer died
        if self._version < min_version:
            facts = memory.facts()
            raise WriterGoneError(
                f"store {memory.name!r}: {what} will never be published: its creator "
                f"(pid {facts['creator_pid']}) and last writer (pid {facts['writer_pid']}) are dead "
                f"(latest published: {facts['version']}, loaded: {self._version})"
            )

    def close(self) -> None:
        """Leave the store's readers' table. The module keeps its weights, in private memory, and
        its mode turns to a private copy for good.

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     _ = reader.poll()
            ...     reader.close()
            ...     reader.viewing, len(store.readers())
            (False, 0)
        """
        self._finalizer()  # the view, the leases and the row given back
        self._set_mode(_private(self._binding), None)
        if self._binding is not None:
            self._binding.held.close()

    def _bind(self) -> Binding:
        """Match the module against the store (materializing weights on ``meta``), choose the bank
        it loads from, and show both in its row.

        Returns:
            The new :class:`~shmsync.reader.binding.Binding`.
        """
        memory, old = self.store.memory, self._binding
        binding = Binding(
            memory,
            self._parts,
            self.device,
            device_slots=self.device_slots,
            zero_copy=False if self.mode.private else self._asked,
            viewing=self._viewing,
        )
        if old is not None and self.mode.viewing:  # the view and the lease are the old binding's
            self._set_mode(Mode.FALLEN_BACK, old)
        self._binding, self._words = binding, binding.slot_reader.words
        if binding.in_place is None:  # its device cannot run in place (or it was asked not to)
            self._set_mode(_private(binding), binding)
        else:
            self._write_flags()  # the bank it loads from
            memory.add_dependent(self)  # given private memory before the store's goes
        self._rows.set_row_word(self._row, R_DEVICE_BYTES, binding.own_device_bytes)
        return binding

    def __repr__(self) -> str:
        last = f", copied={human_bytes(self.copied_bytes)} ({self.unchanged_proof})" if self.reloads else ""
        return f"WeightReader(store={self.store.memory.name!r}, version={self._version}, reloads={self.reloads}{last})"


def _private(binding: Binding | None) -> Mode:
    """The mode of a private copy for good, where ``binding``'s module lives."""
    return Mode.DEVICE if binding is not None and binding.cuda is not None else Mode.COPY


def _await_host_slots(memory: StoreMemory, timeout: float) -> None:
    """A reader of the host slots of a store published from CUDA: ask the writer to fill them (it
    does while such a reader has a row, or once asked), and wait until they hold a version."""
    h, host = memory.header, memory.host
    if h[host.version] >= h[W_VERSION]:
        return
    h[W_HOST_WANTED] += 1
    deadline = time.monotonic() + timeout
    while h[host.version] < 0:
        if time.monotonic() > deadline:
            raise ReloadTimeoutError(
                f"store {memory.name!r}: its host slots held no version after {timeout}s (the trainer publishes into "
                "its GPU and fills them when asked: is it alive?)"
            )
        time.sleep(0.001)


def _warn_private_copy(store: str, worker: int | None) -> None:
    who = "reader" if worker is None else f"worker {worker}"
    log.warning(
        "store %r: the module of %s wrote its parameters in place: it keeps a private copy from now on", store, who
    )


def _warn_no_lease(store: str, worker: int | None, num_slots: int) -> None:
    log.warning(
        "store %r: reader%s could not lease a slot (at most %d distinct versions may be held in "
        "place); it copies into private memory until a later reload leases one. More slots "
        "(num_slots, which cost memory only while held) let every reader lease",
        store,
        "" if worker is None else f" of worker {worker}",
        num_slots - 2,
    )


def _not_loaded_yet(store: str) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        raise NotLoadedError(
            f"this module's weights come from store {store!r} and are not loaded yet (they are on "
            "the meta device): call reader.poll() or reader.wait(0) before running it"
        )

    return hook


def _leave(memory: StoreMemory, row: int, viewing: list[torch.Tensor]) -> None:
    """A reader's finalizer: the module keeps the weights it has, in private memory, and the
    reader's leases on both banks and its row are given back."""
    if viewing:
        make_private(viewing)
    if not memory.closed:
        for words in (memory.host, memory.device):
            Leases(words, memory.locks).release_lease(row)
        ReaderRows(memory.header, memory.locks).release_row(row)
