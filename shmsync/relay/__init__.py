"""Weights beyond one host: the trainer's store relayed over TCP to one relay process per host,
which publishes each version into that host's store under the trainer's version number.

The relays form a tree rooted at the trainer: the trainer's :class:`RelaySender` takes at most
``fanout`` relays itself and points every further one at a relay below it, so the trainer
sends each version ``fanout`` times however many hosts there are. A relay receives a version
straight into a free slot of its host's store and forwards each piece to the relays below it
as soon as it has arrived and passed its check (pipelined, not stored and forwarded); it
commits the version under the trainer's number once the last byte is in. ``fanout=1`` makes a
chain.

Every link starts with the handshake of :mod:`shmsync.relay.wire` (both ends prove the relay
secret), and its frames are encrypted and authenticated under keys of that connection alone
(``encrypt=False`` on both ends, only inside a tunnel, sends them plain). Each server binds only
the address it is given, runs every pending handshake on one thread with a deadline (a peer
silent for a second is cut), and points relays only at relays whose address it checked: the
relay there proved the secret and its identity. Every size and version a peer sends is checked
before a byte is received into memory or published. A peer that breaks the protocol is dropped
and logged (``logging.getLogger("shmsync.relay")``, refusals at most a few per 10 seconds);
nothing it sent is published.

Per host, latest wins: a link that is busy sending one version sends the newest one next and
skips those in between. A link idle for a while carries a keepalive; a relay that takes no bytes
for ``timeout`` seconds is dropped, freeing its place and its address. A slow relay delays only
the relays below it; a dead or stalled one cuts them off until they re-attach: each relay that
loses its parent goes back to the trainer, which points it at a relay with room, and continues
from the version its host holds. When the trainer closes its sender, every relay ends
(``run()`` returns); when the trainer dies, they raise :class:`~shmsync.errors.TrainerGoneError`.
"""

from __future__ import annotations

import json
import logging
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shmsync.core.header import MAX_LAYOUT_BYTES, ROW_LINK
from shmsync.core.layout import Layout, key_str
from shmsync.core.protocol import Write
from shmsync.errors import (
    AuthenticationError,
    ProtocolError,
    RelayError,
    ShmSyncError,
    StoreCorruptError,
    StoreNotFoundError,
    TrainerGoneError,
    WeightMismatchError,
)
from shmsync.relay import wire
from shmsync.relay.reports import Reporter, listen
from shmsync.relay.wire import read_secret_file
from shmsync.remote_rows import HostRows, ReportBook, own_rows
from shmsync.store import WeightStore
from shmsync.table import add_remote, remove_remote

log = logging.getLogger("shmsync.relay")

# Message kinds (see wire for the framing). Relay -> server: JOIN, then HAVE or MISM; or PROB
# (a server checking this one's address: it answers NODE). Server -> relay: REDI (go there
# instead), or LYOT and CONF; then per version VERS, DATA..., CNCL (that version will not
# complete), PING while idle, and at the end STOP (the trainer closed: end) or BYE (this server
# leaves: re-attach through the trainer).
JOIN, HAVE, MISM, PROB, NODE = b"JOIN", b"HAVE", b"MISM", b"PROB", b"NODE"
REDI, LYOT, CONF = b"REDI", b"LYOT", b"CONF"
VERS, DATA, CNCL, PING, STOP, BYE = b"VERS", b"DATA", b"CNCL", b"PING", b"STOP", b"BYE_"
VERSION = struct.Struct(">qQ")  # version, payload bytes

FANOUT = 2
BUCKET_BYTES = 1 << 20
MAX_BUCKET_BYTES = 1 << 30
MAX_FANOUT = 64
MAX_PENDING = 4096  # handshakes under way at once (at most a quarter of the descriptors); beyond, one is cut
MAX_JOINING = 32  # peers that proved the secret and are joining, at once
SILENT_CUTOFF = 1.0  # seconds a new connection may send nothing
STALL_SECONDS = 1.0  # a relay that takes no bytes this long stalls: its link lets its slot go
MAX_LINKS = 256  # relays one server feeds, overflow included
MAX_DROPPED = 256  # relays remembered in `dropped`
MAX_HOPS = 16  # redirects followed before giving up
MAX_DEPTH = 256
MAX_VERSION = 1 << 62  # versions a peer may send (a store holds int64 versions)
MAX_VERSION_LEAP = 1 << 32  # how far above the host's version a relay's next version may be
CLOSE_WITHIN = 2.0  # close() returns within this many seconds, whatever the peers do

__all__ = ["Relay", "RelaySender", "TrainerGoneError", "describe_difference", "read_secret_file"]


@dataclass
class _Forwarding:
    """A version a relay is receiving: its children send its bytes as they arrive."""

    version: int
    nbytes: int
    write: Write
    received: int = 0
    state: str = "receiving"  # then "complete" or "cancelled"


@dataclass
class _Child:
    id: int
    node: str  # the relay's own random id (for cycle checks and its address's check)
    link: wire.Link
    serve: tuple[str, int] | None
    sent: int
    verified: bool = False  # a relay at `serve` proved the secret and this node id
    verifying: bool = True  # that check is under way
    in_version: bool = False  # a VERS went out, the version's end (its last DATA, or CNCL) not yet
    stalled_since: float | None = None  # when the relay last took no bytes for STALL_SECONDS
    thread: threading.Thread | None = field(default=None, repr=False)


class _Throttled:
    """Logs a kind of message at most ``burst`` times per ``period`` seconds, then how many more."""

    def __init__(self, burst: int = 5, period: float = 10.0) -> None:
        self.burst, self.period = burst, period
        self.start, self.count, self.lock = 0.0, 0, threading.Lock()

    def warning(self, message: str) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.start > self.period:
                if self.count > self.burst:
                    log.warning("... and %d more like it in %.0f s", self.count - self.burst, self.period)
                self.start, self.count = now, 0
            self.count += 1
            if self.count > self.burst:
                return
        log.warning("%s", message)


@dataclass
class _Pending:
    sock: socket.socket
    peer: str
    side: wire.ServerSide
    began: float
    got: bytearray = field(default_factory=bytearray)


class _Acceptor:
    """Accepts connections and runs every handshake under way on one thread, on non-blocking
    sockets: a connection costs a socket and a few bytes until its peer proved the secret, however
    many there are. A connection that sends nothing for :data:`SILENT_CUTOFF` seconds, or has not
    finished in ``handshake_timeout``, is cut; at :data:`MAX_PENDING` at once, a new one cuts the
    oldest that sent nothing (else the oldest), so a flood cannot keep a relay out: a relay's
    handshake takes one round trip."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.pending: OrderedDict[int, _Pending] = OrderedDict()
        self.selector = selectors.DefaultSelector()
        self.most = max(16, min(MAX_PENDING, _descriptors() // 4))
        self.resume_accepting = 0.0  # out of descriptors: accept again from then on

    def run(self) -> None:
        server = self.server
        server.sock.setblocking(False)
        self.selector.register(server.sock, selectors.EVENT_READ)
        try:
            while not server.stopping.is_set():
                for key, _ in self.selector.select(0.1):
                    if key.fileobj is server.sock:
                        self._accept()
                    else:
                        self._read(self.pending.get(key.fileobj.fileno()))
                self._expire()
                if self.resume_accepting and time.monotonic() > self.resume_accepting:
                    self.resume_accepting = 0.0
                    self.selector.register(server.sock, selectors.EVENT_READ)
        finally:
            for pending in list(self.pending.values()):
                self._cut(pending, None)
            self.selector.close()

    def _accept(self) -> None:
        server = self.server
        for _ in range(64):  # a burst at a time, then the handshakes under way get their turn
            try:
                sock, peer = server.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            pending = _Pending(
                sock, f"{peer[0]}:{peer[1]}", wire.ServerSide(server.secret, server.encrypt), time.monotonic()
            )
            try:
                sock.send(pending.side.hello())  # 48 bytes: a new socket's buffer takes them
            except OSError:
                sock.close()
                continue
            if len(self.pending) >= self.most:
                silent = next((p for p in self.pending.values() if not p.got), None)
                self._cut(silent or next(iter(self.pending.values())), f"{self.most} handshakes under way")
            self.pending[sock.fileno()] = pending
            self.selector.register(sock, selectors.EVENT_READ)

    def _read(self, pending: _Pending | None) -> None:
        if pending is None:
            return
        try:
            data = pending.sock.recv(wire.CLIENT_HELLO - len(pending.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._cut(pending, f"its connection failed ({e})")
            return
        if not data:
            self._cut(pending, "it hung up during the handshake")
            return
        pending.got += data
        if len(pending.got) < wire.CLIENT_HELLO:
            return
        self._forget(pending)
        try:
            reply, keys = pending.side.answer(bytes(pending.got))
        except AuthenticationError as e:
            if isinstance(getattr(e, "reply", None), bytes):
                _send_now(pending.sock, e.reply)
            pending.sock.close()
            self.server.refuse(f"refused {pending.peer}: {e}")
            return
        if not _send_now(pending.sock, reply):
            pending.sock.close()
            return
        self.server.admit(pending.sock, pending.peer, keys)

    def _expire(self) -> None:
        now, server = time.monotonic(), self.server
        for pending in list(self.pending.values()):
            if now - pending.began > server.handshake_timeout:
                self._cut(pending, f"no handshake within {server.handshake_timeout:.1f} s")
            elif not pending.got and now - pending.began > min(SILENT_CUTOFF, server.handshake_timeout):
                self._cut(pending, f"silent for {min(SILENT_CUTOFF, server.handshake_timeout):.1f} s")

    def _forget(self, pending: _Pending) -> None:
        self.pending.pop(pending.sock.fileno(), None)
        try:
            self.selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def _cut(self, pending: _Pending, why: str | None) -> None:
        self._forget(pending)
        pending.sock.close()
        if why is not None:
            self.server.refuse(f"cut {pending.peer}: {why}")


def _descriptors() -> int:
    """This process's limit on open descriptors."""
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return 1024


def _send_now(sock: socket.socket, data: bytes) -> bool:
    """Send a few bytes on a non-blocking socket (a buffer takes them at once); False if it failed."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


class _Server:
    """Feeds the relays that attach to one node of the tree (the trainer, or a relay): accepts,
    authenticates, admits up to ``fanout`` and points the rest further down, and runs one thread
    per admitted relay that sends it the newest version whenever there is a newer one."""

    def __init__(
        self,
        address: str,
        port: int,
        *,
        secret: bytes,
        node: str,
        bucket_bytes: int,
        timeout: float,
        handshake_timeout: float,
        encrypt: bool,
        root: bool,
    ) -> None:
        self.secret, self.node, self.encrypt, self.root = secret, node, encrypt, root
        self.bucket_bytes = int(bucket_bytes)
        if not 1 <= self.bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes must be between 1 and {MAX_BUCKET_BYTES}, got {bucket_bytes}")
        if not timeout > 0 or not handshake_timeout > 0:
            raise ValueError(f"timeouts must be > 0, got timeout={timeout}, handshake_timeout={handshake_timeout}")
        self.timeout, self.handshake_timeout = timeout, handshake_timeout
        self.ping_every = min(5.0, timeout / 4)
        self.fanout = FANOUT
        self.path: list[str] = []  # node ids from the trainer down to this node
        self.description: bytes | None = None
        self.store: WeightStore | None = None
        self.forwarding: _Forwarding | None = None
        self.children: dict[int, _Child] = {}
        self.dropped: OrderedDict[int, str] = OrderedDict()
        self.refused = 0  # connections that did not prove the secret, or broke the handshake
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self._throttled = _Throttled()
        self._joining = threading.BoundedSemaphore(MAX_JOINING)
        self._next_id, self._turn = 1, 0
        self._admitting: dict[int, tuple[str, int] | None] = {}  # seated, joining: where they serve
        self._final = STOP
        self._warned_overflow = False
        self.book = ReportBook()  # what the relays below report of their hosts' readers
        self.sock = socket.create_server((address, port), backlog=512)
        self.address = self.sock.getsockname()[:2]
        self._accept: threading.Thread | None = None

    def start(self, description: bytes, path: list[str], fanout: int) -> None:
        """Serve ``description``'s versions (from :meth:`set_store`'s store) from now on."""
        with self.changed:
            self.description, self.path, self.fanout = description, path, fanout
        if self._accept is None:
            acceptor = _Acceptor(self)
            self._accept = threading.Thread(target=acceptor.run, name="shmsync-relay-accept", daemon=True)
            self._accept.start()

    def set_store(self, store: WeightStore) -> None:
        """Send ``store``'s versions, waking on each one this process publishes into it."""
        with self.changed:
            if self.store is store:
                return
            self.store = store
            self.changed.notify_all()
        store.add_publish_listener(self.notify)

    def notify(self, *_: Any) -> None:
        with self.changed:
            self.changed.notify_all()

    def refuse(self, why: str) -> None:
        self._throttled.warning(why)
        with self.changed:
            self.refused += 1

    # -- admitting relays ------------------------------------------------------------------------
    def admit(self, sock: socket.socket, peer: str, keys: wire.Keys | None) -> None:
        """A peer proved the secret: let it join (or answer its probe) on a thread of its own."""
        if not self._joining.acquire(blocking=False):
            sock.close()
            self.refuse(f"cut {peer}: {MAX_JOINING} relays are joining at once")
            return
        sock.setblocking(True)
        threading.Thread(target=self._join, args=(sock, peer, keys), name="shmsync-relay-join", daemon=True).start()

    def _join(self, sock: socket.socket, peer: str, keys: wire.Keys | None) -> None:
        link, owned, seated = wire.Link(sock, peer, keys, min(STALL_SECONDS, self.timeout)), False, None
        try:
            wire.tune(sock)
            kind, doc = link.recv_json({JOIN: wire.MAX_JSON_BYTES, PROB: 0}, self.handshake_timeout)
            if kind == PROB:  # a server checking that this address is this node's
                link.send_json(NODE, {"node": self.node})
                return
            node, serve = _check_join(doc, peer)
            with self.changed:
                # A relay admitted just before may still be having its address checked: wait
                # for that (a round trip) rather than take this one on as an overflow.
                deadline = time.monotonic() + self.handshake_timeout
                while self._checks_pending() and time.monotonic() < deadline and not self.stopping.is_set():
                    self.changed.wait(0.05)
                target = self._redirect_target()
                if target is None and len(self.children) + len(self._admitting) >= MAX_LINKS:
                    raise ProtocolError(f"{MAX_LINKS} relays are linked here already")
                if target is None:
                    seated = id(sock)
                    self._admitting[seated] = serve
            if target is not None:
                link.send_json(REDI, {"to": list(target)})
                return
            link.send(LYOT, self.description)
            link.send_json(CONF, {"fanout": self.fanout, "path": [*self.path, self.node], "bucket": self.bucket_bytes})
            kind, doc = link.recv_json({HAVE: wire.MAX_JSON_BYTES, MISM: wire.MAX_JSON_BYTES}, self.handshake_timeout)
            with self.changed:
                relay_id, self._next_id = self._next_id, self._next_id + 1
            if kind == MISM:
                why = str(doc.get("why", "?"))[:500] if isinstance(doc, dict) else "?"
                self._drop(relay_id, f"WeightMismatchError: its host's store holds another model: {why}")
                return
            have = doc.get("version") if isinstance(doc, dict) else None
            self._check_have(have, peer)
            child = _Child(relay_id, node, link, serve, have)
            child.thread = threading.Thread(target=self._feed, args=(child,), name=f"shmsync-relay-{relay_id}")
            child.thread.daemon = True
            with self.changed:
                if self.stopping.is_set():
                    raise EOFError("closing")
                self.children[relay_id] = child
                self._admitting.pop(seated, None)
                seated = None
            child.thread.start()
            owned = True  # the feeding thread closes it
            threading.Thread(
                target=listen,
                args=(link, self.book, node, f"relay {relay_id}", self.stopping.is_set, self.timeout),
                name=f"shmsync-relay-{relay_id}-reports",
                daemon=True,
            ).start()
            if serve is not None:
                threading.Thread(target=self._verify, args=(child,), name="shmsync-relay-verify", daemon=True).start()
            else:
                child.verifying = False
        except (ProtocolError, AuthenticationError, EOFError, OSError, ValueError) as e:
            self.refuse(f"dropped {peer} during its handshake: {e}")
        finally:
            if seated is not None:
                with self.changed:
                    self._admitting.pop(seated, None)
            if not owned:
                link.close()
            self._joining.release()

    def _check_have(self, have: Any, peer: str) -> None:
        """The version a joining relay holds: none (-1) up to this node's newest (a relay's server,
        which may be behind the trainer: up to a bound above it)."""
        if not (isinstance(have, int) and not isinstance(have, bool) and -1 <= have <= MAX_VERSION):
            raise ProtocolError(f"{peer} answered the layout with {str(have)[:100]}, not a version")
        with self.changed:
            newest = self._newest()
        most = newest if self.root else newest + MAX_VERSION_LEAP
        if have > most:
            raise ProtocolError(f"{peer} claims version {have}, but the newest here is {newest}")

    def _newest(self) -> int:
        """With ``changed`` held: the newest version this node holds or is receiving."""
        newest = self.store.version if self.store is not None and not self.store.closed else -1
        fwd = self.forwarding
        return max(newest, fwd.version) if fwd is not None and fwd.state != "cancelled" else newest

    def _checks_pending(self) -> bool:
        """With ``changed`` held: the fan-out is full, nobody below takes relays yet, and a relay's
        address is being checked."""
        full = len(self.children) + len(self._admitting) >= self.fanout
        return (
            full
            and not any(c.verified for c in self.children.values())
            and any(c.verifying for c in self.children.values())
        )

    def _redirect_target(self) -> tuple[str, int] | None:
        """With ``changed`` held: where to point a relay that joins now, or None to admit it."""
        if len(self.children) + len(self._admitting) < self.fanout:
            return None
        serving = [c.serve for c in self.children.values() if c.serve is not None and c.verified]
        if not serving:  # nobody below can take it: admit it anyway, and say so once
            if not self._warned_overflow:
                self._warned_overflow = True
                log.warning(
                    "more than %d relays joined here and none below takes relays of its own at an address checked "
                    "to be its own: this node now sends each version to each of them",
                    self.fanout,
                )
            return None
        self._turn += 1
        return serving[self._turn % len(serving)]

    def _verify(self, child: _Child) -> None:
        """Check that the relay at ``child.serve`` proves the secret and is ``child`` (its node id):
        only then are other relays pointed there."""
        host, port = child.serve
        verified = False
        try:
            link = wire.connect(host, port, self.secret, self.handshake_timeout, encrypt=self.encrypt)
            try:
                link.send(PROB)
                _, doc = link.recv_json({NODE: wire.MAX_JSON_BYTES}, self.handshake_timeout)
                verified = doc == {"node": child.node}
            finally:
                link.close()
        except (OSError, EOFError, RelayError, AuthenticationError) as e:
            log.info("relay %d serves at %s:%s, which does not answer as it (%s)", child.id, host, port, e)
        with self.changed:
            child.verified = verified and child.id in self.children
            child.verifying = False
            self.changed.notify_all()

    # -- feeding one relay ----------------------------------------------------------------------
    def _feed(self, child: _Child) -> None:
        """Send ``child`` the newest version whenever there is a newer one (a keepalive while
        idle). A lease on the slot sent from is held only while the relay takes bytes: one that
        takes none for :data:`STALL_SECONDS` has the rest of the frame kept on the link (at most a
        bucket), the lease released and that version given up (CNCL) once it takes bytes again;
        one that takes none for ``timeout`` is dropped."""
        row, store = -1, None
        try:
            while True:
                if child.link.kept is not None:
                    self._recover(child)
                    continue
                with self.changed:
                    waited = time.monotonic()
                    while not self.stopping.is_set() and not self._newer(child.sent):
                        if time.monotonic() - waited > self.ping_every:
                            break
                        self.changed.wait(0.05)  # also sees publishes of other processes
                    if self.stopping.is_set():
                        break
                    newer = self._newer(child.sent)
                    store, fwd = self.store, self.forwarding
                if not newer:
                    self._sent(child, child.link.send_or_keep(PING))  # idle: the relay can tell this node lives
                    continue
                protocol = store.memory.protocol
                if row < 0:
                    row = protocol.claim_row(flags=ROW_LINK)  # not a reader: left out of the readers' table
                in_flight = fwd is not None and fwd.state != "cancelled" and fwd.version > store.version
                if in_flight and fwd.version > child.sent:
                    # Still arriving (or not committed yet): forward what is there, then follow.
                    if protocol.lease_written(row, fwd.write):
                        try:
                            with store.memory.slot_buffer(fwd.write.slot) as view:
                                self._send(child, fwd.version, view, fwd)
                        finally:
                            protocol.release_lease(row)
                    else:  # no lease to be had: wait for the commit, then send it whole
                        with self.changed:
                            while fwd.state == "receiving" and not self.stopping.is_set():
                                self.changed.wait(0.05)
                    continue
                leased = protocol.lease_latest(row)
                try:
                    if leased is not None:
                        slot, version = leased
                        if version > child.sent:
                            with store.memory.slot_buffer(slot) as view:
                                self._send(child, version, view, None)
                        continue
                finally:
                    protocol.release_lease(row)
                # No slot can be leased now (another link sends from the one that can be, or the
                # writer is on it): no private copy; the newest version goes once one can be.
                with self.changed:
                    self.changed.wait(0.05)
            self._say_goodbye(child)
        except (OSError, EOFError, ShmSyncError) as e:
            if not self.stopping.is_set():
                self._drop(child.id, f"{type(e).__name__}: {e}")
        finally:
            if store is not None and row >= 0 and not store.closed:
                store.memory.protocol.release_lease(row)
                store.memory.protocol.release_row(row)
            with self.changed:
                self.children.pop(child.id, None)  # its place and its address go with it
            child.link.close()

    def _newer(self, sent: int) -> bool:
        """With ``changed`` held: whether a version newer than ``sent`` can be sent now."""
        if self.store is None or self.store.closed:
            return False
        fwd = self.forwarding
        if fwd is not None and fwd.state != "cancelled" and fwd.version > max(sent, self.store.version):
            return True
        return self.store.version > sent

    def _sent(self, child: _Child, whole: bool) -> bool:
        """Note whether a frame went whole; if not, the relay stalls from now on."""
        if not whole and child.stalled_since is None:
            child.stalled_since = time.monotonic()
        return whole

    def _recover(self, child: _Child) -> None:
        """A stalled relay: wait (no lease held) until it takes the rest of its frame, then give up
        the version it was in the middle of; raise if it takes nothing for ``timeout`` seconds."""
        deadline = child.stalled_since + self.timeout
        if not child.link.flush_kept(deadline, self.stopping.is_set):
            if self.stopping.is_set():
                raise EOFError("closing")
            raise TimeoutError(f"it took no bytes for {self.timeout:.0f} s")
        child.stalled_since = None
        if child.in_version:
            child.in_version = not self._sent(child, child.link.send_or_keep(CNCL))

    def _send(self, child: _Child, version: int, view: memoryview, fwd: _Forwarding | None) -> None:
        """Send one version from ``view`` (as far as ``fwd`` has received it, if given). Sets
        ``child.sent`` once it went whole; returns early if it was cancelled upstream, this server
        closes, or the relay stalls (the rest of the frame is then kept on the link)."""
        link, n = child.link, len(view)
        child.in_version = True
        if not self._sent(child, link.send_or_keep(VERS, VERSION.pack(version, n))):
            return
        offset = 0
        while offset < n:
            available = n
            if fwd is not None:
                with self.changed:
                    while fwd.received <= offset and fwd.state == "receiving" and not self.stopping.is_set():
                        self.changed.wait(0.05)
                    available = fwd.received if fwd.state != "cancelled" else -1
            if self.stopping.is_set() or available < 0:
                child.in_version = not self._sent(child, link.send_or_keep(CNCL))
                return
            end = min(available, offset + self.bucket_bytes)
            if not self._sent(child, link.send_or_keep(DATA, view[offset:end])):
                return
            offset = end
        child.in_version = False
        child.sent = version

    def _say_goodbye(self, child: _Child) -> None:
        if child.link.kept is not None:
            return  # a stalled relay: it sees the link close
        try:
            child.link.send_or_keep(self._final)  # a relay that stopped reading must not hold close() up
        except OSError:
            pass

    def _drop(self, relay_id: int, why: str) -> None:
        self._throttled.warning(f"dropped relay {relay_id}: {why}")
        with self.changed:
            self.dropped[relay_id] = why
            while len(self.dropped) > MAX_DROPPED:
                self.dropped.popitem(last=False)

    # -- forwarding (a relay's server) ----------------------------------------------------------
    def begin(self, version: int, nbytes: int, write: Write) -> _Forwarding:
        fwd = _Forwarding(version, nbytes, write)
        with self.changed:
            self.forwarding = fwd
            self.changed.notify_all()
        return fwd

    def advance(self, fwd: _Forwarding, received: int) -> None:
        with self.changed:
            fwd.received = received
            self.changed.notify_all()

    def end(self, fwd: _Forwarding, complete: bool) -> None:
        with self.changed:
            fwd.state = "complete" if complete else "cancelled"
            self.changed.notify_all()

    # -- lifetime -------------------------------------------------------------------------------
    def close(self, final: bytes = STOP) -> None:
        """Stop accepting, tell every linked relay ``final`` (STOP: end; BYE: re-attach elsewhere),
        and return within :data:`CLOSE_WITHIN` seconds whatever they do."""
        deadline = time.monotonic() + CLOSE_WITHIN
        with self.changed:
            if self.stopping.is_set():
                return
            self._final = final
            self.stopping.set()
            self.changed.notify_all()
            children, store = list(self.children.values()), self.store
        if store is not None:
            store.remove_publish_listener(self.notify)
        if self._accept is not None:
            self._accept.join(max(0.0, min(0.5, deadline - time.monotonic())))
        self.sock.close()
        for child in children:
            child.thread.join(max(0.0, deadline - time.monotonic() - 0.2))
        for child in children:
            child.link.close()  # a thread still blocked in a send to a stalled relay wakes up


def _check_join(doc: Any, peer: str) -> tuple[str, tuple[str, int] | None]:
    if not isinstance(doc, dict) or set(doc) != {"node", "serve"}:
        raise ProtocolError(f"{peer} joined with {str(doc)[:100]}, not {{'node': ..., 'serve': ...}}")
    node = doc["node"]
    if not (isinstance(node, str) and len(node) == 16 and all(c in "0123456789abcdef" for c in node)):
        raise ProtocolError(f"{peer} joined with node id {str(node)[:40]!r}, not 16 hex digits")
    serve = None if doc["serve"] is None else wire.address(doc["serve"], f"{peer}'s serving address")
    return node, serve


class RelaySender:
    """Trainer side: relays every new version of ``store`` to the relays that join.

    It takes at most ``fanout`` relays itself and points the others at relays below them
    (see :mod:`shmsync.relay`), once it checked that a relay answers at the address it
    announced; each linked relay gets a thread that sends it the newest version straight from
    its slot of the store (leased, so the trainer does not rewrite it meanwhile), waking on
    each publish. ``publish()`` never waits for any of it. A relay that takes no bytes for
    ``timeout`` seconds, in the middle of a version or not, is dropped (:attr:`dropped`),
    freeing its place and its address; no link ever keeps a copy of the weights.

    Args:
        store: the trainer's store (this process publishes into it).
        address: the address to listen on, and only that one: ``127.0.0.1`` (the default) for
            relays on this machine; this host's address on the network relays reach it by, to
            serve other hosts.
        port: the TCP port (0: any free one, see :attr:`port`).
        secret: the relay secret every relay must prove: at least 32 random bytes (see
            ``shmsync new-secret``). Default: ``$SHMSYNC_RELAY_SECRET``, else the file
            ``$SHMSYNC_RELAY_SECRET_FILE``, else a new random one, printed once to stderr
            (and in :attr:`secret`).
        fanout: relays this sender, and each relay, feeds directly (1: a chain).
        bucket_bytes: a version travels in frames of at most this many bytes (pieces a relay
            checks and forwards as soon as they arrive).
        timeout: seconds a relay may take no bytes before it is dropped.
        handshake_timeout: seconds a connecting relay has to prove the secret and say hello.
        encrypt: encrypt and authenticate every frame (the default). False only for links
            inside a tunnel that does so (WireGuard, SSH): every relay must say the same.

    Example:
        >>> import torch
        >>> from shmsync import WeightStore
        >>> from shmsync.relay import RelaySender
        >>> policy = torch.nn.Linear(4, 2)
        >>> secret = "a random secret of at least 32 bytes, as `shmsync new-secret` makes"
        >>> with WeightStore.create(policy) as store, RelaySender(store, "127.0.0.1", 0, secret=secret) as sender:
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
        secret: str | bytes | None = None,
        fanout: int = FANOUT,
        bucket_bytes: int = BUCKET_BYTES,
        timeout: float = 60.0,
        handshake_timeout: float = 5.0,
        encrypt: bool = True,
    ) -> None:
        if isinstance(fanout, bool) or not isinstance(fanout, int) or not 1 <= fanout <= MAX_FANOUT:
            raise ValueError(f"fanout must be an int between 1 and {MAX_FANOUT}, got {fanout!r}")
        raw, generated = wire.resolve_secret(secret, generate=True)
        if encrypt:
            wire.Keys(bytes(32), bytes(32))  # the cipher is installed (else a clear ImportError now)
        self.secret = raw.decode(errors="replace")
        self.store = store
        self._server = _Server(
            address,
            port,
            secret=raw,
            node=secrets.token_hex(8),
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            handshake_timeout=handshake_timeout,
            encrypt=encrypt,
            root=True,
        )
        if generated:
            print(
                f"shmsync.relay: no relay secret was given; this run's is {self.secret}\n"
                f"  pass it to each relay: {wire.SECRET_ENV}=... or a file only you can read, named in "
                f"{wire.SECRET_FILE_ENV}",
                file=sys.stderr,
            )
        self._server.book = ReportBook(store.name, write_file=True, latest=lambda: store.version)
        add_remote(store, self._server.book)  # store.readers() lists the readers on every host
        self._server.set_store(store)
        self._server.start(store.layout_description, [], fanout)

    @property
    def address(self) -> tuple[str, int]:
        """The address and port it listens on."""
        return self._server.address

    @property
    def port(self) -> int:
        return self._server.address[1]

    @property
    def relays(self) -> dict[int, int]:
        """Relays this sender feeds directly now: relay id -> the last version sent to it."""
        with self._server.changed:
            return {i: c.sent for i, c in self._server.children.items()}

    @property
    def serving(self) -> dict[int, tuple[str, int]]:
        """Relays fed directly whose announced address was checked (others are pointed there)."""
        with self._server.changed:
            return {i: c.serve for i, c in self._server.children.items() if c.verified and c.serve is not None}

    @property
    def bytes_sent(self) -> dict[int, int]:
        """Bytes sent to each relay fed directly now (frames and payloads), by relay id."""
        with self._server.changed:
            return {i: c.link.bytes_sent for i, c in self._server.children.items()}

    @property
    def dropped(self) -> dict[int, str]:
        """Relays dropped (the last 256): relay id -> why (it went away, took no bytes for
        ``timeout`` seconds, broke the protocol, holds another model)."""
        with self._server.changed:
            return dict(self._server.dropped)

    @property
    def refused(self) -> int:
        """Connections refused before they became a relay (no secret, a broken or silent
        handshake, too many at once)."""
        return self._server.refused

    def close(self) -> None:
        """Tell every relay to stop, and stop listening; returns within 2 seconds."""
        self._server.close(STOP)
        remove_remote(self.store, self._server.book)
        self._server.book.close()

    def __enter__(self) -> RelaySender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Relay:
    """Host side: joins the trainer's :class:`RelaySender` (directly, or through the relay it is
    pointed at) and publishes each version it receives into this host's store, under the
    trainer's version number; relays below it get each piece as it arrives.

    Args:
        address, port: where the trainer's :class:`RelaySender` listens.
        store: the name of this host's store. If it exists, its layout must be the trainer's
            (else :class:`~shmsync.WeightMismatchError`, nothing written); if not, it is created
            from the first version received (so readers here never see any other first version).
        secret: the relay secret (default: ``$SHMSYNC_RELAY_SECRET``, else the file
            ``$SHMSYNC_RELAY_SECRET_FILE``): at least 32 random bytes.
        listen: ``(address, port)`` to take relays of its own on. Default ``"auto"``: this
            host's address towards the trainer, any free port. None: take none (a leaf).
        num_slots: slots of a store created here (4: one for the relays below to send from
            while the next version arrives).
        timeout: seconds to keep trying to reach the trainer, and that a link may stay silent
            (a parent sends keepalives while idle) before this relay re-attaches.
        handshake_timeout: seconds each handshake may take.
        encrypt: as the trainer's :class:`RelaySender` has it (both ends must agree).

    Example:
        >>> relay = Relay("10.0.0.1", 29600, store="policy")  # doctest: +SKIP
        >>> relay.run()  # until the trainer closes its sender; TrainerGoneError if it dies  # doctest: +SKIP
    """

    def __init__(
        self,
        address: str,
        port: int,
        *,
        store: str,
        secret: str | bytes | None = None,
        listen: tuple[str, int] | str | None = "auto",
        num_slots: int = 4,
        bucket_bytes: int = BUCKET_BYTES,
        timeout: float = 60.0,
        handshake_timeout: float = 5.0,
        encrypt: bool = True,
    ) -> None:
        self.root = (address, int(port))
        self.name = store
        self.secret, _ = wire.resolve_secret(secret)
        if encrypt:
            wire.Keys(bytes(32), bytes(32))  # the cipher is installed (else a clear ImportError now)
        self.encrypt = encrypt
        self.listen = listen
        self.num_slots = num_slots
        self.bucket_bytes = bucket_bytes
        self.timeout, self.handshake_timeout = timeout, handshake_timeout
        self.node = secrets.token_hex(8)
        self.store: WeightStore | None = None
        self.received = 0
        self.parent: tuple[str, int] | None = None  # where versions come from now
        self.attachments = 0  # how many times it (re-)attached
        self._server: _Server | None = None
        self._description: bytes | None = None
        self._layout: Layout | None = None
        self._bucket = MAX_BUCKET_BYTES  # the most bytes the parent puts in one frame

    @property
    def serving(self) -> tuple[str, int] | None:
        """The address relays below this one attach to (None for a leaf, or before :meth:`run`)."""
        return self._server.address if self._server is not None else None

    def run(self, max_versions: int | None = None) -> None:
        """Receive until the trainer closes its sender (or ``max_versions`` were published here),
        re-attaching through the trainer whenever the relay it receives from goes away.

        Raises:
            TrainerGoneError: the trainer cannot be reached any more (its process died), or no
                version arrived for ``timeout`` seconds while re-attaching.
            WeightMismatchError: this host's store holds another model; nothing written.
            AuthenticationError: the trainer (or a relay it pointed at) holds another secret,
                or wants the other mode; or the trainer's frames failed their check.
            ProtocolError: the trainer itself broke the protocol (nothing it sent was published).
        """
        try:
            lost = []  # when links were lost since the last version received
            while max_versions is None or self.received < max_versions:
                link = self._attach()
                received = self.received
                book = self._server.book if self._server is not None else ReportBook()
                reporter = Reporter(link, self.node, self._own_rows, book)
                try:
                    if self._follow(link, max_versions) == "stopped" and self._server is not None:
                        self._server.close(STOP)  # the trainer closed its sender: the tree ends
                    return
                except (ProtocolError, AuthenticationError):
                    if self.parent == self.root:
                        raise  # the trainer itself broke the protocol: no other parent to try
                    self._lost(link, lost, received, "it broke the protocol")
                except (EOFError, OSError, _Left) as e:
                    self._lost(link, lost, received, e)
                finally:
                    reporter.close()
                    link.close()
        except BaseException:
            if self._server is not None:
                self._server.close(BYE)  # the relays below find another parent
            raise

    def _own_rows(self) -> HostRows | None:
        """This host's readers, for the report to the parent (None before this host's store exists)."""
        store = self.store
        if store is None or store.closed:
            return None
        try:
            table = store.readers(processes=True, memory=False)
        except ShmSyncError:
            return None
        return own_rows(self.name, self.node, [*table.rows, *table.gone])

    def _lost(self, link: wire.Link, lost: list[float], received: int, why: Any) -> None:
        """Note a lost parent; give up once links keep failing for ``timeout`` seconds without a
        version arriving (a tree that never delivers is as good as a dead trainer)."""
        now = time.monotonic()
        if self.received > received:
            lost.clear()
        lost.append(now)
        if now - lost[0] > self.timeout:
            raise TrainerGoneError(
                f"relay {self.name!r}: no version arrived for {self.timeout} s while re-attaching ({why})"
            )
        log.warning("relay %r: lost %s (%s); re-attaching through the trainer", self.name, link.peer, why)
        time.sleep(min(1.0, 0.05 * 2 ** (len(lost) - 1)))  # links that keep failing: back off

    # -- attaching ------------------------------------------------------------------------------
    def _attach(self) -> wire.Link:
        """An admitted link to a node of the tree: the trainer, or where it points."""
        deadline = time.monotonic() + self.timeout
        target, hops = self.root, 0
        while True:
            try:
                link = wire.connect(
                    *target, self.secret, self.handshake_timeout, encrypt=self.encrypt, send_timeout=self.timeout
                )
            except ConnectionRefusedError as e:
                if target == self.root:
                    raise TrainerGoneError(f"relay {self.name!r}: nobody listens at {target[0]}:{target[1]}") from e
                target, hops = self.root, 0  # the relay it was pointed at is gone: ask again
                self._give_up_after(deadline, e)
                continue
            except AuthenticationError:
                raise
            except (RelayError, OSError) as e:
                self._give_up_after(deadline, e)
                time.sleep(0.2)
                target, hops = self.root, 0
                continue
            why: BaseException
            try:
                if self._server is None and self.listen is not None:
                    self._server = self._make_server(link)
                link.send_json(JOIN, {"node": self.node, "serve": self.serving and list(self.serving)})
                allowed = {REDI: wire.MAX_JSON_BYTES, LYOT: MAX_LAYOUT_BYTES}
                kind, length = link.recv_frame(allowed, self.handshake_timeout)
                if kind == REDI:
                    doc = link.recv_payload_json(kind, self.handshake_timeout)
                    link.close()
                    target = wire.address(doc.get("to") if isinstance(doc, dict) else None, "a redirect")
                    hops += 1
                    if hops > MAX_HOPS:
                        raise ProtocolError(f"pointed from relay to relay {MAX_HOPS} times without being admitted")
                    continue
                if self._admitted(link, link.recv_payload(self.handshake_timeout)):
                    self.parent = target
                    self.attachments += 1
                    return link
                link.close()
                why = ProtocolError(f"{link.peer} is below this relay in the tree (a cycle)")
            except WeightMismatchError:
                link.close()
                raise
            except (ProtocolError, AuthenticationError, EOFError, OSError, ValueError) as e:
                link.close()
                if target == self.root and isinstance(e, (ProtocolError, AuthenticationError)):
                    raise  # the trainer itself broke the protocol
                why = e
            self._give_up_after(deadline, why)
            log.warning("relay %r: attaching through %s:%s failed (%s); trying the trainer", self.name, *target, why)
            time.sleep(0.05)
            target, hops = self.root, 0

    def _give_up_after(self, deadline: float, error: BaseException) -> None:
        if time.monotonic() > deadline:
            raise TrainerGoneError(
                f"relay {self.name!r}: could not attach to the trainer's tree within {self.timeout} s ({error})"
            ) from error

    def _make_server(self, link: wire.Link) -> _Server:
        host, port = (link.sock.getsockname()[0], 0) if self.listen == "auto" else self.listen
        return _Server(
            host,
            port,
            secret=self.secret,
            node=self.node,
            bucket_bytes=self.bucket_bytes,
            timeout=self.timeout,
            handshake_timeout=self.handshake_timeout,
            encrypt=self.encrypt,
            root=False,
        )

    def _admitted(self, link: wire.Link, description: bytes) -> bool:
        """Check the layout and the tree path the parent sent, answer with the version this host
        holds; False if admitting would make a cycle. Raises WeightMismatchError (after telling
        the parent) when this host's store holds another model."""
        if self._description is None or description != self._description:  # parsed once, not at every re-attach
            if self._description is not None:
                raise ProtocolError(f"{link.peer} serves another layout than the one this relay had")
            try:
                layout, _ = Layout.from_json(description, f"the layout {link.peer} sent")
            except StoreCorruptError as e:
                raise ProtocolError(str(e)) from None
        else:
            layout = self._layout
        _, conf = link.recv_json({CONF: wire.MAX_JSON_BYTES}, self.handshake_timeout)
        fanout, path, bucket = (conf.get(k) if isinstance(conf, dict) else None for k in ("fanout", "path", "bucket"))
        if not (
            isinstance(fanout, int)
            and not isinstance(fanout, bool)
            and 1 <= fanout <= MAX_FANOUT
            and isinstance(path, list)
            and 0 < len(path) <= MAX_DEPTH
            and all(isinstance(p, str) and len(p) == 16 for p in path)
            and isinstance(bucket, int)
            and not isinstance(bucket, bool)
            and 1 <= bucket <= MAX_BUCKET_BYTES
        ):
            raise ProtocolError(f"{link.peer} sent the tree's settings as {str(conf)[:100]}")
        if self.node in path:
            return False
        if self.store is None:
            try:
                self.store = WeightStore.attach(self.name)
            except StoreNotFoundError:
                self.store = None
        if self.store is not None and self.store.layout_description != description:
            why = describe_difference(self.store.layout_description, description)
            link.send_json(MISM, {"why": why})
            raise WeightMismatchError(
                f"relay: this host's store {self.name!r} holds another model than the trainer's: {why}; nothing written"
            )
        link.send_json(HAVE, {"version": self.store.version if self.store is not None else -1})
        self._description, self._layout, self._bucket = description, layout, bucket
        if self._server is not None:
            if self.store is not None:
                self._server.set_store(self.store)
            self._server.start(description, path, fanout)
        return True

    # -- receiving ------------------------------------------------------------------------------
    def _follow(self, link: wire.Link, max_versions: int | None) -> str:
        """Receive versions from ``link`` until the trainer closed its sender (``"stopped"``) or
        ``max_versions`` were published here (``"enough"``)."""
        nbytes = self._layout.payload_bytes
        while max_versions is None or self.received < max_versions:
            # The parent sends a keepalive while idle: silence for `timeout` means it is gone.
            kind, _ = link.recv_frame({VERS: (VERSION.size, VERSION.size), PING: 0, STOP: 0, BYE: 0}, self.timeout)
            if kind == PING:
                continue
            if kind == STOP:
                return "stopped"
            if kind == BYE:
                raise _Left(f"{link.peer} left the tree")
            version, size = VERSION.unpack(link.recv_payload(self.timeout))
            held = self.store.version if self.store is not None else -1
            if not (held < version <= MAX_VERSION) or (held >= 0 and version - held > MAX_VERSION_LEAP):
                raise ProtocolError(
                    f"{link.peer} sent version {version}; this host holds {held} (versions only go up, by at most "
                    f"{MAX_VERSION_LEAP} at a time, to at most {MAX_VERSION})"
                )
            if size != nbytes:
                raise ProtocolError(f"{link.peer} announced {size} bytes for version {version}, the layout {nbytes}")
            if self._receive(link, version):
                self.received += 1
        return "enough"

    def _receive(self, link: wire.Link, version: int) -> bool:
        """Receive one version into a free slot and commit it; False if the sender cancelled it."""
        cancelled = []

        def fill(buffer: memoryview) -> None:
            fwd = None
            if self._server is not None and self.store is not None:
                fwd = self._server.begin(version, len(buffer), self.store.memory.protocol.writing)
            try:
                self._fill(link, buffer, fwd)
            except _Cancelled:
                cancelled.append(True)
                raise
            except BaseException:
                if fwd is not None:
                    self._server.end(fwd, complete=False)
                raise
            if fwd is not None:
                self._server.end(fwd, complete=True)

        try:
            if self.store is None:
                self.store = WeightStore.create_from_bytes(
                    self._description, fill, version=version, name=self.name, num_slots=self.num_slots
                )
                if self._server is not None:
                    self._server.set_store(self.store)
            else:
                self.store.publish_bytes(fill, version=version)
        except _Cancelled:
            return False
        return True

    def _fill(self, link: wire.Link, buffer: memoryview, fwd: _Forwarding | None) -> None:
        """Receive a version's frames into ``buffer``; each piece is there (and forwarded) only
        once it passed its check."""
        n, got = len(buffer), 0
        while got < n:
            kind, length = link.recv_frame(
                {DATA: (1, min(n - got, self._bucket)), CNCL: 0, STOP: 0, BYE: 0}, self.timeout
            )
            if kind in (CNCL, STOP, BYE):
                if fwd is not None:
                    self._server.end(fwd, complete=False)
                if kind == CNCL:
                    raise _Cancelled()
                raise _Left(f"{link.peer} stopped in the middle of a version")
            link.recv_payload_into(buffer[got : got + length], self.timeout)
            got += length
            if fwd is not None:
                self._server.advance(fwd, got)

    def close(self) -> None:
        """Stop feeding relays below (they re-attach elsewhere) and let go of this host's store."""
        if self._server is not None:
            self._server.close(BYE)
        if self.store is not None:
            self.store.close()


class _Cancelled(Exception):
    """The parent cancelled the version being received (it will send a newer one)."""


class _Left(Exception):
    """The parent stopped feeding this relay (it is leaving the tree): attach elsewhere."""


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
