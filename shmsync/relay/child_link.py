"""The link to one relay below this node: a thread per admitted relay sends it the newest version whenever there is a
newer one, straight from a leased slot of this node's store (or, on a relay's node, from the slot
a version is still arriving in), and a keepalive while idle. A relay that holds the version just
before it gets only what changed (its delta, :mod:`shmsync.relay.deltas`, gathered and sealed once
for every such relay); one that holds anything else gets the whole version.

A lease on the slot sent from is held only while the relay takes bytes: one that takes none for
:data:`~shmsync.relay.messages.STALL_SECONDS` has the rest of the frame kept on the link (at most
a bucket), the lease released and that version given up (CNCL) once it takes bytes again; one
that takes none for ``timeout`` is dropped. No link keeps a copy of the weights.
"""

from __future__ import annotations

import time
from typing import Any

from shmsync.core.header import ROW_LINK
from shmsync.errors import LinkClosedError, LinkTimeoutError, ShmSyncError
from shmsync.relay.deltas import WireDelta
from shmsync.relay.messages import CNCL, DATA, DELT, PING, VERS, VERSION, Child, Forwarding
from shmsync.relay.sealing import SealedVersion


class ChildLink:
    """Sends ``child`` every newer version of ``server``'s node (a :class:`~shmsync.relay.server.Server`).

    Run :meth:`run` on a thread of its own; it ends when the server closes or the relay goes.
    """

    def __init__(self, server: Any, child: Child) -> None:
        self.server, self.child = server, child
        self.store: Any = None
        self.row = -1  # this link's row in the store's header (for its leases), claimed on first use

    def run(self) -> None:
        server, child = self.server, self.child
        try:
            while self._step():
                pass
            self._say_goodbye()
        except (OSError, EOFError, ShmSyncError) as e:
            if not server.stopping.is_set():
                server.drop(child.id, f"{type(e).__name__}: {e}")
        finally:
            store, row = self.store, self.row
            if store is not None and row >= 0 and not store.closed:
                store.leases.release_lease(row)
                store.rows.release_row(row)
            with server.changed:
                server.children.pop(child.id, None)  # its place and its address go with it
            child.link.close()

    def _step(self) -> bool:
        """Send what is due now: the rest of a stalled frame, a newer version, or a keepalive.
        False once the server is closing."""
        server, child = self.server, self.child
        if child.link.kept is not None:
            self._recover()
            return True
        newer, store, fwd = self._wait_for_newer()
        if server.stopping.is_set():
            return False
        if not newer:
            self._sent(child.link.send_or_keep(PING))  # idle: the relay can tell this node lives
            return True
        self.store = store
        if self.row < 0:
            self.row = store.rows.claim_row(flags=ROW_LINK)  # not a reader: left out of the readers' table
        if fwd is not None and fwd.state != "cancelled" and fwd.version > max(store.version, child.sent):
            self._forward(store, fwd)
        elif not self._send_latest(store):
            # No slot can be leased now (another link sends from the one that can be, or the
            # writer is on it), or no version sealed: no private copy; the newest goes once it can.
            with server.changed:
                server.changed.wait(0.05)
        return True

    def _wait_for_newer(self) -> tuple[bool, Any, Forwarding | None]:
        """Wait until a version newer than the relay's can be sent, at most a keepalive's period."""
        server = self.server
        with server.changed:
            waited = time.monotonic()
            while not server.stopping.is_set() and not server.newer(self.child.sent):
                if time.monotonic() - waited > server.ping_every:
                    break
                server.changed.wait(0.05)  # also sees publishes of other processes
            return server.newer(self.child.sent), server.store, server.forwarding

    def _forward(self, store: Any, fwd: Forwarding) -> None:
        """A version still arriving (or not committed yet): forward what is there, then follow. A
        delta goes to a relay holding its base, from the buffer it arrives in; any other relay
        waits for the commit and gets the whole version."""
        leases = store.leases
        if fwd.delta is not None:
            if fwd.payload is not None and self.child.sent == fwd.delta.base:
                with memoryview(fwd.payload) as view:
                    self._send(fwd.version, view, fwd, fwd.delta)
                return
        elif fwd.write is not None and leases.lease_written(self.row, fwd.write):
            try:
                with store.memory.slot_buffer(fwd.write.slot) as view:
                    self._send(fwd.version, view, fwd)
            finally:
                leases.release_lease(self.row)
            return
        server = self.server  # no lease to be had: wait for the commit, then send it whole
        with server.changed:
            while fwd.state == "receiving" and not server.stopping.is_set():
                server.changed.wait(0.05)

    def _send_latest(self, store: Any) -> bool:
        """Send the store's latest version from its leased slot, or its delta (gathered from there,
        then sent with the slot let go); False if no slot could be leased."""
        leases = store.leases
        lease = leases.lease_latest(self.row)
        try:
            if lease is None:
                return False
            if lease.version <= self.child.sent:
                return True
            with store.memory.slot_buffer(lease.slot) as view:
                delta = self.server.delta_of(store, lease.version, self.child.sent, view)
                if delta is None:
                    return self._send(lease.version, view, None)
        finally:
            leases.release_lease(self.row)
        wire_delta, payload = delta
        with memoryview(payload) as view:
            return self._send(lease.version, view, None, wire_delta)

    def _sent(self, whole: bool) -> bool:
        """Note whether a frame went whole; if not, the relay stalls from now on."""
        if not whole and self.child.stalled_since is None:
            self.child.stalled_since = time.monotonic()
        return whole

    def _recover(self) -> None:
        """A stalled relay: wait (no lease held) until it takes the rest of its frame, then give up
        the version it was in the middle of; raise if it takes nothing for ``timeout`` seconds."""
        server, child = self.server, self.child
        deadline = child.stalled_since + server.timeout
        if not child.link.flush_kept(deadline, server.stopping.is_set):
            if server.stopping.is_set():
                raise LinkClosedError("closing")
            raise LinkTimeoutError(f"it took no bytes for {server.timeout:.0f} s")
        child.stalled_since = None
        if child.completes >= 0:  # the kept frame was the version's last: it went whole
            child.sent, child.completes = child.completes, -1
        if child.in_version:  # the version stopped midway: the relay drops what it has of it
            self._cancel()

    def _available(self, fwd: Forwarding | None, offset: int, n: int) -> int:
        """How far the version is there to send: ``n``, what has arrived of one still arriving,
        or -1 if it was cancelled upstream or the server closes."""
        server = self.server
        if fwd is not None:
            with server.changed:
                while fwd.received <= offset and fwd.state == "receiving" and not server.stopping.is_set():
                    server.changed.wait(0.05)
                n = fwd.received if fwd.state != "cancelled" else -1
        return -1 if server.stopping.is_set() else n

    def _send(self, version: int, view: memoryview, fwd: Forwarding | None, delta: WireDelta | None = None) -> bool:
        """Send one version (or its ``delta``, whose bytes ``view`` then holds) from ``view`` (as
        far as ``fwd`` has received it, if given); with encrypted links, its pieces as sealed once
        for every link (:mod:`shmsync.relay.sealing`): as they came, or sealed here as they go.
        False if it could not begin now (other links send two versions already: the newest goes
        once one is done)."""
        shelf = self.server.sealed
        if shelf is None:
            self._send_pieces(version, view, fwd, None, delta)
            return True
        if fwd is not None:
            sealed = shelf.hold(fwd.sealed)
        elif delta is not None:
            sealed = shelf.take(version, len(view), delta.base, delta.leaves)
        else:
            sealed = shelf.take(version, len(view))
        if sealed is None:
            return fwd is not None  # arriving: cancelled upstream before this link began it
        try:
            self._send_pieces(version, view, fwd, sealed, delta)
        finally:
            shelf.let_go(sealed)
        return True

    def _send_pieces(
        self,
        version: int,
        view: memoryview,
        fwd: Forwarding | None,
        sealed: SealedVersion | None,
        delta: WireDelta | None = None,
    ) -> None:
        """Send a version's header (its delta's, for a delta) and pieces. Sets ``child.sent`` once
        it went whole; returns early if it was cancelled upstream, the server closes, or the relay
        stalls (the rest of the frame is then kept on the link)."""
        child = self.child
        link, n = child.link, len(view)
        child.in_version = True
        header = VERSION.pack(version, n) if sealed is None else sealed.header()
        kind = VERS if delta is None else DELT
        if delta is not None:
            header += delta.tail()
        if not self._sent(link.send_or_keep(kind, header)):
            return
        offset, piece = 0, 0
        while offset < n:
            available = self._available(fwd, offset, n)
            if available < 0:
                self._cancel()
                return
            if sealed is None:
                end, frame = min(available, offset + self.server.bucket_bytes), None
            else:  # a version arriving is there in whole pieces (opened: checked)
                if fwd is None:
                    sealed.seal_upto(piece, view)
                end, frame = offset + sealed.span(piece)[1], sealed.sealed(piece)
            # Its last frame ends the version, sent now or flushed after a stall: never CNCL after it.
            child.in_version = end < n
            whole = link.send_or_keep(DATA, view[offset:end] if frame is None else frame, sealed=frame is not None)
            if not self._sent(whole):
                child.completes = -1 if end < n else version
                return
            offset, piece = end, piece + 1
        child.in_version = False
        child.sent = version

    def _cancel(self) -> None:
        """Tell the relay the version under way is given up: CNCL ends it, sent now or flushed
        after a stall (so it is never sent twice)."""
        self.child.in_version = False
        self._sent(self.child.link.send_or_keep(CNCL))

    def _say_goodbye(self) -> None:
        link = self.child.link
        if link.kept is not None:
            return  # a stalled relay: it sees the link close
        try:
            link.send_or_keep(self.server.final)  # a relay that stopped reading must not hold close() up
        except OSError:
            pass


__all__ = ["ChildLink"]
