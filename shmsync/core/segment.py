"""Named shared-memory segments: files in ``/dev/shm`` mapped into each process.

Files in ``/dev/shm`` are used directly instead of :mod:`multiprocessing.shared_memory`
because the latter registers every attachment with the resource tracker of the
attaching process, which unlinks the segment for everyone when an unrelated
process exits (Python < 3.13). Here only the creator (or ``shmsync gc``) unlinks.

A store file is input like any other: another user, or a mistake, can put anything under a
store's name. :func:`open_file` opens without following links or blocking, and refuses
anything but a regular file that only this user can write (``SHMSYNC_TRUST_GROUP=1`` also
trusts files of this user's groups, for stores shared within a group); the header and the
layout are checked (``_header.check_words``, ``_layout.parse_description``) before the
file is mapped.

Each segment also carries advisory locks (Linux open-file-description locks, released
by the kernel when the holder dies, however it dies, and seen alike from every PID
namespace), which are all that liveness rests on: pids in the header are only displayed.

* byte 0, shared by every process that has the segment open: lets ``gc`` tell
  whether any live process still holds a store;
* byte 1, exclusive: the writer role;
* byte 2, exclusive: the host bank's reader token (see :mod:`shmsync.core.protocol`);
* byte 3, exclusive, held for microseconds: changing the reader table (rows, leases);
* byte 4, exclusive: held by the creator while it has the store open;
* byte 5, exclusive: the device bank's reader token;
* byte ``ROW_LOCKS + r``, exclusive: held by the reader in row ``r`` of the reader table.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import TypeVar

from shmsync.core.pages import reserve
from shmsync.errors import InvalidArgumentError, StoreExistsError, StoreNotFoundError, StoreUntrustedError

SHM_DIR = os.environ.get("SHMSYNC_DIR", "/dev/shm")
PREFIX = "shmsync-"
INCOMING = ".incoming-"  # a store being made under a temporary name (see Segment.link)
SIDE = "~"  # in no store name: `shmsync-NAME~...` is a file beside store NAME, never a store

HOLDER_LOCK = 0
WRITER_LOCK = 1
TOKEN_LOCK = 2
TABLE_LOCK = 3
CREATOR_LOCK = 4
DEVICE_TOKEN_LOCK = 5
TOKEN_LOCKS = (TOKEN_LOCK, DEVICE_TOKEN_LOCK)  # per bank
ROW_LOCKS = 64  # row r of the reader table: byte ROW_LOCKS + r

_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
# struct flock on 64-bit Linux: short type, short whence, off_t start, off_t len, pid_t pid.
_FLOCK = "hhqqi4x"
T = TypeVar("T")

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_INCOMING = re.compile(re.escape(INCOMING) + r"[0-9a-f]{16}")
# Never block on a FIFO, never follow a link, never become a controlling terminal.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def validate_name(name: str) -> str:
    """``name`` if it is a valid store name, else ValueError naming the rule."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"invalid store name {name!r}: use 1-200 characters among letters, digits, '_', '.' and '-', "
            "starting with a letter, a digit or '_'"
        )
    return name


def default_name(*parts: str) -> str:
    """A new store name that says whose it is: ``PROGRAM-[PARTS-]PID-RANDOM``, where PROGRAM is
    the running script's name (``train_cartpole``; ``python`` for ``-c`` or a REPL), e.g.
    ``train_cartpole-policy-4242-3f9a1c``."""
    argv0 = sys.argv[0] if sys.argv else ""
    script = "" if argv0 in ("-c", "-") else os.path.basename(argv0)  # -c, stdin and the REPL: python
    if script == "__main__.py":  # python -m PACKAGE: the package's name
        script = os.path.basename(os.path.dirname(argv0))
    program = re.sub(r"[^A-Za-z0-9_.-]+", "-", script.removesuffix(".py")).strip(".-")[:40] or "python"
    return "-".join((program, *parts, str(os.getpid()), secrets.token_hex(3)))


def is_incoming(name: str) -> bool:
    """Whether ``name`` is a store still being made under a temporary name."""
    return bool(_INCOMING.fullmatch(name))


def path_of(name: str) -> str:
    """The file that backs store ``name``."""
    if not is_incoming(name):
        validate_name(name)
    return os.path.join(SHM_DIR, PREFIX + name)


def trust_group() -> bool:
    """Whether store files of this user's groups are trusted (``SHMSYNC_TRUST_GROUP=1``)."""
    return os.environ.get("SHMSYNC_TRUST_GROUP", "").strip() in ("1", "true", "yes")


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def check_trusted(st: os.stat_result, path: str) -> None:
    """Refuse a file that is not a regular file only this user (or, with
    ``SHMSYNC_TRUST_GROUP=1``, this user's groups) can write.

    Raises:
        StoreUntrustedError: naming what is wrong with it.
    """
    if not stat.S_ISREG(st.st_mode):
        raise StoreUntrustedError(f"{path} is {_kind(st.st_mode)}, not a store file")
    mode = stat.S_IMODE(st.st_mode)
    group = trust_group()
    ours = st.st_uid == os.geteuid() or (group and st.st_gid in {os.getegid(), *os.getgroups()})
    if not ours:
        raise StoreUntrustedError(
            f"{path} is owned by uid {st.st_uid} (gid {st.st_gid}), not by this user (uid {os.geteuid()}): "
            "whoever owns it chooses the weights read from it"
            + ("" if group else "; SHMSYNC_TRUST_GROUP=1 trusts stores of this user's groups")
        )
    if mode & stat.S_IWOTH:
        raise StoreUntrustedError(f"{path} has mode {mode:#o}: every user of this host may write it")
    if mode & stat.S_IWGRP and not group:
        raise StoreUntrustedError(
            f"{path} has mode {mode:#o}: its group may write it; SHMSYNC_TRUST_GROUP=1 trusts stores shared "
            "within a group"
        )


def open_file(path: str, flags: int) -> tuple[int, os.stat_result]:
    """Open a store file as untrusted input: no link followed, no FIFO blocked on; refused unless
    :func:`check_trusted` accepts it. Returns ``(fd, stat)``.

    Raises:
        StoreNotFoundError: there is no such file.
        StoreUntrustedError: a link, a directory or other non-regular file, or a file others may
            write (the descriptor is closed).
    """
    try:
        fd = os.open(path, flags | _OPEN_FLAGS)
    except FileNotFoundError:
        name = os.path.basename(path).removeprefix(PREFIX)
        raise StoreNotFoundError(f"no store named {name!r} on this host ({path} does not exist)") from None
    except OSError as e:
        try:
            st = os.lstat(path)
            what = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"mode {stat.S_IMODE(st.st_mode):#o}"
        except OSError:
            what = "unreadable"
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM, errno.EROFS):
            raise StoreUntrustedError(f"cannot open {path} ({what}): {e.strerror}") from None
        raise
    return fd, _checked(fd, path)


def _checked(fd: int, path: str) -> os.stat_result:
    """``fd``'s ``stat``, if :func:`check_trusted` accepts it; else ``fd`` is closed and it raises."""
    try:
        st = os.fstat(fd)
        check_trusted(st, path)
    except BaseException:
        os.close(fd)
        raise
    return st


def open_mapped(path: str) -> tuple[int, os.stat_result]:
    """Open, read-only, a store file that was unlinked but that a process still holds open, through
    that process's descriptor (``/proc/PID/fd/N``, a link the kernel keeps, so it is followed).
    Refused unless :func:`check_trusted` accepts what it leads to. Returns ``(fd, stat)``.

    Raises:
        StoreNotFoundError: the descriptor is closed now.
        StoreUntrustedError: it leads to a file :func:`check_trusted` refuses.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise StoreNotFoundError(f"{path} cannot be opened any more ({e.strerror})") from None
    return fd, _checked(fd, path)


def not_found_hint(name: str) -> str:
    """What to add to "no store named NAME": the close names in the store folder, the stores
    there, and where to look."""
    names = list_names()
    close = difflib.get_close_matches(name, names, n=3)
    if close:
        return f": did you mean {', '.join(map(repr, close))}? (`shmsync ls` lists the stores on this host)"
    elsewhere = "or it was unlinked, or made on another host or with another SHMSYNC_DIR"
    if names:
        shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        return f": the stores on this host are {shown} (`shmsync ls`); {elsewhere}"
    return f": there is no store on this host; if the trainer has not created it yet, attach once it has, {elsewhere}"


def list_unlinked() -> list[tuple[str, str]]:
    """``(name, path)`` for every store that was unlinked from the store folder but that a process
    of this user still holds open (a TorchRL collector's, once its workers attached; a store whose
    trainer was killed, while readers live), one per file: ``path`` is a ``/proc/PID/fd/N`` to
    open it by (:func:`open_mapped`). Processes of other users are not looked at."""
    folder = os.path.realpath(SHM_DIR) + os.sep + PREFIX
    found: dict[tuple[int, int], tuple[str, str]] = {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        try:
            entries = os.listdir(fds)
        except OSError:  # gone, or not ours
            continue
        for entry in entries:
            path = f"{fds}/{entry}"
            try:
                target = os.readlink(path)
            except OSError:
                continue
            if not (target.startswith(folder) and target.endswith(" (deleted)")):
                continue
            name = target[len(folder) : -len(" (deleted)")]
            if not _NAME.fullmatch(name):
                continue  # a store still being made (its temporary name), or not a store's
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.setdefault((st.st_dev, st.st_ino), (name, path))
    return sorted(found.values())


def list_side_files() -> list[tuple[str, str]]:
    """``(file name, store name)`` of every file beside a store in the store folder (see :data:`SIDE`)."""
    try:
        names = [e.name for e in os.scandir(SHM_DIR) if e.name.startswith(PREFIX) and SIDE in e.name]
    except FileNotFoundError:
        return []
    return sorted((n, n[len(PREFIX) :].split(SIDE, 1)[0]) for n in names)


def track_file(name: str, *, register: bool) -> bool:
    """(Un)register ``shmsync-NAME`` in the store folder with the resource tracker (see :func:`_track`)."""
    return _track(name, register=register)


def list_names() -> list[str]:
    """Names of the segments in the store folder, oldest first: regular files only (a FIFO, a
    directory, a link or a socket of that name is left out, see :func:`list_entries`)."""
    return [name for name, problem in list_entries() if problem is None]


def list_entries() -> list[tuple[str, str | None]]:
    """``(name, problem)`` for every entry of the store folder that starts with the prefix (files
    beside a store, with :data:`SIDE` in their name, aside), oldest first; ``problem`` says why an
    entry is not a store to look at (None for one to look at). Nothing is opened: only the folder
    is read and each entry ``lstat``-ed."""
    try:
        entries = [e for e in os.scandir(SHM_DIR) if e.name.startswith(PREFIX) and SIDE not in e.name]
    except FileNotFoundError:
        return []
    dated = []
    for e in entries:
        name = e.name[len(PREFIX) :]
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # unlinked since the folder was read
        problem = None
        if not (_NAME.fullmatch(name) or is_incoming(name)):
            problem = "not a valid store name"
        elif not stat.S_ISREG(st.st_mode):
            problem = _kind(st.st_mode)
        elif st.st_uid != os.geteuid() and not (trust_group() and st.st_gid in {os.getegid(), *os.getgroups()}):
            problem = f"owned by uid {st.st_uid}, not by this user"
        dated.append((st.st_mtime_ns, name, problem))
    return [(name, problem) for _, name, problem in sorted(dated)]


def peek(name: str, nbytes: int = 4096) -> tuple[bytes, os.stat_result] | None:
    """The first ``nbytes`` of a segment and its ``stat``, read without mapping or locking it
    (None if gone). Raises :class:`StoreUntrustedError` for a file :func:`open_file` refuses."""
    try:
        fd, st = open_file(path_of(name), os.O_RDONLY)
    except StoreNotFoundError:
        return None
    try:
        return os.pread(fd, nbytes, 0), st
    finally:
        os.close(fd)


def _lock(fd: int, byte: int, *, exclusive: bool, wait: bool) -> bool:
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, _F_OFD_SETLKW if wait else _F_OFD_SETLK, struct.pack(_FLOCK, kind, 0, byte, 1, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def conflicting_lock(fd: int, byte: int, *, exclusive: bool = True) -> bool:
    """Whether another open file description holds a lock on ``byte`` that conflicts with ``exclusive``."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    out = fcntl.fcntl(fd, _F_OFD_GETLK, struct.pack(_FLOCK, kind, 0, byte, 1, 0))
    return struct.unpack(_FLOCK, out)[0] != fcntl.F_UNLCK


_UNLOCKED = struct.pack("h", fcntl.F_UNLCK)
_ROW_QUERIES: list[bytes] = []  # per row, the F_OFD_GETLK request for its lock byte, made once


def locked_rows(fd: int, rows: list[int], own: AbstractSet[int] = frozenset()) -> set[int]:
    """Of reader-table ``rows``, those whose lock a live process holds: one ``F_OFD_GETLK`` a row
    (about a microsecond), none for a row whose lock is in ``own`` (bytes held through ``fd``)."""
    queries = _ROW_QUERIES
    if rows and max(rows) >= len(queries):
        queries += [
            struct.pack(_FLOCK, fcntl.F_RDLCK, 0, ROW_LOCKS + r, 1, 0) for r in range(len(queries), max(rows) + 1)
        ]
    get, request, unlocked = fcntl.fcntl, _F_OFD_GETLK, _UNLOCKED
    out = set()
    for row in rows:
        if ROW_LOCKS + row in own or get(fd, request, queries[row])[:2] != unlocked:
            out.add(row)
    return out


class Segment:
    """One mapped segment: its file, its kernel locks, and its mappings.

    ``buf`` maps the segment's head (header and layout; ``head`` bytes) read-write in every
    process. The rest, the slots, is mapped on first use by :meth:`data`: shared and
    writable for a writer, private for a reader (it reads the store's own pages; a write of
    its own copies the page for it alone, and never reaches the store).

    Made by :meth:`create` or :meth:`open`, which check the file first."""

    def __init__(self, name: str, fd: int, size: int, head: int) -> None:
        if not 0 < head <= size:
            raise InvalidArgumentError(f"segment {name!r}: head of {head} bytes out of range for {size} bytes")
        self.name = name
        self.fd = fd
        self.size = size
        self.head = head
        self.tracked = False  # multiprocessing's resource tracker unlinks it if we die first
        # This process's threads, beside the OFD locks (which do not exclude threads sharing
        # one file description): per lock byte.
        self.thread_locks = {byte: threading.Lock() for byte in (*TOKEN_LOCKS, TABLE_LOCK)}
        self._locks: set[int] = set()
        # Every holder takes a shared lock so gc can see the segment is in use. Nobody takes
        # it exclusively, so a conflict means someone is in the way on purpose.
        if not self.lock(HOLDER_LOCK, exclusive=False, wait=False):
            raise StoreUntrustedError(f"{path_of(name)}: another process holds its lock byte 0 exclusively")
        self.buf = mmap.mmap(fd, head)
        self._data: dict[bool, tuple[mmap.mmap, int]] = {}

    @classmethod
    def create(
        cls, name: str, size: int, head: int, *, reserve_bytes: int | None = None, track: bool = False
    ) -> Segment:
        """Create and map a new segment of ``size`` bytes; its first ``reserve_bytes`` (default:
        all) are allocated now, the rest as it is first written. With ``track``, it is removed
        even if this process is killed (see :func:`_track`). ``SHMSYNC_TRUST_GROUP=1`` makes it
        writable by the group."""
        path = path_of(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _OPEN_FLAGS, 0o600)
        except FileExistsError:
            raise StoreExistsError(f"a store named {name!r} already exists ({path})") from None
        try:
            # Held from the first moment: gc never takes a store being made for garbage.
            _lock(fd, HOLDER_LOCK, exclusive=False, wait=False)
            if trust_group():
                os.fchmod(fd, 0o660)  # the umask may have taken the group's bits
            os.ftruncate(fd, size)
            # Reserve what is written at once: a full /dev/shm then fails here with a clear
            # error, not later with SIGBUS in the middle of a copy.
            reserve(fd, 0, size if reserve_bytes is None else min(size, reserve_bytes), f"store {name!r}")
            segment = cls(name, fd, size, head)
            if track:
                segment.tracked = _track(name, register=True)
            return segment
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def create_incoming(cls, size: int, head: int, *, reserve_bytes: int | None = None, track: bool = False) -> Segment:
        """A new segment under a temporary name, for a store that must not be seen before it
        holds its first version; :meth:`link` gives it its name."""
        return cls.create(INCOMING + secrets.token_hex(8), size, head, reserve_bytes=reserve_bytes, track=track)

    def link(self, name: str) -> None:
        """Give a segment made by :meth:`create_incoming` its name, in one step (a hard link,
        which fails if the name is taken), and drop the temporary name.

        Raises:
            FileExistsError: a store named ``name`` exists already (this one keeps its temporary name).
        """
        target = path_of(name)
        try:
            os.link(path_of(self.name), target)
        except FileExistsError:
            raise StoreExistsError(f"a store named {name!r} already exists ({target})") from None
        tracked = self.tracked
        self.unlink()
        self.name = name
        if tracked:
            self.tracked = _track(name, register=True)

    @classmethod
    def open(cls, name: str, inspect: Callable[[int, os.stat_result], tuple[int, T]]) -> tuple[Segment, T]:
        """Open store ``name``'s file (see :func:`open_file`), let ``inspect(fd, stat)`` check what it
        holds (with ``os.pread``: nothing is mapped yet) and return ``(head, facts)``, then map its
        head. Returns the segment and ``facts``; if anything raises, the descriptor is closed and
        nothing is mapped."""
        fd, st = open_file(path_of(name), os.O_RDWR)
        try:
            head, facts = inspect(fd, st)
            return cls(name, fd, st.st_size, head), facts
        except BaseException:
            os.close(fd)
            raise

    def data(self, *, shared: bool) -> tuple[mmap.mmap, int]:
        """The slots' part of the segment, mapped on first use: ``(mapping, offset in the file of
        its first byte)``. ``shared``: the store's pages, read-write (a writer's); else a private
        mapping of them (a reader's: a write copies the page for this process alone)."""
        if shared not in self._data:
            base = self.head - self.head % mmap.ALLOCATIONGRANULARITY
            flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
            self._data[shared] = (mmap.mmap(self.fd, self.size - base, flags=flags, offset=base), base)
        return self._data[shared]

    def mapped(self, *, shared: bool) -> bool:
        """Whether :meth:`data` has mapped that kind of mapping in this process."""
        return shared in self._data

    # -- locks ---------------------------------------------------------------------------------
    def lock(self, byte: int, *, exclusive: bool, wait: bool) -> bool:
        """Take lock ``byte``; returns False if ``wait`` is False and another holder has it."""
        if not _lock(self.fd, byte, exclusive=exclusive, wait=wait):
            return False
        self._locks.add(byte)
        return True

    def unlock(self, byte: int) -> None:
        fcntl.fcntl(self.fd, _F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, 0, byte, 1, 0))
        self._locks.discard(byte)

    def held(self, byte: int) -> bool:
        """Whether this process holds lock ``byte`` through this mapping."""
        return byte in self._locks

    def held_anywhere(self, byte: int) -> bool:
        """Whether any process (this one included) holds lock ``byte`` exclusively."""
        return byte in self._locks or conflicting_lock(self.fd, byte, exclusive=False)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and close. Raises BufferError if tensors still view a mapping."""
        if self.fd < 0:
            return
        for shared, (mapping, _base) in list(self._data.items()):
            mapping.close()  # BufferError if tensors still view it: the rest stays for a later close
            del self._data[shared]
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
    """The reader token, the reader table's lock and the rows' locks of a segment, excluding
    other processes (kernel locks, dropped if the holder dies) and this process's other threads
    alike. What the classes of :mod:`shmsync.core.protocol` take as ``locks``."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment

    def try_token(self, bank: int = 0) -> bool:
        byte = TOKEN_LOCKS[bank]
        threads = self.segment.thread_locks[byte]
        if not threads.acquire(blocking=False):
            return False
        if self.segment.lock(byte, exclusive=True, wait=False):
            return True
        threads.release()
        return False

    def release_token(self, bank: int = 0) -> None:
        byte = TOKEN_LOCKS[bank]
        self.segment.unlock(byte)
        self.segment.thread_locks[byte].release()

    @contextlib.contextmanager
    def table(self, patience: float | None) -> Iterator[bool]:
        """Hold the table lock; yields whether it was taken. With ``patience`` (seconds) both
        locks are given up after that long in all (a stopped holder must not stall a reload:
        the caller then copies instead); None waits for it. (Held for microseconds at every lease
        change: the kernel calls are made here, not through :meth:`Segment.lock`.)"""
        segment, threads = self.segment, self.segment.thread_locks[TABLE_LOCK]
        fd = segment.fd
        if patience is None:
            threads.acquire()
            fcntl.fcntl(fd, _F_OFD_SETLKW, _TABLE_TAKE)
        else:
            deadline = time.monotonic() + patience
            if not threads.acquire(timeout=patience):
                yield False
                return
            while True:
                try:
                    fcntl.fcntl(fd, _F_OFD_SETLK, _TABLE_TAKE)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        threads.release()
                        raise
                if time.monotonic() > deadline:
                    threads.release()
                    yield False
                    return
                time.sleep(0.0001)
        try:
            yield True
        finally:
            if segment.fd >= 0:
                fcntl.fcntl(fd, _F_OFD_SETLK, _TABLE_GIVE)
            threads.release()

    def hold_row(self, row: int) -> bool:
        """Take row ``row``'s lock (never waits); False if a live reader holds it, in this process
        (through this mapping: the kernel would let the same description take it again) or another."""
        byte = ROW_LOCKS + row
        return not self.segment.held(byte) and self.segment.lock(byte, exclusive=True, wait=False)

    def release_row(self, row: int) -> None:
        if self.segment.fd >= 0:
            self.segment.unlock(ROW_LOCKS + row)

    def row_alive(self, row: int) -> bool:
        """Whether a live process holds row ``row`` (its reader's lock)."""
        return self.segment.fd >= 0 and self.segment.held_anywhere(ROW_LOCKS + row)

    def rows_alive(self, rows: list[int]) -> set[int]:
        """Of ``rows``, those a live process holds (see :func:`locked_rows`)."""
        if self.segment.fd < 0:
            return set()
        return locked_rows(self.segment.fd, rows, self.segment._locks)


_TABLE_TAKE = struct.pack(_FLOCK, fcntl.F_WRLCK, 0, TABLE_LOCK, 1, 0)
_TABLE_GIVE = struct.pack(_FLOCK, fcntl.F_UNLCK, 0, TABLE_LOCK, 1, 0)


def _track(name: str, *, register: bool) -> bool:
    """(Un)register the segment with multiprocessing's resource tracker, a helper process that
    outlives this one and unlinks what is still registered once every process of this tree has
    exited: a creator killed by a signal (SIGKILL, a SIGSEGV from a write through an in-place
    view) then leaves no store behind. The tracker unlinks POSIX shared memory, so only
    segments in /dev/shm qualify. True if registered."""
    if os.path.realpath(SHM_DIR) != "/dev/shm":
        return False
    from multiprocessing import resource_tracker

    (resource_tracker.register if register else resource_tracker.unregister)(f"/{PREFIX}{name}", "shared_memory")
    return True


def unlink(name: str) -> bool:
    """Remove the file behind store ``name``; existing mappings stay valid. True if removed."""
    try:
        os.unlink(path_of(name))
        return True
    except FileNotFoundError:
        return False
