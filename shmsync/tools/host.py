"""The stores on this host: listing them and removing the ones nobody can use any more.

Everything here reads headers with ``pread`` and asks the kernel about locks; it never
attaches, so it cannot keep a store alive or change it. Liveness comes from the kernel's
locks alone (a store is in use while a process holds it open; it can still be published
while some process holds its writer role or its creator holds it), never from the pids in
its header, which may belong to another PID namespace or have been reused.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass

from shmsync.core import segment
from shmsync.core.header import (
    HEADER_BYTES,
    R_FLAGS,
    R_PID,
    ROW_LINK,
    W_CREATE_NS,
    W_CREATOR_PID,
    W_DEVICE_BYTES,
    W_PAYLOAD_BYTES,
    W_PUBLISH_NS,
    W_VERSION,
    W_WRITER_PID,
    check_words,
    reader_rows,
)
from shmsync.errors import ShmSyncError, StoreNotFoundError, StoreUntrustedError, warn_deprecated
from shmsync.store.reader_table import ReaderTable, assemble, local_rows
from shmsync.watch.remote_rows import read_report_file


@dataclass
class StoreStatus:
    """What ``shmsync ls`` shows about one store."""

    name: str
    valid: bool  # a complete shmsync header, every field in range
    version: int
    payload_bytes: int
    shm_bytes: int
    creator_pid: int  # as its header says (possibly of another PID namespace)
    creator_alive: bool  # its creator still holds it open
    writer_pid: int
    writer_held: bool  # some process holds its writer role
    readers: list[int]  # pids of live attached readers
    held: bool  # some live process has it open
    last_publish_age_s: float | None
    age_s: float
    problem: str | None = None  # why it is not valid
    unlinked: bool = False  # its name left the store folder; processes still hold it (see `path`)
    path: str | None = None  # where it was read: its file, or a process's descriptor of it
    resident_bytes: int = 0  # memory its pages take now (slots nobody uses take none)
    device_bytes: int = 0  # GPU memory its device slots take now (a store published from CUDA)

    @property
    def writer_alive(self) -> bool:
        """Whether a live process can still publish into it."""
        return self.writer_held or self.creator_alive

    @property
    def publisher_alive(self) -> bool:
        """Deprecated: :attr:`writer_alive` (renamed in 0.2.0, removed in 0.3.0)."""
        warn_deprecated("StoreStatus.publisher_alive", "StoreStatus.writer_alive", "0.3.0")
        return self.writer_alive

    def as_dict(self) -> dict:
        return asdict(self)


def status(name: str, path: str | None = None) -> StoreStatus | None:
    """The status of store ``name`` (None if it vanished meanwhile); ``path``: a process's
    descriptor of an unlinked store to read it through (see :func:`shmsync.core.segment.list_unlinked`).

    Raises:
        StoreUntrustedError: the file is not one this user could have written alone.
    """
    try:
        fd, st = _open(name, path)
    except StoreNotFoundError:
        return None
    try:
        raw = os.pread(fd, HEADER_BYTES, 0)

        def locked(byte: int, *, exclusive: bool = False) -> bool:
            return segment.conflicting_lock(fd, byte, exclusive=exclusive)

        held = locked(segment.HOLDER_LOCK, exclusive=True)  # anyone, even a shared holder
        now = time.time_ns()
        h = memoryview(raw[: len(raw) // 8 * 8]).cast("q")
        try:
            check_words(h, st.st_size, name)
            problem = None
        except ShmSyncError as e:
            problem = str(e)
        unlinked, where, resident = path is not None, path or segment.path_of(name), st.st_blocks * 512
        if problem is not None:
            return StoreStatus(
                name, False, -1, 0, st.st_size, 0, locked(segment.CREATOR_LOCK), 0,
                locked(segment.WRITER_LOCK), [], held, None, (now - st.st_mtime_ns) / 1e9, problem,
                unlinked=unlinked, path=where, resident_bytes=resident,
            )  # fmt: skip
        # The readers the readers' table lists: a relay's link to another host is none.
        rows = [(row, w[R_PID]) for row, w in reader_rows(h) if not w[R_FLAGS] & ROW_LINK]
        readers = [pid for row, pid in rows if locked(segment.ROW_LOCKS + row)]
        published = h[W_PUBLISH_NS]
        return StoreStatus(
            name=name,
            valid=True,
            version=h[W_VERSION],
            payload_bytes=h[W_PAYLOAD_BYTES],
            shm_bytes=st.st_size,
            creator_pid=h[W_CREATOR_PID],
            creator_alive=locked(segment.CREATOR_LOCK),
            writer_pid=h[W_WRITER_PID],
            writer_held=locked(segment.WRITER_LOCK),
            readers=readers,
            held=held,
            last_publish_age_s=(now - published) / 1e9 if published else None,
            age_s=(now - h[W_CREATE_NS]) / 1e9,
            device_bytes=max(h[W_DEVICE_BYTES], 0),
            unlinked=unlinked,
            path=where,
            resident_bytes=resident,
        )
    finally:
        os.close(fd)


def _open(name: str, path: str | None) -> tuple[int, os.stat_result]:
    if path is None:
        return segment.open_file(segment.path_of(name), os.O_RDONLY)
    return segment.open_mapped(path)


def table(name: str, *, processes: bool = True) -> ReaderTable:
    """The readers' table of store ``name`` on this host, read from outside any process that uses
    it (``shmsync ls NAME``): its header read with ``pread``, its readers' liveness from the
    kernel's locks, and the rows of readers on other hosts that the trainer's relays report. An
    unlinked store that a process still holds is found through that process.

    Args:
        name: the store's name.
        processes: also look up each reader's process state and private memory (USS).

    Raises:
        StoreNotFoundError: no store of that name on this host, linked or held by a process.
        StoreUntrustedError: its file is not one this user could have written alone.
        StoreCorruptError, ShmSyncError: its header is not a valid store's (naming the field).
    """
    segment.validate_name(name)

    def candidates():
        yield None  # the store folder first; processes' descriptors only if it is not there
        yield from (path for found, path in segment.list_unlinked() if found == name)

    for path in candidates():
        try:
            fd, st = _open(name, path)
        except StoreNotFoundError:
            continue
        try:
            h = memoryview(os.pread(fd, HEADER_BYTES, 0)).cast("q") if st.st_size >= HEADER_BYTES else ()
            check_words(h, st.st_size, name)

            def alive(rows: list[int], fd: int = fd) -> set[int]:
                return segment.locked_rows(fd, rows)

            version = h[W_VERSION]
            live, gone = local_rows(name, h, alive, version, processes=processes)
        finally:
            os.close(fd)
        hosts, remote = read_report_file(name, version) if path is None else ([], [])
        return assemble(name, version, live, gone, hosts=hosts, remote=remote)
    raise StoreNotFoundError(_not_found(name))


def _not_found(name: str) -> str:
    names = sorted({s.name for s in list_stores()})
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    listed = (
        f"stores on this host: {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}"
        if names
        else ("there are no stores on this host (has the trainer created it yet?)")
    )
    return f"no store named {name!r} on this host, linked or held by a process{hint} ({listed}; see `shmsync ls`)"


def scan() -> tuple[list[StoreStatus], list[tuple[str, str]]]:
    """Every store on this host, oldest first, then those unlinked that a process still holds
    open; and ``(name, why)`` for every entry of the store folder that was skipped (not a regular
    file, another user's, not a valid store name...)."""
    stores, skipped = [], []
    found: list[tuple[str, str | None, str | None]] = [
        (name, None, problem) for name, problem in segment.list_entries()
    ]
    found += [(name, path, None) for name, path in segment.list_unlinked()]
    for name, path, problem in found:
        if problem is None:
            try:
                s = status(name, path)
            except (StoreUntrustedError, OSError) as e:
                skipped.append((name, str(e)))
                continue
            if s is not None:
                stores.append(s)
        else:
            skipped.append((name, problem))
    return stores, skipped


def list_stores() -> list[StoreStatus]:
    """Every store on this host that this user may look at, oldest first (see :func:`scan`)."""
    return scan()[0]


def is_garbage(s: StoreStatus, min_age_s: float = 5.0) -> bool:
    """Nobody can use it: no live process has it open, whatever its header says.

    A store without a valid header counts once it is older than ``min_age_s``."""
    if s.held:
        return False
    if not s.valid:
        return s.age_s > min_age_s
    return True


def is_orphaned(s: StoreStatus) -> bool:
    """Live processes (readers that outlived the trainer) hold it, but none can publish: nobody
    holds its writer role and its creator has let go of it."""
    return s.valid and s.held and not s.writer_alive


def collect_garbage(
    dry_run: bool = False,
    orphaned: bool = False,
    names: Collection[str] | None = None,
    stores: list[StoreStatus] | None = None,
) -> list[StoreStatus]:
    """Remove (or, with ``dry_run``, only list) every store :func:`is_garbage` says is garbage,
    and with ``orphaned`` also the :func:`is_orphaned` ones (their readers keep their mapping
    and the weights they loaded; nothing new can reach them). ``names`` limits it to those
    stores; ``stores`` is what :func:`scan` found, if the caller has it already. A store whose
    writer role or creator is alive is never removed."""
    removed = []
    for s in list_stores() if stores is None else stores:
        if s.unlinked or (names is not None and s.name not in names):
            continue  # an unlinked store has no name to remove: it goes with its last holder
        if is_garbage(s) or (orphaned and is_orphaned(s)):
            if not dry_run:
                segment.unlink(s.name)
            removed.append(s)
    return removed


def collect_side_files(dry_run: bool = False) -> list[str]:
    """Remove (or, with ``dry_run``, only list) the files beside stores that are gone from the
    store folder (say, the report file of a trainer that was killed); returns their names."""
    stores = set(segment.list_names())
    removed = []
    for file, store in segment.list_side_files():
        if store not in stores:
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(segment.SHM_DIR, file))
            removed.append(file)
    return removed
