"""The weight store: versioned copies of a model's weights in host shared memory.

The store is the public face of three lower layers: the segment (a file in ``/dev/shm``
and its kernel locks, :mod:`shmsync.core.segment`), the tensor layout of a slot
(:mod:`shmsync.core.layout`) and the protocol between the one writer and many readers
(:mod:`shmsync.core.protocol`, where the argument for why readers never accept a mix of two
versions, and why the writer never waits, is laid out). Here: creating and attaching,
checking what is published against the layout, the writer role, CUDA publishing, and
lifetime.
"""

from __future__ import annotations

import os
import secrets
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from shmsync.core import fences
from shmsync.core.copies import copy_all
from shmsync.core.header import (
    FORMAT,
    HEADER_BYTES,
    MAGIC,
    MAX_SLOTS,
    W_CREATE_NS,
    W_CREATOR_PID,
    W_CREATOR_PPID,
    W_CREATOR_START,
    W_DATA_OFFSET,
    W_FORMAT,
    W_LAYOUT_BYTES,
    W_LAYOUT_OFFSET,
    W_MAGIC,
    W_PAYLOAD_BYTES,
    W_PUBLISH_COUNT,
    W_PUBLISH_NS,
    W_SLOT_BYTES,
    W_VERSION,
    W_WRITER_PID,
    check_words,
    header_view,
)
from shmsync.core.layout import Layout, segment_bytes
from shmsync.core.mapping import StoreMemory
from shmsync.core.processes import process_start_ns
from shmsync.core.protocol import initialize
from shmsync.core.segment import CREATOR_LOCK, WRITER_LOCK, Segment, validate_name
from shmsync.errors import ShmSyncError, StoreCorruptError, WriterBusyError
from shmsync.sources import as_tensordict, module_weights, parts
from shmsync.table import ReaderTable, assemble, local_rows


class Snapshot(NamedTuple):
    """A private copy of one complete version."""

    version: int
    weights: TensorDict


class WeightStore:
    """Versioned weights in host shared memory, published by one process, read by many.

    Create it in the trainer with :meth:`create`; open it elsewhere with :meth:`attach`
    or by pickling it to a child process. :meth:`publish` copies new weights in and
    makes them visible as one new version; readers (:class:`~shmsync.WeightReader`)
    load the newest complete version, never a mix of two.

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Not called directly: use :meth:`WeightStore.create` (trainer) or :meth:`WeightStore.attach`."""
        raise TypeError("make a store with WeightStore.create(source) or open one with WeightStore.attach(name)")

    @classmethod
    def _open(
        cls, segment: Segment, layout: Layout, destinations: Any, *, owner: bool, unlink_at_exit: bool
    ) -> WeightStore:
        self = cls.__new__(cls)
        self.memory = StoreMemory(
            segment, header_view(segment.buf), layout, destinations, unlink_at_exit=owner and unlink_at_exit
        )
        self._owner = owner
        self.publish_seconds = 0.0  # time spent in publish() by this process
        self._cuda_publisher = None
        self._plans: dict = {}  # (id(module), prefix) -> what _match_module checked last time
        self._dependents: weakref.WeakSet = weakref.WeakSet()  # closed before the memory goes
        return self

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        source: Any,
        name: str | None = None,
        *,
        num_slots: int = 3,
        unlink_at_exit: bool = True,
        version: int = 0,
    ) -> WeightStore:
        """Allocate a store shaped like ``source`` and publish its weights as version 0.

        Args:
            source: an ``nn.Module`` (its parameters and buffers), a ``TensorDict``, or a
                mapping ``{destination: module or TensorDict}``. Several destinations live
                in one store and are published together under one version. Tensors may be
                on any device; the store always lives in host shared memory.
            name: a name to attach by: 1 to 200 letters, digits, ``_``, ``.`` and ``-``.
                Default: a unique name, so concurrent test processes never collide.
            num_slots: copies kept. 3 (the default) guarantees that no reader starves
                however fast the writer publishes; 2 saves memory but readers may have to
                wait for a pause in publishing. Zero-copy readers (see
                :class:`~shmsync.WeightReader`) may lease at most ``num_slots - 2``
                distinct slots at once; those that cannot lease copy.
            unlink_at_exit: remove the shared memory when this process exits or the
                store is garbage collected. Existing readers keep their mapping.
            version: the version of these first weights (say, the trainer's version that a
                store on another host starts from). Default 0.

        Returns:
            The store, open in this process, at ``version``; this process holds its writer role.
            Only this user may open it (and its group, with ``SHMSYNC_TRUST_GROUP=1``).

        Raises:
            FileExistsError: ``name`` is taken.
            ValueError: ``name`` is not a valid store name.
            WeightMismatchError: ``source`` holds no tensors, or tensors on ``meta``.
        """
        _check_version(version)
        td, destinations = as_tensordict(source, "WeightStore.create() source")
        layout = Layout.from_tensordict(td)
        tensors = layout.match(td, "weights given to WeightStore.create()")
        name = f"{os.getpid()}-{secrets.token_hex(6)}" if name is None else name
        store = cls._make(layout, destinations, Segment.create, name, num_slots, unlink_at_exit)
        # The creator keeps the writer role: no other process can lock the trainer out by
        # publishing first. It publishes from elsewhere after release_writer() here.
        try:
            store._write(tensors, version=version)
        except BaseException:
            store.unlink()
            store.close()
            raise
        return store

    @classmethod
    def create_from_bytes(
        cls,
        layout_description: bytes,
        fill: Callable[[torch.Tensor], None],
        *,
        version: int,
        name: str,
        num_slots: int = 3,
        unlink_at_exit: bool = True,
    ) -> WeightStore:
        """A store laid out as ``layout_description`` says (:attr:`layout_description` of another
        store), whose first version's bytes ``fill(view)`` writes straight into a slot: how a relay
        makes the store of a host from the trainer's first version, with no copy in between.

        The store gets its name only once it holds that version, in one step: no process can
        attach to it before, so nothing on this host ever reads any other first version.

        Raises:
            StoreCorruptError: the description fails a check (naming the field).
            FileExistsError: ``name`` was taken meanwhile (nothing is left behind).
            Exception: whatever ``fill`` raised (nothing is left behind).
        """
        _check_version(version)
        validate_name(name)
        layout, destinations = Layout.from_json(layout_description, "the layout to make a store from")
        store = cls._make(
            layout,
            destinations,
            lambda _name, size, track: Segment.create_incoming(size, track=track),
            name,
            num_slots,
            unlink_at_exit,
        )
        try:
            store.publish_bytes(fill, version=version)
            store.memory.segment.link(name)
        except BaseException:
            store.unlink()
            store.close()
            raise
        return store

    @classmethod
    def _make(
        cls, layout: Layout, destinations: Any, make_segment: Callable, name: str, num_slots: int, unlink_at_exit: bool
    ) -> WeightStore:
        """A new store with no version yet, this process its creator and writer."""
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 2 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be an int between 2 and {MAX_SLOTS}, got {num_slots!r}")
        doc = layout.to_json(destinations)
        layout_offset, data_offset, size = segment_bytes(doc, layout.slot_bytes, num_slots)
        segment = make_segment(name, size, track=unlink_at_exit)
        h = header_view(segment.buf)
        try:
            segment.lock(CREATOR_LOCK, exclusive=True, wait=False)
            segment.buf[layout_offset : layout_offset + len(doc)] = doc
            pid = os.getpid()
            for word, value in (
                (W_FORMAT, FORMAT),
                (W_CREATOR_PID, pid),
                (W_CREATOR_PPID, os.getppid()),
                (W_CREATOR_START, process_start_ns(pid)),
                (W_CREATE_NS, time.time_ns()),
                (W_LAYOUT_OFFSET, layout_offset),
                (W_LAYOUT_BYTES, len(doc)),
                (W_DATA_OFFSET, data_offset),
                (W_SLOT_BYTES, layout.slot_bytes),
                (W_PAYLOAD_BYTES, layout.payload_bytes),
            ):
                h[word] = value
            initialize(h, num_slots)
            fences.ordering()[1]()  # everything above before the magic word
            h[W_MAGIC] = MAGIC  # last: attach() refuses a half-initialised header
            h.release()
            store = cls._open(segment, layout, destinations, owner=True, unlink_at_exit=unlink_at_exit)
            store._acquire_writer()
        except BaseException:
            h.release()
            segment.unlink()
            segment.close()
            raise
        return store

    @classmethod
    def attach(cls, name: str) -> WeightStore:
        """Open the store called ``name`` from any process on this host.

        The file is checked before it is mapped: a regular file (no link followed) that only this
        user may write (and its group, with ``SHMSYNC_TRUST_GROUP=1``), whose every header and
        layout field is in range for its size.

        Raises:
            StoreNotFoundError: there is no such store (or it was unlinked).
            StoreUntrustedError: the file is not one this user alone could have written.
            StoreCorruptError: a header or layout field is out of range (naming it).
            ValueError: ``name`` is not a valid store name.
        """

        def inspect(fd: int, st: os.stat_result) -> tuple[Layout, Any]:
            if st.st_size < HEADER_BYTES:
                check_words((), st.st_size, name)  # raises, saying why
            h = memoryview(os.pread(fd, HEADER_BYTES, 0)).cast("q")
            lo, ln = check_words(h, st.st_size, name)
            raw = os.pread(fd, ln, lo)
            layout, destinations = Layout.from_json(raw, f"store {name!r}: layout")
            if layout.payload_bytes != h[W_PAYLOAD_BYTES]:
                raise StoreCorruptError(
                    f"store {name!r}: header field payload_bytes is {h[W_PAYLOAD_BYTES]}, its layout holds "
                    f"{layout.payload_bytes} bytes; the store was not opened"
                )
            return layout, destinations

        segment, (layout, destinations) = Segment.open(name, inspect)
        try:
            return cls._open(segment, layout, destinations, owner=False, unlink_at_exit=False)
        except BaseException:
            segment.close()
            raise

    def __reduce__(self):
        # A child process attaches by name; the shared memory is the same.
        return (WeightStore.attach, (self.name,))

    # -- properties -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name other processes attach by."""
        return self.memory.segment.name

    @property
    def version(self) -> int:
        """The last completed version (monotonic; 0 is the weights given to :meth:`create`)."""
        return self.memory.header[W_VERSION]

    @property
    def destinations(self) -> tuple[str, ...] | None:
        """The destination names when created from a mapping, else None."""
        return self.memory.destinations

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the weights."""
        return self.memory.header[W_PAYLOAD_BYTES]

    @property
    def shm_bytes(self) -> int:
        """Bytes of shared memory the store occupies (header and all slots)."""
        return self.memory.segment.size

    @property
    def num_slots(self) -> int:
        return self.memory.num_slots

    @property
    def closed(self) -> bool:
        return self.memory.closed

    def keys(self) -> list[str]:
        """Dotted keys of every tensor in the store."""
        return [".".join(e.key) for e in self.memory.layout.entries]

    def info(self) -> dict[str, int]:
        """Header facts: version, creator and writer pids, publish count and times (ns)."""
        h = self.memory.header
        return {
            "version": h[W_VERSION],
            "creator_pid": h[W_CREATOR_PID],
            "creator_start_ns": h[W_CREATOR_START],
            "creator_ppid": h[W_CREATOR_PPID],
            "writer_pid": h[W_WRITER_PID],
            "publish_count": h[W_PUBLISH_COUNT],
            "last_publish_ns": h[W_PUBLISH_NS],
            "create_ns": h[W_CREATE_NS],
            "payload_bytes": h[W_PAYLOAD_BYTES],
            "shm_bytes": self.memory.segment.size,
            "num_slots": self.memory.num_slots,
        }

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version={self.version}"
        return f"WeightStore(name={self.name!r}, {state}, nbytes={self.nbytes})"

    # -- writing --------------------------------------------------------------------------------
    def publish(self, source: Any, *, version: int | None = None) -> int:
        """Copy ``source``'s weights in and make them visible as one new version.

        Never waits for readers. Only one process may publish into a store at a time: the
        creator holds the writer role from :meth:`create` until :meth:`close` or
        :meth:`release_writer`; another process takes it at its first publish once it is free.
        From CUDA tensors it returns once the copy is queued (see :mod:`shmsync.cuda_publish`);
        the version becomes visible when the bytes are in host memory (:meth:`flush` waits).

        Args:
            source: the same kind of object the store was created from, with the same
                keys, shapes and dtypes (on any device).
            version: publish under this version number instead of the next one (say, the
                trainer's optimizer-step count, or a restored checkpoint's version). It must
                be higher than every version published before; versions may skip, never go
                back.

        Returns:
            The new version.

        Raises:
            WeightMismatchError: a key, shape or dtype differs; nothing is written.
            ValueError: ``version`` is not higher than the last one; nothing is written.
            WriterBusyError: another live process holds the writer role.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> policy = torch.nn.Linear(4, 2)
            >>> with WeightStore.create(policy) as store:
            ...     store.publish(policy), store.publish(policy, version=10), store.version
            (1, 10, 10)
        """
        start = time.perf_counter()
        self._check_open()
        tensors = self._match_source(source, f"weights published to store {self.name!r}")
        if version is not None:
            self._check_next_version(version)
        if not self.memory.segment.held(WRITER_LOCK):
            self._acquire_writer()
        if any(t.is_cuda for t in tensors):
            version = self._publish_from_cuda(tensors, version)
        else:
            if self._cuda_publisher is not None:
                self._cuda_publisher.wait()  # one write at a time: after the one in flight
            version = self._write(tensors, on_cpu=True, version=version)
        self.publish_seconds += time.perf_counter() - start
        return version

    def _match_source(self, source: Any, what: str) -> list[torch.Tensor]:
        """The source's tensors in entry order, checked against the layout (nothing written).
        Destination by destination, without building a nested TensorDict: entries are sorted by
        key, so destinations come in sorted order, as :func:`~shmsync.sources.parts` gives them."""
        tensors = []
        for prefix, part in parts(source, self.memory.destinations, what):
            where = f"{what}, destination {prefix[0]!r}" if prefix else what
            if isinstance(part, nn.Module):
                tensors += self._match_module(part, prefix, where)
            elif isinstance(part, TensorDictBase):
                tensors += self._match_tensordict(part, prefix, where)
            else:
                sub, _ = as_tensordict(part, where)
                tensors += self.memory.layout.match(sub, where, prefix=prefix)
        return tensors

    def _match_tensordict(self, td: TensorDictBase, prefix: tuple[str, ...], what: str) -> list[torch.Tensor]:
        """``layout.match`` for a TensorDict, with a fast path for one checked before: if each of
        its keys still holds the very same tensor, with the same shape and dtype, the full walk
        over its keys is skipped (an update checks, then publishes, the same TensorDict)."""
        plan_key = ("td", id(td), prefix)
        cached = self._plans.get(plan_key)
        if cached is not None:
            ref, paths, before, entries = cached
            if ref() is td and all(
                td.get(path, None) is t and t.shape == e.shape and t.dtype == e.dtype
                for path, t, e in zip(paths, before, entries)
            ):
                return list(before)
        sub, _ = as_tensordict(td, what)
        tensors = self.memory.layout.match(sub, what, prefix=prefix)
        if sub is td:  # keys as stored (not a flat state-dict-like TensorDict)
            layout = self.memory.layout
            entries = [layout.entries[i] for i in layout.subset(prefix)]
            paths = [e.key[len(prefix) :] for e in entries]
            if len(self._plans) >= 32:  # TensorDicts made afresh for each update must not pile up
                self._plans.pop(next(iter(self._plans)))
            self._plans[plan_key] = (weakref.ref(td), paths, tensors, entries)
        return tensors

    def _match_module(self, module: nn.Module, prefix: tuple[str, ...], what: str) -> list[torch.Tensor]:
        """Like ``layout.match(TensorDict.from_module(module))``, with a fast path for a module
        published before: if it still holds the very same tensors, in the same places, with the
        same shapes and dtypes, the full check is skipped."""
        owned = _owned_tensors(module)
        cached = self._plans.get((id(module), prefix))
        if cached is not None:
            ref, before, order, entries = cached
            if (
                ref() is module
                and len(owned) == len(before)
                and all(a is b for a, b in zip(owned, before))
                and all(
                    owned[i].shape == e.shape and owned[i].dtype == e.dtype and not owned[i].is_meta
                    for i, e in zip(order, entries)
                )
            ):
                return [owned[i] for i in order]
        tensors = self.memory.layout.match(module_weights(module), what, prefix=prefix)
        position = {id(t): i for i, t in enumerate(owned)}
        if len(position) == len(owned) and all(id(t) in position for t in tensors):
            entries = [self.memory.layout.entries[i] for i in self.memory.layout.subset(prefix)]
            order = [position[id(t)] for t in tensors]
            self._plans[(id(module), prefix)] = (weakref.ref(module), owned, order, entries)
        return tensors

    def check(self, source: Any, *, version: int | None = None) -> None:
        """Raise what :meth:`publish` would raise for ``source``'s keys, shapes and dtypes (and
        for ``version``), writing nothing; for checking a whole set of stores before publishing
        into any.

        Raises:
            WeightMismatchError: a key, shape or dtype differs.
            ValueError: ``version`` is not higher than the last one.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     store.check(torch.nn.Linear(4, 2))  # fine: returns None
            ...     store.check(torch.nn.Linear(3, 2))
            Traceback (most recent call last):
            ...
            shmsync.errors.WeightMismatchError: ...
        """
        self._check_open()
        self._match_source(source, f"weights for store {self.name!r}")
        if version is not None:
            self._check_next_version(version)

    def _check_next_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"store {self.name!r}: version must be an int, got {type(version).__name__}")
        last = self._last_version()
        if version <= last:
            raise ValueError(
                f"store {self.name!r}: version {version} is not higher than the last published version {last}; "
                "versions only go up"
            )

    def _last_version(self) -> int:
        """The newest version published by this process, including a CUDA publish still in flight."""
        publisher = self._cuda_publisher
        pending = publisher.pending_version if publisher is not None else None
        return max(self.memory.header[W_VERSION], pending if pending is not None else -1)

    def _publish_from_cuda(self, tensors: list[torch.Tensor], version: int | None = None) -> int:
        # Returns once the copy is queued; the version turns visible when it has landed.
        from shmsync.cuda_publish import AsyncPublisher

        device = next(t.device for t in tensors if t.is_cuda)
        publisher = self._cuda_publisher
        if publisher is None or publisher.device != device:
            if publisher is not None:
                publisher.wait()
            self.memory.pin_for_cuda()
            publisher = self._cuda_publisher = AsyncPublisher(self.memory, device)
        return publisher.publish(tensors, version)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until everything published from this process is visible to readers.

        Publishing from CUDA tensors returns before the device-to-host copy has finished;
        this waits for it. Returns the version readers now see.
        """
        if self._cuda_publisher is not None:
            self._cuda_publisher.wait(timeout)
        return self.version

    def release_writer(self) -> None:
        """Give up the writer role so another process may publish (after a CUDA publish still
        in flight has landed: it must not complete under the next writer)."""
        if self._cuda_publisher is not None:
            self._cuda_publisher.wait()
        if self.memory.segment.held(WRITER_LOCK):
            self.memory.segment.unlock(WRITER_LOCK)

    def _acquire_writer(self) -> None:
        if not self.memory.segment.lock(WRITER_LOCK, exclusive=True, wait=False):
            raise WriterBusyError(
                f"store {self.name!r} is being published by another process (last writer pid "
                f"{self.memory.header[W_WRITER_PID]}); one process publishes at a time: publish from "
                "that process, or call release_writer()/close() there first"
            )

    def _write(self, tensors: list[torch.Tensor], on_cpu: bool | None = None, version: int | None = None) -> int:
        protocol = self.memory.protocol
        write = protocol.begin_write()
        try:
            copy_all(self.memory.slots[write.slot], tensors, on_cpu)
        except BaseException:
            protocol.abort(write)
            raise
        return protocol.commit(write, version)

    # -- raw bytes (for moving whole versions between hosts) ------------------------------------
    @property
    def layout_description(self) -> bytes:
        """The store's layout (keys, shapes, dtypes and byte offsets, destinations), as bytes:
        two stores with equal descriptions hold their versions as the same bytes."""
        return self.memory.layout.to_json(self.memory.destinations)

    def read_bytes(self, out: Any, timeout: float = 60.0) -> int:
        """Copy the newest complete version's bytes (:attr:`nbytes` of them, in this store's
        layout) into ``out``, a writable buffer (a ``bytearray``, a memoryview); returns its version.

        Raises:
            ValueError: ``out`` is not a writable buffer of :attr:`nbytes` bytes.
            ReloadTimeoutError: no complete copy could be made within ``timeout`` seconds.
        """
        self._check_open()
        target = memoryview(out).cast("B")
        if target.readonly or target.nbytes != self.nbytes:
            raise ValueError(f"read_bytes(out): want a writable buffer of {self.nbytes} bytes, got {target.nbytes}")
        memory = self.memory

        def copy(slot: int) -> None:
            with memory.slot_buffer(slot) as source:
                target[:] = source

        return memory.protocol.read(copy, timeout=timeout)

    def publish_bytes(self, fill: Callable[[memoryview], None], *, version: int) -> int:
        """Publish a version whose bytes ``fill(buffer)`` writes straight into a free slot.

        ``buffer`` is a writable memoryview of :attr:`nbytes` bytes in this store's layout (see
        :attr:`layout_description`), valid while ``fill`` runs: a relay receives another host's
        version into it, with no copy in between. If ``fill`` raises, the slot is left empty and
        nothing is published.

        Returns:
            ``version``.

        Raises:
            ValueError: ``version`` is not higher than the last one; nothing is written.
            WriterBusyError: another live process holds the writer role.
        """
        self._check_open()
        self._check_next_version(version)
        if not self.memory.segment.held(WRITER_LOCK):
            self._acquire_writer()
        if self._cuda_publisher is not None:
            self._cuda_publisher.wait()
        protocol = self.memory.protocol
        write = protocol.begin_write()
        try:
            with self.memory.slot_buffer(write.slot, writable=True) as buffer:
                fill(buffer)
        except BaseException:
            protocol.abort(write)
            raise
        return protocol.commit(write, version)

    def add_publish_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(version)`` each time a version published from this process becomes
        visible, in the thread that made it visible, right after (a relay's sender wakes on it
        instead of polling). It must return at once and never raise."""
        self.memory.protocol.listeners.append(listener)

    def remove_publish_listener(self, listener: Callable[[int], None]) -> None:
        """Undo :meth:`add_publish_listener`."""
        if listener in self.memory.protocol.listeners:
            self.memory.protocol.listeners.remove(listener)

    # -- reading --------------------------------------------------------------------------------
    def snapshot(self, timeout: float = 60.0) -> Snapshot:
        """A private copy of the newest complete version.

        Returns:
            ``Snapshot(version, weights)``; ``weights`` is a TensorDict shaped like the source
            (keyed by destination for a multi-destination store).

        Raises:
            ReloadTimeoutError: no complete copy could be made within ``timeout`` seconds.
        """
        self._check_open()
        memory = self.memory
        tensors = [torch.empty(e.shape, dtype=e.dtype) for e in memory.layout.entries]
        version = memory.protocol.read(lambda slot: copy_all(tensors, memory.slots[slot]), timeout=timeout)
        return Snapshot(version, memory.layout.as_tensordict(tensors))

    @property
    def retries(self) -> int:
        """Optimistic copies in this process that failed validation (and were retried)."""
        return self.memory.protocol.retries

    @property
    def pinned_reads(self) -> int:
        """Reads in this process that needed the pinned fallback."""
        return self.memory.protocol.pinned_reads

    def readers(self, *, processes: bool = False, memory: bool | None = None) -> ReaderTable:
        """The readers' table: every reader attached in a live process, worst lagging first, and
        the readers on other hosts that relays report to this process (see :mod:`shmsync.table`).

        Reading it sends no message and never waits for a reader (about a microsecond a reader).

        Args:
            processes: also look up each local reader's process state and private memory (USS),
                about 0.5 ms a reader.
            memory: look up the private memory (default: as ``processes``); the state alone
                takes about 0.05 ms a reader.

        Returns:
            A :class:`~shmsync.table.ReaderTable`: ``len()`` and iteration go over the live readers.

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     _ = reader.poll()
            ...     [(row.version, row.behind, row.mode) for row in store.readers()]
            [(0, 0, 'copy')]
        """
        mapped = self.memory
        latest = mapped.header[W_VERSION]
        live, gone = local_rows(
            self.name, mapped.header, mapped.protocol.locks.rows_alive, latest, processes=processes, memory=memory
        )
        return assemble(self.name, latest, live, gone, self)

    def publisher_alive(self) -> bool:
        """Whether a live process can still publish: some process holds the writer role, or the
        creator still has the store open. False once the trainer is gone for good. Told by the
        kernel's locks, whatever PID namespace the trainer runs in.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     store.publisher_alive()
            True
        """
        if self.closed:
            return False
        segment = self.memory.segment
        return segment.held_anywhere(WRITER_LOCK) or segment.held_anywhere(CREATOR_LOCK)

    # -- lifetime -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ShmSyncError(f"store {self.name!r} is closed in this process")

    def close(self) -> None:
        """Let go of the store in this process (and unlink it, if this process created it with
        ``unlink_at_exit=True``). Other processes keep their mapping. Waits for a CUDA publish
        still in flight; ``version`` and :meth:`info` still tell the last state afterwards."""
        if not self.closed:
            for dependent in list(self._dependents):
                dependent.close()  # say, readers: private copies, leases given back, while mapped
            if self._cuda_publisher is not None:
                self._cuda_publisher.wait()
                self._cuda_publisher = None
            self.memory.close()

    def add_dependent(self, obj: Any) -> None:
        """Call ``obj.close()`` when this store is closed, before its memory goes (``obj`` is held
        weakly): for objects that view the store's memory, such as zero-copy readers."""
        self._dependents.add(obj)

    def unlink(self) -> None:
        """Remove the store's name from the host: no new process can attach. Mappings that
        exist stay valid until closed."""
        self.memory.segment.unlink()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            self.unlink()
        self.close()


def _check_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")


def _owned_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer object of ``module``, in registration order."""
    return [
        t
        for m in module.modules()
        for _, t in (
            *m.named_parameters(recurse=False, remove_duplicate=False),
            *m.named_buffers(recurse=False, remove_duplicate=False),
        )
        if t is not None
    ]


__all__ = ["WeightStore", "Snapshot"]
