"""A collector that is another process's remote node: a node of shmsync's distributed collectors,
or a Ray actor of its ``RayCollector``.

Such a collector publishes each push of the trainer's weights under the trainer's number of that
push, and the trainer checks after every push that each node or actor it reached published it
(:mod:`shmsync.torchrl.distributed`):

- **a node** (:class:`NodePushes`) reads the number from the TCPStore TorchRL's push already uses,
  where the trainer wrote it before pushing, and writes back what it published. It never raises
  into TorchRL's receive path (TorchRL would then never acknowledge the push, and the trainer
  would wait on it for an hour): a problem is written back instead, and the trainer raises it;
- **an actor** (:class:`ActorPushes`) is told the number in a call the trainer submits just before
  the push (Ray runs an actor's calls from one caller in order), and answers the trainer's
  question afterwards. An error is raised: Ray hands it to the trainer at that push.

``name_push`` and ``published_version`` run inside an actor, through Ray's ``__ray_call__``.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from shmsync.errors import InvalidArgumentError, ShmSyncError
from shmsync.store.reader_table import merge
from shmsync.torchrl import compat, push_deltas
from shmsync.torchrl.publisher import Publisher
from shmsync.watch.remote_rows import (
    MAX_REPORT_BYTES,
    REPORT_EVERY,
    HostRows,
    own_rows,
    report_from_wire,
    report_to_wire,
)

PUSH_KEY = "shmsync/push"  # the number of the trainer's latest push, set before it is sent
PUBLISHED_KEY = "shmsync/published/{rank}"  # what a node published last, or what went wrong
READY_KEY = "shmsync/ready/{rank}"
READERS_KEY = "shmsync/readers/{rank}"  # the node's readers' table, rewritten about once a second
STORE_TIMEOUT = timedelta(seconds=60)
CONFIRM_FLUSH_S = 30.0  # how long an actor asked for its version waits for the push's copy to land
ERROR = "error: "
log = logging.getLogger("shmsync.torchrl.distributed")


class NodePushes:
    """A node of shmsync's ``DistributedSyncCollector`` / ``DistributedCollector``.

    Args:
        collector: the node's own collector (its local workers' collector).
        model_id: the key whose pushes this pushes numbers.
        upstream: where the trainer's push store listens (the trainer tells its remote_schemes before the
            nodes start).
    """

    def __init__(self, collector: Any, model_id: str, upstream: tuple[str, int] | None) -> None:
        self.collector = collector
        self.model_id = model_id
        self.upstream = upstream
        self.last = 0  # version 0: the weights the node started from
        self._client: torch.distributed.Store | None = None
        self.node = secrets.token_hex(8)

    def _store(self) -> torch.distributed.Store | None:
        if self._client is None and self.upstream is not None:
            self._client = _client(*self.upstream)
        return self._client

    @property
    def rank(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return int(self.collector.worker_idx)

    def started(self) -> None:
        """The node's store exists: tell the trainer, which waits for it before its first push
        (a push before it would reach no worker). Never raises: the trainer names the problem."""
        try:
            store = self._store()
        except ShmSyncError as e:
            log.error("shmsync: node %s cannot tell the trainer its store exists: %s", self.rank, e)
            return
        if store is not None:
            store.set(READY_KEY.format(rank=self.rank), "1")
            threading.Thread(
                target=self._report_readers, args=(self.upstream,), name="shmsync-node-report", daemon=True
            ).start()

    def _report_readers(self, address: tuple[str, int]) -> None:
        """About once a second, the node's readers' table into the TCPStore, where the trainer's
        table reads it; ends with the node (or when the store cannot be reached any more)."""
        rank, seq = self.rank, 0
        try:
            store = torch.distributed.TCPStore(*address, is_master=False, timeout=STORE_TIMEOUT)  # its own link
            while True:
                time.sleep(REPORT_EVERY)
                entry = collector_rows(self.collector, self.node)
                if entry is None:
                    return  # the node's collector shut down
                seq += 1
                store.set(READERS_KEY.format(rank=rank), encode_report(seq, [entry]).decode())
        except Exception as e:  # the trainer went: nothing to report to
            log.debug("shmsync: node %s stopped reporting its readers: %s", rank, e)

    def take(self) -> int:
        """The trainer's number of the push being applied."""
        store = self._store()
        if store is None:
            raise compat.changed(compat.NODES_START, "the trainer told this node no push store")
        number = int(store.get(PUSH_KEY)) if store.check([PUSH_KEY]) else None
        if number is None or number <= self.last:
            raise ShmSyncError(
                f"a push reached node {self.rank} that the trainer did not number (the store says {number}, this node "
                f"already published {self.last}): TorchRL pushed around shmsync's numbering"
            )
        refused = push_deltas.refusal(number)
        if refused is not None:  # what arrived is not that push's weights whole: nothing of it is published
            raise ShmSyncError(f"node {self.rank} refused the leaves it was sent: {refused}")
        return number

    def applied(self, version: int) -> None:
        self.last = version
        self._report(str(version))

    def failed(self, error: BaseException) -> None:
        self._report(f"{ERROR}{type(error).__name__}: {error}")

    def _report(self, value: str) -> None:
        try:
            store = self._store()
        except ShmSyncError as e:
            log.error("shmsync: node %s cannot tell the trainer %r: %s", self.rank, value, e)
            return
        if store is not None:
            store.set(PUBLISHED_KEY.format(rank=self.rank), value)


@functools.cache
def _client(host: str, port: int) -> torch.distributed.Store:
    # A connection of its own: TorchRL's receiving thread blocks the node scheme's in a long get().
    return torch.distributed.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT)


class Announced:
    """The trainer's number of the next push, named by the trainer just before it pushes
    (``RayCollector``: in a call Ray runs before the push). Each number is taken by one push: a
    second push with no new number is refused rather than given the old one. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._number: int | None = None

    def name(self, number: int) -> None:
        with self._lock:
            self._number = int(number)

    def take(self) -> int:
        with self._lock:
            number, self._number = self._number, None
        if number is None:
            raise ShmSyncError(
                "a push of the trainer's weights reached this collector, but the trainer named no version for it "
                "(a collector that does not number its pushes, or a push that went around the numbering): use "
                "shmsync.torchrl.distributed.RayCollector, shmsync.torchrl.distributed.DistributedSyncCollector or "
                "shmsync.torchrl.distributed.DistributedCollector"
            )
        return number


class ActorPushes(Announced):
    """A Ray actor of shmsync's ``RayCollector``: the trainer names each push's number first."""

    def __init__(self) -> None:
        super().__init__()
        self.node = secrets.token_hex(8)  # names this actor's host entry in the trainer's table

    def started(self) -> None:
        pass

    def applied(self, version: int) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        raise error


def make_pushes(
    kind: str, collector: Any, model_id: str, upstream: tuple[str, int] | None = None
) -> NodePushes | ActorPushes:
    """The remote node of ``kind`` (``"distributed"`` or ``"ray"``) for ``collector`` (a node's scheme
    reads each push's number in the trainer's push store, at ``upstream``)."""
    if kind == "distributed":
        return NodePushes(collector, model_id, upstream)
    if kind == "ray":
        return ActorPushes()
    raise InvalidArgumentError(f"unknown remote node {kind!r}")


def collector_rows(collector: Any, node: str) -> HostRows | None:
    """This host's entry of a report: the readers of ``collector``'s stores (None once they closed)."""
    publisher = Publisher.of(collector)
    groups = publisher.live_groups() if publisher is not None else []
    if not groups:
        return None
    table = merge([g.readers(processes=True, memory=False) for g in groups])
    return own_rows(table.store, node, [*table.rows, *table.gone], push_deltas.node_transfer())


def encode_report(seq: int, entries: list[HostRows]) -> bytes:
    """A node's report as stored: its number (so the trainer tells a new one from the last) and its rows."""
    return json.dumps({"seq": seq, "report": report_to_wire(entries)}, separators=(",", ":")).encode()


def decode_report(raw: bytes) -> tuple[int, list[HostRows]]:
    """A node's report as the trainer reads it, every field checked (ValueError names the first bad one)."""
    if len(raw) > MAX_REPORT_BYTES:
        raise InvalidArgumentError(f"a report of {len(raw)} bytes, more than {MAX_REPORT_BYTES}")
    doc = json.loads(raw)
    if not isinstance(doc, dict) or set(doc) != {"seq", "report"}:
        raise InvalidArgumentError("a report is not {'seq': ..., 'report': ...}")
    seq = doc["seq"]
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise InvalidArgumentError(f"a report's seq is {str(seq)[:20]}")
    return seq, report_from_wire(doc["report"])


def name_push(actor: Any, number: int) -> None:
    """Inside an actor: the next push is the trainer's number ``number``."""
    publisher = Publisher.of(actor)
    if publisher is not None and isinstance(publisher.pushes, ActorPushes):
        publisher.pushes.name(number)


def shut_down(actor: Any) -> None:
    """Inside an actor about to exit: shut its collector down (its workers end, its stores close)."""
    shutdown = getattr(actor, "shutdown", None)
    if callable(shutdown):
        shutdown()


def published_version(actor: Any) -> tuple[int | None, bytes | None]:
    """Inside an actor: the newest version its stores hold (None without shmsync), once the push's
    copy landed (a background copy may still run), and its readers' table as a report (None
    without shmsync)."""
    publisher = Publisher.of(actor)
    groups = publisher.live_groups() if publisher is not None else []
    if publisher is None or not groups:
        return None, None
    for store in (s for g in groups for s in g.stores):
        store.flush(timeout=CONFIRM_FLUSH_S)
    pushes = publisher.pushes
    node = pushes.node if isinstance(pushes, ActorPushes) else secrets.token_hex(8)
    try:
        entry = collector_rows(actor, node)
        report = encode_report(0, [entry]) if entry is not None else None
    except Exception as e:  # the table is for the operator: never a reason to fail the push
        log.warning("shmsync: this actor's readers' table could not be read: %s", e)
        report = None
    return max(g.version for g in groups), report
