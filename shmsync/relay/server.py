"""One node of the relay tree as seen from below: accepting and admitting relays, pointing the
rest further down, and the version this node is receiving (which its links forward as it comes).
Each admitted relay is fed by :mod:`shmsync.relay.child_link`."""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from typing import Any, cast

from shmsync.core.protocol import Write
from shmsync.errors import AuthenticationError, InvalidArgumentError, LinkClosedError, ProtocolError, RelayError
from shmsync.relay import wire
from shmsync.relay.acceptor import Acceptor
from shmsync.relay.child_link import ChildLink
from shmsync.relay.deltas import WireDelta
from shmsync.relay.messages import (
    CLOSE_WITHIN,
    CONF,
    FANOUT,
    HAVE,
    JOIN,
    LYOT,
    MAX_BUCKET_BYTES,
    MAX_DROPPED,
    MAX_JOINING,
    MAX_LINKS,
    MISM,
    NODE,
    PROB,
    REDI,
    STALL_SECONDS,
    STOP,
    Child,
    Forwarding,
    Throttled,
    check_have,
    check_join,
    log,
)
from shmsync.relay.reports import listen
from shmsync.relay.sealing import SealedShelf, SealedVersion
from shmsync.watch.remote_rows import ReportBook
from shmsync.writer.store import WeightStore


class Server:
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
            raise InvalidArgumentError(f"bucket_bytes must be between 1 and {MAX_BUCKET_BYTES}, got {bucket_bytes}")
        if not timeout > 0 or not handshake_timeout > 0:
            raise InvalidArgumentError(
                f"timeouts must be > 0, got timeout={timeout}, handshake_timeout={handshake_timeout}"
            )
        self.timeout, self.handshake_timeout = timeout, handshake_timeout
        self.ping_every = min(5.0, timeout / 4)
        self.fanout = FANOUT
        self.path: list[str] = []  # node ids from the trainer down to this node
        self.description: bytes | None = None
        self.store: WeightStore | None = None
        self.forwarding: Forwarding | None = None
        self.children: dict[int, Child] = {}
        self.dropped: OrderedDict[int, str] = OrderedDict()
        self.refused = 0  # connections that did not prove the secret, or broke the handshake
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self._throttled = Throttled()
        self._joining = threading.BoundedSemaphore(MAX_JOINING)
        self._next_id, self._turn = 1, 0
        self._admitting: dict[int, str] = {}  # seated, still joining: their node ids
        self.final = STOP
        self._warned_overflow = False
        self.book = ReportBook()  # what the relays below report of their hosts' readers
        self.sealed = SealedShelf(secret, self.bucket_bytes) if encrypt else None  # sealed once, for every link
        self.deltas = True  # send a relay holding the version before only what changed
        self._delta: tuple[int, WireDelta, bytearray] | None = None  # the newest delta's bytes, for every link
        self._delta_lock = threading.Lock()
        self.sock = socket.create_server((address, port), backlog=512)
        self.address = self.sock.getsockname()[:2]
        self._accept: threading.Thread | None = None

    def start(self, description: bytes, path: list[str], fanout: int) -> None:
        """Serve ``description``'s versions (from :meth:`set_store`'s store) from now on."""
        with self.changed:
            self.description, self.path, self.fanout = description, path, fanout
        if self._accept is None:
            acceptor = Acceptor(self)
            self._accept = threading.Thread(target=acceptor.run, name="shmsync-relay-accept", daemon=True)
            self._accept.start()

    def set_store(self, store: WeightStore) -> None:
        """Send ``store``'s versions, waking on each one this process publishes into it."""
        with self.changed:
            if self.store is store:
                return
            self.store = store
            self.changed.notify_all()
        store.add_listener(self.notify)

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
            node, serve, direct = check_join(doc, peer)
            target = self._seat_or_redirect(id(sock), node, direct)
            if target is not None:
                link.send_json(REDI, {"to": list(target)})
                return
            seated = id(sock)
            child = self._take_on(link, node, serve, peer)
            if child is None:
                return
            with self.changed:
                if self.stopping.is_set():
                    raise LinkClosedError("closing")
                self.children[child.id] = child
                self._admitting.pop(seated, None)
                seated = None
            self._start_links(child)
            owned = True  # the feeding thread closes it
        except (ProtocolError, AuthenticationError, EOFError, OSError, ValueError) as e:
            self.refuse(f"dropped {peer} during its handshake: {e}")
        finally:
            if seated is not None:
                with self.changed:
                    self._admitting.pop(seated, None)
            if not owned:
                link.close()
            self._joining.release()

    def _seat_or_redirect(self, seat: int, node: str, direct: bool) -> tuple[str, int] | None:
        """Where to point a relay that joins now, or None once a place here is kept for it (always
        if ``direct``: it was pointed round a circle). ProtocolError if ``node`` is taken here or above."""
        with self.changed:
            self._check_node_id(node)
            # A relay admitted just before may still be having its address checked: wait for
            # that (a round trip) rather than take this one on as an overflow.
            deadline = time.monotonic() + self.handshake_timeout
            while self._checks_pending() and time.monotonic() < deadline and not self.stopping.is_set():
                self.changed.wait(0.05)
            target = None if direct else self._redirect_target()
            if target is None and len(self.children) + len(self._admitting) >= MAX_LINKS:
                raise ProtocolError(f"{MAX_LINKS} relays are linked here already")
            if target is None:
                self._check_node_id(node)  # again: the wait above let the lock go
                self._admitting[seat] = node
            return target

    def _check_node_id(self, node: str) -> None:
        """With ``changed`` held: refuse a node id taken here or above (no peer joins twice, or as the trainer)."""
        if node == self.node or node in self.path:
            raise ProtocolError(f"joined under the node id {node} of this node or one above it in the tree")
        if node in self._admitting.values() or any(c.node == node for c in self.children.values()):
            raise ProtocolError(f"joined under the node id {node} of a relay linked here")

    def _take_on(self, link: wire.Link, node: str, serve: tuple[str, int] | None, peer: str) -> Child | None:
        """Send the layout and the tree's settings, take the relay's answer: the child to feed, or
        None if its host holds another model (it is dropped, saying so)."""
        link.send(LYOT, cast(bytes, self.description))  # set by start(), before any child
        link.send_json(CONF, {"fanout": self.fanout, "path": [*self.path, self.node], "bucket": self.bucket_bytes})
        kind, doc = link.recv_json({HAVE: wire.MAX_JSON_BYTES, MISM: wire.MAX_JSON_BYTES}, self.handshake_timeout)
        with self.changed:
            relay_id, self._next_id = self._next_id, self._next_id + 1
        if kind == MISM:
            why = str(doc.get("why", "?"))[:500] if isinstance(doc, dict) else "?"
            self.drop(relay_id, f"WeightMismatchError: its host's store holds another model: {why}")
            return None
        have = doc.get("version") if isinstance(doc, dict) else None
        with self.changed:
            newest = self._newest()
        check_have(have, newest, self.root, peer)
        return Child(relay_id, node, link, serve, cast(int, have))

    def _start_links(self, child: Child) -> None:
        """The threads of a new child: feeding it, reading its reports, checking its address."""
        child.thread = threading.Thread(target=ChildLink(self, child).run, name=f"shmsync-relay-{child.id}")
        child.thread.daemon = True
        child.thread.start()
        threading.Thread(
            target=listen,
            args=(child.link, self.book, child.node, f"relay {child.id}", self.stopping.is_set, self.timeout),
            name=f"shmsync-relay-{child.id}-reports",
            daemon=True,
        ).start()
        if child.serve is not None:
            threading.Thread(target=self._verify, args=(child,), name="shmsync-relay-verify", daemon=True).start()
        else:
            child.verifying = False

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

    def _verify(self, child: Child) -> None:
        """Check that the relay at ``child.serve`` proves the secret and is ``child`` (its node id):
        only then are other relays pointed there."""
        host, port = cast(tuple[str, int], child.serve)  # verified only when it serves
        verified = False
        try:
            link = wire.connect(host, port, self.secret, self.handshake_timeout, encrypt=self.encrypt)
            try:
                link.send(PROB)
                _, doc = link.recv_json({NODE: wire.MAX_JSON_BYTES}, self.handshake_timeout)
                # Never an address that answers as this node or one above it: relays pointed
                # there would be pointed back up, round a circle.
                with self.changed:
                    above = {self.node, *self.path}
                verified = doc == {"node": child.node} and child.node not in above
            finally:
                link.close()
        except (OSError, EOFError, RelayError, AuthenticationError) as e:
            log.info("relay %d serves at %s:%s, which does not answer as it (%s)", child.id, host, port, e)
        with self.changed:
            child.verified = verified and child.id in self.children
            child.verifying = False
            self.changed.notify_all()

    def newer(self, sent: int) -> bool:
        """With ``changed`` held: whether a version newer than ``sent`` can be sent now."""
        if self.store is None or self.store.closed:
            return False
        fwd = self.forwarding
        if fwd is not None and fwd.state != "cancelled" and fwd.version > max(sent, self.store.version):
            return True
        return self.store.version > sent

    def drop(self, relay_id: int, why: str) -> None:
        self._throttled.warning(f"dropped relay {relay_id}: {why}")
        with self.changed:
            self.dropped[relay_id] = why
            while len(self.dropped) > MAX_DROPPED:
                self.dropped.popitem(last=False)

    # -- deltas ----------------------------------------------------------------------------------
    def delta_of(
        self, store: WeightStore, version: int, held: int, view: memoryview
    ) -> tuple[WireDelta, bytearray] | None:
        """The delta of ``version`` (whose whole bytes ``view`` holds: a leased slot) for a relay
        holding ``held``, its leaves' bytes gathered once for every link; None where the relay
        gets the whole version: it holds another version than the one before ``version``, or this
        node's writer does not know what ``version`` changed (published from CUDA, in the
        background, from a whole version received, or by another process), or everything changed."""
        if held < 0 or not self.deltas:
            return None
        with self._delta_lock:
            kept = self._delta
            if kept is not None and kept[0] == version:
                return (kept[1], kept[2]) if kept[1].base == held else None
            record = store.delta_of(version)
            entries = store.memory.layout.entries
            if record is None or record.base != held or len(record.leaves) >= len(entries):
                return None
            spans = [(entries[i].offset, entries[i].nbytes) for i in record.leaves]
            payload, at = bytearray(sum(n for _, n in spans)), 0
            for offset, n in spans:
                payload[at : at + n] = view[offset : offset + n]
                at += n
            delta = WireDelta(record.base, record.leaves, at)
            self._delta = (version, delta, payload)
            return delta, payload

    # -- forwarding (a relay's server) ----------------------------------------------------------
    def begin(
        self,
        version: int,
        nbytes: int,
        write: Write | None,
        sealed: SealedVersion | None = None,
        delta: WireDelta | None = None,
        payload: bytearray | None = None,
    ) -> Forwarding:
        fwd = Forwarding(version, nbytes, write, sealed, delta=delta, payload=payload)
        with self.changed:
            self.forwarding = fwd
            self.changed.notify_all()
        return fwd

    def advance(self, fwd: Forwarding, received: int) -> None:
        with self.changed:
            fwd.received = received
            self.changed.notify_all()

    def end(self, fwd: Forwarding, complete: bool) -> None:
        if complete and fwd.delta is not None and fwd.payload is not None:
            with self._delta_lock:  # for relays below that come for it later
                self._delta = (fwd.version, fwd.delta, fwd.payload)
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
            self.final = final
            self.stopping.set()
            self.changed.notify_all()
            children, store = list(self.children.values()), self.store
        if store is not None:
            store.remove_listener(self.notify)
        if self._accept is not None:
            self._accept.join(max(0.0, min(0.5, deadline - time.monotonic())))
        self.sock.close()
        for child in children:
            if child.thread is not None:
                child.thread.join(max(0.0, deadline - time.monotonic() - 0.2))
        for child in children:
            child.link.close()  # a thread still blocked in a send to a stalled relay wakes up
        if self.sealed is not None:
            self.sealed.close()
