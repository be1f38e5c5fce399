"""Weights beyond one host: the trainer's store relayed over torch.distributed to one relay
process per host, which publishes each version into that host's store under the trainer's
version number.

Trainer host: a :class:`RelaySender` beside the trainer's store listens for relays (a
``TCPStore`` at ``address:port``). Each relay that joins gets a thread and a two-rank gloo
process group of its own. The thread sends the store's layout once; then, whenever the store
holds a newer version than that relay has, it sends the newest version's bytes, once per host
however many workers the host runs: a header (version, layout fingerprint, byte count, bucket size)
and the payload in buckets. A slow host delays only its own thread, and skips the versions it had no
time for (latest wins); the trainer's ``publish()`` never waits for any of it.

Other hosts: one :class:`Relay` joins, checks the host's store against the trainer's layout
(or creates it from the first version it receives), and receives each version straight into a
free slot of it (:meth:`WeightStore.publish_bytes`), committed under the trainer's version.
Until then the host's readers keep the previous version. A relay killed mid-receive leaves a
slot that is never read; a new relay takes the writer role and catches up. When the trainer
goes, its relays' receives fail at once and :meth:`Relay.run` raises :class:`TrainerGoneError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._layout import Layout, key_str
from .errors import ShmSyncError, StoreNotFoundError, WeightMismatchError
from .store import WeightStore

JOINED = "relay/joined"
HEADER, PAYLOAD, HELLO = 0, 1, 2  # message tags
STOP = -1  # a header's version when the sender closes
BUCKET_BYTES = 16 << 20


class TrainerGoneError(ShmSyncError, ConnectionError):
    """The trainer's :class:`RelaySender` went away (closed, or its process died)."""


def fingerprint(layout_description: bytes) -> int:
    """A 63-bit digest of a store layout (what a version's header carries)."""
    return int.from_bytes(hashlib.blake2b(layout_description, digest_size=8).digest(), "little") >> 1


def _group(tcp: dist.Store, relay_id: int, rank: int, timeout: float) -> dist.ProcessGroup:
    """The two-rank gloo group of one relay and the sender (loopback or any host address)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout)
    host = os.environ.get("SHMSYNC_RELAY_INTERFACE_ADDR", "")
    device = (
        dist.ProcessGroupGloo.create_device(hostname=host) if host else dist.ProcessGroupGloo.create_default_device()
    )
    opts._devices = [device]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"relay/{relay_id}/", tcp), rank, 2, opts)


def _send(pg: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> None:
    pg.send([tensor], peer, tag).wait()


def _recv(pg: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> None:
    pg.recv([tensor], peer, tag).wait()


def _buckets(flat: torch.Tensor, size: int):
    for start in range(0, flat.numel(), size):
        yield flat[start : start + size]


class RelaySender:
    """Trainer side: relays every new version of ``store`` to the relays that join.

    Args:
        store: the trainer's store (this process publishes into it).
        address: the address relays connect to (``127.0.0.1`` for relays on this machine).
        port: the TCP port relays connect to.
        bucket_bytes: a version travels in pieces of at most this many bytes.
        timeout: seconds a send may stall before that relay is dropped.

    Example:
        >>> import torch
        >>> from shmsync import WeightStore
        >>> from shmsync.relay import RelaySender
        >>> policy = torch.nn.Linear(4, 2)
        >>> with WeightStore.create(policy) as store, RelaySender(store, "127.0.0.1", 29631) as sender:
        ...     store.publish(policy)  # relays on other hosts receive version 1
        ...     sender.relays  # none joined in this example
        1
        {}
    """

    def __init__(
        self,
        store: WeightStore,
        address: str = "127.0.0.1",
        port: int = 29600,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        timeout: float = 60.0,
    ) -> None:
        self.store = store
        self.bucket_bytes = int(bucket_bytes)
        self.timeout = timeout
        self._description = store.layout_description
        self._fingerprint = fingerprint(self._description)
        self._tcp = dist.TCPStore(address, port, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._errors: dict[int, str] = {}
        self._links: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="shmsync-relay-accept", daemon=True)
        self._accept.start()

    @property
    def relays(self) -> dict[int, int]:
        """Relays linked now: relay id -> the last version sent to it."""
        with self._lock:
            return dict(self._sent)

    @property
    def bytes_sent(self) -> dict[int, int]:
        """Bytes sent to each relay so far (headers and payloads), by relay id."""
        with self._lock:
            return dict(self._bytes)

    @property
    def dropped(self) -> dict[int, str]:
        """Relays dropped: relay id -> why (it went away, or holds another model)."""
        with self._lock:
            return dict(self._errors)

    def _accept_loop(self) -> None:
        known = 0
        while not self._stop.wait(0.02):
            joined = self._tcp.add(JOINED, 0)
            for relay_id in range(known + 1, joined + 1):
                link = threading.Thread(
                    target=self._link, args=(relay_id,), name=f"shmsync-relay-{relay_id}", daemon=True
                )
                self._links.append(link)
                link.start()
            known = max(known, joined)

    def _link(self, relay_id: int) -> None:
        reader = WeightStore.attach(self.store.name)  # its own reader state, apart from the trainer's
        try:
            pg = _group(self._tcp, relay_id, 0, self.timeout)
            doc = torch.frombuffer(bytearray(self._description), dtype=torch.uint8)
            _send(pg, torch.tensor([doc.numel()]), 1, HELLO)
            _send(pg, doc, 1, HELLO)
            answer = torch.zeros(2, dtype=torch.int64)  # [accepted, version it holds]
            _recv(pg, answer, 1, HELLO)
            if not answer[0]:
                raise WeightMismatchError(f"relay {relay_id} holds another model (it says which)")
            sent = int(answer[1])
            with self._lock:
                self._sent[relay_id] = sent
            buf = torch.empty(reader.nbytes, dtype=torch.uint8)
            while not self._stop.is_set():
                if reader.version <= sent:
                    self._stop.wait(0.0001)
                    continue
                version = reader.read_bytes(buf)
                header = torch.tensor([version, self._fingerprint, buf.numel(), self.bucket_bytes])
                _send(pg, header, 1, HEADER)
                for piece in _buckets(buf, self.bucket_bytes):
                    _send(pg, piece, 1, PAYLOAD)
                sent = version
                with self._lock:
                    self._sent[relay_id] = sent
                    self._bytes[relay_id] = self._bytes.get(relay_id, 0) + header.numel() * 8 + buf.numel()
            _send(pg, torch.tensor([STOP, self._fingerprint, 0, 0]), 1, HEADER)
        except Exception as e:  # the relay went away, or refused: only this link ends
            with self._lock:
                self._errors[relay_id] = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._sent.pop(relay_id, None)
            reader.close()

    def close(self, timeout: float = 10.0) -> None:
        """Tell every relay to stop, and stop listening."""
        self._stop.set()
        self._accept.join(timeout)
        for link in self._links:
            link.join(timeout)
        self._tcp = None

    def __enter__(self) -> RelaySender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Relay:
    """Host side: joins a :class:`RelaySender` and publishes each version it relays into this
    host's store, under the trainer's version number.

    Args:
        address, port: where the trainer's :class:`RelaySender` listens.
        store: the name of this host's store. If it exists, its layout must be the trainer's
            (else :class:`~shmsync.WeightMismatchError`, nothing written); if not, it is created
            from the first version received (so readers here never see any other first version).
        num_slots: slots of a store created here.
        timeout: seconds to wait for the sender, and for a stalled receive.

    Example:
        >>> relay = Relay("10.0.0.1", 29600, store="policy")  # doctest: +SKIP
        >>> relay.run()  # until the trainer closes its sender; TrainerGoneError if it dies  # doctest: +SKIP
    """

    def __init__(self, address: str, port: int, *, store: str, num_slots: int = 3, timeout: float = 60.0) -> None:
        self.address, self.port, self.name = address, int(port), store
        self.num_slots = num_slots
        self.timeout = timeout
        self.store: WeightStore | None = None
        self.received = 0

    def run(self, max_versions: int | None = None) -> None:
        """Receive until the sender stops (or ``max_versions`` were published here).

        Raises:
            TrainerGoneError: the sender's process went away mid-run.
            WeightMismatchError: this host's store holds another model; nothing written.
        """
        tcp = dist.TCPStore(self.address, self.port, None, False, timeout=timedelta(seconds=self.timeout))
        relay_id = tcp.add(JOINED, 1)
        try:
            pg = _group(tcp, relay_id, 1, self.timeout)
            description = self._hello(pg)
            layout, destinations = Layout.from_json(description)
            expected = fingerprint(description)
            while max_versions is None or self.received < max_versions:
                header = torch.zeros(4, dtype=torch.int64)
                _recv(pg, header, 0, HEADER)
                version, print_, nbytes, bucket = (int(x) for x in header)
                if version == STOP:
                    return
                if print_ != expected or nbytes != layout.payload_bytes:
                    raise WeightMismatchError(f"relay: a version arrived for another layout ({nbytes} bytes)")
                self._receive(pg, version, layout, destinations, bucket)
                self.received += 1
        except RuntimeError as e:  # gloo: the peer's connection closed
            if isinstance(e, ShmSyncError):
                raise
            raise TrainerGoneError(f"relay {self.name!r}: the trainer's sender went away ({e})") from e

    def _hello(self, pg: dist.ProcessGroup) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        _recv(pg, size, 0, HELLO)
        raw = bytearray(int(size))
        _recv(pg, torch.frombuffer(raw, dtype=torch.uint8), 0, HELLO)
        description = bytes(raw)
        try:
            self.store = WeightStore.attach(self.name)
        except StoreNotFoundError:
            self.store = None
        if self.store is not None and self.store.layout_description != description:
            why = describe_difference(self.store.layout_description, description)
            _send(pg, torch.tensor([0, -1]), 0, HELLO)
            raise WeightMismatchError(
                f"relay: this host's store {self.name!r} holds another model than the trainer's: {why}; nothing written"
            )
        have = self.store.version if self.store is not None else -1
        _send(pg, torch.tensor([1, have]), 0, HELLO)
        return description

    def _receive(self, pg: dist.ProcessGroup, version: int, layout: Layout, destinations: Any, bucket: int) -> None:
        def fill(view: torch.Tensor) -> None:
            for piece in _buckets(view, bucket):
                _recv(pg, piece, 0, PAYLOAD)

        if self.store is not None:
            self.store.publish_bytes(fill, version=version)
            return
        # The first version makes the store: it never holds anything but the trainer's versions.
        raw = bytearray(layout.payload_bytes)
        fill(torch.frombuffer(raw, dtype=torch.uint8))
        td = layout.as_tensordict(layout.slot_views(raw, 0))
        source = {d: td[d] for d in destinations} if destinations else td
        self.store = WeightStore.create(source, name=self.name, num_slots=self.num_slots, version=version)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def describe_difference(ours: bytes, theirs: bytes) -> str:
    """The first key, shape or dtype in which two store layouts differ, in words."""
    a, b = (json.loads(x) for x in (ours, theirs))
    rows_a = {key_str(tuple(r[0])): r for r in a["entries"]}
    rows_b = {key_str(tuple(r[0])): r for r in b["entries"]}
    missing, extra = sorted(set(rows_b) - set(rows_a)), sorted(set(rows_a) - set(rows_b))
    if missing or extra:
        return f"keys the trainer has and this store lacks {missing[:5]}, keys only here {extra[:5]}"
    for key in sorted(rows_a):
        (_, shape_a, dtype_a, *_), (_, shape_b, dtype_b, *_) = rows_a[key], rows_b[key]
        if shape_a != shape_b:
            return f"{key!r} has shape {tuple(shape_a)} here, {tuple(shape_b)} on the trainer"
        if dtype_a != dtype_b:
            return f"{key!r} has dtype {dtype_a} here, {dtype_b} on the trainer"
    return "the destinations or the byte layout differ"
