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

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from shmsync.core.copies import copy_all
from shmsync.core.header import (
    W_CREATE_NS,
    W_CREATOR_PID,
    W_CREATOR_PPID,
    W_CREATOR_START,
    W_PAYLOAD_BYTES,
    W_PUBLISH_COUNT,
    W_PUBLISH_NS,
    W_VERSION,
    W_WRITER_PID,
    header_view,
)
from shmsync.core.layout import Layout
from shmsync.core.mapping import StoreMemory, new_segment, read_layout
from shmsync.core.segment import Segment, default_name, not_found_hint
from shmsync.errors import ShmSyncError, StoreNotFoundError
from shmsync.sources import SourceMatcher, as_tensordict
from shmsync.store_writer import StoreWriter
from shmsync.table import ReaderTable, assemble, local_rows


class Snapshot(NamedTuple):
    """A private copy of one complete version."""

    version: int
    weights: TensorDict


_INFO = {
    "version": W_VERSION,
    "creator_pid": W_CREATOR_PID,
    "creator_start_ns": W_CREATOR_START,
    "creator_ppid": W_CREATOR_PPID,
    "writer_pid": W_WRITER_PID,
    "publish_count": W_PUBLISH_COUNT,
    "last_publish_ns": W_PUBLISH_NS,
    "create_ns": W_CREATE_NS,
    "payload_bytes": W_PAYLOAD_BYTES,
}


class WeightStore(StoreWriter):
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
        self._matcher = SourceMatcher(layout, destinations)
        self._dependents: weakref.WeakSet = weakref.WeakSet()  # closed before the memory goes
        return self

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        source: Any,
        name: str | None = None,
        *,
        num_slots: int = 4,
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
            num_slots: slots of shared memory, each room for one copy of the weights. A slot
                holds memory only while it holds the latest version, the next write, or a
                version a reader runs in place: the others are given back, so the store takes
                two copies while readers keep up, one more per older version a reader holds.
                Readers that run in place (see :class:`~shmsync.WeightReader`) may hold at
                most ``num_slots - 2`` distinct versions at once; those that cannot, copy.
                Default 4: every reader can hold the old version while the next one arrives.
                With 3 or more, no reader starves however fast the writer publishes; 2 may
                make readers wait for a pause in publishing.
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
        check_version(version)
        td, destinations = as_tensordict(source, "WeightStore.create() source")
        layout = Layout.from_tensordict(td)
        tensors = layout.match(td, "weights given to WeightStore.create()")
        name = default_name() if name is None else name
        store = cls._create_empty(layout, destinations, Segment.create, name, num_slots, unlink_at_exit)
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
    def _create_empty(
        cls, layout: Layout, destinations: Any, make_segment: Callable, name: str, num_slots: int, unlink_at_exit: bool
    ) -> WeightStore:
        """A new store with no version yet, this process its creator and writer."""
        segment = new_segment(layout, destinations, make_segment, name, num_slots, track=unlink_at_exit)
        try:
            store = cls._open(segment, layout, destinations, owner=True, unlink_at_exit=unlink_at_exit)
            store._acquire_writer()
        except BaseException:
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

        try:
            segment, (layout, destinations) = Segment.open(name, lambda fd, st: read_layout(fd, st, name))
        except StoreNotFoundError as e:
            raise StoreNotFoundError(f"{e}{not_found_hint(name)}") from None
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
        """Bytes of shared memory the store may take (header and every slot): its file's size."""
        return self.memory.segment.size

    @property
    def resident_bytes(self) -> int:
        """Bytes of memory the store takes now: its header, and the slots that hold pages (the
        latest, the next write's, and those readers hold; the others are given back)."""
        return self.memory.resident_bytes()

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
        facts = {name: h[word] for name, word in _INFO.items()}
        return {
            **facts,
            "shm_bytes": self.memory.segment.size,
            "resident_bytes": self.memory.resident_bytes(),
            "num_slots": self.memory.num_slots,
        }

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version={self.version}"
        return f"WeightStore(name={self.name!r}, {state}, nbytes={self.nbytes})"

    # -- raw bytes (for moving whole versions between hosts) ------------------------------------
    @property
    def layout_description(self) -> bytes:
        """The store's layout (keys, shapes, dtypes and byte offsets, destinations), as bytes:
        two stores with equal descriptions hold their versions as the same bytes."""
        return self.memory.layout.to_json(self.memory.destinations)

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

        Reading it sends no message and never waits for a reader.

        Args:
            processes: also look up each local reader's process state and private memory (USS);
                the docs' Performance page has what each costs.
            memory: look up the private memory (default: as ``processes``).

        Returns:
            A :class:`~shmsync.table.ReaderTable`: ``len()`` and iteration go over the live readers.

        Examples:
            >>> import torch
            >>> from shmsync import WeightReader, WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     reader = WeightReader(store, torch.nn.Linear(4, 2))
            ...     _ = reader.poll()
            ...     [(row.version, row.behind, row.mode) for row in store.readers()]
            [(0, 0, 'zero-copy')]
        """
        mapped = self.memory
        latest = mapped.header[W_VERSION]
        live, gone = local_rows(
            self.name, mapped.header, mapped.protocol.locks.rows_alive, latest, processes=processes, memory=memory
        )
        return assemble(self.name, latest, live, gone, self)

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


def check_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")


__all__ = ["WeightStore", "Snapshot"]
