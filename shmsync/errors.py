"""Exceptions raised by shmsync, the one warning category of its own, and the one way a deprecated
name says so."""

from __future__ import annotations

import warnings


class ShmSyncError(RuntimeError):
    """Base class of shmsync's own runtime errors."""


class StoreNotFoundError(ShmSyncError, FileNotFoundError):
    """No store of that name exists on this host (never created, or already unlinked)."""


class StoreCorruptError(ShmSyncError, ValueError):
    """A store file, or a layout a peer sent, failed a check: a header word or a layout field is
    out of range. The message names the field and its value; nothing was mapped or written."""


class StoreUntrustedError(ShmSyncError, PermissionError):
    """A store file that someone other than this user could have written: owned by another user,
    writable by its group (without ``SHMSYNC_TRUST_GROUP=1``) or by anyone, a symbolic link, or
    not a regular file. It was not opened for use."""


class InvalidArgumentError(ShmSyncError, ValueError):
    """An argument is out of range, or does not fit what it is used with (the message names it).
    Nothing was done."""


class ArgumentTypeError(ShmSyncError, TypeError):
    """An argument is of a kind that is not accepted here (the message names it and what is).
    Nothing was done."""


class StoreExistsError(ShmSyncError, FileExistsError):
    """A store of that name already exists on this host."""


class WaitTimeoutError(ShmSyncError, TimeoutError):
    """A wait with a deadline ran out: a publish handed over to the store's thread did not land, no
    batch came from any worker (the message says which)."""


class UnknownKeyError(ShmSyncError, KeyError):
    """A key that the store or the collector does not hold."""


class NotSupportedError(ShmSyncError, NotImplementedError):
    """A path shmsync does not support (the message says what to use instead)."""


class MissingExtraError(ShmSyncError, ImportError):
    """An optional dependency is not installed, or an installed one is a release shmsync does not
    support (the message names what to install)."""


class UnknownAttributeError(ShmSyncError, AttributeError):
    """A name that the object at hand does not have (a module path that does not resolve)."""


class SharedMemoryError(ShmSyncError, OSError):
    """The kernel refused to reserve or give back a store's shared memory (``errno`` says why)."""


class WriteTrackingError(ShmSyncError, OSError):
    """The kernel cannot tell which pages of this process were written: write tracking is unavailable
    here (not Linux 6.7 or later, the system call refused, a feature missing, turned off with
    ``SHMSYNC_WRITE_TRACKING=0``), or a scan failed (``errno`` says why). The message says which;
    a caller copies what it would have skipped."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno  # set here: RuntimeError's constructor, first in line, leaves it unset


class WeightMismatchError(ShmSyncError, ValueError):
    """Weights do not match the store's layout: a key, shape or dtype differs.

    Raised before anything in shared memory is written.
    """


class NotLoadedError(ShmSyncError):
    """A module whose weights a :class:`~shmsync.WeightReader` loads was run before its first load
    (its parameters are still on the meta device): call ``poll()`` or ``wait()`` first."""


class SharedWeightsWrittenError(ShmSyncError):
    """This process wrote into parameters that view a store's shared memory (those of a reader
    in place). The write stayed in this process and was undone: no other process
    saw it. A policy that writes its own weights needs a private copy (``zero_copy=False``)."""


class WriterBusyError(ShmSyncError):
    """Another live process is already publishing into this store."""


class ReloadTimeoutError(ShmSyncError, TimeoutError):
    """A reader could not load a complete version (or the version it waits for) in time."""


class WriterGoneError(ShmSyncError):
    """No live process can publish into this store any more: the version waited for will never come.

    Nobody holds its writer role and its creator has let go of it (the trainer was killed).
    """


class WrittenWhileCopiedError(ShmSyncError):
    """The weights were written by another thread each time a copy of them was being made
    (:meth:`~shmsync.WeightStore.publish_if_changed`), so no copy held one state of them. Nothing was
    published: readers keep the newest version."""


class ClosedError(ShmSyncError):
    """What the call needs was closed in this process: a store closed here, or the collector whose
    stores an update would publish into shut down. Nothing was published."""


class NotAttachedError(ShmSyncError):
    """A :class:`~shmsync.ShmWeightSyncScheme` was asked for what only a scheme set up by a
    collector (or by ``init_on_sender``) has: its stores, its workers. It has none yet, or none
    any more once its collector shut down."""


class StaleReaderError(ShmSyncError):
    """A reader fell behind or froze (see :mod:`shmsync.watch.alarm`), raised in the trainer at its next
    publish when the alarm's ``on_stale`` is ``"raise"``. ``event`` says which reader and how.
    Nothing was published by the call that raised it."""

    def __init__(self, message: str, event: object = None) -> None:
        super().__init__(message)
        self.event = event


class RelayError(ShmSyncError, ConnectionError):
    """A relay link failed (see :mod:`shmsync.relay`)."""


class AuthenticationError(RelayError):
    """The peer did not prove that it holds the relay secret (or this side holds another one).
    Nothing was sent to it beyond the handshake."""


class ProtocolError(RelayError):
    """The peer broke the relay protocol: a message of an unknown kind, or a size or number out of
    range. The link was dropped; nothing it sent was published."""


class LinkClosedError(RelayError, EOFError):
    """The peer closed the relay link (or it is being closed here)."""


class LinkTimeoutError(RelayError, TimeoutError):
    """The peer took no bytes, or sent none, within the link's timeout."""


class SecretFileError(ShmSyncError, PermissionError):
    """The relay's secret file is not one only this user can read and write (the message says why)."""


class TrainerGoneError(RelayError):
    """The trainer's :class:`~shmsync.relay.RelaySender` went away (closed, or its process died)."""


class FreshnessWarning(UserWarning):
    """A collector's workers ran older weights than TorchRL's default scheme would have given them
    in the same loop (say, a ``MultiAsyncCollector`` whose trainer updates before it trains). Said
    once per collector; the message names the call and the fix. Every frame still ran exactly
    the version on its tag."""


def warn_deprecated(old: str, new: str, removed_in: str) -> None:
    """Say that ``old`` is deprecated for ``new`` (a :class:`DeprecationWarning` pointing at the
    caller of the alias): every deprecated alias calls this, and docs/api.md lists them.

    Args:
        old: the deprecated name, as the user wrote it (``"WeightStore.table"``).
        new: the name to use instead.
        removed_in: the release that removes ``old``.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_deprecated("Thing.old", "Thing.new", "0.3.0")
        >>> str(caught[0].message)
        'Thing.old is deprecated (removed in 0.3.0): use Thing.new'
    """
    warnings.warn(f"{old} is deprecated (removed in {removed_in}): use {new}", DeprecationWarning, stacklevel=3)
