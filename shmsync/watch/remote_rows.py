"""Readers on other hosts: their rows as they travel (checked field by field), the book of the
reports each node of a tree last heard, and the file the trainer keeps them in for
``shmsync ls NAME``.

A report lists, per host, the rows of its readers as read there and how old they were when
sent: ages travel, never clocks, and every node that forwards a report adds how long it held
it. A host whose reports stop shows as ``silent`` after :data:`SILENT_AFTER` seconds; one whose
link ended as ``lost``, its rows kept (marked so) for :data:`LOST_KEEP` seconds. Everything
here comes from a peer or from a file: sizes are bounded, types and ranges checked, and a
report that fails a check is refused whole (ValueError naming the field).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shmsync.core import segment
from shmsync.errors import InvalidArgumentError, ShmSyncError
from shmsync.store.reader_table import HOST, MAX_WORKER, MODES, HostReport, ReaderRow, Transfer, rebase

log = logging.getLogger("shmsync.table")

MAX_REPORT_BYTES = 4 << 20  # one report a relay sends upstream
REPORT_EVERY = 1.0  # seconds between two reports of a relay or a node
SILENT_AFTER = 3.5  # seconds without a report before a host shows as silent
LOST_KEEP = 30.0  # seconds the rows of a host whose link ended stay listed, marked lost
WRITE_EVERY = 1.0  # seconds between two writes of the trainer's report file


# -- rows on the wire ------------------------------------------------------------------------------
# A report is JSON: {"hosts": [[host, store, age_s, [row, ...]], ...]}, each row a list in this
# order. It comes from a peer: every field is checked (type and range) before a row is made.
WIRE_FIELDS = (
    "worker",
    "pid",
    "version",
    "since_reload_s",
    "reloads",
    "mode",
    "waiting",
    "state",
    "uss",
    "device_bytes",
    "copied_bytes",
)
MAX_NAME = 255
MAX_STATE = 32


def row_to_wire(r: ReaderRow) -> list[Any]:
    mode = MODES.index(r.mode)
    return [
        *(r.worker, r.pid, r.version, r.since_reload_s, r.reloads, mode, r.waiting, r.state, r.uss),
        *(r.device_bytes, r.copied_bytes),
    ]


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgumentError(f"{what} is {str(value)[:40]}, not an int from {lo} to {hi}")
    return value


def _seconds(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e9:
        raise InvalidArgumentError(f"{what} is {str(value)[:40]}, not a number of seconds")
    return float(value)


def _text(value: Any, most: int, what: str) -> str:
    if not isinstance(value, str) or len(value) > most or not value.isprintable():
        raise InvalidArgumentError(f"{what} is {ascii(value)[:60]}, not printable text of at most {most} characters")
    return value


def row_from_wire(fields: Any, host: str, store: str, age_s: float) -> ReaderRow:
    """A row another host reported, every field checked (ValueError names the first bad one)."""
    if not isinstance(fields, list) or not len(WIRE_FIELDS) - 2 <= len(fields) <= len(WIRE_FIELDS):
        raise InvalidArgumentError(f"a reader row is {str(fields)[:60]}, not a list of {len(WIRE_FIELDS)} fields")
    # Rows of older relays: 9 fields (no GPU bytes), 10 (no bytes copied).
    worker, pid, version, since, reloads, mode, waiting, state, uss, *rest = fields
    device, copied = (rest + [0, 0])[:2]
    if not isinstance(waiting, bool):
        raise InvalidArgumentError(f"a reader row's waiting flag is {str(waiting)[:20]}, not a bool")
    return ReaderRow(
        store=store,
        host=host,
        worker=None if worker is None else _int(worker, 0, MAX_WORKER, "a reader row's worker"),
        pid=_int(pid, 1, (1 << 62), "a reader row's pid"),
        version=_int(version, -1, 1 << 62, "a reader row's version"),
        behind=None,
        since_reload_s=_seconds(since, "a reader row's since_reload_s"),
        reloads=_int(reloads, 0, 1 << 62, "a reader row's reloads"),
        mode=MODES[_int(mode, 0, len(MODES) - 1, "a reader row's mode")],
        waiting=waiting,
        state=_text(state, MAX_STATE, "a reader row's state"),
        uss=None if uss is None else _int(uss, 0, 1 << 62, "a reader row's uss"),
        report_age_s=age_s,
        device_bytes=_int(device, 0, 1 << 62, "a reader row's device_bytes"),
        copied_bytes=_int(copied, 0, 1 << 62, "a reader row's copied_bytes"),
    )


def transfer_from_wire(fields: Any, what: str) -> Transfer | None:
    """What a host's versions cost on the network, as a report or the report file carries it
    (None: not reported), every field checked (ValueError names the first bad one)."""
    if fields is None:
        return None
    if not isinstance(fields, list) or len(fields) != 6 or not isinstance(fields[2], bool):
        raise InvalidArgumentError(f"{what} is {str(fields)[:60]}, not [version, bytes, delta, deltas, wholes, bytes]")
    version, last, delta, deltas, wholes, total = fields
    return Transfer(
        _int(version, -1, 1 << 62, f"{what}'s version"),
        _int(last, 0, 1 << 62, f"{what}'s last bytes"),
        delta,
        _int(deltas, 0, 1 << 62, f"{what}'s deltas"),
        _int(wholes, 0, 1 << 62, f"{what}'s wholes"),
        _int(total, 0, 1 << 62, f"{what}'s total bytes"),
    )


# A report: the rows of readers on other hosts, each host's as last read there, ``age_s`` ago,
# and what the versions that reached it cost on the network (None: not reported).
@dataclass(frozen=True)
class HostRows:
    host: str
    node: str  # the id of the relay that read them
    store: str
    age_s: float
    rows: tuple[ReaderRow, ...]
    transfer: Transfer | None = None

    def aged(self, seconds: float) -> HostRows:
        return replace(self, age_s=self.age_s + seconds)


MAX_REPORT_HOSTS = 4096
MAX_REPORT_ROWS = 1 << 16  # rows in one report, all hosts together


def report_to_wire(entries: Iterable[HostRows]) -> dict[str, Any]:
    """``entries`` as a JSON document (a relay's report to its parent)."""
    return {"hosts": [_entry_to_wire(e) for e in entries]}


def _entry_to_wire(e: HostRows) -> list[Any]:
    entry = [e.host, e.node, e.store, round(e.age_s, 3), [row_to_wire(r) for r in e.rows]]
    return entry if e.transfer is None else [*entry, e.transfer.to_wire()]


def _host_entry(entry: Any) -> HostRows:
    """One host's entry of a report, every field checked."""
    if not isinstance(entry, list) or len(entry) not in (5, 6) or not isinstance(entry[4], list):
        raise InvalidArgumentError(
            f"a report's host entry is {str(entry)[:60]}, not [host, node, store, age_s, rows(, transfer)]"
        )
    host = _text(entry[0], MAX_NAME, "a report's host")
    node = entry[1]
    if not (isinstance(node, str) and len(node) == 16 and all(c in "0123456789abcdef" for c in node)):
        raise InvalidArgumentError(f"a report's node is {ascii(node)[:40]}, not 16 hex digits")
    store = _text(entry[2], MAX_NAME, "a report's store")
    age = _seconds(entry[3], "a report's age_s") or 0.0
    transfer = transfer_from_wire(entry[5], "a report's transfer") if len(entry) == 6 else None
    return HostRows(host, node, store, age, tuple(row_from_wire(f, host, store, age) for f in entry[4]), transfer)


def report_from_wire(doc: Any) -> list[HostRows]:
    """A report a peer sent, every field checked (ValueError names the first bad one)."""
    hosts = doc.get("hosts") if isinstance(doc, dict) and set(doc) == {"hosts"} else None
    if not isinstance(hosts, list) or len(hosts) > MAX_REPORT_HOSTS:
        raise InvalidArgumentError(f"a report is {str(doc)[:60]}, not {{'hosts': [at most {MAX_REPORT_HOSTS} hosts]}}")
    out, total = [], 0
    for entry in hosts:
        if isinstance(entry, list) and len(entry) in (5, 6) and isinstance(entry[4], list):
            total += len(entry[4])
        if total > MAX_REPORT_ROWS:
            raise InvalidArgumentError(f"a report holds more than {MAX_REPORT_ROWS} rows")
        out.append(_host_entry(entry))
    return out


# -- the report file: what the trainer last heard from other hosts, for `shmsync ls NAME` -------------
REPORT_SUFFIX = segment.SIDE + "hosts"  # never taken for a store
MAX_REPORT_FILE = 16 << 20


def report_path(store: str) -> str:
    return segment.path_of(store) + REPORT_SUFFIX


def write_report_file(store: str, hosts: Sequence[HostReport], rows: Sequence[ReaderRow]) -> bool:
    """Write what other hosts reported for ``store`` next to it, in one step (a new file renamed
    over the old), only this user may read it. Each row's ages are as of now. False if it was too
    large to write (the file keeps its last state)."""
    doc = {
        "format": 1,
        "written_ns": time.time_ns(),
        "hosts": [
            [h.host, h.via, h.store, round(h.age_s, 3), h.state, h.readers, h.transfer and h.transfer.to_wire()]
            for h in hosts
        ],
        "rows": [[r.host, r.store, round(r.report_age_s or 0.0, 3), row_to_wire(r)] for r in rows],
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    if len(data) > MAX_REPORT_FILE:
        return False
    path = report_path(store)
    temp = f"{path}.{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return True


def remove_report_file(store: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(report_path(store))


def read_report_file(store: str, store_version: int) -> tuple[list[HostReport], list[ReaderRow]]:
    """What the trainer last wrote of other hosts' readers for ``store`` (nothing if it wrote
    none), aged to now and seen against ``store_version``. The file is input like any other: opened as a
    store file is (no link, only this user's), bounded in size, every field checked; one that
    fails is ignored with a warning."""
    try:
        fd, st = segment.open_file(report_path(store), os.O_RDONLY)
    except ShmSyncError:
        return [], []
    try:
        if st.st_size > MAX_REPORT_FILE:
            raise InvalidArgumentError(f"it holds {st.st_size} bytes, more than {MAX_REPORT_FILE}")
        doc = json.loads(os.pread(fd, st.st_size, 0))
        if not isinstance(doc, dict) or doc.get("format") != 1:
            raise InvalidArgumentError("it is not a report file of this shmsync")
        age = max(0.0, (time.time_ns() - _int(doc.get("written_ns"), 0, 1 << 63, "written_ns")) / 1e9)
        hosts = []
        for h in _list(doc.get("hosts"), MAX_REPORT_HOSTS, "hosts"):
            if not isinstance(h, list) or len(h) not in (6, 7):
                raise InvalidArgumentError(f"a host entry is {str(h)[:60]}")
            hosts.append(
                HostReport(
                    _text(h[0], MAX_NAME, "a host"),
                    _text(h[1], MAX_NAME, "a host's via"),
                    _text(h[2], MAX_NAME, "a host's store"),
                    (_seconds(h[3], "a host's age_s") or 0.0) + age,
                    _text(h[4], MAX_STATE, "a host's state"),
                    _int(h[5], 0, MAX_REPORT_ROWS, "a host's readers"),
                    transfer_from_wire(h[6], "a host's transfer") if len(h) == 7 else None,
                )
            )
        rows = []
        for r in _list(doc.get("rows"), MAX_REPORT_ROWS, "rows"):
            if not isinstance(r, list) or len(r) != 4:
                raise InvalidArgumentError(f"a row entry is {str(r)[:60]}")
            host, where = _text(r[0], MAX_NAME, "a row's host"), _text(r[1], MAX_NAME, "a row's store")
            rows.append(row_from_wire(r[3], host, where, _seconds(r[2], "a row's age") or 0.0))
        return hosts, rebase(rows, store_version, age)
    except ValueError as e:
        log.warning("shmsync: ignored %s: %s", ascii(report_path(store)), e)
        return [], []
    finally:
        os.close(fd)


def _list(value: Any, most: int, what: str) -> list:
    if not isinstance(value, list) or len(value) > most:
        raise InvalidArgumentError(f"{what} is not a list of at most {most} entries")
    return value


@dataclass
class _Heard:
    via: str
    entries: list[HostRows]
    at: float  # time.monotonic() when it came
    lost_at: float | None = None


class ReportBook:
    """What one node of the tree (the trainer's sender, or a relay's server) last heard from each
    relay linked to it, about that relay's host and every host below it.

    Args:
        store: the store's name at this node: the trainer writes the file ``shmsync ls NAME``
            reads beside it (``write_file``).
        write_file: keep that file up to date (the trainer only).
    """

    def __init__(self, store: str = "", *, write_file: bool = False, version: Callable[[], int] = lambda: -1) -> None:
        self.store = store
        self.write_file = write_file
        self._version = version
        self._heard: dict[str, _Heard] = {}  # by the node id of the relay linked here
        self._lock = threading.Lock()
        self._written = 0.0
        self._wrote_any = False
        self._tracked = False
        # The report file's writes and its removal, one at a time: a write a receiving thread began
        # before close() would otherwise land after the removal, and leave the file behind.
        self._file_lock = threading.Lock()
        self._closed = False

    @property
    def version(self) -> int:
        """The newest complete version this node knows of (:class:`shmsync.store.reader_table.RemoteRows`)."""
        return self._version()

    def heard(self, node: str, via: str, entries: list[HostRows]) -> None:
        """A report came from relay ``node`` (linked here as ``via``)."""
        with self._lock:
            self._heard[node] = _Heard(via, entries, time.monotonic())
        self._maybe_write()

    def lost(self, node: str) -> None:
        """The link to relay ``node`` ended: its rows stay a while, marked lost."""
        with self._lock:
            heard = self._heard.get(node)
            if heard is not None and heard.lost_at is None:
                heard.lost_at = time.monotonic()
        self._maybe_write(force=True)

    def entries(self) -> list[HostRows]:
        """Every host heard of and still linked, aged to now (what a relay forwards upstream)."""
        now = time.monotonic()
        with self._lock:
            return [e.aged(now - h.at) for h in self._heard.values() if h.lost_at is None for e in h.entries]

    def remote_rows(self, store_version: int) -> tuple[list[HostReport], list[ReaderRow]]:
        """The hosts heard of and their rows, seen now against ``store_version`` (see ``reader_table.RemoteRows``)."""
        now = time.monotonic()
        hosts, rows = [], []
        with self._lock:
            for node in [n for n, h in self._heard.items() if h.lost_at is not None and now - h.lost_at > LOST_KEEP]:
                del self._heard[node]
            heard = list(self._heard.items())
        for node, h in heard:
            for e in h.entries:
                age = e.age_s + now - h.at
                state = "lost" if h.lost_at is not None else "silent" if now - h.at > SILENT_AFTER else "reporting"
                via = h.via if e.node == node else f"below {h.via}"
                hosts.append(HostReport(e.host, via, e.store, age, state, len(e.rows), e.transfer))
                extra = {"state": "lost"} if state == "lost" else {}
                rows += rebase(e.rows, store_version, now - h.at, **extra)
        return hosts, rows

    def _maybe_write(self, force: bool = False) -> None:
        if not self.write_file or not self.store:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._written < WRITE_EVERY:
                return
            self._written = now
            self._wrote_any = True
        hosts, rows = self.remote_rows(self.version)
        with self._file_lock:
            if self._closed:
                return
            try:
                if write_report_file(self.store, hosts, rows) and not self._tracked:
                    # Removed by the resource tracker if this process is killed, as its store is.
                    self._tracked = segment.track_file(self.store + REPORT_SUFFIX, register=True)
            except OSError:
                pass  # the table in this process has them; `shmsync ls NAME` shows local readers only

    def close(self) -> None:
        with self._file_lock:
            self._closed = True
            if self._wrote_any:
                remove_report_file(self.store)
            if self._tracked:
                self._tracked = not segment.track_file(self.store + REPORT_SUFFIX, register=False)


def own_rows(store_name: str, node: str, rows: list[ReaderRow], transfer: Transfer | None = None) -> HostRows:
    """This host's entry of a report (``transfer``: what the versions that reached it cost)."""
    return HostRows(HOST, node, store_name, 0.0, tuple(rows), transfer)


__all__ = ["HostRows", "ReportBook", "read_report_file", "report_from_wire", "report_to_wire"]
