"""Exceptions raised by shmsync."""

from __future__ import annotations


class ShmSyncError(RuntimeError):
    """Base class of shmsync's own runtime errors."""


class StoreNotFoundError(ShmSyncError, FileNotFoundError):
    """No store of that name exists on this host (never created, or already unlinked)."""


class WeightMismatchError(ValueError):
    """Weights do not match the store's layout: a key, shape or dtype differs.

    Raised before anything in shared memory is written.
    """


class WriterBusyError(ShmSyncError):
    """Another live process is already publishing into this store."""


class ReloadTimeoutError(ShmSyncError, TimeoutError):
    """A reader could not load a complete version (or the version it waits for) in time."""


class WriterGoneError(ShmSyncError):
    """No live process can publish into this store any more: the version waited for will never come.

    Its creator is dead and no live process holds the writer role (the trainer was killed).
    """
