"""Accepting connections and running every handshake under way, on one thread."""

from __future__ import annotations

import selectors
import socket
import time
from collections import OrderedDict
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


class Acceptor:
    """Accepts connections and runs every handshake under way on one thread, on non-blocking
    sockets: a connection costs a socket and a few bytes until its peer proved the secret, however
    many there are. A connection that sends nothing for :data:`SILENT_CUTOFF` seconds, or has not
    finished in ``handshake_timeout``, is cut; at :data:`MAX_PENDING` at once, a new one cuts the
    oldest that sent nothing (else the oldest), so a flood cannot keep a relay out: a relay's
    handshake takes one round trip."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.pending: OrderedDict[int, Pending] = OrderedDict()
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
            pending = Pending(
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
            if isinstance(getattr(e, "reply", None), bytes):
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
        self.pending.pop(pending.sock.fileno(), None)
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
