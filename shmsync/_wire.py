"""The relay's wire protocol: authenticated TCP links carrying framed messages (no torch here).

Both ends prove that they hold the relay secret before anything else crosses, and the secret
itself never does (an HMAC challenge-response, each side with a fresh nonce)::

    server -> client   MAGIC, server nonce (32 bytes)
    client -> server   MAGIC, client nonce (32), HMAC-SHA256(secret, "client" | server nonce | client nonce)
    server -> client   HMAC-SHA256(secret, "server" | client nonce | server nonce)

Then every message is a frame: a 4-letter kind, an 8-byte big-endian length, the payload.
A reader names the kinds it accepts at that point and the most bytes each may carry; any
other kind, or a longer one, is a :class:`~shmsync.errors.ProtocolError` before a byte of
its payload is read, so a peer can never make this side allocate or receive more than it
expects. Every read of the handshake has a deadline.

What this protects: only peers that hold the secret get a link, learn the layout or receive
a byte of the weights, and nothing a peer sends is trusted for a size. What it does not:
the frames are neither encrypted nor signed after the handshake, so someone on the network
path between two hosts can read or alter them; across a network you do not trust, carry the
links through a tunnel (WireGuard, an SSH port forward).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct
import time
from typing import Any

from .errors import AuthenticationError, ProtocolError, RelayError

MAGIC = b"SHMSYNC-RELAY/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
FRAME = struct.Struct(">4sQ")
MAX_JSON_BYTES = 64 << 10
SECRET_ENV = "SHMSYNC_RELAY_SECRET"
SECRET_FILE_ENV = "SHMSYNC_RELAY_SECRET_FILE"


def resolve_secret(secret: str | bytes | None = None, *, generate: bool = False) -> tuple[bytes, bool]:
    """The relay secret: ``secret`` itself, else ``$SHMSYNC_RELAY_SECRET``, else the file named by
    ``$SHMSYNC_RELAY_SECRET_FILE`` (which only this user may read), else, with ``generate``, a new
    random one. Returns ``(secret, generated)``.

    Raises:
        ValueError: no secret anywhere (and ``generate`` is False), or one shorter than 16 bytes.
        PermissionError: the secret file may be read or written by others.
    """
    generated = False
    if secret is None and os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV]
    if secret is None and os.environ.get(SECRET_FILE_ENV):
        secret = read_secret_file(os.environ[SECRET_FILE_ENV])
    if secret is None:
        if not generate:
            raise ValueError(
                f"no relay secret: pass secret=..., set {SECRET_ENV}, or name a file only you can read in "
                f"{SECRET_FILE_ENV} (the trainer's RelaySender generates and prints one if it is given none)"
            )
        secret, generated = secrets.token_urlsafe(32), True
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"a relay secret must be at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
    return raw, generated


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``, stripped of surrounding whitespace; the file must be a regular file of
    this user that nobody else may read or write (mode 0600 or stricter)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or mode & 0o077:
            raise PermissionError(
                f"relay secret file {path}: want a regular file of yours that only you can read (chmod 600), "
                f"got mode {mode:#o}, uid {st.st_uid}"
            )
        return os.read(fd, 4096).strip()
    finally:
        os.close(fd)


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None, what: str) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    if deadline is None:
        sock.settimeout(None)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"{what}: the peer sent {got} of {n} bytes in time")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise ProtocolError(f"{what}: the peer sent {got} of {n} bytes in time") from None
        if k == 0:
            raise EOFError(f"{what}: the peer closed the connection")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Run the server's side of the handshake on an accepted connection.

    Raises:
        AuthenticationError: the peer did not prove the secret (nothing was sent to it but a nonce).
        ProtocolError, EOFError, OSError: it broke off or took longer than ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    ours = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(timeout)
    sock.sendall(MAGIC + ours)
    got = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES + MAC_BYTES, deadline, "handshake")
    if got[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("the peer does not speak the shmsync relay protocol")
    theirs, proof = got[len(MAGIC) : len(MAGIC) + NONCE_BYTES], got[len(MAGIC) + NONCE_BYTES :]
    if not hmac.compare_digest(proof, _mac(secret, b"client", ours, theirs)):
        raise AuthenticationError("the peer does not hold the relay secret")
    sock.sendall(_mac(secret, b"server", theirs, ours))


def client_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Run the client's side of the handshake on a connected socket.

    Raises:
        AuthenticationError: the server did not prove the secret (it may be a stranger's; nothing
            was accepted from it).
        ProtocolError, EOFError, OSError: it broke off or took longer than ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    got = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES, deadline, "handshake")
    if got[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("the server does not speak the shmsync relay protocol")
    theirs, ours = got[len(MAGIC) :], secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + ours + _mac(secret, b"client", theirs, ours))
    try:
        proof = _recv_exactly(sock, MAC_BYTES, deadline, "handshake")
    except (EOFError, ConnectionResetError):
        # A server hangs up right here when this side's proof fails: the secrets differ.
        raise AuthenticationError("the server refused this side's proof: the two hold different secrets") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", ours, theirs)):
        raise AuthenticationError("the server does not hold the relay secret")


def tune(sock: socket.socket) -> None:
    """No Nagle delay, and TCP keepalives so that a peer whose host vanished is noticed (~30 s)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Link:
    """One authenticated connection: frames out, checked frames in.

    The socket is left blocking and times out through the kernel (``SO_RCVTIMEO``), set only when
    the timeout changes: a receive is one system call, not a poll and a receive.

    Args:
        sock: the connected socket (after the handshake).
        peer: how messages name the other end (``"10.0.0.2:41234"``).
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.bytes_sent = 0
        sock.settimeout(None)
        self._timeout: float | None = None  # the socket's receive timeout now (None: none)

    # -- out -----------------------------------------------------------------------------------
    def send(self, kind: bytes, payload: bytes | memoryview = b"") -> None:
        # Header and payload in one system call: two sends would let the peer wake on the header
        # and wait, a scheduler slice on a busy host, for the rest.
        header, n = FRAME.pack(kind, len(payload)), len(payload)
        sent = self.sock.sendmsg([header, payload]) if n else self.sock.send(header)
        if sent < FRAME.size:
            self.sock.sendall(header[sent:])
            sent = FRAME.size
        if sent < FRAME.size + n:
            with memoryview(payload) as view:
                self.sock.sendall(view[sent - FRAME.size :])
        self.bytes_sent += FRAME.size + n

    def send_json(self, kind: bytes, doc: Any) -> None:
        self.send(kind, json.dumps(doc, separators=(",", ":")).encode())

    # -- in ------------------------------------------------------------------------------------
    def recv_frame(self, allowed: dict[bytes, int], timeout: float | None = None) -> tuple[bytes, int]:
        """The next frame's kind and length, which must be one of ``allowed`` (kind -> most bytes);
        its payload is left for the caller to read (:meth:`recv_bytes`, :meth:`recv_into`).

        Raises:
            ProtocolError: another kind, or more bytes than that kind may carry.
            EOFError: the peer closed the link.
        """
        kind, length = FRAME.unpack(self.recv_bytes(FRAME.size, timeout))
        if kind not in allowed:
            raise ProtocolError(
                f"{self.peer} sent a {kind!r} message where only {sorted(k.decode() for k in allowed)} may come"
            )
        if length > allowed[kind]:
            most = allowed[kind]
            raise ProtocolError(f"{self.peer} sent a {kind.decode()} message of {length} bytes, at most {most}")
        return kind, length

    def recv_bytes(self, n: int, timeout: float | None = None) -> bytes:
        """``n`` bytes (a frame's header, or the payload of the frame just read, ``n`` checked by
        :meth:`recv_frame`), all within ``timeout`` seconds (None: however long it takes)."""
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while got < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ProtocolError(f"{self.peer} sent {got} of {n} bytes in time")
            got += self.recv_into(view[got:], left)
        return bytes(buf)

    def recv_json(self, allowed: dict[bytes, int], timeout: float | None = None) -> tuple[bytes, Any]:
        """The next frame, whose payload is a JSON document of at most ``allowed[kind]`` bytes."""
        kind, length = self.recv_frame(allowed, timeout)
        return kind, self.recv_payload_json(kind, length, timeout)

    def recv_payload_json(self, kind: bytes, length: int, timeout: float | None = None) -> Any:
        """The payload of the frame just read, parsed as JSON (None if empty)."""
        raw = self.recv_bytes(length, timeout)
        if not length:
            return None
        try:
            return json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ProtocolError(f"{self.peer} sent a {kind.decode()} message that is not JSON ({e})") from None

    def recv_into(self, view: memoryview, timeout: float | None) -> int:
        """Receive at most ``len(view)`` bytes straight into ``view``, waiting at most ``timeout``
        seconds for the first (None: forever); returns how many (never 0)."""
        if timeout != self._timeout:
            seconds = 0.0 if timeout is None else max(timeout, 0.001)
            tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self._timeout = timeout
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, TimeoutError):
            raise ProtocolError(f"{self.peer} stalled mid-message for over {timeout:.1f} s") from None
        if n == 0:
            raise EOFError(f"{self.peer} closed the link")
        return n

    def close(self) -> None:
        """Shut the connection down (a thread blocked on it wakes up) and close it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def address(value: Any, what: str) -> tuple[str, int]:
    """A ``[host, port]`` pair a peer sent, checked.

    Raises:
        ProtocolError: not a host name or address of at most 255 characters and a port 1-65535.
    """
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and 0 < len(value[0]) <= 255
        and all(c.isalnum() or c in ".-:_%[]" for c in value[0])
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
        and 0 < value[1] < 65536
    ):
        return value[0], value[1]
    raise ProtocolError(f"{what}: want [host, port], got {str(value)[:100]}")


def connect(host: str, port: int, secret: bytes, timeout: float) -> Link:
    """A new authenticated link to the relay server at ``host:port``.

    Raises:
        ConnectionRefusedError: nobody listens there.
        AuthenticationError: the server does not hold the secret.
        RelayError: it did not answer the handshake in ``timeout`` seconds.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        tune(sock)
        client_handshake(sock, secret, timeout)
    except (EOFError, ProtocolError) as e:
        sock.close()
        raise RelayError(f"relay server {host}:{port} broke off the handshake ({e})") from e
    except BaseException:
        sock.close()
        raise
    return Link(sock, f"{host}:{port}")
