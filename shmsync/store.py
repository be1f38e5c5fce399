"""The weight store: versioned copies of a model's weights in host shared memory.

Protocol
--------
A store has ``N >= 2`` slots (3 by default), each a full copy of the weights, and a
header of int64 words: ``version`` (the last completed version), ``latest`` (the slot
holding it), and per slot a sequence number ``seq[i]`` and the version it holds.

Writer (one process at a time, enforced by a lock the kernel drops if it dies)::

    target = a slot that is neither `latest`, nor pinned, nor leased (the least recently written)
    seq[target] += 1            # odd: being written; then a full fence, and back off if leased
    copy the weights into target
    slot_version[target] = v; seq[target] += 1   # even: complete
    latest = target; version = v

The writer never reads anything a reader writes except three pin words and the
per-slot lease counts, and never waits: publishing is a copy plus a handful of word
stores. Zero-copy readers lease a slot instead of copying it (see :mod:`shmsync._leases`).

Reader, optimistic path (seqlock validation)::

    s = seq[latest]; v = slot_version[latest]; copy the slot; valid iff seq is still s

A slot is rewritten only once it is no longer ``latest``; with 3 slots the writer
must finish two whole publishes and start a third while one reader copy runs before
that copy is invalidated, so retries are rare. Validation guarantees that a reader
never *accepts* a mixed copy, whatever the timing.

Reader, bounded fallback (slot pinning): after ``max_attempts`` failed optimistic
copies a reader takes the store's single reader token (a kernel lock, released if
the reader dies) and asks the writer to pin a slot by writing a fresh ticket into
``pin_request``. At the start of its next publish the writer sets
``pin_slot = latest`` (or a slot leased by a zero-copy reader, already safe from it)
and ``pin_grant = ticket``, and from then on never writes
into ``pin_slot`` until ``pin_release == pin_grant``. With 3 slots there is always
a slot that is neither latest nor pinned, so the writer still never waits, and the
pinned reader's copy cannot be invalidated: it completes in one copy. A writer that
is idle grants nothing, but then an optimistic copy succeeds, so the reader keeps
trying those while it waits. A reader that dies while pinned only costs the writer
one slot until the next ticket replaces its pin. A reader that is stopped (SIGSTOP)
while holding the token cannot block the others either: the holder writes its pid into
``token_pid``, and once it is seen stopped the others issue a ticket without the token,
which moves the pin; the stopped reader's copy, if it ever resumes, fails validation and
is retried. A holder that runs, however slowly, keeps its pin: its copy completes, so the
next reader waits at most one copy of it for the token (two slow readers taking the pin
off each other would never finish).

Ordering: on x86-64 stores become visible in program order and loads are not
reordered with other loads, which is all this protocol needs between its word
stores and the bulk copies; elsewhere a full fence is issued at the marked points.

A writer killed in the middle of a copy leaves ``seq[target]`` odd and ``latest``
untouched: readers keep loading the last complete version, and the next writer
rewrites that slot from scratch.
"""

from __future__ import annotations

import os
import platform
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import psutil
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from . import _leases
from ._header import (
    FORMAT,
    MAGIC,
    MAX_READERS,
    MAX_SLOTS,
    READER_WORDS,
    W_CREATE_NS,
    W_CREATOR_PID,
    W_CREATOR_PPID,
    W_CREATOR_START,
    W_DATA_OFFSET,
    W_FORMAT,
    W_LATEST,
    W_LAYOUT_BYTES,
    W_LAYOUT_OFFSET,
    W_LEASES,
    W_MAGIC,
    W_NUM_SLOTS,
    W_PAYLOAD_BYTES,
    W_PIN_GRANT,
    W_PIN_RELEASE,
    W_PIN_REQUEST,
    W_PIN_SLOT,
    W_PUBLISH_COUNT,
    W_PUBLISH_NS,
    W_READERS,
    W_SEQ,
    W_SLOT_BYTES,
    W_SLOT_VERSION,
    W_TOKEN_PID,
    W_VERSION,
    W_WRITER_PID,
    header_view,
    reader_rows,
)
from ._layout import Layout, segment_bytes
from ._leases import full_fence
from ._segment import TOKEN_LOCK, WRITER_LOCK, Segment, conflicting_lock
from ._source import as_tensordict, module_weights
from .errors import ReloadTimeoutError, ShmSyncError, StoreNotFoundError, WeightMismatchError, WriterBusyError
from .host import pid_alive

if platform.machine() in ("x86_64", "AMD64", "i386", "i686"):

    def _fence() -> None:
        pass

else:  # weakly ordered CPUs: a lock round trip is a full barrier
    _FENCE_LOCK = threading.Lock()

    def _fence() -> None:
        with _FENCE_LOCK:
            pass


CopyFn = Callable[[int], None]  # copies out of the slot with that index


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger); False for 0 or a running one."""
    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


class Snapshot(NamedTuple):
    """A private copy of one complete version."""

    version: int
    weights: TensorDict


def process_start_ns(pid: int) -> int:
    """Start time of ``pid`` in ns (0 if it does not exist): tells a reused pid apart."""
    try:
        return int(psutil.Process(pid).create_time() * 1e9)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def _release(segment: Segment, views: tuple[list, ...], creator_pid: int, unlink: bool, pinned: list) -> None:
    if pinned:
        from ._cuda import unregister_host

        for ptr, _view in pinned:
            unregister_host(ptr)  # before the memory is unmapped
        pinned.clear()
    for v in views:
        v.clear()
    if unlink and os.getpid() == creator_pid:
        segment.unlink()
    try:
        segment.close()
    except BufferError:
        pass  # tensors of the caller still view the mapping; it goes when they do


class WeightStore:
    """Versioned weights in host shared memory, published by one process, read by many.

    Create it in the trainer with :meth:`create`; open it elsewhere with :meth:`attach`
    or by pickling it to a child process. :meth:`publish` copies new weights in and
    makes them visible as one new version; readers (:class:`~shmsync.WeightReader`)
    load the newest complete version, never a mix of two.

    Examples:
        >>> import torch
        >>> from shmsync import WeightStore
        >>> policy = torch.nn.Linear(4, 2)
        >>> with WeightStore.create(policy) as store:
        ...     v = store.publish(policy)
        ...     reader = store.reader(torch.nn.Linear(4, 2))
        ...     reader.poll(), reader.version == v
        (True, True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Not called directly: use :meth:`WeightStore.create` (trainer) or :meth:`WeightStore.attach`."""
        raise TypeError("make a store with WeightStore.create(source) or open one with WeightStore.attach(name)")

    @classmethod
    def _open(cls, segment: Segment, *, owner: bool, unlink_at_exit: bool) -> WeightStore:
        self = cls.__new__(cls)
        self._segment = segment
        buf = segment.buf
        self._hdr = h = header_view(buf)
        magic, fmt = h[W_MAGIC], h[W_FORMAT]
        if magic != MAGIC or fmt != FORMAT:
            h.release()  # so the caller can unmap
            if magic != MAGIC:
                raise StoreNotFoundError(f"{segment.name!r} is not a shmsync store, or it is still being created")
            raise ShmSyncError(f"store {segment.name!r} has format {fmt}, this shmsync reads {FORMAT}")
        lo, ln = h[W_LAYOUT_OFFSET], h[W_LAYOUT_BYTES]
        self._layout, self._destinations = Layout.from_json(bytes(buf[lo : lo + ln]))
        self._num_slots = h[W_NUM_SLOTS]
        data, stride = h[W_DATA_OFFSET], h[W_SLOT_BYTES]
        self._slots = [self._layout.slot_views(buf, data + i * stride) for i in range(self._num_slots)]
        self._ro_slots: list[list[torch.Tensor]] = []  # read-only twins, made on first use
        self._zero_copy_readers: weakref.WeakSet = weakref.WeakSet()  # closed before the store
        self._owner = owner
        self.retries = 0  # optimistic copies that failed validation in this process
        self.pinned_reads = 0  # reads that needed the pinned fallback in this process
        self.publish_seconds = 0.0  # time spent in publish() by this process
        self._pinned: list = []  # (pointer, view) of page-locked memory, for CUDA copies
        self._cuda_publisher = None
        self._plans: dict = {}  # (id(module), prefix) -> what _match_module checked last time
        self._finalizer = weakref.finalize(
            self,
            _release,
            segment,
            (self._slots, self._ro_slots),
            h[W_CREATOR_PID],
            owner and unlink_at_exit,
            self._pinned,
        )
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
    ) -> WeightStore:
        """Allocate a store shaped like ``source`` and publish its weights as version 0.

        Args:
            source: an ``nn.Module`` (its parameters and buffers), a ``TensorDict``, or a
                mapping ``{destination: module or TensorDict}``. Several destinations live
                in one store and are published together under one version. Tensors may be
                on any device; the store always lives in host shared memory.
            name: a name to attach by. Default: a unique name, so concurrent test
                processes never collide.
            num_slots: copies kept. 3 (the default) guarantees that no reader starves
                however fast the writer publishes; 2 saves memory but readers may have to
                wait for a pause in publishing. Zero-copy readers (see
                :class:`~shmsync.WeightReader`) may lease at most ``num_slots - 2``
                distinct slots at once; those that cannot lease copy.
            unlink_at_exit: remove the shared memory when this process exits or the
                store is garbage collected. Existing readers keep their mapping.

        Returns:
            The store, open in this process, at version 0; this process holds its writer role.

        Raises:
            FileExistsError: ``name`` is taken.
            WeightMismatchError: ``source`` holds no tensors, or tensors on ``meta``.
        """
        if not 2 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be between 2 and {MAX_SLOTS}, got {num_slots}")
        td, destinations = as_tensordict(source, "WeightStore.create() source")
        layout = Layout.from_tensordict(td)
        tensors = layout.match(td, "weights given to WeightStore.create()")
        doc = layout.to_json(destinations)
        layout_offset, data_offset, size = segment_bytes(doc, layout.slot_bytes, num_slots)
        name = f"{os.getpid()}-{secrets.token_hex(6)}" if name is None else name
        segment = Segment.create(name, size, track=unlink_at_exit)
        h = header_view(segment.buf)
        try:
            segment.buf[layout_offset : layout_offset + len(doc)] = doc
            pid = os.getpid()
            for word, value in (
                (W_FORMAT, FORMAT),
                (W_VERSION, -1),
                (W_LATEST, 0),
                (W_NUM_SLOTS, num_slots),
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
            for i in range(num_slots):
                h[W_SLOT_VERSION + i] = -1
            _fence()
            h[W_MAGIC] = MAGIC  # last: attach() refuses a half-initialised header
            h.release()
            store = cls._open(segment, owner=True, unlink_at_exit=unlink_at_exit)
        except BaseException:
            h.release()
            segment.unlink()
            segment.close()
            raise
        # The creator keeps the writer role: no other process can lock the trainer out by
        # publishing first. It publishes from elsewhere after release_writer() here.
        with store._writer_role(keep=True):
            store._write(tensors)
        return store

    @classmethod
    def attach(cls, name: str) -> WeightStore:
        """Open the store called ``name`` from any process on this host.

        Raises:
            StoreNotFoundError: there is no such store (or it was unlinked).
        """
        segment = Segment.open(name)
        try:
            return cls._open(segment, owner=False, unlink_at_exit=False)
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
        return self._segment.name

    @property
    def version(self) -> int:
        """The last completed version (monotonic; 0 is the weights given to :meth:`create`)."""
        return self._hdr[W_VERSION]

    @property
    def destinations(self) -> tuple[str, ...] | None:
        """The destination names when created from a mapping, else None."""
        return self._destinations

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the weights."""
        return self._hdr[W_PAYLOAD_BYTES]

    @property
    def shm_bytes(self) -> int:
        """Bytes of shared memory the store occupies (header and all slots)."""
        return self._segment.size

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def keys(self) -> list[str]:
        """Dotted keys of every tensor in the store."""
        return [".".join(e.key) for e in self._layout.entries]

    def info(self) -> dict[str, int]:
        """Header facts: version, creator and writer pids, publish count and times (ns)."""
        h = self._hdr
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
            "shm_bytes": self._segment.size,
            "num_slots": self._num_slots,
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
        From CUDA tensors it returns once the copy is queued (see :mod:`shmsync._cuda`);
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
        if not self._segment.held(WRITER_LOCK):
            self._acquire_writer()
        if any(t.is_cuda for t in tensors):
            version = self._publish_from_cuda(tensors, version)
        else:
            version = self._write(tensors, on_cpu=True, version=version)
        self.publish_seconds += time.perf_counter() - start
        return version

    def _match_source(self, source: Any, what: str) -> list[torch.Tensor]:
        """The source's tensors in entry order, checked against the layout (nothing written)."""
        dests = self._destinations
        if dests is None and isinstance(source, nn.Module):
            return self._match_module(source, (), what)
        if (
            isinstance(source, Mapping)
            and not isinstance(source, TensorDictBase)
            and not any(isinstance(v, torch.Tensor) for v in source.values())
        ):
            # A mapping of destinations (not a state dict): name the mismatch plainly.
            if dests is None:
                raise WeightMismatchError(
                    f"{what}: the store was created from a single module, without destinations, but got "
                    f"destinations {sorted(map(str, source))}; create the store from that mapping "
                    f"(WeightStore.create({{{', '.join(repr(str(k)) + ': ...' for k in source)}}})) or publish the "
                    "module itself"
                )
            if set(source) != set(dests):
                raise WeightMismatchError(
                    f"{what}: the store holds destinations {sorted(dests)}, got {sorted(map(str, source))}"
                )
        if dests is not None and isinstance(source, Mapping) and source.keys() == set(dests):
            # One destination at a time, without building a nested TensorDict. Entries are
            # sorted by key, so destinations come in sorted order.
            tensors = []
            for dest in sorted(dests):
                value, where = source[dest], f"{what}, destination {dest!r}"
                if isinstance(value, nn.Module):
                    tensors += self._match_module(value, (dest,), where)
                else:
                    sub, _ = as_tensordict(value, where)
                    tensors += self._layout.match(sub, where, prefix=(dest,))
            return tensors
        td, _ = as_tensordict(source, what)
        return self._layout.match(td, what)

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
        tensors = self._layout.match(module_weights(module), what, prefix=prefix)
        position = {id(t): i for i, t in enumerate(owned)}
        if len(position) == len(owned) and all(id(t) in position for t in tensors):
            entries = [self._layout.entries[i] for i in self._layout.subset(prefix)]
            order = [position[id(t)] for t in tensors]
            self._plans[(id(module), prefix)] = (weakref.ref(module), owned, order, entries)
        return tensors

    def check(self, source: Any) -> None:
        """Raise what :meth:`publish` would raise for ``source``'s keys, shapes and dtypes,
        writing nothing; for checking a whole set of stores before publishing into any.

        Raises:
            WeightMismatchError: a key, shape or dtype differs.

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
        return max(self._hdr[W_VERSION], pending if pending is not None else -1)

    def _publish_from_cuda(self, tensors: list[torch.Tensor], version: int | None = None) -> int:
        # Returns once the copy is queued; the version turns visible when it has landed.
        from ._cuda import AsyncPublisher

        device = next(t.device for t in tensors if t.is_cuda)
        publisher = self._cuda_publisher
        if publisher is None or publisher.device != device:
            if publisher is not None:
                publisher.wait()
            self._ensure_pinned()
            publisher = self._cuda_publisher = AsyncPublisher(self, device)
        return publisher.publish(tensors, version)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until everything published from this process is visible to readers.

        Publishing from CUDA tensors returns before the device-to-host copy has finished;
        this waits for it. Returns the version readers now see.
        """
        if self._cuda_publisher is not None:
            self._cuda_publisher.wait(timeout)
        return self.version

    def _ensure_pinned(self) -> None:
        """Page-lock the slots in this process (once), so CUDA copies are asynchronous DMA."""
        if self._pinned or not torch.cuda.is_available():
            return
        from ._cuda import register_host

        h = self._hdr
        region = torch.frombuffer(
            self._segment.buf, dtype=torch.uint8, count=h[W_SLOT_BYTES] * self._num_slots, offset=h[W_DATA_OFFSET]
        )
        self._pinned.append((register_host(region), region))

    def release_writer(self) -> None:
        """Give up the writer role so another process may publish."""
        if self._segment.held(WRITER_LOCK):
            self._segment.unlock(WRITER_LOCK)

    def _acquire_writer(self) -> None:
        if not self._segment.lock(WRITER_LOCK, exclusive=True, wait=False):
            raise WriterBusyError(
                f"store {self.name!r} is being published by another process (last writer pid "
                f"{self._hdr[W_WRITER_PID]}); one process publishes at a time: publish from "
                "that process, or call release_writer()/close() there first"
            )

    class _WriterRole:
        def __init__(self, store: WeightStore, keep: bool) -> None:
            self.store, self.keep = store, keep

        def __enter__(self) -> None:
            self.had = self.store._segment.held(WRITER_LOCK)
            if not self.had:
                self.store._acquire_writer()

        def __exit__(self, *exc) -> None:
            if not self.had and not self.keep:
                self.store.release_writer()

    def _writer_role(self, keep: bool) -> WeightStore._WriterRole:
        return WeightStore._WriterRole(self, keep)

    def _choose_target(self, backed_off: tuple[int, ...] = ()) -> int | None:
        """Serve a pending pin request, then pick the slot to write (None if every slot but
        the latest is leased or backed off from). Never waits."""
        h = self._hdr
        request = h[W_PIN_REQUEST]
        if request != h[W_PIN_GRANT]:
            h[W_PIN_SLOT] = self._pin_candidate()
            _fence()
            h[W_PIN_GRANT] = request
        pinned = h[W_PIN_SLOT] if h[W_PIN_RELEASE] != h[W_PIN_GRANT] else -1
        latest = h[W_LATEST] if h[W_VERSION] >= 0 else -1
        others = [s for s in range(self._num_slots) if s != latest and s not in backed_off]
        free = [s for s in others if not h[W_LEASES + s]]
        if not free:  # a count may be too high: the rows tell (see _leases.py)
            free = [s for s in others if not _leases.row_leased(h, s)]
        candidates = [s for s in free if s != pinned] or free  # 2 slots and a pin: the pinned reader retries
        return min(candidates, key=lambda s: h[W_SLOT_VERSION + s]) if candidates else None

    def _pin_candidate(self) -> int:
        """The slot to pin for a starving reader: a slot leased by a zero-copy reader if there
        is one besides the latest (it is already safe from the writer, so the pin costs no
        slot; its version is older but complete), else the latest."""
        h = self._hdr
        latest = h[W_LATEST]
        for s in range(self._num_slots):
            if s != latest and h[W_LEASES + s] and not h[W_SEQ + s] & 1 and _leases.row_leased(h, s):
                return s
        return latest

    def _begin_write(self) -> tuple[int, int]:
        h = self._hdr
        backed_off: tuple[int, ...] = ()
        for _ in range(1000):
            target = self._choose_target(backed_off)
            if target is None:
                if not backed_off:  # at most num_slots - 2 slots are leased: unreachable
                    raise ShmSyncError(f"store {self.name!r}: every slot but the latest is leased by a reader")
                backed_off = ()  # those leases may have been brief: look again
                continue
            seq = h[W_SEQ + target]
            odd = seq + 2 if seq & 1 else seq + 1  # odd already: a writer died mid-copy
            h[W_SEQ + target] = odd
            full_fence()  # the store above before the lease loads below (see _leases.py)
            if not h[W_LEASES + target] or not _leases.row_leased(h, target):
                return target, odd
            h[W_SEQ + target] = odd + 1  # a reader leased it meanwhile: leave it, untouched
            backed_off += (target,)
        raise ShmSyncError(f"store {self.name!r}: readers kept leasing every free slot")

    def _end_write(self, target: int, odd: int, version: int | None = None) -> int:
        h = self._hdr
        if version is None:
            version = h[W_VERSION] + 1
        h[W_SLOT_VERSION + target] = version
        _fence()
        h[W_SEQ + target] = odd + 1
        h[W_LATEST] = target
        h[W_VERSION] = version
        h[W_PUBLISH_NS] = time.time_ns()
        h[W_WRITER_PID] = os.getpid()
        h[W_PUBLISH_COUNT] += 1
        return version

    def _write(self, tensors: list[torch.Tensor], on_cpu: bool | None = None, version: int | None = None) -> int:
        target, odd = self._begin_write()
        _copy_all(self._slots[target], tensors, on_cpu)
        return self._end_write(target, odd, version)

    # -- reading --------------------------------------------------------------------------------
    def _read(
        self,
        copy: CopyFn,
        *,
        max_attempts: int = 2,
        timeout: float = 60.0,
    ) -> int:
        """Run ``copy(slot_views)`` on the newest complete slot until one copy validates.

        ``copy(slot)`` must have finished reading that slot when it returns. Returns the version
        copied. Optimistic copies are tried ``max_attempts`` times, then the pinned
        fallback (see the module docstring) bounds the wait.
        """
        self._check_open()
        for _ in range(max_attempts):
            version = self._try_read(copy)
            if version is not None:
                return version
        return self._read_pinned(copy, time.monotonic() + timeout)

    def _try_read(self, copy: CopyFn) -> int | None:
        h = self._hdr
        slot = h[W_LATEST]
        seq = h[W_SEQ + slot]
        if seq & 1:
            return None  # `latest` moved on and that slot is already being rewritten
        version = h[W_SLOT_VERSION + slot]
        _fence()
        copy(slot)
        _fence()
        if h[W_SEQ + slot] != seq:
            self.retries += 1
            return None
        return version

    def _read_pinned(self, copy: CopyFn, deadline: float, steal_after: float = 0.25) -> int:
        h, segment = self._hdr, self._segment
        self.pinned_reads += 1
        waited_since = time.monotonic()
        looked = 0.0
        token = segment.lock(TOKEN_LOCK, exclusive=True, wait=False)
        while not token:
            # Another reader holds the token; it finishes in one copy. Keep trying meanwhile.
            version = self._try_read(copy)
            if version is not None:
                return version
            self._check_deadline(deadline, "waiting for the reader token")
            now = time.monotonic()
            if now - waited_since > steal_after and now - looked > 0.05:
                looked = now
                if _stopped(h[W_TOKEN_PID]):
                    # Its holder is stopped (a dead one has lost the token already): take over
                    # the pin without the token. Never from a holder that runs, however slowly:
                    # two slow readers would take the pin off each other without end.
                    break
            time.sleep(0.0005)
            token = segment.lock(TOKEN_LOCK, exclusive=True, wait=False)
        if token:
            h[W_TOKEN_PID] = os.getpid()
        try:
            while True:
                ticket = h[W_PIN_REQUEST] + 1
                h[W_PIN_REQUEST] = ticket
                try:
                    version = self._await_pin(copy, ticket, deadline)
                finally:
                    h[W_PIN_RELEASE] = ticket  # a newer ticket's pin stays active: GRANT != this
                if version is not None:
                    return version
        finally:
            if token:
                h[W_TOKEN_PID] = 0
                segment.unlock(TOKEN_LOCK)

    def _await_pin(self, copy: CopyFn, ticket: int, deadline: float) -> int | None:
        h = self._hdr
        published = h[W_PUBLISH_COUNT]
        waited_since = time.monotonic()
        while True:
            if h[W_PIN_GRANT] == ticket:
                _fence()
                slot = h[W_PIN_SLOT]
                seq = h[W_SEQ + slot]
                version = h[W_SLOT_VERSION + slot]
                if seq & 1:
                    return None
                copy(slot)
                _fence()
                return version if h[W_SEQ + slot] == seq else None  # None: 2 slots only
            # No grant yet. A writer that has not published since the request is idle or
            # in a long copy; an optimistic copy then succeeds (or at worst fails once).
            if h[W_PUBLISH_COUNT] == published and time.monotonic() - waited_since > 0.002:
                version = self._try_read(copy)
                if version is not None:
                    return version
                published, waited_since = h[W_PUBLISH_COUNT], time.monotonic()
            self._check_deadline(deadline, "waiting for the writer to pin a slot")
            time.sleep(0.0001)

    def _check_deadline(self, deadline: float, doing: str) -> None:
        if time.monotonic() > deadline:
            raise ReloadTimeoutError(f"store {self.name!r}: no complete version could be read in time ({doing})")

    def snapshot(self) -> Snapshot:
        """A private copy of the newest complete version.

        Returns:
            ``Snapshot(version, weights)``; ``weights`` is a TensorDict shaped like the source
            (keyed by destination for a multi-destination store).
        """
        tensors = [torch.empty(e.shape, dtype=e.dtype) for e in self._layout.entries]
        version = self._read(lambda slot: _copy_all(tensors, self._slots[slot]))
        return Snapshot(version, self._layout.as_tensordict(tensors))

    # -- reader table -------------------------------------------------------------------------
    def _claim_reader_row(self) -> int:
        """A free row of the reader table for this process (-1 if the table is full, or its lock
        stayed busy for seconds: the reader then works without a row, copying, unlisted)."""
        h = self._hdr
        with _leases.TableLock(self._segment, patience=5.0) as locked:
            if not locked:
                return -1
            for row in range(MAX_READERS):
                base = W_READERS + row * READER_WORDS
                pid = h[base]
                if pid == 0 or not pid_alive(pid):
                    # A dead reader's lease stays counted until the next recount: safe.
                    h[base], h[base + 1], h[base + 2], h[base + 3], h[base + 4] = os.getpid(), -1, 0, 0, 0
                    return row
            return -1

    def _update_reader_row(self, row: int, version: int, reloads: int) -> None:
        if row >= 0 and not self.closed:
            base = W_READERS + row * READER_WORDS
            h = self._hdr
            h[base + 1], h[base + 2], h[base + 3] = version, reloads, time.time_ns()

    def _release_reader_row(self, row: int) -> None:
        if row >= 0 and not self.closed:
            self._hdr[W_READERS + row * READER_WORDS] = 0

    # -- leases (zero-copy readers, see _leases.py) ---------------------------------------------
    def _readonly_slots(self) -> list[list[torch.Tensor]]:
        """Per slot, read-only views of every entry (a write through them faults)."""
        if not self._ro_slots:
            h, buf = self._hdr, self._segment.readonly()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self._ro_slots += [
                    self._layout.slot_views(buf, h[W_DATA_OFFSET] + i * h[W_SLOT_BYTES]) for i in range(self._num_slots)
                ]
        return self._ro_slots

    def _lease_latest(self, row: int) -> tuple[int, int] | None:
        """Lease the latest slot for reader ``row`` (dropping its previous lease): ``(slot,
        version)``, or None if refused."""
        self._check_open()
        return _leases.lease_latest(self._hdr, self._segment, row, self._num_slots, pid_alive)

    def _release_lease(self, row: int) -> None:
        if row >= 0 and not self.closed:
            _leases.release(self._hdr, self._segment, row, self._num_slots, pid_alive)

    def readers(self) -> list[dict[str, int]]:
        """Readers attached to this store in live processes: pid, loaded version, reloads,
        the wall-clock time of their last reload (ns), and whether their module views the
        store's memory in place (``zero_copy``)."""
        h = self._hdr
        return [
            {
                "pid": pid,
                "version": version,
                "reloads": reloads,
                "last_reload_ns": last,
                "zero_copy": bool(h[_leases.lease_word(row)]),
            }
            for row, pid, version, reloads, last in reader_rows(h)
            if pid_alive(pid)
        ]

    def publisher_alive(self) -> bool:
        """Whether a live process can still publish: this one holds the writer role, another
        live process does, or the creator lives. False once the trainer is gone for good.

        Examples:
            >>> import torch
            >>> from shmsync import WeightStore
            >>> with WeightStore.create(torch.nn.Linear(4, 2)) as store:
            ...     store.publisher_alive()
            True
        """
        if self.closed:
            return False
        if self._segment.held(WRITER_LOCK) or conflicting_lock(self._segment.fd, WRITER_LOCK):
            return True
        h = self._hdr
        return pid_alive(h[W_CREATOR_PID], h[W_CREATOR_START])

    def reader(self, module: Any, device: torch.device | str | None = None, **kwargs: Any):
        """A :class:`~shmsync.WeightReader` that loads this store into ``module``."""
        from .reader import WeightReader

        return WeightReader(self, module, device=device, **kwargs)

    def sender(self, source: Any, *, root: Any = None):
        """A :class:`~shmsync.WeightSender`: ``update_weights()`` publishes ``source``.

        ``source`` is what :meth:`publish` takes, or a mapping ``{destination: path}`` of
        paths resolved on ``root`` (say, a trainer) at every update.
        """
        from .sender import WeightSender

        return WeightSender(self, source, root=root)

    # -- lifetime -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ShmSyncError(f"store {self.name!r} is closed in this process")

    def close(self) -> None:
        """Let go of the store in this process (and unlink it, if this process created it with
        ``unlink_at_exit=True``). Other processes keep their mapping."""
        if self._finalizer.alive:
            for reader in list(self._zero_copy_readers):
                reader.close()  # private copies, leases given back, while the header is mapped
            if self._cuda_publisher is not None:
                self._cuda_publisher.wait()
                self._cuda_publisher = None
            # Drop this object's views first so the mapping can be unmapped now; keep a
            # private copy of the header so `version` and `info()` still tell the last state.
            mapped, self._hdr = self._hdr, memoryview(bytearray(self._hdr.tobytes())).cast("q")
            mapped.release()
            self._finalizer()

    def unlink(self) -> None:
        """Remove the store's name from the host: no new process can attach. Mappings that
        exist stay valid until closed."""
        self._segment.unlink()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            self.unlink()
        self.close()


def _owned_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer object of ``module``, in registration order."""
    return [t for m in module.modules() for d in (m._parameters, m._buffers) for t in d.values() if t is not None]


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], on_cpu: bool | None = None) -> None:
    """``dst[i].copy_(src[i])`` for all i, batched, without autograd.

    ``on_cpu``: whether no tensor is on CUDA, when the caller already knows (hot paths).
    """
    if on_cpu is None:
        on_cpu = not any(t.is_cuda for t in dst) and not any(t.is_cuda for t in src)
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # what no_grad() does, without its per-call overhead
    try:
        if on_cpu:
            torch._foreach_copy_(dst, src)
        else:
            non_blocking = any(t.is_cuda for t in dst)
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=non_blocking)
            for dev in {t.device for t in (*dst, *src) if t.is_cuda}:
                torch.cuda.current_stream(dev).synchronize()
    finally:
        torch._C._set_grad_enabled(grad)


__all__ = ["WeightStore", "Snapshot"]
