"""The weight store: versioned copies of a model's weights in shared memory, and publishing into it.

:class:`WeightStore` is the store's one public face. What it holds:

* its mapping (:class:`~shmsync.store.memory.StoreMemory`: file, header, slots, sizes), the
  readers' rows, the leases of its host bank, and the protocol's reader side;
* in a process that writes it, a :class:`Writer`: the parts of this process's writing, each with
  one job (the writer role, the source's check against the layout, what changed, the copy into a
  slot, the optimizer steps counted, the background thread, and the CUDA or background copy
  where one is asked for). A process that only reads builds none.

One publish, on the trainer's thread (:meth:`WeightStore.publish`)::

    role.claim(version)                                 (shmsync.writer.role: the writer role held)
    tensors = the source matched against the layout     (shmsync.store.sources)
    found = what changed since the newest version       (shmsync.writer.changes, shmsync.store.changes)
    copy.copy_source(tensors, found, version)           (shmsync.writer.slot_copy: what the slot lacks,
                                                         copied into a slot no reader uses, committed)

A version is a snapshot: ``publish()`` returns once the weights are copied into the slot (from
CPU tensors), or once the copy is enqueued on the trainer's current CUDA stream (from CUDA tensors,
:mod:`shmsync.writer.cuda`), so that any later write of the source reaches no version. Only the
opt-in ``unsafe_background_copy=True`` returns before the bytes are copied
(:mod:`shmsync.writer.background`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from shmsync.core.header import W_PAYLOAD_BYTES, W_PROMISED, W_STEPS, W_VERSION
from shmsync.core.protocol import Leases, ReaderRows, SlotReader, SlotWriter, Write, steps_of
from shmsync.core.segment import Segment, default_name
from shmsync.errors import ArgumentTypeError, warn_deprecated
from shmsync.store.copies import Copier
from shmsync.store.layout import Layout
from shmsync.store.memory import StoreMemory
from shmsync.store.reader_table import ReaderTable, RemoteSources, assemble, local_rows
from shmsync.store.sources import SourceMatcher, as_tensordict
from shmsync.writer.background import InBackground
from shmsync.writer.changes import Delta, SourceChanges, others_may_write
from shmsync.writer.role import WriterRole, check_version
from shmsync.writer.slot_copy import SlotCopy, check_delta
from shmsync.writer.steps import OptimizerSteps


class Snapshot(NamedTuple):
    """A private copy of one complete version."""

    version: int
    weights: TensorDict


@dataclass(eq=False)
class Writer:
    """The parts of one process's writing into one store, built when the process first writes
    (a process that only reads builds none). Each has one job; :class:`WeightStore`'s methods use
    them.

    Attributes:
        role: who may write (:class:`~shmsync.writer.role.WriterRole`).
        matcher: the source checked against the layout (:class:`~shmsync.store.sources.SourceMatcher`).
        copy: a version copied into a slot and committed (:class:`~shmsync.writer.slot_copy.SlotCopy`),
            with what changed since the newest version (its ``changes``).
        steps: the optimizer steps counted (:class:`~shmsync.writer.steps.OptimizerSteps`).
        copier: the store's background thread (give-backs, CUDA copies landing, background copies).
        background: the background copy (a store made with ``unsafe_background_copy``), once used.
        cuda: the CUDA writer, from the first publish from CUDA tensors on.
        seconds: time spent publishing by this process.
    """

    role: WriterRole
    matcher: SourceMatcher
    copy: SlotCopy
    steps: OptimizerSteps
    copier: Copier
    background: InBackground | None = None
    cuda: Any = None
    seconds: float = 0.0
    what: str = field(default="")

    @classmethod
    def of(cls, memory: StoreMemory, leases: Leases) -> Writer:
        """The parts, for ``memory`` (the store's mapping here) and ``leases`` (its host bank's)."""
        slot_writer = SlotWriter(memory.host, leases)
        steps = OptimizerSteps(memory.header)  # counting once this process takes the writer role
        copier = Copier(f"shmsync-publish-{memory.name}")
        copy = SlotCopy(memory, slot_writer, copier, SourceChanges(len(memory.layout.owners)))
        return cls(
            WriterRole(memory, slot_writer, steps),
            SourceMatcher(memory.layout, memory.destinations),
            copy,
            steps,
            copier,
            what=f"weights published to store {memory.name!r}",
        )

    def newest(self) -> list[torch.Tensor] | None:
        """The newest version's slot (the device bank's, from CUDA on), viewed in this process, or
        None before any."""
        if self.cuda is not None:
            return self.cuda.newest_views()
        memory = self.copy.memory
        h, host = memory.header, memory.host
        return memory.slots[h[host.latest]] if h[host.version] >= 0 else None

    def background_copy(self) -> InBackground:
        """The background copy, made at the first publish that asks for it."""
        if self.background is None:
            self.background = InBackground(self.copy)
        return self.background

    def cuda_for(self, tensors: list[torch.Tensor]) -> Any:
        """The CUDA writer, made at the first publish from CUDA tensors: the store's versions live
        on their GPU from then on (CPU tensors published later are copied there)."""
        if self.cuda is None:
            from shmsync.writer.cuda import CudaWriter

            device = next(t.device for t in tensors if t.is_cuda)
            self.cuda = CudaWriter(self.copy.memory, self.copy.slot_writer, self.copier, device)
        return self.cuda

    def close(self) -> None:
        """Wait for the writes in flight, then end the copier's thread and the CUDA writer."""
        try:
            self.copier.close()
        finally:
            self.steps.close()
            self.copy.changes.close()
            if self.cuda is not None:
                self.cuda.close()


@contextmanager
def _removed_if_failed(store: WeightStore) -> Iterator[None]:
    """The steps that finish a new store: if one fails, the store's file is removed and its
    memory let go before the error goes on (no half-made store is left for others to attach)."""
    try:
        yield
    except BaseException:
        store.unlink()
        store.close()
        raise


class WeightStore:
    """A store open in this process: versioned weights in shared memory, published by one process,
    read by many. Its job is the store's versions: where they live is its :attr:`memory`'s (a
    :class:`~shmsync.store.memory.StoreMemory`: file, header, slots, sizes); this process's
    writing is done by the parts of its :attr:`writer` (a :class:`Writer`, built at the first write).

    Make it in the trainer with :meth:`create`; open it elsewhere with :meth:`attach`, or pickle it
    to a child process. Readers (:class:`~shmsync.WeightReader`) load the newest complete version.

    Args:
        memory: its mapping in this process; owner: this process created it (a ``with`` unlinks it).

    Attributes:
        rows: the readers' rows; leases: the leases of its host slots; slot_reader: the protocol's reader side
            :meth:`snapshot` reads with.
        remote_rows: the sources of other hosts' rows in :meth:`readers` (a relay's sender adds its own).

    Examples:
        >>> import torch
        >>> from shmsync import WeightReader, WeightStore
        >>> policy = torch.nn.Linear(4, 2)
        >>> with WeightStore.create(policy) as store:
        ...     v = store.publish(policy)
        ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
        ...     reader.poll(), reader.version == v
        (True, True)
    """

    def __init__(self, memory: StoreMemory | None = None, *, owner: bool = False) -> None:
        if not isinstance(memory, StoreMemory):
            raise ArgumentTypeError(
                "make a store with WeightStore.create(source) or open one with WeightStore.attach(name)"
            )
        self.memory = memory
        self.owner = owner
        self.rows = ReaderRows(memory.header, memory.locks)
        self.leases = Leases(memory.host, memory.locks)
        self.slot_reader = SlotReader(memory.host, memory.locks)
        self.remote_rows = RemoteSources()
        self.unsafe_background_copy = False  # see create()
        self._writer: Writer | None = None

    @property
    def writer(self) -> Writer:
        """This process's writing into the store (its parts: :class:`Writer`), built at its first write."""
        if self._writer is None:
            self._writer = Writer.of(self.memory, self.leases)
        return self._writer

    @classmethod
    def create(
        cls,
        source: Any,
        name: str | None = None,
        *,
        num_slots: int = 4,
        unlink_at_exit: bool = True,
        version: int = 0,
        unsafe_background_copy: bool = False,
    ) -> WeightStore:
        """Allocate a store shaped like ``source`` and publish its weights as version 0.

        Args:
            source: an ``nn.Module`` (its parameters and buffers), a ``TensorDict``, or a
                mapping ``{destination: module or TensorDict}``. Several destinations live in one
                store and are published together under one version. Tensors may be on any
                device: published from CUDA, versions are kept in device memory too (the GPUs page).
            name: a name to attach by: 1 to 200 letters, digits, ``_``, ``.`` and ``-``.
                Default: a unique name, so concurrent test processes never collide.
            num_slots: slots, each room for one copy of the weights; only those holding the latest
                version, the next write or a version a reader runs in place hold memory. Readers in
                place hold at most ``num_slots - 2`` distinct versions (the others copy).
            unlink_at_exit: remove the shared memory when this process exits or the store is
                garbage collected. Existing readers keep their mapping.
            version: the version of these first weights. Default 0.
            unsafe_background_copy: CPU publishes return before their copy, which reads the live
                source on a background thread: this gives up the snapshot. Write the source only
                once it landed (:meth:`flush`; an optimizer step waits by itself): a write through
                ``.data`` meanwhile may publish a mix of two states (other writes are found, and
                that version withdrawn). Default False: each publish copies before it returns.

        Returns:
            The store at ``version``, this process its writer; only this user may open it.

        Raises:
            StoreExistsError: ``name`` is taken.
            InvalidArgumentError: ``name`` is not a valid store name, or ``version`` below 0.
            WeightMismatchError: ``source`` holds no tensors, or tensors on ``meta``.
        """
        check_version(version, -1)
        td, destinations = as_tensordict(source, "WeightStore.create() source")
        layout = Layout.from_tensordict(td)
        layout.match(td, "weights given to WeightStore.create()")
        name = default_name() if name is None else name
        store = cls.create_empty(layout, destinations, name, num_slots=num_slots, unlink_at_exit=unlink_at_exit)
        with _removed_if_failed(store):
            store.publish(source, version=version)  # the first version is copied before create() returns
            store.flush()
            store.unsafe_background_copy = bool(unsafe_background_copy)
        return store

    @classmethod
    def create_empty(
        cls,
        layout: Layout,
        destinations: tuple[str, ...] | None,
        name: str,
        *,
        num_slots: int,
        unlink_at_exit: bool,
        make_segment: Callable[..., Segment] = Segment.create,
    ) -> WeightStore:
        """A new store of ``layout`` with no version yet, this process its creator and writer
        (``make_segment`` makes its file: see :func:`~shmsync.store.memory.new_segment`)."""
        memory = StoreMemory.create(
            layout, destinations, name, num_slots, unlink_at_exit=unlink_at_exit, make_segment=make_segment
        )
        store = cls(memory, owner=True)
        with _removed_if_failed(store):
            store.writer.role.acquire()
        return store

    @classmethod
    def attach(cls, name: str) -> WeightStore:
        """Open the store called ``name`` from any process on this host. Its file is checked before
        it is mapped: a regular file only this user may write, every header and layout field in range.

        Raises:
            StoreNotFoundError: there is no such store (or it was unlinked).
            StoreUntrustedError: the file is not one this user alone could have written.
            StoreCorruptError: a header or layout field is out of range (naming it).
            InvalidArgumentError: ``name`` is not a valid store name.
        """
        return cls(StoreMemory.attach(name))

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (WeightStore.attach, (self.name,))  # a child process attaches by name

    # -- facts ----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name other processes attach by."""
        return self.memory.name

    @property
    def version(self) -> int:
        """The newest complete version: published, so readers can load it (it only goes up; 0 is
        the weights given to :meth:`create`)."""
        return self.memory.header[W_VERSION]

    @property
    def promised(self) -> int:
        """The newest promised version: that of the last publish begun, whose copy may still be in
        flight (from CUDA, or in the background); :attr:`version` once it landed, never below it."""
        h = self.memory.header
        return max(h[W_VERSION], h[W_PROMISED])

    @property
    def steps(self) -> int:
        """Optimizer steps the writer's process has taken on the weights it publishes here so far:
        steps of any optimizer holding a tensor last published (see :mod:`shmsync.writer.steps`)."""
        return self.memory.header[W_STEPS]

    def steps_of(self, version: int) -> int | None:
        """The optimizer steps ``version`` had seen when it was published (so ``store.steps -
        store.steps_of(v)`` is how many steps behind the trainer weights of version ``v`` are);
        None for a version this store no longer knows (in the writer's process, one of the last
        4096; elsewhere, of the last 64), or whose writer counted none (a relay's).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(2, 1)
            >>> optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
            >>> with WeightStore.create(policy) as store:
            ...     for _ in range(3):
            ...         policy(torch.ones(1, 2)).sum().backward()
            ...         optimizer.step()
            ...     v = store.publish(policy)
            ...     optimizer.step()
            ...     store.steps_of(0), store.steps_of(v), store.steps
            (0, 3, 4)
        """
        w = self._writer
        writers = [] if w is None else [w.copy.slot_writer, *([w.cuda.slot_writer] if w.cuda is not None else [])]
        known = next((w.steps[version] for w in writers if version in w.steps), None)
        return known if known is not None else steps_of(self.memory.header, version, self.version)

    @property
    def destinations(self) -> tuple[str, ...] | None:
        """The destination names, or None for a store made from one module or TensorDict."""
        return self.memory.destinations

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the weights."""
        return self.memory.header[W_PAYLOAD_BYTES]

    @property
    def closed(self) -> bool:
        """Whether this process closed it."""
        return self.memory.closed

    def info(self) -> dict[str, int]:
        """Header facts: versions (published and promised), creator and writer pids, publish count
        and times (ns), bytes of host and device memory (``shm_bytes``, ``resident_bytes``,
        ``device_bytes``), ``num_slots``, the device (-1: none), the optimizer ``steps`` counted
        (-1: none), and of the last publish: ``copied_bytes``, ``skipped_bytes`` (unchanged since
        the version its slot held) and ``unchanged_proof``, how unchanged leaves were proved so: 0
        none (every leaf copied: from CUDA, in the background, a whole version from a relay), 1
        comparison, 2 the pages written (see :mod:`shmsync.writer.changes`), 3 the delta a relay
        received (:meth:`publish_delta`: the trainer proved them unchanged).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 2))
            >>> with WeightStore.create(policy, num_slots=2) as store:  # two slots: each publish writes the older
            ...     for _ in range(3):
            ...         with torch.no_grad():
            ...             _ = policy[1].bias.add_(1.0)  # the head trains, the rest stays
            ...         _ = store.publish(policy)
            ...     info = store.info()
            >>> info["copied_bytes"] < 10_000 < info["skipped_bytes"]
            True
        """
        return self.memory.facts()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version={self.version}"
        return f"WeightStore(name={self.name!r}, {state}, nbytes={self.nbytes})"

    # -- publishing (this process's Writer) ------------------------------------------------------
    def publish(
        self,
        source: Any,
        *,
        version: int | None = None,
        only: Collection[str] | None = None,
        checked: bool = False,
    ) -> int:
        """Copy ``source``'s weights in and make them visible as one new version.

        Never waits for readers. The version is a snapshot of ``source`` as it is now: CPU
        tensors are copied before this returns, so ``source`` may be written any way at once.
        From CUDA the copy is enqueued on the current stream (later writes on it come after; see
        the GPUs page for other streams) and the version promised until it lands (:meth:`flush`
        waits for it). One process publishes at a time; any of its threads may.

        Args:
            source: the same kind of object the store was created from, with the same keys,
                shapes and dtypes (on any device).
            version: this version number instead of the next one (say, the optimizer-step count),
                higher than every version before: versions may skip, never go back.
            only: for a store of destinations, the destinations to take from ``source``; the
                others keep the newest version's weights. Default: all.
            checked: other threads may write ``source`` during the call: a copy that a write
                reached while it was made is dropped and made again, as
                :meth:`publish_if_changed` does (a comparison of what was copied, after the copy).

        Returns:
            The new version.

        Raises:
            WeightMismatchError: a key, shape or dtype differs; nothing is written.
            InvalidArgumentError: ``version`` is not higher than the last one; nothing is written.
            WriterBusyError: another live process holds the writer role.
            ShmSyncError: the previous CUDA or background publish failed (its error is the cause).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(4, 2)
            >>> with WeightStore.create(policy) as store:
            ...     store.publish(policy), store.publish(policy, version=10), store.version
            (1, 10, 10)
        """
        return self._publish(source, version, only=only, checked=checked)  # type: ignore[return-value]

    def publish_if_changed(self, source: Any, *, only: Collection[str] | None = None) -> int | None:
        """Publish ``source`` as a new version if it differs in any byte from the newest version;
        else publish nothing. Unlike :meth:`publish`, it may be called while other threads write
        ``source``: a copy that a write reached while it was made is dropped and made again, so
        the version holds the weights' memory as it was at one moment (with a thread that is in
        the middle of a write of its own at that moment caught where it stands: see
        :mod:`shmsync.writer.changes`).

        How a TorchRL collector hands its workers the weights as they are when their work starts
        (see the TorchRL page): the update call publishes a snapshot, and the hand-out of the
        next batch publishes again only what training changed since.

        Args:
            source: what :meth:`publish` takes.
            only: for a store of destinations, the destinations to take from ``source``; the
                others keep the newest version's weights. Default: all.

        Returns:
            The new version, or None if ``source`` holds the newest version's bytes.

        Raises:
            WrittenWhileCopiedError: each of the copies it made was written while it was being
                made; nothing was published.
            WeightMismatchError: a key, shape or dtype differs; nothing is written.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(4, 2)
            >>> with WeightStore.create(policy) as store:
            ...     unchanged = store.publish_if_changed(policy)
            ...     with torch.no_grad():
            ...         _ = policy.bias.add_(1.0)
            ...     unchanged, store.publish_if_changed(policy), store.version
            (None, 1, 1)
        """
        return self._publish(source, None, only=only, checked=True, if_changed=True)

    def _begin(self, version: int | None) -> Writer:
        """The writer, its role held for a write of ``version`` (see
        :meth:`~shmsync.writer.role.WriterRole.claim`), the write in flight and its give-backs
        landed (one write open at a time)."""
        w = self.writer
        with w.role.lock:
            w.role.claim(version)
        if w.copier.pending:
            w.copier.wait()
        return w

    def _publish(
        self,
        source: Any,
        version: int | None,
        *,
        only: Collection[str] | None = None,
        checked: bool = False,
        if_changed: bool = False,
    ) -> int | None:
        """:meth:`publish` and :meth:`publish_if_changed`: the source matched against the layout,
        the writer role held, then the copy of what changed (from CUDA: enqueued; in the
        background: promised); None where ``if_changed`` and nothing changed."""
        w = self._writer or self.writer
        with w.role.lock:  # a publishing thread beside the trainer's: one version after the other
            start = time.perf_counter()
            tensors = w.matcher.match(source, w.what)
            if self.memory.layout.tied:
                self.memory.layout.check_tied(tensors, w.what)
            w.role.claim(version)
            if w.copier.pending:
                w.copier.wait()  # the write in flight, and its give-backs, landed: one write open at a time
            w.steps.tensors = tensors  # optimizers holding them count from now on
            newest = w.newest()
            if newest is not None and only is not None and not set(self.memory.destinations or ()) <= set(only):
                tensors = _keep_others(self.memory, tensors, newest, only)
            if w.cuda is not None or any(t.is_cuda for t in tensors):
                version = self._enqueue(w, tensors, newest, version, if_changed)
            elif self.unsafe_background_copy and not checked:
                version = w.background_copy().publish(tensors, version)
            else:
                version = self._copy_changes(w, tensors, newest, version, checked, if_changed)
            w.seconds += time.perf_counter() - start
            return version

    def _copy_changes(
        self,
        w: Writer,
        tensors: list[torch.Tensor],
        newest: list[torch.Tensor] | None,
        version: int | None,
        checked: bool,
        if_changed: bool,
    ) -> int | None:
        """A publish from the CPU: what changed since the newest version found, and copied into a
        slot (checked where another thread could write the source meanwhile); None where
        ``if_changed`` and nothing changed."""
        if self.memory.layout.tied:  # the entries holding bytes of their own
            tensors, newest = _owned(self.memory, tensors), newest and _owned(self.memory, newest)
        found = w.copy.changes.find(tensors, newest, "checked" if checked else "plain")
        if if_changed and not any(found):
            return None
        return w.copy.copy_source(tensors, found, version, checked and others_may_write())

    def _enqueue(
        self,
        w: Writer,
        tensors: list[torch.Tensor],
        newest: list[torch.Tensor] | None,
        version: int | None,
        if_changed: bool,
    ) -> int | None:
        """A publish from CUDA: enqueued on the current stream, whose order makes it a snapshot
        (writes enqueued after it on the stream come after); None where ``if_changed`` and nothing changed."""
        if if_changed:
            held = None if newest is None else _owned(self.memory, newest)
            if not any(w.copy.changes.find(_owned(self.memory, tensors), held, "checked")):
                return None
        version = w.cuda_for(tensors).enqueue(tensors, version)
        w.copy.forget()
        return version

    def delta_of(self, version: int) -> Delta | None:
        """What ``version`` changed, where this process published it from its own weights: the
        leaves whose bytes may differ from the version before it (a relay sends a host holding
        that version only those); None for a version published any other way, or too long ago.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
            >>> with WeightStore.create(policy) as store:
            ...     with torch.no_grad():
            ...         _ = policy[1].bias.add_(1.0)
            ...     v = store.publish(policy)
            ...     store.delta_of(v).leaves  # 1.bias: the layout's third entry (0.bias, 0.weight, 1.bias, ...)
            (2,)
        """
        return self._writer.copy.deltas.get(version) if self._writer is not None else None

    def differs(self, source: Any, *, only: Collection[str] | None = None) -> bool:
        """Whether ``source`` differs in any byte from the newest version (publishes nothing; waits
        for this process's write in flight). ``only``: as :meth:`publish_if_changed`.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(4, 2)
            >>> with WeightStore.create(policy) as store:
            ...     before = store.differs(policy)
            ...     policy.weight.data[0, 0] = 7.0  # a write torch's version counter does not see
            ...     before, store.differs(policy)
            (False, True)
        """
        w = self.writer
        with w.role.lock:
            tensors = w.matcher.match(source, w.what)
            self.flush()  # this process's write in flight landed: the newest version is whole in its slot
            newest = w.newest() if w.role.holding else None
            if newest is None and self.version >= 0:  # not this process's to write: a copy of it
                newest = list(self.snapshot().weights.flatten_keys(".").values())
            if newest is not None and only is not None:
                tensors = _keep_others(self.memory, tensors, newest, only)
            held = None if newest is None else _owned(self.memory, newest)
            return any(w.copy.changes.find(_owned(self.memory, tensors), held, "checked"))

    def flush(self, timeout: float | None = None) -> int:
        """Wait until this process's publishes landed and idle slots went back; returns the version readers see.

        Raises:
            WaitTimeoutError: still copying after ``timeout`` seconds.
            ShmSyncError: a CUDA or background publish failed (its error is the cause).
        """
        if self._writer is not None:
            self._writer.copier.wait(timeout)
        return self.version

    def publish_bytes(self, fill: Callable[[memoryview, Write], None], *, version: int) -> int:
        """Publish a version whose bytes ``fill(buffer, write)`` writes straight into a free slot:
        how a relay publishes what it receives, with no copy in between.

        Args:
            fill: writes :attr:`nbytes` bytes, in the store's layout, into ``buffer`` (a writable
                memoryview valid while it runs); ``write`` is the slot being written (a relay's
                links forward from it as it fills). If ``fill`` raises, the slot is left empty
                and nothing is published.
            version: the version's number, higher than every version before.

        Returns:
            ``version``.

        Raises:
            InvalidArgumentError: ``version`` is not higher than the last one; nothing is written.
            WriterBusyError: another live process holds the writer role.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(2, 2)) as store:
            ...     ones = lambda buffer, write: buffer.cast("B").__setitem__(slice(None), b"\\x01" * len(buffer))
            ...     store.publish_bytes(ones, version=7), store.version
            (7, 7)
        """
        w = self._begin(version)
        with w.role.lock:
            w.copy.changes.forget()
            return w.copy.copy_bytes(fill, version)

    def publish_delta(self, data: Any, *, version: int, base: int, leaves: Sequence[int]) -> int:
        """Publish ``version``, which differs from ``base``, this store's newest version, only in the
        leaves ``leaves`` (indices into the layout, in increasing order), whose bytes ``data`` holds
        one after the other: how a relay publishes a version whose changes alone came over the
        network. The slot it writes gets those bytes, and from the newest version's slot only what
        it lacks (the leaves that changed since the version it held); later publishes know which
        leaves changed at ``version``.

        Args:
            data: the bytes of the leaves named, in layout order, without the layout's gaps.
            version: the version's number, higher than every version before.
            base: the version the delta is from: the newest one here.
            leaves: the leaves that changed since ``base`` (every other leaf holds its bytes).

        Returns:
            ``version``.

        Raises:
            InvalidArgumentError: ``version`` is not higher than the last one, ``base`` is not the
                newest version, a leaf index is out of range or out of order, or ``data`` does not
                hold exactly those leaves' bytes; nothing is written.
            WriterBusyError: another live process holds the writer role.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> weights = {"frozen": torch.zeros(1000), "head": torch.zeros(2)}
            >>> with WeightStore.create(weights, num_slots=2) as store:  # version 0 in one slot
            ...     for v in (1, 2):  # the other slot, then the first again: it lacks only the head
            ...         head = torch.tensor([float(v), 2.0 * v])
            ...         _ = store.publish_delta(head.numpy().tobytes(), version=v, base=v - 1, leaves=[1])
            ...     store.snapshot().weights["head"].tolist(), store.info()["copied_bytes"]
            ([2.0, 4.0], 8)
        """
        w = self._begin(version)
        with w.role.lock:
            return w.copy.copy_delta(data, version, base, leaves)

    def check(self, source: Any, version: int | None = None) -> None:
        """Raise what :meth:`publish` would raise for ``source`` (and ``version``), writing nothing:
        an update that reaches several stores checks each before it writes any.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     store.check(torch.nn.Linear(3, 2))
            Traceback (most recent call last):
            ...
            shmsync.errors.WeightMismatchError: ...
        """
        w = self.writer
        tensors = w.matcher.match(source, f"weights for store {self.name!r}")
        if self.memory.layout.tied:
            self.memory.layout.check_tied(tensors, f"weights for store {self.name!r}")
        if version is not None:
            check_version(version, self.promised, self.name)

    def add_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(version)`` right after each version this process publishes turns visible,
        on the thread that made it visible (a relay's links wake on it instead of polling). It must
        return at once and never raise."""
        self.writer.copy.listeners.append(listener)

    def remove_listener(self, listener: Callable[[int], None]) -> None:
        """Undo :meth:`add_listener`."""
        if self._writer is not None and listener in self._writer.copy.listeners:
            self._writer.copy.listeners.remove(listener)

    @property
    def publish_seconds(self) -> float:
        """Seconds this process spent in :meth:`publish` (the calls, not copies landing later)."""
        return self._writer.seconds if self._writer is not None else 0.0

    def release_writer(self) -> None:
        """Give up the writer role so another process may publish (once this process's publishes landed)."""
        if self._writer is not None:
            self.flush()
            self._writer.role.release()

    def writer_alive(self) -> bool:
        """Whether a live process can still publish, as the kernel's locks tell (any PID namespace).

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     store.writer_alive()
            True
        """
        return self.memory.writer_alive()

    @property
    def table(self) -> ReaderRows:
        """Deprecated: :attr:`rows` (renamed in 0.2.0, removed in 0.3.0)."""
        warn_deprecated("WeightStore.table", "WeightStore.rows", "0.3.0")
        return self.rows

    @property
    def reader(self) -> SlotReader:
        """Deprecated: :attr:`slot_reader` (renamed in 0.2.0, removed in 0.3.0)."""
        warn_deprecated("WeightStore.reader", "WeightStore.slot_reader", "0.3.0")
        return self.slot_reader

    def publisher_alive(self) -> bool:
        """Deprecated: :meth:`writer_alive` (renamed in 0.2.0, removed in 0.3.0)."""
        warn_deprecated("WeightStore.publisher_alive()", "WeightStore.writer_alive()", "0.3.0")
        return self.writer_alive()

    # -- reading --------------------------------------------------------------------------------
    def snapshot(self, timeout: float = 60.0) -> Snapshot:
        """A private copy of the newest complete version (this process's publishes landed first):
        ``Snapshot(version, weights)``, ``weights`` a TensorDict shaped like the source.

        Raises:
            ReloadTimeoutError: no complete copy could be made within ``timeout`` seconds.
        """
        memory = self.memory
        memory.check_open()
        self.flush(timeout)
        if self._writer is not None and self._writer.cuda is not None:
            version, tensors = self._writer.cuda.snapshot()
            return Snapshot(version, memory.layout.as_tensordict(tensors))
        version, tensors = memory.copy_latest(self.slot_reader, timeout)
        return Snapshot(version, memory.layout.as_tensordict(tensors))

    def readers(self, *, processes: bool = True, memory: bool | None = None) -> ReaderTable:
        """The readers' table (:mod:`shmsync.store.reader_table`): every reader attached in a live
        process, worst lagging first, and those on other hosts that relays report here. No message,
        no wait.

        Args:
            processes: look up each local reader's process state and private memory (USS), a few
                milliseconds a reader; False for the versions alone (microseconds a reader).
            memory: look up the private memory (default: as ``processes``).

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     _ = reader.poll()
            ...     [(row.version, row.behind, row.mode) for row in store.readers()]
            [(0, 0, 'in place')]
        """
        mapped = self.memory
        version, alive = mapped.header[W_VERSION], mapped.locks.rows_alive
        live, gone = local_rows(self.name, mapped.header, alive, version, processes=processes, memory=memory)
        return assemble(self.name, version, live, gone, self.remote_rows)

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of the store here (unlinking it if this process created it to), once this process's
        publishes landed; other processes keep their mapping. ``version`` and :meth:`info` still tell."""
        if not self.closed:
            try:
                if self._writer is not None:
                    self._writer.close()
            finally:
                self.memory.close()  # its dependents (readers in place) first

    def unlink(self) -> None:
        """Remove the store's name from the host: no new process can attach. Mappings stay valid."""
        self.memory.segment.unlink()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self.owner:
            self.unlink()
        self.close()


def _owned(memory: StoreMemory, per_entry: list[torch.Tensor]) -> list[torch.Tensor]:
    """The items of a per-entry list that belong to entries holding bytes of their own (a tied
    entry's bytes are its owner's)."""
    owners = memory.layout.owners
    return per_entry if len(owners) == len(per_entry) else [per_entry[i] for i in owners]


def _keep_others(
    memory: StoreMemory, tensors: list[torch.Tensor], newest: list[torch.Tensor], only: Collection[str]
) -> list[torch.Tensor]:
    """``tensors``, but the newest version's for every destination not in ``only``."""
    keep = list(tensors)
    for destination in memory.destinations or ():
        if destination not in only:
            for i in memory.layout.subset((destination,)):
                keep[i] = newest[i]
    return keep


__all__ = ["WeightStore", "Snapshot", "Writer", "check_delta", "check_version"]
