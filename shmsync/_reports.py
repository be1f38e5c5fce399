"""Readers' tables up the relay tree: each relay reports its host's readers, and those of the
relays below it, to its parent, so the trainer's table lists every reader on every host.

A report is one ``RPRT`` frame a relay sends its parent about once a second, on the link it
receives versions from (the only frames a relay sends upstream once it joined): small (about
60 bytes a reader), bounded (:data:`MAX_REPORT_BYTES`), checked field by field like every other
input (:func:`shmsync.table.report_from_wire`). Nothing rides on the publish path: a relay reads
its host's table on a thread of its own, and a server reads each link's reports on another.

Ages travel, never clocks: each host's entry says how old its rows were when sent, and every
node that forwards it adds how long it held it. A host whose reports stop shows as ``silent``
after :data:`SILENT_AFTER` seconds; one whose link ended as ``lost``, its rows kept (marked so)
for :data:`LOST_KEEP` seconds.
"""

from __future__ import annotations

import json
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import _segment, _wire
from .errors import ProtocolError
from .table import (
    HOST,
    REPORT_SUFFIX,
    HostReport,
    HostRows,
    ReaderRow,
    rebase,
    remove_report_file,
    report_from_wire,
    report_to_wire,
    write_report_file,
)

RPRT = b"RPRT"
MAX_REPORT_BYTES = 4 << 20
REPORT_EVERY = 1.0  # seconds between two reports of a relay
SILENT_AFTER = 3.5  # seconds without a report before a host shows as silent
LOST_KEEP = 30.0  # seconds the rows of a host whose link ended stay listed, marked lost
WRITE_EVERY = 1.0  # seconds between two writes of the trainer's report file


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

    def __init__(self, store: str = "", *, write_file: bool = False, latest: Callable[[], int] = lambda: -1) -> None:
        self.store = store
        self.write_file = write_file
        self._latest = latest
        self._heard: dict[str, _Heard] = {}  # by the node id of the relay linked here
        self._lock = threading.Lock()
        self._written = 0.0
        self._wrote_any = False
        self._tracked = False

    @property
    def latest(self) -> int:
        """The newest version this node knows of (:class:`shmsync.table.RemoteRows`)."""
        return self._latest()

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

    def remote_rows(self, latest: int) -> tuple[list[HostReport], list[ReaderRow]]:
        """The hosts heard of and their rows, seen now against ``latest`` (``shmsync.table.RemoteRows``)."""
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
                hosts.append(HostReport(e.host, via, e.store, age, state, len(e.rows)))
                extra = {"state": "lost"} if state == "lost" else {}
                rows += rebase(e.rows, latest, now - h.at, **extra)
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
        hosts, rows = self.remote_rows(self.latest)
        try:
            if write_report_file(self.store, hosts, rows) and not self._tracked:
                # Removed by the resource tracker if this process is killed, as its store is.
                self._tracked = _segment.track_file(self.store + REPORT_SUFFIX, register=True)
        except OSError:
            pass  # the table in this process has them; `shmsync ls NAME` shows local readers only

    def close(self) -> None:
        if self._wrote_any:
            remove_report_file(self.store)
        if self._tracked:
            self._tracked = not _segment.track_file(self.store + REPORT_SUFFIX, register=False)


def listen(link: _wire.Link, book: ReportBook, node: str, via: str, stopping: Callable[[], bool], timeout: float):
    """Receive ``node``'s reports from ``link`` until it ends or ``stopping()``. A link whose reports
    stop is not cut here (the thread feeding it decides whether the relay still lives): its host
    shows as silent. One that sends anything but reports, or a frame that does not come whole
    within ``timeout`` seconds, is closed (its feeder then drops it). Its rows stay in ``book``,
    marked lost."""
    poller = select.poll()  # not select(): a server may hold descriptors above 1024
    try:
        poller.register(link.sock, select.POLLIN)
        while not stopping():
            if not poller.poll(500):
                continue
            kind, _ = link.recv_frame({RPRT: MAX_REPORT_BYTES}, timeout)
            doc = link.recv_payload_json(kind, timeout)
            try:
                entries = report_from_wire(doc)
            except ValueError as e:
                raise ProtocolError(f"{link.peer} sent a report that fails its check: {e}") from None
            book.heard(node, via, entries)
    except (OSError, ValueError, EOFError, ProtocolError, _wire.AuthenticationError):
        link.close()
    finally:
        book.lost(node)


class Reporter:
    """A relay's thread that sends its parent a report about once a second: its host's readers
    (``own()``) and those ``book`` heard of below it."""

    def __init__(self, link: _wire.Link, node: str, own: Callable[[], HostRows | None], book: ReportBook) -> None:
        self.link, self.node, self.own, self.book = link, node, own, book
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shmsync-relay-report", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(REPORT_EVERY):
            mine = self.own()
            entries = ([mine] if mine is not None else []) + self.book.entries()
            payload = _encode(entries)
            try:
                self.link.send(RPRT, payload)
            except (OSError, _wire.RelayError):
                return  # the link ended: the relay re-attaches and starts another

    def close(self) -> None:
        self.stop.set()


def _encode(entries: list[HostRows]) -> bytes:
    """The report as bytes, within :data:`MAX_REPORT_BYTES` (the hosts furthest down are left out
    of one too large: the parent would refuse it, and the link with it)."""
    while True:
        payload = json.dumps(report_to_wire(entries), separators=(",", ":")).encode()
        if len(payload) <= MAX_REPORT_BYTES or not entries:
            return payload
        entries = entries[: len(entries) // 2]


def own_rows(store_name: str, node: str, rows: list[ReaderRow]) -> HostRows:
    """This host's entry of a report."""
    return HostRows(HOST, node, store_name, 0.0, tuple(rows))


__all__ = ["RPRT", "ReportBook", "Reporter", "listen", "own_rows"]
