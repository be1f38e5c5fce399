"""The writer's side of a :class:`~shmsync.WeightStore`: publishing (from the CPU or from CUDA),
checking a source without writing it, and the writer role (one process at a time).

:class:`StoreWriter` is a part of :class:`~shmsync.WeightStore` (its base class), not used alone:
it works on the store's mapping (``memory``), its source matcher and its CUDA publisher.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from shmsync.core.copies import copy_all
from shmsync.core.header import W_VERSION, W_WRITER_PID
from shmsync.core.segment import CREATOR_LOCK, WRITER_LOCK
from shmsync.errors import WriterBusyError


class StoreWriter:
    """Publishing into a store (see :class:`~shmsync.WeightStore`, of which this is a part)."""

    memory: Any
    name: str
    publish_seconds: float
    _matcher: Any
    _cuda_publisher: Any

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
        tensors = self._matcher.match(source, f"weights published to store {self.name!r}")
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
        self._matcher.match(source, f"weights for store {self.name!r}")
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

    def _claim_writer(self) -> None:
        """Hold the writer role (taking it if free), a CUDA publish in flight landed first: one
        write at a time."""
        if not self.memory.segment.held(WRITER_LOCK):
            self._acquire_writer()
        if self._cuda_publisher is not None:
            self._cuda_publisher.wait()

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
        return self.memory.commit(write, version)

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
        if self.memory.closed:
            return False
        segment = self.memory.segment
        return segment.held_anywhere(WRITER_LOCK) or segment.held_anywhere(CREATOR_LOCK)


__all__ = ["StoreWriter"]
