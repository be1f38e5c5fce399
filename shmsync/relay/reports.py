"""Readers' tables up the relay tree: each relay reports its host's readers, and those of the
relays below it, to its parent, so the trainer's table lists every reader on every host.

A report is one ``RPRT`` frame a relay sends its parent about once a second, on the link it
receives versions from (the only frames a relay sends upstream once it joined): small (about
60 bytes a reader), bounded (:data:`MAX_REPORT_BYTES`), checked field by field like every other
input (:func:`shmsync.watch.remote_rows.report_from_wire`). Nothing rides on the publish path: a relay
reads its host's table on a thread of its own, and a server reads each link's reports on another.
What a node heard is kept in a :class:`~shmsync.watch.remote_rows.ReportBook`.
"""

from __future__ import annotations

import json
import select
import threading
from collections.abc import Callable

from shmsync.errors import ProtocolError
from shmsync.relay import wire
from shmsync.watch.remote_rows import (
    MAX_REPORT_BYTES,
    REPORT_EVERY,
    HostRows,
    ReportBook,
    report_from_wire,
    report_to_wire,
)

RPRT = b"RPRT"


def listen(link: wire.Link, book: ReportBook, node: str, via: str, stopping: Callable[[], bool], timeout: float):
    """Receive ``node``'s reports from ``link`` until it ends or ``stopping()``. A link whose reports
    stop is not cut here (the thread feeding it decides whether the relay still lives): its host
    shows as silent. One that sends anything but reports, or a frame that does not come whole
    within ``timeout`` seconds, is closed (its child_link then drops it). Its rows stay in ``book``,
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
    except (OSError, ValueError, EOFError, ProtocolError, wire.AuthenticationError):
        link.close()
    finally:
        book.lost(node)


class Reporter:
    """A relay's thread that sends its parent a report about once a second: its host's readers
    (``own()``) and those ``book`` heard of below it."""

    def __init__(self, link: wire.Link, node: str, own: Callable[[], HostRows | None], book: ReportBook) -> None:
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
            except (OSError, wire.RelayError):
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


__all__ = ["RPRT", "Reporter", "listen"]
