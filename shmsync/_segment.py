"""Named shared-memory segments: files in ``/dev/shm`` mapped into each process.

Files in ``/dev/shm`` are used directly instead of :mod:`multiprocessing.shared_memory`
because the latter registers every attachment with the resource tracker of the
attaching process, which unlinks the segment for everyone when an unrelated
process exits (Python < 3.13). Here only the creator (or ``shmsync gc``) unlinks.

Each segment also carries advisory locks (Linux open-file-description locks,
released by the kernel when the holder dies, however it dies):

* byte 0, shared by every process that has the segment open: lets ``gc`` tell
  whether any live process still holds a store;
* byte 1, exclusive: the writer role;
* byte 2, exclusive: the reader's starvation token (see :mod:`shmsync._protocol`);
* byte 3, exclusive, held for microseconds: changing the reader table (rows, leases).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator

from .errors import StoreNotFoundError

SHM_DIR = os.environ.get("SHMSYNC_DIR", "/dev/shm")
PREFIX = "shmsync-"

HOLDER_LOCK = 0
WRITER_LOCK = 1
TOKEN_LOCK = 2
TABLE_LOCK = 3

_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
# struct flock on 64-bit Linux: short type, short whence, off_t start, off_t len, pid_t pid.
_FLOCK = "hhqqi4x"


def path_of(name: str) -> str:
    """The file that backs store ``name``."""
    return os.path.join(SHM_DIR, PREFIX + name)


def list_names() -> list[str]:
    """Names of every segment on this host, oldest first."""
    try:
        entries = [e for e in os.scandir(SHM_DIR) if e.name.startswith(PREFIX)]
    except FileNotFoundError:
        return []
    dated = []
    for e in entries:
        try:
            dated.append((e.stat().st_mtime_ns, e.name[len(PREFIX) :]))
        except FileNotFoundError:
            continue  # unlinked since the directory was read
    return [name for _, name in sorted(dated)]


def peek(name: str, nbytes: int = 4096) -> bytes | None:
    """The first ``nbytes`` of a segment, read without mapping or locking it (None if gone)."""
    try:
        fd = os.open(path_of(name), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or len(name) > 200:
        raise ValueError(f"invalid store name {name!r}: use 1-200 characters without '/'")
    return name


class Segment:
    """One mapped segment. ``buf`` is the writable mapping; :meth:`readonly` maps it again,
    read-only (for memory that a process must never write: a write there faults)."""

    def __init__(self, name: str, fd: int, size: int, created: bool) -> None:
        self.name = name
        self.fd = fd
        self.size = size
        self.created = created
        self.tracked = False  # multiprocessing's resource tracker unlinks it if we die first
        # This process's threads, beside the OFD locks (which do not exclude threads sharing
        # one file description): per lock byte.
        self.thread_locks = {TOKEN_LOCK: threading.Lock(), TABLE_LOCK: threading.Lock()}
        self.buf = mmap.mmap(fd, size)
        self._readonly: mmap.mmap | None = None
        self._locks: set[int] = set()
        # Every holder takes a shared lock so gc can see the segment is in use.
        self.lock(HOLDER_LOCK, exclusive=False, wait=True)

    @classmethod
    def create(cls, name: str, size: int, *, track: bool = False) -> Segment:
        """Create and map a new segment; with ``track``, it is removed even if this process is
        killed (see :func:`_track`)."""
        path = path_of(validate_name(name))
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise FileExistsError(f"a store named {name!r} already exists ({path})") from None
        try:
            os.ftruncate(fd, size)
            try:
                # Reserve the pages now: a full /dev/shm then fails here with a clear error,
                # not later with SIGBUS in the middle of a publish, and no publish pays page faults.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"cannot reserve {human_bytes(size)} in {SHM_DIR} for store {name!r} ({e.strerror}; "
                    f"{human_bytes(_free_bytes())} free there); free shared memory (`shmsync gc`), "
                    "use fewer slots, or enlarge it",
                ) from None
            segment = cls(name, fd, size, created=True)
            if track:
                segment.tracked = _track(name, register=True)
            return segment
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def open(cls, name: str) -> Segment:
        path = path_of(validate_name(name))
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise StoreNotFoundError(
                f"no store named {name!r} on this host ({path} does not exist); "
                "was it unlinked, or created on another host?"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise StoreNotFoundError(f"store {name!r} is still being created or is corrupt (empty)")
            return cls(name, fd, size, created=False)
        except BaseException:
            os.close(fd)
            raise

    # -- locks ---------------------------------------------------------------------------------
    def lock(self, byte: int, *, exclusive: bool, wait: bool) -> bool:
        """Take lock ``byte``; returns False if ``wait`` is False and another holder has it."""
        kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
        try:
            fcntl.fcntl(self.fd, _F_OFD_SETLKW if wait else _F_OFD_SETLK, struct.pack(_FLOCK, kind, 0, byte, 1, 0))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        self._locks.add(byte)
        return True

    def unlock(self, byte: int) -> None:
        fcntl.fcntl(self.fd, _F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, 0, byte, 1, 0))
        self._locks.discard(byte)

    def held(self, byte: int) -> bool:
        return byte in self._locks

    def readonly(self) -> mmap.mmap:
        """A second, read-only mapping of the whole segment (made on first use)."""
        if self._readonly is None:
            self._readonly = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
        return self._readonly

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and close. Raises BufferError if tensors still view a mapping."""
        if self.fd < 0:
            return
        if self._readonly is not None:
            self._readonly.close()
        self.buf.close()
        os.close(self.fd)  # also drops this description's locks
        self.fd = -1
        self._locks.clear()

    def unlink(self) -> None:
        unlink(self.name)
        if self.tracked:
            self.tracked = False
            _track(self.name, register=False)


class SegmentLocks:
    """The reader token and the reader table's lock of a segment, excluding other processes
    (kernel locks, dropped if the holder dies) and this process's other threads alike. What
    :class:`shmsync._protocol.Protocol` takes as ``locks``."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment

    def try_token(self) -> bool:
        threads = self.segment.thread_locks[TOKEN_LOCK]
        if not threads.acquire(blocking=False):
            return False
        if self.segment.lock(TOKEN_LOCK, exclusive=True, wait=False):
            return True
        threads.release()
        return False

    def release_token(self) -> None:
        self.segment.unlock(TOKEN_LOCK)
        self.segment.thread_locks[TOKEN_LOCK].release()

    @contextlib.contextmanager
    def table(self, patience: float | None) -> Iterator[bool]:
        """Hold the table lock; yields whether it was taken. With ``patience`` (seconds) both
        locks are given up after that long in all (a stopped holder must not stall a reload:
        the caller then copies instead); None waits for it."""
        segment, threads = self.segment, self.segment.thread_locks[TABLE_LOCK]
        if patience is None:
            threads.acquire()
            segment.lock(TABLE_LOCK, exclusive=True, wait=True)
        else:
            deadline = time.monotonic() + patience
            if not threads.acquire(timeout=patience):
                yield False
                return
            while not segment.lock(TABLE_LOCK, exclusive=True, wait=False):
                if time.monotonic() > deadline:
                    threads.release()
                    yield False
                    return
                time.sleep(0.0001)
        try:
            yield True
        finally:
            if segment.fd >= 0:
                segment.unlock(TABLE_LOCK)
            threads.release()


def conflicting_lock(fd: int, byte: int, *, exclusive: bool = True) -> bool:
    """Whether another open file description holds a lock on ``byte`` that conflicts with ``exclusive``."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    out = fcntl.fcntl(fd, _F_OFD_GETLK, struct.pack(_FLOCK, kind, 0, byte, 1, 0))
    return struct.unpack(_FLOCK, out)[0] != fcntl.F_UNLCK


def _track(name: str, *, register: bool) -> bool:
    """(Un)register the segment with multiprocessing's resource tracker, a helper process that
    outlives this one and unlinks what is still registered once every process of this tree has
    exited: a creator killed by a signal (SIGKILL, a SIGSEGV from a write through a zero-copy
    view) then leaves no store behind. The tracker unlinks POSIX shared memory, so only
    segments in /dev/shm qualify. True if registered."""
    if os.path.realpath(SHM_DIR) != "/dev/shm":
        return False
    from multiprocessing import resource_tracker

    (resource_tracker.register if register else resource_tracker.unregister)(f"/{PREFIX}{name}", "shared_memory")
    return True


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def unlink(name: str) -> bool:
    """Remove the file behind store ``name``; existing mappings stay valid. True if removed."""
    try:
        os.unlink(path_of(name))
        return True
    except FileNotFoundError:
        return False
