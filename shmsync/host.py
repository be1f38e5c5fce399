"""The stores on this host: listing them and removing the ones nobody can use any more.

Everything here reads headers with ``pread`` and asks the kernel about locks; it never
attaches, so it cannot keep a store alive or change it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass

import numpy as np

from . import _segment
from ._header import (
    FORMAT,
    HEADER_BYTES,
    MAGIC,
    W_CREATE_NS,
    W_CREATOR_PID,
    W_CREATOR_START,
    W_FORMAT,
    W_MAGIC,
    W_PAYLOAD_BYTES,
    W_PUBLISH_NS,
    W_VERSION,
    W_WRITER_PID,
    reader_rows,
)
from ._processes import pid_alive


@dataclass
class StoreStatus:
    """What ``shmsync ls`` shows about one store."""

    name: str
    valid: bool  # a complete shmsync header
    version: int
    payload_bytes: int
    shm_bytes: int
    creator_pid: int
    creator_alive: bool
    writer_pid: int
    readers: list[int]  # pids of live attached readers
    held: bool  # some live process has it open
    last_publish_age_s: float | None
    age_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def _held(name: str) -> bool:
    try:
        fd = os.open(_segment.path_of(name), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return _segment.conflicting_lock(fd, _segment.HOLDER_LOCK, exclusive=True)
    finally:
        os.close(fd)


def status(name: str) -> StoreStatus | None:
    """The status of store ``name`` (None if it vanished meanwhile)."""
    raw = _segment.peek(name, HEADER_BYTES)
    try:
        st = os.stat(_segment.path_of(name))
    except FileNotFoundError:
        return None
    now = time.time_ns()
    if raw is None or len(raw) < HEADER_BYTES or np.frombuffer(raw, np.int64, 1)[0] != MAGIC:
        return StoreStatus(
            name, False, -1, 0, st.st_size, 0, False, 0, [], _held(name), None, (now - st.st_mtime_ns) / 1e9
        )
    h = np.frombuffer(raw, dtype=np.int64)
    # Another format lays its reader table out differently: its readers are not listed.
    readers = [pid for _row, pid, *_ in reader_rows(h) if pid_alive(pid)] if h[W_FORMAT] == FORMAT else []
    published = int(h[W_PUBLISH_NS])
    return StoreStatus(
        name=name,
        valid=int(h[W_MAGIC]) == MAGIC,
        version=int(h[W_VERSION]),
        payload_bytes=int(h[W_PAYLOAD_BYTES]),
        shm_bytes=st.st_size,
        creator_pid=int(h[W_CREATOR_PID]),
        creator_alive=pid_alive(int(h[W_CREATOR_PID]), int(h[W_CREATOR_START])),
        writer_pid=int(h[W_WRITER_PID]),
        readers=readers,
        held=_held(name),
        last_publish_age_s=(now - published) / 1e9 if published else None,
        age_s=(now - int(h[W_CREATE_NS])) / 1e9,
    )


def list_stores() -> list[StoreStatus]:
    """Every store on this host, oldest first."""
    return [s for s in (status(n) for n in _segment.list_names()) if s is not None]


def is_garbage(s: StoreStatus, min_age_s: float = 5.0) -> bool:
    """Nobody can use it: its creator is gone and no live process has it open.

    A store without a complete header counts once it is older than ``min_age_s`` (its
    creator died while creating it)."""
    if s.held:
        return False
    if not s.valid:
        return s.age_s > min_age_s
    return not s.creator_alive


def is_orphaned(s: StoreStatus) -> bool:
    """Its creator is dead, yet live processes (readers that outlived the trainer) hold it."""
    return s.valid and s.held and not s.creator_alive


def collect_garbage(
    dry_run: bool = False, orphaned: bool = False, names: Collection[str] | None = None
) -> list[StoreStatus]:
    """Remove (or, with ``dry_run``, only list) every store :func:`is_garbage` says is garbage,
    and with ``orphaned`` also the :func:`is_orphaned` ones (their readers keep their mapping
    and the weights they loaded; nothing new can reach them). ``names`` limits it to those
    stores."""
    removed = []
    for s in list_stores():
        if names is not None and s.name not in names:
            continue
        if is_garbage(s) or (orphaned and is_orphaned(s)):
            if not dry_run:
                _segment.unlink(s.name)
            removed.append(s)
    return removed
