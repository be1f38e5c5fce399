"""Accepting connections and running every handshake under way, on one thread."""

from __future__ import annotations

import selectors
import socket
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shmsync.errors import AuthenticationError
from shmsync.relay import wire
from shmsync.relay.messages import MAX_PENDING, SILENT_CUTOFF


@dataclass
class Pending:
    sock: socket.socket
    peer: str
    side: wire.ServerSide
    began: float
    got: bytearray = field(default_factory=bytearray)

    @property
    def source(self) -> str:
        return self.peer.rpartition(":")[0]


class Acceptor:
    """Accepts connections and runs every handshake under way on one thread, on non-blocking
    sockets: a connection costs a socket and a few bytes until its peer proved the secret, however
    many there are. A connection that sends nothing for :data:`SILENT_CUTOFF` seconds, or has not
    finished in ``handshake_timeout`` counted from its accept (bytes trickled in do not extend
    it), is cut. At :data:`MAX_PENDING` at once, a new one cuts the oldest handshake of the source
    with the most under way. A relay's handshake takes one round trip from its accept, so a flood
    must open ``MAX_PENDING`` connections within that round trip to cut it (it then tries again,
    :func:`shmsync.relay.wire.connect`), whatever its connections send; and a flood from a few
    sources cuts its own. A relay that proved the secret has left this table: it is never cut here."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.pending: OrderedDict[int, Pending] = OrderedDict()  # oldest accept first
        self.per_source: Counter[str] = Counter()
        self.selector = selectors.DefaultSelector()
        self.most = max(16, min(MAX_PENDING, descriptors() // 4))
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
                        self._read(self.pending.get(key.fd))
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
            pending = Pending(
                sock, f"{peer[0]}:{peer[1]}", wire.ServerSide(server.secret, server.encrypt), time.monotonic()
            )
            try:
                sock.send(pending.side.hello())  # 48 bytes: a new socket's buffer takes them
            except OSError:
                sock.close()
                continue
            if len(self.pending) >= self.most:
                self._cut(self._oldest_of_busiest_source(), f"{self.most} handshakes under way")
            self.pending[sock.fileno()] = pending
            self.per_source[pending.source] += 1
            self.selector.register(sock, selectors.EVENT_READ)

    def _oldest_of_busiest_source(self) -> Pending:
        """The handshake to cut for a new one: the oldest of the source with the most under way."""
        source, _ = self.per_source.most_common(1)[0]
        return next(p for p in self.pending.values() if p.source == source)

    def _read(self, pending: Pending | None) -> None:
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
            if isinstance(e, wire.Refused):
                send_now(pending.sock, e.reply)
            pending.sock.close()
            self.server.refuse(f"refused {pending.peer}: {e}")
            return
        if not send_now(pending.sock, reply):
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

    def _forget(self, pending: Pending) -> None:
        if self.pending.pop(pending.sock.fileno(), None) is not None:
            self.per_source[pending.source] -= 1
            if not self.per_source[pending.source]:
                del self.per_source[pending.source]
        try:
            self.selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def _cut(self, pending: Pending, why: str | None) -> None:
        self._forget(pending)
        pending.sock.close()
        if why is not None:
            self.server.refuse(f"cut {pending.peer}: {why}")


def descriptors() -> int:
    """This process's limit on open descriptors."""
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return 1024


def send_now(sock: socket.socket, data: bytes) -> bool:
    """Send a few bytes on a non-blocking socket (a buffer takes them at once); False if it failed."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False
